"""Model families by Hugging Face architecture name."""

from __future__ import annotations

from fuseserve.errors import UnsupportedModelError
from fuseserve.worker.models.llama import LlamaForCausalLM
from fuseserve.worker.models.mistral import MistralForCausalLM
from fuseserve.worker.models.opt import OPTForCausalLM

MODEL_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "OPTForCausalLM": OPTForCausalLM,
}


def model_class(config):
    """The fuseserve class for ``config.architectures[0]``; raises ``UnsupportedModelError``."""
    archs = getattr(config, "architectures", None) or []
    for arch in archs:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    raise UnsupportedModelError(
        f"unsupported architecture {archs or config.model_type!r}; supported: {', '.join(MODEL_REGISTRY)}"
    )
