"""Quantized checkpoints: the scheme a checkpoint's ``quantization_config`` names, and the model's
linear layers (and, for GGUF, the embedding) swapped for quantized ones before loading.

The model files do not change. ``quantize_modules`` runs on the ``meta`` model: every linear layer
the scheme quantizes gets a quantized subclass of its own class (``QuantizedLinearMixin``: the same
tensor-parallel behaviour, the matmul of ``fuseserve.kernels.quant_linear``) and loses its ``weight``
parameter; the loader then hands it the checkpoint's raw tensors (``qweight``, ``scales``, ...), per
fused part, and ``finalize`` turns them into the canonical ``QuantizedWeight`` (``Scheme.decode``),
keeps this rank's slice, stacks fused parts and packs the result for the kernel
``choose_kernel`` measured fastest here. Mixture-of-experts weights are quantized per expert
(``experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj``): ``QuantizedExpertsMixin`` packs each
expert's gate and up as one fused linear and its down as another, decoded, sliced and packed as every
other layer is; the router stays float (``SparseMoE.float_modules``).

Schemes (``scheme_for``; anything else, or a bit width they do not cover, is refused with
``UnsupportedModelError`` naming it):

- ``gguf``: a GGUF file repacked by ``fuseserve.gguf_quant`` (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K);
- ``gptq``: 2/4/8-bit, any group size or per channel, ``desc_act`` (``g_idx``), sym and asym,
  ``checkpoint_format`` gptq (zeros stored minus one) or gptq_v2 (``services/worker/quant_formats.py``);
- ``awq``: 4-bit GEMM packing (``quant_formats.py``);
- ``compressed-tensors``: ``pack-quantized`` int 4/8-bit weights (W4A16, W8A16; group, channel) and
  ``float-quantized`` FP8 weights (``quant_formats.py``).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from fuseserve.errors import ModelLoadError, UnsupportedModelError
from fuseserve.kernels import quant_linear as ql
from fuseserve.worker import parallel
from fuseserve.worker.models.layers import MergedLinear
from fuseserve.worker.parallel import ParallelLMHead, RowParallelLinear, VocabParallelEmbedding

log = logging.getLogger(__name__)


class Scheme:
    """One checkpoint format. ``quantizes(name)``: whether the checkpoint module ``name`` (Hugging
    Face's name, e.g. ``model.layers.0.self_attn.q_proj``) is quantized; ``decode(tensors, name)``:
    its raw tensors (by leaf) → ``QuantizedWeight`` / ``Float8Weight`` of shape ``[N, K]``."""

    name = "?"
    embeddings = False  # whether the input embedding may be quantized

    def quantizes(self, module: str) -> bool:
        raise NotImplementedError

    def decode(self, tensors: dict[str, torch.Tensor], module: str) -> ql.QuantizedWeight | ql.Float8Weight:
        raise NotImplementedError


class GGUFScheme(Scheme):
    """``fuseserve.gguf_quant``'s checkpoints: ``qweight`` ``[N, K]`` uint8, ``scales`` and
    ``offsets`` ``[N, K / G]``; bits and group per module in ``quantization_config["modules"]``."""

    name = "gguf"
    embeddings = True

    def __init__(self, config: dict):
        self.modules = config.get("modules") or {}

    def quantizes(self, module: str) -> bool:
        return module in self.modules

    def decode(self, tensors, module):
        spec = self.modules[module]
        _require(tensors, ("qweight", "scales", "offsets"), module)
        return ql.QuantizedWeight(
            tensors["qweight"].to(torch.uint8),
            tensors["scales"].float(),
            tensors["offsets"].float(),
            int(spec["bits"]),
            int(spec["group_size"]),
        )


def _require(tensors: dict, leaves: tuple[str, ...], module: str) -> None:
    missing = [leaf for leaf in leaves if leaf not in tensors]
    if missing:
        raise ModelLoadError(f"quantized module {module} lacks {', '.join(missing)} in the checkpoint")


def scheme_for(config: Any) -> Scheme | None:
    """The scheme of the Hugging Face ``config``'s ``quantization_config`` (None: not quantized).

    Raises ``UnsupportedModelError`` naming an unknown ``quant_method`` or an unsupported setting.
    """
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        return None
    if not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else dict(vars(qc))
    method = str(qc.get("quant_method", "")).lower()
    if method == GGUFScheme.name:
        return GGUFScheme(qc)
    from fuseserve.worker import quant_formats

    factory = quant_formats.SCHEMES.get(method)
    if factory is None:
        known = ", ".join([GGUFScheme.name, *quant_formats.SCHEMES])
        raise UnsupportedModelError(f"quantization method {method!r} is not supported (supported: {known})")
    return factory(qc)


# --------------------------------------------------------------------------- quantized modules


class QuantizedLinearMixin:
    """A linear layer whose weight is quantized: ``forward`` is its class's, with ``F.linear(x, W)``
    replaced by the packed kernel (``self.packed``); row-parallel layers all-reduce before the bias,
    the LM head gathers the vocabulary."""

    packed: ql.PackedLinear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.packed(x)
        if isinstance(self, RowParallelLinear):
            y = parallel.all_reduce(y)
        if self.bias is not None:
            y = y + self.bias
        if isinstance(self, ParallelLMHead):
            y = parallel.all_gather_last(y)
        return y


class QuantizedEmbeddingMixin:
    """A vocabulary-parallel embedding whose rows are dequantized on lookup."""

    packed: ql.Dequant

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if parallel.world()[1] == 1:
            return self.packed.rows(ids)
        mine = (ids >= self.start) & (ids < self.end)
        out = self.packed.rows(torch.where(mine, ids - self.start, 0))
        return parallel.all_reduce(out * mine.unsqueeze(-1).to(out.dtype))


class QuantizedExpertsMixin:
    """Mixture-of-experts weights that are quantized: ``Experts.forward``'s grouped loop, each expert's
    matmuls run by its packed weights ``self.packed_experts[e] = (gate_up, down)`` (this rank's
    ``[2 * inter, hidden]`` and ``[hidden, inter]``)."""

    packed_experts: list[tuple[ql.PackedLinear, ql.PackedLinear]]

    def gate_up(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        return self.packed_experts[expert][0](x)

    def down(self, expert: int, h: torch.Tensor) -> torch.Tensor:
        return self.packed_experts[expert][1](h)


_SUBCLASSES: dict[type, type] = {}


def _quantized_class(cls: type, mixin: type) -> type:
    if cls not in _SUBCLASSES:
        _SUBCLASSES[cls] = type(f"Quantized{cls.__name__}", (mixin, cls), {})
    return _SUBCLASSES[cls]


def _checkpoint_parts(model: nn.Module, name: str, module: nn.Module) -> dict[Any, str]:
    """Our module ``name`` → {part (None: the whole module): the checkpoint module it comes from};
    experts: {(expert, "gate" | "up" | "down"): ``{name}.{expert}.gate_proj``, ...}."""
    if hasattr(module, "checkpoint_parts"):  # fused 3-D expert weights, one checkpoint module per part
        return {
            (e, part): f"{name}.{e}.{ckpt}"
            for e in range(module.num_experts)
            for ckpt, (_, part) in module.checkpoint_parts.items()
        }
    prefix, _, leaf = name.rpartition(".")
    parts = {
        part: f"{prefix}.{ckpt}" if prefix else ckpt
        for ckpt, (fused, part) in getattr(model, "packed_modules_mapping", {}).items()
        if fused == leaf and isinstance(module, MergedLinear) and part in module.sizes
    }
    return parts or {None: name}


def quantize_modules(model: nn.Module, scheme: Scheme, device: torch.device, dtype: torch.dtype) -> int:
    """Swap every linear layer (and embedding) ``scheme`` quantizes, and every mixture-of-experts
    module whose experts it quantizes, for its quantized subclass, on the ``meta`` model before
    loading; returns how many. Routers stay float. Raises ``UnsupportedModelError`` for fused parts
    (or experts' parts) quantized differently."""
    keep_float = {
        f"{name}.{leaf}" for name, m in model.named_modules() for leaf in getattr(m, "float_modules", ())
    }
    count = 0
    for name, module in list(model.named_modules()):
        is_experts = hasattr(module, "checkpoint_parts")
        is_embedding = isinstance(module, VocabParallelEmbedding)
        if name in keep_float or not (
            is_experts or isinstance(module, nn.Linear) or (is_embedding and scheme.embeddings)
        ):
            continue
        parts = _checkpoint_parts(model, name, module)
        flags = {scheme.quantizes(ckpt) for ckpt in parts.values()}
        if flags == {False}:
            continue
        if len(flags) > 1:
            floats = [ckpt for ckpt in parts.values() if not scheme.quantizes(ckpt)]
            raise UnsupportedModelError(
                f"{name}: its fused parts are not all quantized ({len(floats)} of {len(parts)} "
                f"float, e.g. {floats[0]})"
            )
        if is_experts:
            mixin = QuantizedExpertsMixin
            for fused, _ in module.checkpoint_parts.values():
                module.register_parameter(fused, None)
        else:
            mixin = QuantizedEmbeddingMixin if is_embedding else QuantizedLinearMixin
            module.register_parameter("weight", None)  # no float weight: code that checks for one skips it
        module.__class__ = _quantized_class(type(module), mixin)
        module.quant_scheme, module.quant_parts = scheme, parts
        module.quant_tensors = {part: {} for part in parts}
        module.quant_target = (torch.device(device), dtype)
        count += 1
    return count


def is_quantized(module: nn.Module) -> bool:
    """Whether ``module`` is waiting for, or holds, quantized weights."""
    return hasattr(module, "quant_scheme")


def add_tensor(module: nn.Module, leaf: str, part: Any, tensor: torch.Tensor) -> None:
    """Keep one raw checkpoint tensor of a quantized ``module`` (``part``: the fused part it belongs
    to, None for a whole module; a fused checkpoint tensor of a merged module arrives with None)."""
    key = part if part in module.quant_tensors else None
    module.quant_tensors.setdefault(key, {})[leaf] = tensor


def finalize(model: nn.Module, path: Any) -> None:
    """Decode, slice, stack and pack the raw tensors of every quantized module (experts: each
    expert's). Raises ``ModelLoadError`` for missing or mis-shaped tensors, or a tensor-parallel slice
    that does not fall on the weight's groups."""
    for name, module in model.named_modules():
        if not is_quantized(module) or module.quant_tensors is None:
            continue
        device, dtype = module.quant_target
        try:
            if isinstance(module, QuantizedExpertsMixin):
                module.packed_experts = [
                    tuple(_pack(w, want, dtype, device) for w, want in _expert_weights(module, e))
                    for e in range(module.num_experts)
                ]
            else:
                kernel = "dequant" if isinstance(module, VocabParallelEmbedding) else None
                module.packed = _pack(_rank_weight(module), _local_shape(module), dtype, device, kernel)
                log.debug("%s: %s kernel", name, module.packed.name)
        except (ValueError, KeyError) as e:
            raise ModelLoadError(f"{path}: quantized {name}: {e}") from e
        module.quant_tensors = None


def _pack(weight, want: tuple[int, int], dtype: torch.dtype, device, kernel: str | None = None):
    """``ql.pack(weight)`` once its shape is checked against ``want`` (``ValueError`` otherwise)."""
    if tuple(weight.shape) != want:
        raise ValueError(f"has shape {tuple(weight.shape)}, expected {want}")
    return ql.pack(weight, dtype, device, kernel=kernel)


def _local_shape(module: nn.Module) -> tuple[int, int]:
    if isinstance(module, VocabParallelEmbedding):
        return module.num_embeddings, module.embedding_dim
    return module.out_features, module.in_features


def _stacked_rows(scheme: Scheme, sources: list[tuple[dict, str, int, int]]):
    """Fused parts stacked by rows: each ``(raw tensors, checkpoint module, start, length)`` decoded and
    cut to its rows ``[start, start + length)`` (this rank's)."""
    pieces = [scheme.decode(raw, ckpt).rows(start, length) for raw, ckpt, start, length in sources]
    return type(pieces[0]).cat_rows(pieces)


def _rank_weight(module: nn.Module) -> ql.QuantizedWeight | ql.Float8Weight:
    """This rank's weight of ``module`` from its raw checkpoint tensors."""
    scheme, parts, raw = module.quant_scheme, module.quant_parts, module.quant_tensors
    if isinstance(module, MergedLinear):
        if raw.get(None) and None not in parts:  # one fused checkpoint tensor (Phi-3's qkv_proj)
            whole = scheme.decode(raw[None], module.__class__.__name__)
            start, pieces = 0, []
            for part, size in module.full_sizes.items():
                full = whole.rows(start, size)
                pieces.append(full.rows(module.source_starts[part], module.sizes[part]))
                start += size
            return type(whole).cat_rows(pieces)
        return _stacked_rows(
            scheme,
            [(raw.get(p) or {}, ckpt, module.source_starts[p], module.sizes[p]) for p, ckpt in parts.items()],
        )
    w = scheme.decode(raw.get(None) or {}, parts[None])
    if isinstance(module, RowParallelLinear):
        return w.columns(module.start, module.in_features)
    if isinstance(module, ParallelLMHead | VocabParallelEmbedding):
        return w.rows(module.start, module.end - module.start)
    return w


def _expert_weights(module: nn.Module, e: int) -> list[tuple[Any, tuple[int, int]]]:
    """Expert ``e``'s ``[(gate_up, its shape), (down, its shape)]`` on this rank: the rows of gate and
    up, the columns of down, of this rank's intermediate features (``module.source_start``,
    ``module.inter``)."""
    scheme, parts, raw = module.quant_scheme, module.quant_parts, module.quant_tensors
    start, inter, hidden = module.source_start, module.inter, module.hidden_size
    gate_up = _stacked_rows(scheme, [(raw[(e, p)], parts[(e, p)], start, inter) for p in ("gate", "up")])
    try:
        down = scheme.decode(raw[(e, "down")], parts[(e, "down")]).columns(start, inter)
    except ValueError as err:
        raise ValueError(f"expert {e}'s down projection, this rank's {err}") from err
    return [(gate_up, (2 * inter, hidden)), (down, (hidden, inter))]


def weight_bytes(model: nn.Module) -> int:
    """Resident bytes of the model's weights: parameters, buffers (a prepacked float weight is one)
    and packed quantized weights (experts' included); the rotary tables (``cos``, ``sin``) excluded."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    counted: set[int] = set()  # a tied embedding and LM head share one packed weight
    for module in model.modules():
        packed = getattr(module, "packed", None)
        if isinstance(packed, ql.PackedLinear) and id(packed) not in counted:
            counted.add(id(packed))
            total += packed.nbytes()
        total += sum(p.nbytes() for pair in getattr(module, "packed_experts", ()) for p in pair)
        for key, buf in module._buffers.items():
            if buf is not None and key not in ("cos", "sin"):
                total += buf.numel() * buf.element_size()
    return total


def keep_float_weights_bf16(model: nn.Module) -> int:
    """In a quantized model computing in fp32 on one CPU rank, keep the float embedding and LM head
    as bfloat16 when every value is one (a bf16 checkpoint's: GPTQ and llm-compressor leave these
    float): the embedding widens the rows it looks up, the LM head multiplies through the C++
    widening kernel (``cpu_quant_linear.Bf16Linear``), exactly the fp32 weights at half the bytes
    resident and read per token. A tied pair shares one tensor. Returns the bytes saved (0 when
    the model is not such a model, or the kernel is unavailable)."""
    from fuseserve.kernels import cpu_quant_linear

    quantized = any(is_quantized(m) for m in model.modules())
    if not quantized or parallel.world()[1] != 1 or not cpu_quant_linear.available():
        return 0
    shared: dict[int, cpu_quant_linear.Bf16Linear] = {}
    saved = 0
    for module in model.modules():
        if type(module) not in (VocabParallelEmbedding, ParallelLMHead):
            continue
        w = module.weight
        if w.dtype != torch.float32 or (id(w) not in shared and not cpu_quant_linear.Bf16Linear.holds(w)):
            continue
        if id(w) not in shared:
            shared[id(w)] = cpu_quant_linear.Bf16Linear(w)
            saved += w.numel() * 2
        is_embedding = isinstance(module, VocabParallelEmbedding)
        module.__class__ = _quantized_class(
            type(module), QuantizedEmbeddingMixin if is_embedding else QuantizedLinearMixin
        )
        module.packed = shared[id(w)]
        module.register_parameter("weight", None)
    if saved:
        log.info("float embedding / LM head kept in bfloat16 (exact): %.0f MiB saved", saved / 2**20)
    return saved
