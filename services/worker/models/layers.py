"""Building blocks shared by the model files: norms, rotary embedding, stacked projections,
grouped-query attention and the gated MLP.

Parameter names follow Hugging Face checkpoints (``qkv_proj``, ``o_proj``, ``gate_up_proj``,
``down_proj``); a ``MergedLinear`` stacks several checkpoint tensors by output rows so one GEMM
computes them all, and tells the loader which rows each checkpoint tensor fills (``shard_index``).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.activations import ACT2FN

from fuseserve.kernels import cpu_fused
from fuseserve.worker import parallel
from fuseserve.worker.attention import attention, pass_memo
from fuseserve.worker.model_args import ModelArgs
from fuseserve.worker.parallel import RowParallelLinear


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019), computed in fp32 as in ``transformers``.

    ``unit_offset`` (Gemma): the weight is stored as ``w - 1`` and the product ``x * (1 + w)`` is taken
    in fp32 before casting; otherwise (LLaMA) ``w * x`` is taken after casting ``x`` back.
    """

    def __init__(self, dim: int, eps: float, unit_offset: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.unit_offset = unit_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., dim]`` → ``[..., dim]``."""
        if cpu_fused.usable(x, self.weight):
            return cpu_fused.rms_norm(x, self.weight, self.eps, self.unit_offset)
        return self._aten(x)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``h = x + residual`` and its norm, ``x`` / ``residual [T, dim]`` → ``(norm(h), h)``; on CPU one
        fused call (``cpu_fused.add_rms_norm``)."""
        if cpu_fused.usable(x, residual, self.weight) and x.stride(-1) == 1 and residual.stride(-1) == 1:
            return cpu_fused.add_rms_norm(x, residual, self.weight, self.eps, self.unit_offset)
        h = x + residual
        return self._aten(h), h

    def _aten(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (x32 * (1.0 + self.weight.float())).to(dtype)
        return self.weight * x32.to(dtype)


def _inv_freq(config, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``[rotary_dim / 2]`` and the cos/sin scale, from ``transformers``' rope init
    (the ``default`` type computed here, honouring ``partial_rotary_factor``)."""
    config.standardize_rope_params()
    params = config.rope_parameters or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        theta = params.get("rope_theta", 10000.0)
        return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"), seq_len=seq_len)


def _rotary_table(config, max_positions: int) -> tuple[torch.Tensor, float]:
    """Angles ``[max_positions, rotary_dim]`` (half-split layout) and the cos/sin scale."""
    positions = torch.arange(max_positions, dtype=torch.float32)
    inv_freq, scaling = _inv_freq(config)
    freqs = torch.outer(positions, inv_freq.float())
    params = config.rope_parameters or {}
    if params.get("rope_type") == "longrope":
        original = params["original_max_position_embeddings"]
        long_inv_freq, _ = _inv_freq(config, seq_len=original + 1)
        freqs[original:] = torch.outer(positions[original:], long_inv_freq.float())
    return torch.cat((freqs, freqs), dim=-1), scaling


class Rotary(nn.Module):
    """Rotary position embedding (Su et al. 2021), half-split layout as in ``transformers``' LLaMA.

    Frequencies, including rope scaling (linear, llama3, yarn, longrope, ...), come from the config
    through ``transformers.modeling_rope_utils``; with ``partial_rotary_factor`` < 1 only the first
    dimensions of each head rotate. LongRoPE (Phi-3): positions below
    ``original_max_position_embeddings`` use the short factors, later positions the long ones.
    cos/sin are precomputed on the CPU for ``max_positions`` (also when the model is built on ``meta``).
    """

    def __init__(self, config, max_positions: int):
        super().__init__()
        with torch.device("cpu"):  # real tables even while the model is built on ``meta``
            emb, scaling = _rotary_table(config, max_positions)
        self.rotary_dim = emb.shape[-1]
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``q [T, H, D]`` and ``k [T, KVH, D]`` by ``positions [T]``; on CPU in place, one fused
        call (``cpu_fused.rotary_``: the returned tensors are ``q`` and ``k`` themselves)."""
        if (
            cpu_fused.usable(q, k)
            and self.cos.device.type == "cpu"
            and positions.dtype == torch.int64
            and q.stride(-1) == 1
            and k.stride(-1) == 1
        ):
            cpu_fused.rotary_(q, k, positions.contiguous(), self.cos, self.sin)
            return q, k
        cos, sin = self._cos_sin(positions, q.dtype)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[T, 1, rotary_dim]`` of ``positions``, gathered once per pass (``pass_memo``:
        every layer rotates by the same positions; eager only, the compiled graph does it its own way)."""
        if torch.compiler.is_compiling():  # no id() under dynamo: it guards on it and recompiles every pass
            return self._gather(positions, dtype)
        memo = pass_memo()
        if memo is None:
            return self._gather(positions, dtype)
        key = (id(self), id(positions), dtype)
        hit = memo.get(key)
        if hit is not None and hit[0] is positions:
            return hit[1], hit[2]
        cos, sin = self._gather(positions, dtype)
        memo[key] = (positions, cos, sin)
        return cos, sin

    def _gather(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.rotary_dim == x.shape[-1]:
            return x * cos + _rotate_half(x) * sin
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        return torch.cat((rot * cos + _rotate_half(rot) * sin, rest), dim=-1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class MergedLinear(nn.Linear):
    """Several projections of the same input stacked by output rows: one GEMM, outputs split after.

    ``sizes`` names the parts in order (``{"q": 512, "k": 128, "v": 128}``); checkpoints that store the
    parts separately (``q_proj``, ``k_proj``, ``v_proj``) fill the rows ``shard_index`` gives. Under
    tensor parallelism (column parallel) ``sizes`` are this rank's slices, ``source_starts`` where each
    slice begins in its checkpoint part and ``full_sizes`` the checkpoint parts' sizes.
    """

    def __init__(
        self,
        in_features: int,
        sizes: dict[str, int],
        bias: bool,
        source_starts: dict[str, int] | None = None,
        full_sizes: dict[str, int] | None = None,
    ):
        super().__init__(in_features, sum(sizes.values()), bias=bias)
        self.sizes = sizes
        self.source_starts = source_starts or dict.fromkeys(sizes, 0)
        self.full_sizes = full_sizes or sizes

    def shard_index(self, param_name: str, shard: str) -> tuple[slice]:
        """Rows of ``weight`` / ``bias`` that checkpoint part ``shard`` fills."""
        start = 0
        for name, size in self.sizes.items():
            if name == shard:
                return (slice(start, start + size),)
            start += size
        raise KeyError(f"{shard!r} is not a part of {list(self.sizes)}")

    def shard_source(self, param_name: str, shard: str, fused: bool = False) -> tuple[int, int, int]:
        """``(dim, start, length)`` of this rank's rows of part ``shard`` in the checkpoint tensor: the
        part's own tensor, or with ``fused`` the checkpoint's stacked tensor (Phi-3's ``qkv_proj``)."""
        offset = 0
        if fused:
            names = list(self.full_sizes)
            offset = sum(self.full_sizes[n] for n in names[: names.index(shard)])
        return 0, offset + self.source_starts[shard], self.sizes[shard]

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``x [T, in]`` → one ``[T, size]`` tensor per part, in order."""
        return self(x).split(list(self.sizes.values()), dim=-1)


class Attention(nn.Module):
    """Grouped-query self-attention with rotary positions over the flattened ragged batch.

    ``qkv_bias``: biases on q, k, v (Qwen2); ``qk_norm``: RMSNorm over each head of q and k before
    rotary (Qwen3). The layer's sliding window and logit soft-cap go to the attention backend with
    each call (``args.sliding_windows[layer_idx]``, ``args.attn_logit_softcap``). Under tensor
    parallelism each rank computes its own heads (``parallel``).
    """

    def __init__(
        self, args: ModelArgs, layer_idx: int, rotary: Rotary, qkv_bias: bool = False, qk_norm: bool = False
    ):
        super().__init__()
        rank, size = parallel.world()
        self.layer_idx = layer_idx
        self.head_dim = hd = args.head_dim
        self.num_heads = parallel.divide(args.num_heads, size, "the attention heads")  # this rank's
        self.num_kv_heads = parallel.kv_heads_per_rank(args.num_kv_heads)
        q_size, kv_size = self.num_heads * hd, self.num_kv_heads * hd
        kv_start = parallel.kv_head_start(args.num_kv_heads) * hd
        self.qkv_proj = MergedLinear(
            args.hidden_size,
            {"q": q_size, "k": kv_size, "v": kv_size},
            bias=qkv_bias or args.attention_bias,
            source_starts={"q": rank * q_size, "k": kv_start, "v": kv_start},
            full_sizes={"q": args.num_heads * hd, "k": args.num_kv_heads * hd, "v": args.num_kv_heads * hd},
        )
        self.o_proj = RowParallelLinear(args.num_heads * hd, args.hidden_size, bias=args.attention_bias)
        self.q_norm = RMSNorm(self.head_dim, args.norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, args.norm_eps) if qk_norm else None
        self.rotary = rotary
        self.scale = args.attn_scale
        self.sliding_window = args.sliding_windows[layer_idx]
        self.soft_cap = args.attn_logit_softcap

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``x [T, hidden]``, ``positions [T]`` → ``[T, hidden]``."""
        q, k, v = self.qkv_proj.split(x)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(q, k, positions)
        out = attention(
            self.layer_idx, q, k, v, self.scale, sliding_window=self.sliding_window, soft_cap=self.soft_cap
        )
        return self.o_proj(out)


class GatedMLP(nn.Module):
    """Gated MLP ``down(act(gate x) * up x)``: SwiGLU with silu (LLaMA), GeGLU with gelu (Gemma).

    Under tensor parallelism each rank computes a slice of the intermediate features.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, act: str, bias: bool = False):
        super().__init__()
        rank, size = parallel.world()
        local = parallel.divide(intermediate_size, size, "the MLP's intermediate size")
        self.gate_up_proj = MergedLinear(
            hidden_size,
            {"gate": local, "up": local},
            bias,
            source_starts={"gate": rank * local, "up": rank * local},
            full_sizes={"gate": intermediate_size, "up": intermediate_size},
        )
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)
        self.act = ACT2FN[act]
        self.silu = act in ("silu", "swish")  # the fused CPU operator's activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, hidden]`` → ``[T, hidden]``; SiLU on CPU: one fused call (``cpu_fused.silu_mul``)."""
        gate_up = self.gate_up_proj(x)
        if self.silu and cpu_fused.usable(gate_up) and gate_up.dim() == 2 and gate_up.stride(-1) == 1:
            return self.down_proj(cpu_fused.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)  # gate and up: equal sizes
        return self.down_proj(self.act(gate) * up)


def soft_cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``cap * tanh(x / cap)`` (Gemma 2's final logits), ``x`` itself when ``cap`` is None."""
    return x if cap is None else cap * torch.tanh(x / cap)
