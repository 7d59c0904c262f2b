"""The Triton kernels compile for NVIDIA GPUs (SM80 and SM90, down to a cubin), with no GPU present,
the fp8 KV cache's paths (uint8 caches, ``kernels/triton_fp8.py``) included on SM80 (Ampere has no
fp8 instructions).

The interpreter (which runs the numeric tests on CPU) accepts code that the compiler rejects (plain
Python globals in a kernel, dot shapes under 16, ...). Triton's NVIDIA backend compiles without a
driver, using the ptxas it ships, so this test compiles each kernel in a subprocess started with
``TRITON_INTERPRET=0`` (the test session itself runs interpreted).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[dev]')")

# (target arch, dtype, cache dtype, constexprs of the attention kernel)
CASES = [
    (90, "bf16", "bf16", dict(G=3, HEAD_DIM=64, D_PAD=64, BLOCK_Q=21, BLOCK_M=64, BLOCK_N=32, PAGE=16,
                      HAS_WINDOW=True, HAS_SOFT_CAP=True, SPLIT=True, UPCAST=False, IEEE=False, KV_FP8=False)),
    (80, "fp32", "fp32", dict(G=1, HEAD_DIM=80, D_PAD=128, BLOCK_Q=16, BLOCK_M=16, BLOCK_N=32, PAGE=32,
                      HAS_WINDOW=False, HAS_SOFT_CAP=False, SPLIT=False, UPCAST=False, IEEE=True, KV_FP8=False)),
    (80, "bf16", "u8", dict(G=3, HEAD_DIM=64, D_PAD=64, BLOCK_Q=21, BLOCK_M=64, BLOCK_N=32, PAGE=16,
                      HAS_WINDOW=False, HAS_SOFT_CAP=False, SPLIT=True, UPCAST=False, IEEE=False, KV_FP8=True)),
]  # fmt: skip
# (target arch, cache dtype, QUANT) of the KV-write kernel (bf16 inputs)
WRITES = [(90, "bf16", False), (80, "u8", True)]


def compile_all() -> None:
    """Compile the attention kernel for each case, and the KV-write and split-merge kernels (bf16, SM90)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from fuseserve.kernels import triton_attention_kernel, triton_kv_write

    def build(fn, arch, types, consts):
        sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
        kernel = triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", arch, 32))
        assert kernel.asm["cubin"], fn.__name__
        print(f"compiled {fn.__name__} for SM{arch}", flush=True)

    for arch, dt, cache, consts in CASES:
        types = dict.fromkeys(("out_ptr", "q_ptr"), f"*{dt}") | dict.fromkeys(
            ("k_cache_ptr", "v_cache_ptr"), f"*{cache}"
        )
        types |= {"part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32", "scale": "fp32", "soft_cap": "fp32"}
        types |= dict.fromkeys(
            ("block_tables_ptr", "qb_seq_ptr", "qb_start_ptr", "cu_q_ptr", "ctx_ptr"), "*i32"
        )
        build(triton_attention_kernel._paged_attention_kernel, arch, types, consts)
    for arch, cache, quant in WRITES:
        types = dict.fromkeys(("k_ptr", "v_ptr"), "*bf16") | dict.fromkeys(
            ("k_cache_ptr", "v_cache_ptr"), f"*{cache}"
        )
        types |= {"slot_ptr": "*i64", "inv_k_scale": "fp32", "inv_v_scale": "fp32"}
        consts = dict(HEAD_DIM=64, ROW=192, ROW_PAD=256, PAGE=16, BLOCK_T=16, QUANT=quant)
        build(triton_kv_write._write_kv_kernel, arch, types, consts)
    build(
        triton_attention_kernel._merge_splits_kernel,
        90,
        {"out_ptr": "*bf16", "part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32"},
        dict(HEAD_DIM=64, D_PAD=64, SPLITS_PAD=4),
    )


@pytest.mark.slow  # ~20 s of Triton compilation on 2 cores; CI runs it (./dev.sh test-slow)
def test_triton_kernels_compile_for_nvidia_gpus():
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("compiled ") == len(CASES) + len(WRITES) + 1, proc.stdout


if __name__ == "__main__":
    compile_all()
