"""The GGUF conversion cache: a ``.gguf`` file dequantized ONCE to a float32 Hugging Face directory.

``cached_conversion`` keys the cache by the sha256 of the file's bytes (``gguf_sha256``, itself
cached by path, size and mtime in ``gguf-hashes.json``). ``convert_gguf`` dequantizes through
``transformers`` (~40 s for SmolLM2-135M on 2 cores) and writes config.json, model.safetensors,
tokenizer files and generation_config.json into a temporary directory that is renamed into place,
under a file lock, so a crash never leaves a half-written cache and two processes never convert
the same file at once. ``fuseserve.model_source.resolve_model`` is the entry point.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import pathlib
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator

from fuseserve.errors import ModelLoadError

logger = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"
_HASH_CHUNK_BYTES = 1 << 22
_HASH_INDEX_FILE = "gguf-hashes.json"
_SOURCE_MARKER_FILE = "fuseserve_source.json"


def cached_conversion(
    path: pathlib.Path, cache: pathlib.Path, progress: bool, quantized: bool = False
) -> pathlib.Path:
    """Return the directory holding the cached conversion of the GGUF file ``path``, converting it
    first if needed.

    ``cache`` is the cache root (the conversion lands in ``cache/gguf/<stem>-<sha256[:16]>``, or with
    ``quantized`` the weights kept quantized, ``fuseserve.gguf_quant``, in ``...-<sha256[:16]>-q``).
    Raises ``ModelLoadError`` for a file that is
    not GGUF, cannot be read or cannot be converted, or a cache directory that cannot be created.
    """
    _check_gguf_magic(path)
    digest = gguf_sha256(path, cache)
    root = cache / "gguf"
    target = root / f"{path.stem}-{digest[:16]}{'-q' if quantized else ''}"
    if not target.is_dir():
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ModelLoadError(f"cannot create cache directory {root}: {exc}") from exc
        with _file_lock(root / f"{target.name}.lock"):
            if not target.is_dir():  # another process may have finished while we waited
                for stale in root.glob(f".tmp-{target.name}-*"):  # left by a killed converter
                    shutil.rmtree(stale, ignore_errors=True)
                if quantized:
                    from fuseserve.gguf_quant import convert_gguf_quantized

                    convert_gguf_quantized(path, target, digest, progress)
                else:
                    convert_gguf(path, target, digest, progress)
    return target


def _check_gguf_magic(path: pathlib.Path) -> None:
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise ModelLoadError(f"cannot read GGUF file {path}: {exc}") from exc
    if magic != GGUF_MAGIC:
        raise ModelLoadError(f"{path} is not a GGUF file: expected the magic bytes 'GGUF', got {magic!r}")


def gguf_sha256(path: pathlib.Path, cache: pathlib.Path | None = None) -> str:
    """sha256 (hex) of the file's bytes, streamed in 4 MiB chunks.

    With ``cache``, the digest is remembered in ``cache/gguf-hashes.json`` keyed by
    (real path, size in bytes, mtime in ns), so an unchanged file is hashed once.
    """
    real = os.path.realpath(path)
    try:
        st = os.stat(real)
    except OSError as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    stamp = [st.st_size, st.st_mtime_ns]
    index_path = cache / _HASH_INDEX_FILE if cache is not None else None
    index: dict[str, dict] = {}
    if index_path is not None and index_path.is_file():
        try:
            index = json.loads(index_path.read_text())
        except (OSError, ValueError):
            index = {}  # a damaged index only costs a rehash
        entry = index.get(real)
        if isinstance(entry, dict) and entry.get("stamp") == stamp and "sha256" in entry:
            return entry["sha256"]
    h = hashlib.sha256()
    try:
        with open(real, "rb") as f:
            while chunk := f.read(_HASH_CHUNK_BYTES):
                h.update(chunk)
    except OSError as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    digest = h.hexdigest()
    if index_path is not None:
        index[real] = {"stamp": stamp, "sha256": digest}
        with contextlib.suppress(OSError):  # the index is an optimisation only
            index_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = index_path.with_name(f".{index_path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(index, indent=1))
            os.replace(tmp, index_path)
    return digest


@contextlib.contextmanager
def _file_lock(path: pathlib.Path) -> Iterator[None]:
    """Hold an exclusive ``fcntl.flock`` on ``path`` (created if absent) for the block."""
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def _transformers_progress(enabled: bool) -> Iterator[None]:
    """Enable or silence transformers' own progress bars for the block, then restore them."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    if enabled:
        hf_logging.enable_progress_bar()
    else:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
        else:
            hf_logging.disable_progress_bar()


def convert_gguf(path: pathlib.Path, target: pathlib.Path, digest: str, progress: bool) -> None:
    """Dequantize ``path`` to a float32 safetensors checkpoint at ``target`` (one-time, ~40 s).

    Writes config.json, model.safetensors, tokenizer files (tokenizer.json, chat template) and
    generation_config.json into a temporary sibling directory, then renames it to ``target``.
    Raises ``ModelLoadError`` naming ``path`` when the file cannot be read or converted.
    """
    from tqdm.auto import tqdm

    def say(message: str) -> None:
        logger.info(message)
        if progress:
            tqdm.write(f"fuseserve: {message}", file=sys.stderr)

    start = time.perf_counter()
    say(f"converting {path.name} to safetensors (one-time, ~40 s) into {target}")
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".tmp-{target.name}-", dir=target.parent))
    stages = ["check GGUF", "tokenizer", "dequantize weights", "write safetensors"]
    bar = tqdm(total=len(stages), desc="gguf -> safetensors", unit="stage", disable=not progress)
    try:
        with _transformers_progress(progress):
            _check_gguf_tensors(path)
            bar.update(1)
            _save_tokenizer(path, tmp)
            bar.update(1)
            model = _load_gguf_model(path)
            bar.update(1)
            _save_model(model, path, tmp)
            bar.update(1)
        (tmp / _SOURCE_MARKER_FILE).write_text(
            json.dumps({"gguf": str(path), "sha256": digest, "converted_s": time.perf_counter() - start})
        )
        _make_readable(tmp)
        os.rename(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        bar.close()
    say(f"converted {path.name} in {time.perf_counter() - start:.1f} s; cached at {target}")


def _make_readable(tmp: pathlib.Path) -> None:
    """Give the cache the usual umask permissions (mkdtemp creates 0700, some writers 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)
    for child in tmp.iterdir():
        os.chmod(child, 0o666 & ~umask)


def _check_gguf_tensors(path: pathlib.Path) -> None:
    """Parse the GGUF header and tensor table (a truncated file fails here, before the slow part)."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
        if not reader.tensors:
            raise ValueError("no tensors")
    except Exception as exc:
        raise ModelLoadError(
            f"corrupt or truncated GGUF file {path} ({type(exc).__name__}: {exc})".replace("\n", " ")
        ) from exc


def _save_tokenizer(path: pathlib.Path, out: pathlib.Path) -> None:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        tokenizer.save_pretrained(str(out))
    except Exception as exc:
        raise ModelLoadError(
            f"cannot read the tokenizer of GGUF file {path} ({type(exc).__name__}: {exc})".replace("\n", " ")
        ) from exc
    if not (out / "tokenizer.json").is_file():
        raise ModelLoadError(f"GGUF file {path}: transformers wrote no tokenizer.json for its tokenizer")


def _load_gguf_model(path: pathlib.Path):
    import torch
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        )
    except Exception as exc:
        raise ModelLoadError(
            f"cannot dequantize GGUF file {path} ({type(exc).__name__}: {exc})".replace("\n", " ")
        ) from exc


def _save_model(gguf_model, path: pathlib.Path, out: pathlib.Path) -> None:
    """Save a GGUF-loaded model (which refuses ``save_pretrained``) through a fresh copy."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    try:
        config = gguf_model.config
        with torch.device("cpu"):
            fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        fresh.load_state_dict(gguf_model.state_dict(), strict=True)
        fresh.generation_config = _generation_config(gguf_model, GenerationConfig)
        fresh.save_pretrained(str(out), safe_serialization=True)
    except Exception as exc:
        raise ModelLoadError(
            f"cannot convert GGUF file {path} to safetensors ({type(exc).__name__}: {exc})".replace("\n", " ")
        ) from exc


def _generation_config(model, generation_config_cls):
    """A generation config carrying the model's bos / eos / pad token ids."""
    cfg = model.config
    gen = model.generation_config
    eos = gen.eos_token_id if gen.eos_token_id is not None else cfg.eos_token_id
    bos = gen.bos_token_id if gen.bos_token_id is not None else cfg.bos_token_id
    pad = gen.pad_token_id if gen.pad_token_id is not None else getattr(cfg, "pad_token_id", None)
    return generation_config_cls(bos_token_id=bos, eos_token_id=eos, pad_token_id=pad)
