"""Build a fuseserve model from a Hugging Face style directory (config.json + safetensors)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from fuseserve.errors import ModelLoadError
from fuseserve.worker.models import model_class

log = logging.getLogger(__name__)


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
    path: str | Path, config, device: torch.device, dtype: torch.dtype, progress: bool = True
) -> torch.nn.Module:
    """Instantiate the family's model for ``config`` and load weights from ``path`` by name.

    Returns the model in eval mode on ``device`` in ``dtype``. Raises ``UnsupportedModelError`` for
    an unknown architecture and ``ModelLoadError`` for unreadable or incomplete weights.
    """
    path = Path(path)
    cls = model_class(config)
    with torch.device(device):
        model = cls(config)
    model.to(dtype)
    expected = {n for n, _ in model.named_parameters()}
    filled: set[str] = set()
    files = safetensors_files(path)
    bar = tqdm(total=len(files), desc=f"loading {path.name}", unit="file", disable=not progress)
    try:
        for f in files:
            with safe_open(str(f), framework="pt", device="cpu") as st:
                filled |= model.load_weights((k, st.get_tensor(k)) for k in st.keys())
            bar.update(1)
    except (OSError, ValueError, RuntimeError) as e:  # safetensors raises SafetensorError(Exception)
        raise ModelLoadError(f"{path}: cannot read weights: {e}") from e
    except Exception as e:
        if type(e).__name__ == "SafetensorError":
            raise ModelLoadError(f"{path}: corrupt safetensors file: {e}") from e
        raise
    finally:
        bar.close()
    covered = {n.split(":")[0] for n in filled}
    missing = expected - covered
    if missing:
        raise ModelLoadError(f"{path}: checkpoint lacks {len(missing)} weights, e.g. {sorted(missing)[:3]}")
    return model.eval()
