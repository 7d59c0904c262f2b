"""Peak resident memory of loading a model with fuseserve's loader, as a multiple of the weights' size.

Runs the load in a fresh subprocess: imports first, then resets the kernel's peak-RSS mark
(``/proc/self/clear_refs``, value 5), then ``load_model``; the peak is ``VmHWM`` after the load minus
``VmRSS`` before it, so the interpreter and imports do not count (torch imports some 800 modules,
sympy among them, the first time a module is built on ``meta``; the child does that first). The weights' size is the
model's parameter bytes in the final dtype (tied tensors once).

``python -m benchmarks.load_memory [--model smollm2-135m-instruct|DIR] [--dtype float32]``
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

_CHILD = r"""
import json, sys, torch
from transformers import AutoConfig
from fuseserve.worker.loader import load_model

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)

path, dtype = sys.argv[1], getattr(torch, sys.argv[2])
config = AutoConfig.from_pretrained(path)
with torch.device("meta"):  # torch's lazy imports on the first module built there (~800 modules)
    torch.nn.Embedding(2, 2)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
before = status("VmRSS")
model = load_model(path, config, torch.device("cpu"), dtype, progress=False)
peak = status("VmHWM") - before
weights = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
print(json.dumps({"peak_bytes": peak, "weights_bytes": weights, "ratio": peak / weights}))
"""


def measure(path: str, dtype: str = "float32") -> dict:
    """Load ``path`` in a subprocess; returns ``peak_bytes``, ``weights_bytes`` and their ``ratio``.

    Raises ``RuntimeError`` when the subprocess fails.
    """
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(path), dtype], capture_output=True, text=True, timeout=600
    )
    if proc.returncode != 0:
        raise RuntimeError(f"load failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="float32")
    a = ap.parse_args()
    from fuseserve.model_source import resolve_model

    src = resolve_model(a.model)
    r = measure(str(src.path), a.dtype)
    print(
        f"{src.name} ({a.dtype}): peak {r['peak_bytes'] / 2**20:.0f} MiB for "
        f"{r['weights_bytes'] / 2**20:.0f} MiB of weights = {r['ratio']:.2f}x"
    )


if __name__ == "__main__":
    main()
