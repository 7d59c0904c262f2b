"""One weight loader for every model family: safetensors shards → the model, in the final dtype,
straight onto the target device.

The model is built on the ``meta`` device (no memory), then each parameter is allocated once, in its
final dtype on the target device, and filled from the checkpoint (gpt-fast's ``assign=True``). Tensors
are read from the shard files with plain ``readinto`` calls, directly into the destination when dtype
and device match, else through a bounded staging buffer (``STAGING_BYTES``). Nothing is memory-mapped,
so file pages never count as resident memory, and there is never a float32 copy of the model: peak
resident memory is the weights plus one staging buffer.

Model files keep Hugging Face's parameter names and declare:
- ``checkpoint_renames``: ``(regex, replacement)`` pairs applied to each checkpoint name first;
- ``packed_modules_mapping``: a checkpoint module that is a part of a fused one, e.g.
  ``"q_proj": ("qkv_proj", "q")``; the fused module's ``shard_index(param, part)`` says where it goes;
- ``tied_weights``: parameters that reuse another when the checkpoint lacks them and the config ties
  them (``tie_word_embeddings``).
Per-expert checkpoint tensors (``...experts.{e}.{part}.weight``) go into the experts module's fused
3-D tensors by its ``checkpoint_parts`` (quantized experts keep every raw tensor by expert and part).
Under tensor parallelism (``parallel``) each rank reads only its part of each tensor (``shard_source``
of the owning module). A checkpoint with a ``quantization_config`` has its quantized layers swapped
first (``fuseserve.worker.quantization``); their raw tensors (``qweight``, ``scales``, ...) go to the
layer, which packs them at ``finish``.
"""

from __future__ import annotations

import json
import logging
import math
import re
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch import nn
from tqdm import tqdm

from fuseserve.errors import ModelLoadError, UnsupportedModelError
from fuseserve.worker import parallel, quantization
from fuseserve.worker.model_args import ModelArgs
from fuseserve.worker.models import model_class
from fuseserve.worker.models.layers import MergedLinear

log = logging.getLogger(__name__)

STAGING_BYTES = 8 << 20  # staging buffer for dtype conversion / host-to-device copies
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_EXPERT = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<expert>\d+)\.(?P<part>\w+)\.(?P<leaf>\w+)$")


def safetensors_files(path: Path) -> list[Path]:
    """The checkpoint's safetensors shards (from the index when sharded). Raises ``ModelLoadError``."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors weights found")
    return files


def load_model(
    path: str | Path, config: Any, device: torch.device, dtype: torch.dtype, progress: bool = True
) -> nn.Module:
    """Build the family's model for ``config`` and load its weights from ``path``.

    Returns the model in eval mode, every parameter in ``dtype`` on ``device`` (``model.args`` holds
    the normalised ``ModelArgs``). Raises ``UnsupportedModelError`` for an unknown architecture (or
    one without tensor parallelism under N > 1 ranks) and ``ModelLoadError`` for unreadable,
    mis-shaped or incomplete weights or shapes the ranks cannot split.
    """
    path = Path(path)
    cls = model_class(config)
    if parallel.world()[1] > 1 and not getattr(cls, "supports_tensor_parallel", False):
        raise UnsupportedModelError(f"{cls.__name__} has no tensor-parallel implementation")
    args = ModelArgs.from_hf(config)
    try:
        with torch.device("meta"):
            model = cls(args)
    except ValueError as e:  # e.g. a tensor-parallel size that does not divide the heads
        raise ModelLoadError(f"{path}: {e}") from e
    scheme = quantization.scheme_for(config)
    if scheme is not None:
        quantization.quantize_modules(model, scheme, device, dtype)
    loader = _Loader(model, device, dtype)
    files = safetensors_files(path)
    bar = tqdm(total=len(files), desc=f"loading {path.name}", unit="file", disable=not progress)
    try:
        for f in files:
            loader.load_file(f)
            bar.update(1)
    finally:
        bar.close()
    loader.finish(path)
    return model.eval()


class _Loader:
    """Allocates each parameter on first touch and fills it (whole, or part by part)."""

    def __init__(self, model: nn.Module, device: torch.device, dtype: torch.dtype):
        self.model, self.device, self.dtype = model, torch.device(device), dtype
        self.params = dict(model.named_parameters())
        self.tensors: dict[str, torch.Tensor] = {}
        self.num_filled: dict[str, int] = {}  # elements written per parameter
        self.staging: torch.Tensor | None = None

    def resolve(self, name: str) -> tuple[str, Any]:
        """Checkpoint name → (our parameter name, part or None): ``resolve_name``."""
        return resolve_name(self.model, name)

    def _module(self, name: str) -> nn.Module | None:
        return _submodule(self.model, name)

    def load_file(self, path: Path) -> None:
        """Read every tensor of one shard into its parameter. Raises ``ModelLoadError``."""
        try:
            with open(path, "rb") as f:
                header, data_start = _read_header(f, path)
                for name, info in header.items():
                    if name != "__metadata__":
                        self._load_tensor(f, path, name, info, data_start)
        except OSError as e:
            raise ModelLoadError(f"{path}: cannot read weights: {e}") from e

    def _load_tensor(self, f: BinaryIO, path: Path, name: str, info: dict, data_start: int) -> None:
        target, part = self.resolve(name)
        param = self.params.get(target)
        owner = self._module(target.rpartition(".")[0]) if param is None else None
        if owner is not None and quantization.is_quantized(owner):
            tensor = self._read_whole(f, path, name, info, data_start)
            quantization.add_tensor(owner, target.rpartition(".")[2], part, tensor)
            return
        if param is None:
            log.debug("skipping checkpoint tensor %s (no parameter %s)", name, target)
            return
        try:
            src_dtype = _DTYPES[info["dtype"]]
            shape = tuple(info["shape"])
            begin, end = info["data_offsets"]
        except (KeyError, TypeError, ValueError) as e:
            raise ModelLoadError(f"{path}: corrupt safetensors entry {name}: {info}") from e
        if target not in self.tensors:
            self.tensors[target] = torch.empty(param.shape, dtype=self.dtype, device=self.device)
        owner_name, _, leaf = target.rpartition(".")
        owner = self.model.get_submodule(owner_name)
        numel = math.prod(shape)
        if end - begin != numel * _itemsize(src_dtype):
            raise ModelLoadError(
                f"{path}: safetensors entry {name} has {end - begin} bytes for shape {shape}"
            )
        for piece, region in _pieces(owner, leaf, part):
            dest = self.tensors[target]
            if piece is not None:
                dest = dest[owner.shard_index(leaf, piece)]
            want = list(shape)
            if region is not None:
                dim, start, length = region
                if start + length > shape[dim]:
                    raise ModelLoadError(f"{path}: checkpoint tensor {name} {shape} lacks rows {region}")
                want[dim] = length
            if tuple(dest.shape) != tuple(want):
                raise ModelLoadError(
                    f"{path}: checkpoint tensor {name} has shape {shape}, expected {tuple(dest.shape)} "
                    f"for {target}" + (f" (this rank's part {region})" if region else "")
                )
            self._read_region(f, path, name, dest, src_dtype, shape, region, data_start + begin)
            self.num_filled[target] = self.num_filled.get(target, 0) + dest.numel()

    def _read_whole(self, f: BinaryIO, path: Path, name: str, info: dict, data_start: int) -> torch.Tensor:
        """One checkpoint tensor as stored (its own dtype, on the CPU). Raises ``ModelLoadError``."""
        try:
            dtype, shape, (begin, end) = _DTYPES[info["dtype"]], tuple(info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError) as e:
            raise ModelLoadError(f"{path}: corrupt safetensors entry {name}: {info}") from e
        out = torch.empty(shape, dtype=dtype)
        if end - begin != out.numel() * _itemsize(dtype):
            raise ModelLoadError(
                f"{path}: safetensors entry {name} has {end - begin} bytes for shape {shape}"
            )
        f.seek(data_start + begin)
        _readinto(f, out.view(-1), path, name)
        return out

    def _read_region(
        self,
        f: BinaryIO,
        path: Path,
        name: str,
        dest: torch.Tensor,
        src_dtype: torch.dtype,
        shape: tuple[int, ...],
        region: tuple[int, int, int] | None,
        offset: int,
    ) -> None:
        """Fill ``dest`` from the tensor at byte ``offset``: all of it, or along ``dim`` the
        ``length`` entries from ``start`` (a tensor-parallel rank's part)."""
        if region is None:
            f.seek(offset)
            self._read_into(f, path, name, dest.view(-1), src_dtype)
            return
        dim, start, length = region
        outer, size, inner = math.prod(shape[:dim]), shape[dim], math.prod(shape[dim + 1 :])
        item = _itemsize(src_dtype)
        if outer == 1:  # a contiguous byte range
            f.seek(offset + start * inner * item)
            self._read_into(f, path, name, dest.view(-1), src_dtype)
            return
        out = dest.view(outer, length, inner)
        step = max(1, STAGING_BYTES // (size * inner * item))
        f.seek(offset)
        for o in range(0, outer, step):
            n = min(step, outer - o)
            buf = self._staging(n * size * inner, src_dtype)
            _readinto(f, buf, path, name)
            out[o : o + n].copy_(buf.view(n, size, inner)[:, start : start + length])

    def _read_into(
        self, f: BinaryIO, path: Path, name: str, dest: torch.Tensor, src_dtype: torch.dtype
    ) -> None:
        """Fill the contiguous 1-D ``dest`` from the file's current position (``src_dtype`` elements)."""
        if dest.dtype == src_dtype and dest.device.type == "cpu":
            _readinto(f, dest, path, name)
            return
        step = max(1, STAGING_BYTES // _itemsize(src_dtype))
        for start in range(0, dest.numel(), step):
            n = min(step, dest.numel() - start)
            buf = self._staging(n, src_dtype)
            _readinto(f, buf, path, name)
            dest[start : start + n].copy_(buf)

    def _staging(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        nbytes = n * _itemsize(dtype)
        if self.staging is None or self.staging.numel() < nbytes:
            self.staging = torch.empty(max(nbytes, 1), dtype=torch.uint8)
        return self.staging[:nbytes].view(dtype)

    def finish(self, path: Path) -> None:
        """Tie what the config ties, pack the quantized layers, check every parameter is filled,
        install the tensors."""
        quantization.finalize(self.model, path)
        tie = self.model.args.tie_word_embeddings
        for name, source in getattr(self.model, "tied_weights", {}).items():
            if name in self.params and name not in self.tensors and tie and source in self.tensors:
                self.tensors[name] = self.tensors[source]
                self.num_filled[name] = self.num_filled[source]
        missing = [n for n, p in self.params.items() if self.num_filled.get(n, 0) < p.numel()]
        if missing:
            raise ModelLoadError(f"{path}: checkpoint lacks {len(missing)} weights, e.g. {missing[:3]}")
        installed: dict[int, nn.Parameter] = {}
        for name, tensor in self.tensors.items():
            module_name, _, leaf = name.rpartition(".")
            param = installed.setdefault(id(tensor), nn.Parameter(tensor, requires_grad=False))
            setattr(self.model.get_submodule(module_name), leaf, param)
        for module in self.model.modules():  # buffers built on the CPU (rotary tables) follow the model
            for key, buf in module._buffers.items():
                if buf is not None and buf.device != self.device:
                    module._buffers[key] = buf.to(self.device)
        self.staging = None


def resolve_name(model: nn.Module, name: str) -> tuple[str, Any]:
    """A checkpoint tensor's name → (our parameter name, part or None), by the model's
    ``checkpoint_renames``, its experts' ``checkpoint_parts`` and its ``packed_modules_mapping``
    (``model.layers.0.self_attn.k_proj.weight`` → ``(model.layers.0.self_attn.qkv_proj.weight, "k")``;
    a quantized expert's ``...experts.3.up_proj.qweight`` → ``(...experts.qweight, (3, "up"))``).
    Also used for LoRA adapters' tensors (``fuseserve.worker.lora_adapter``)."""
    for pattern, replacement in getattr(model, "checkpoint_renames", ()):
        name = re.sub(pattern, replacement, name)
    m = _EXPERT.match(name)
    if m:
        experts = _submodule(model, m["prefix"])
        parts = getattr(experts, "checkpoint_parts", None)
        if parts is not None and m["part"] in parts:
            fused, part = parts[m["part"]]
            if quantization.is_quantized(experts):  # its raw tensors, each leaf by (expert, part)
                return f"{m['prefix']}.{m['leaf']}", (int(m["expert"]), part)
            if m["leaf"] == "weight":
                return f"{m['prefix']}.{fused}", (int(m["expert"]), part)
    for module, (fused, part) in getattr(model, "packed_modules_mapping", {}).items():
        if f".{module}." in name:
            return name.replace(f".{module}.", f".{fused}.", 1), part
    return name, None


def _submodule(model: nn.Module, name: str) -> nn.Module | None:
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


def _pieces(owner: nn.Module, leaf: str, part: Any) -> list[tuple[Any, tuple[int, int, int] | None]]:
    """What one checkpoint tensor fills: ``(part, region)`` pairs, where ``region`` (``(dim, start,
    length)``) is the slice this tensor-parallel rank reads, None for all of it."""
    if parallel.world()[1] == 1 or not hasattr(owner, "shard_source"):
        return [(part, None)]
    if part is None and isinstance(owner, MergedLinear):  # a fused checkpoint tensor (Phi-3)
        return [(p, owner.shard_source(leaf, p, fused=True)) for p in owner.sizes]
    return [(part, owner.shard_source(leaf, part))]


def _read_header(f: BinaryIO, path: Path) -> tuple[dict, int]:
    """The safetensors JSON header and the offset where tensor data starts. Raises ``ModelLoadError``."""
    raw = f.read(8)
    if len(raw) != 8:
        raise ModelLoadError(f"{path}: corrupt safetensors file (no header)")
    size = int.from_bytes(raw, "little")
    if size > 100 << 20:
        raise ModelLoadError(f"{path}: corrupt safetensors file (header of {size} bytes)")
    try:
        header = json.loads(f.read(size))
    except ValueError as e:
        raise ModelLoadError(f"{path}: corrupt safetensors file (header: {e})") from e
    if not isinstance(header, dict):
        raise ModelLoadError(f"{path}: corrupt safetensors file (header is not a JSON object)")
    return header, 8 + size


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _readinto(f: BinaryIO, dest: torch.Tensor, path: Path, name: str) -> None:
    """Read exactly ``dest``'s bytes from ``f`` into the contiguous CPU tensor ``dest``."""
    view = memoryview(dest.view(torch.uint8).numpy()) if dest.numel() else memoryview(b"")
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            raise ModelLoadError(f"{path}: truncated safetensors file (tensor {name})")
        got += n
