"""The on-disk formats of quantized Hugging Face checkpoints, decoded into the canonical weight of
``fuseserve.kernels.quant_linear`` (``W = q * scale + offset`` in groups, ``perm`` for act-order).

Integer packing: ``32 / bits`` values per int32, value ``j`` in bits ``[j * bits, (j + 1) * bits)``
(2, 4 and 8 bits; 3-bit and other widths are refused at load, naming the width).

- **GPTQ** (``quant_method: gptq``; AutoGPTQ / GPTQModel): ``qweight`` int32 ``[K / pack, N]``
  (packed along the input features), ``qzeros`` int32 ``[K / G, N / pack]`` (packed along the
  outputs), ``scales`` ``[K / G, N]``, ``g_idx`` int32 ``[K]`` (the group of each input feature;
  with ``desc_act`` not ``k // G``). ``W[n, k] = scales[g, n] * (q[k, n] - z[g, n])``, ``g = g_idx[k]``;
  ``checkpoint_format`` ``gptq`` (v1) stores ``z - 1``, ``gptq_v2`` stores ``z``. ``group_size`` -1:
  per channel. Every linear layer of the decoder blocks is quantized (``modules_in_block_to_quantize``
  narrows it), the LM head only with ``lm_head: true``.
- **AWQ** (``quant_method: awq``, ``version: gemm``; AutoAWQ): ``qweight`` int32 ``[K, N / 8]`` and
  ``qzeros`` int32 ``[K / G, N / 8]`` packed along the outputs with column ``c`` of each 8 in nibble
  ``[0, 4, 1, 5, 2, 6, 3, 7][c]``; ``scales`` ``[K / G, N]``; ``W = (q - z) * s``.
  ``modules_to_not_convert`` are left float.
- **compressed-tensors** (``quant_method: compressed-tensors``; llm-compressor):
  ``pack-quantized``: ``weight_packed`` int32 ``[N, K / pack]`` (packed along the input features) of
  ``q + 2**(bits-1)`` for signed ``q``; ``weight_scale`` ``[N, K / G]`` (``[N, 1]`` per channel);
  asymmetric: ``weight_zero_point`` packed the same way along the outputs, ``[N / pack, K / G]``;
  act-order: ``weight_g_idx`` ``[K]``. ``W = (q - zero) * scale``.
  ``float-quantized`` (and ``naive-quantized`` with float weights, which llm-compressor writes for
  weight-only FP8): ``weight`` float8 e4m3 ``[N, K]``, ``weight_scale`` ``[N, 1]`` or ``[1]``;
  ``naive-quantized`` int: ``weight`` int8 ``[N, K]`` of the signed values. Weight-only: activation
  quantization is refused, naming it. ``config_groups`` give each group's
  ``targets`` (``Linear`` or ``re:`` patterns), ``ignore`` the modules left float.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

from fuseserve.errors import UnsupportedModelError
from fuseserve.kernels import quant_linear as ql
from fuseserve.worker.quantization import Scheme, _require

PACKABLE_BITS = (2, 4, 8)
_AWQ_NIBBLE_OF_COLUMN = [0, 4, 1, 5, 2, 6, 3, 7]


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words → unsigned values (uint8), ``32 / bits`` per word along ``dim`` (0 or 1), value
    ``j`` of a word in its bits ``[j * bits, (j + 1) * bits)``."""
    per = 32 // bits
    words = packed.to(torch.int32)
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    if dim == 0:
        vals = (words.unsqueeze(1) >> shifts.view(1, per, 1)) & (2**bits - 1)  # [R, per, C]
        return vals.reshape(words.shape[0] * per, words.shape[1]).to(torch.uint8)
    vals = (words.unsqueeze(2) >> shifts.view(1, 1, per)) & (2**bits - 1)  # [R, C, per]
    return vals.reshape(words.shape[0], words.shape[1] * per).to(torch.uint8)


def _check_bits(method: str, bits: int) -> int:
    if bits not in PACKABLE_BITS:
        raise UnsupportedModelError(
            f"{method}: {bits}-bit weights are not supported (supported: {', '.join(map(str, PACKABLE_BITS))}-bit)"
        )
    return bits


def canonical(
    q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, g_idx: torch.Tensor | None
) -> ql.QuantizedWeight:
    """``W[n, k] = scale[n, g(k)] * (q[n, k] - zero[n, g(k)])`` with ``g(k) = g_idx[k]`` → canonical.

    q: ``[N, K]`` unsigned; scale, zero: ``[N, num_groups]``; g_idx: ``[K]`` (None: ``k // (K /
    num_groups)``). Groups must have equal sizes; columns are permuted so each group is contiguous
    when ``g_idx`` is not ascending. Raises ``ValueError`` otherwise.
    """
    n, k = q.shape
    num_groups = scale.shape[1]
    scale = scale.float()
    offset = -scale * zero.float()
    group = k // num_groups
    if g_idx is None or torch.equal(g_idx.long(), torch.arange(k) // group):
        return ql.QuantizedWeight(q.contiguous(), scale, offset, bits, group)
    counts = torch.bincount(g_idx.long(), minlength=num_groups)
    if not bool((counts == group).all()):
        raise ValueError(f"g_idx groups of unequal sizes ({counts.min()}..{counts.max()})")
    perm = torch.argsort(g_idx.long(), stable=True)
    return ql.QuantizedWeight(q[:, perm].contiguous(), scale, offset, bits, group, perm)


def _matches(pattern: str, name: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return name == pattern or name.endswith("." + pattern)


class GPTQScheme(Scheme):
    """GPTQ (module docstring)."""

    name = "gptq"

    def __init__(self, qc: dict):
        self.bits = _check_bits("GPTQ", int(qc.get("bits", 4)))
        self.group_size = int(qc.get("group_size", 128))
        self.sym = bool(qc.get("sym", True))
        fmt = str(qc.get("checkpoint_format") or "gptq").lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise UnsupportedModelError(f"GPTQ checkpoint_format {fmt!r} is not supported (gptq, gptq_v2)")
        self.zero_plus_one = fmt == "gptq"
        if qc.get("dynamic"):
            raise UnsupportedModelError("GPTQ 'dynamic' per-module overrides are not supported")
        self.lm_head = bool(qc.get("lm_head", False))
        inside = qc.get("modules_in_block_to_quantize")
        self.only = {m.split(".")[-1] for group in inside for m in group} if inside else None

    def quantizes(self, module: str) -> bool:
        if module == "lm_head":
            return self.lm_head
        if ".layers." not in module:
            return False
        return self.only is None or module.split(".")[-1] in self.only

    def decode(self, tensors, module):
        _require(tensors, ("qweight", "qzeros", "scales"), module)
        q = unpack_int32(tensors["qweight"], self.bits, dim=0).T  # [N, K]
        zero = unpack_int32(tensors["qzeros"], self.bits, dim=1).T.float()  # [N, K / G]
        if self.zero_plus_one:
            zero = zero + 1
        scale = tensors["scales"].T  # [N, K / G]
        n, k = q.shape
        if zero.shape[0] != n or scale.shape[0] != n:
            raise ValueError(
                f"qzeros {tuple(zero.shape)} / scales {tuple(scale.shape)} do not fit {n} outputs"
            )
        g_idx = tensors.get("g_idx")
        return canonical(q, scale, zero, self.bits, None if g_idx is None else g_idx.long())


class AWQScheme(Scheme):
    """AWQ, GEMM packing (module docstring)."""

    name = "awq"

    def __init__(self, qc: dict):
        bits = int(qc.get("bits", qc.get("w_bit", 4)))
        if bits != 4:
            raise UnsupportedModelError(f"AWQ: {bits}-bit weights are not supported (4-bit)")
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise UnsupportedModelError(f"AWQ version {version!r} is not supported (gemm)")
        self.group_size = int(qc.get("group_size", qc.get("q_group_size", 128)))
        self.zero_point = bool(qc.get("zero_point", True))
        self.skip = list(qc.get("modules_to_not_convert") or [])

    def quantizes(self, module: str) -> bool:
        return ".layers." in module and not any(s in module for s in self.skip)

    def _unpack(self, packed: torch.Tensor) -> torch.Tensor:
        vals = unpack_int32(packed, 4, dim=1)  # [R, C] in nibble order
        r, c = vals.shape
        order = torch.tensor(_AWQ_NIBBLE_OF_COLUMN)
        return vals.view(r, c // 8, 8)[:, :, order].reshape(r, c)

    def decode(self, tensors, module):
        _require(tensors, ("qweight", "scales") + (("qzeros",) if self.zero_point else ()), module)
        q = self._unpack(tensors["qweight"]).T  # [N, K]
        scale = tensors["scales"].T
        zero = self._unpack(tensors["qzeros"]).T.float() if self.zero_point else torch.full_like(scale, 8.0)
        return canonical(q, scale, zero, 4, None)


class CompressedTensorsScheme(Scheme):
    """compressed-tensors' ``pack-quantized`` and ``float-quantized`` (module docstring)."""

    name = "compressed-tensors"

    def __init__(self, qc: dict):
        self.ignore = list(qc.get("ignore") or [])
        self.groups = []
        top_format = qc.get("format")
        for gname, group in (qc.get("config_groups") or {}).items():
            fmt = group.get("format") or top_format
            weights = group.get("weights") or {}
            if group.get("input_activations") or group.get("output_activations"):
                raise UnsupportedModelError(
                    f"compressed-tensors {gname}: activation quantization is not supported (weights only)"
                )
            if fmt == "pack-quantized":
                if weights.get("type", "int") != "int":
                    raise UnsupportedModelError(
                        f"compressed-tensors {gname}: pack-quantized {weights.get('type')}"
                    )
                _check_bits("compressed-tensors pack-quantized", int(weights.get("num_bits", 4)))
            elif fmt == "naive-quantized" and weights.get("type", "int") == "int":
                _check_bits("compressed-tensors naive-quantized", int(weights.get("num_bits", 8)))
            elif fmt in ("float-quantized", "naive-quantized"):
                if weights.get("type") != "float" or int(weights.get("num_bits", 8)) != 8:
                    raise UnsupportedModelError(
                        f"compressed-tensors {gname}: float-quantized {weights.get('num_bits')}-bit "
                        f"{weights.get('type')} (supported: 8-bit float, e4m3)"
                    )
                if weights.get("strategy") not in ("channel", "tensor"):
                    raise UnsupportedModelError(
                        f"compressed-tensors {gname}: FP8 strategy {weights.get('strategy')!r} (channel, tensor)"
                    )
            else:
                raise UnsupportedModelError(
                    f"compressed-tensors format {fmt!r} is not supported "
                    "(pack-quantized, float-quantized, naive-quantized)"
                )
            self.groups.append((list(group.get("targets") or []), fmt, weights))

    def _group(self, module: str):
        if any(_matches(p, module) for p in self.ignore):
            return None
        for targets, fmt, weights in self.groups:
            for t in targets:
                if t == "Linear" or _matches(t, module):
                    return fmt, weights
        return None

    def quantizes(self, module: str) -> bool:
        return self._group(module) is not None

    def decode(self, tensors, module):
        fmt, weights = self._group(module)
        if weights.get("type") == "float":
            _require(tensors, ("weight", "weight_scale"), module)
            w = tensors["weight"]
            if w.dtype != torch.float8_e4m3fn:
                raise ValueError(f"FP8 weight stored as {w.dtype}, expected float8_e4m3fn")
            scale = tensors["weight_scale"].float().reshape(-1)
            return ql.Float8Weight(w, scale.expand(w.shape[0]).contiguous() if scale.numel() == 1 else scale)
        bits = int(weights.get("num_bits", 4))
        if fmt == "naive-quantized":  # signed integers, one per int8
            _require(tensors, ("weight", "weight_scale"), module)
            q = (tensors["weight"].to(torch.int16) + 2 ** (bits - 1)).to(torch.uint8)
        else:
            _require(tensors, ("weight_packed", "weight_scale"), module)
            q = unpack_int32(tensors["weight_packed"], bits, dim=1)
            if "weight_shape" in tensors:
                n, k = (int(v) for v in tensors["weight_shape"].tolist())
                q = q[:n, :k]
        n = q.shape[0]
        scale = tensors["weight_scale"].reshape(n, -1)
        if weights.get("symmetric", True):
            zero = torch.full(scale.shape, float(2 ** (bits - 1)))
        else:
            _require(tensors, ("weight_zero_point",), module)
            zp = tensors["weight_zero_point"]
            packed = zp.dtype == torch.int32 and fmt == "pack-quantized"
            zero = unpack_int32(zp, bits, dim=0)[:n] if packed else zp.to(torch.int32) + 2 ** (bits - 1)
            zero = zero.reshape(n, -1).float()
        g_idx = tensors.get("weight_g_idx")
        return canonical(q, scale, zero, bits, None if g_idx is None else g_idx.long())


SCHEMES: dict[str, Callable[[dict], Scheme]] = {
    "gptq": GPTQScheme,
    "awq": AWQScheme,
    "compressed-tensors": CompressedTensorsScheme,
}
"""``quant_method`` → scheme (``fuseserve.worker.quantization.scheme_for`` adds ``gguf``)."""
