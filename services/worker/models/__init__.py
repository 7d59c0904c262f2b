"""Model families by Hugging Face architecture name."""

from __future__ import annotations

from fuseserve.errors import UnsupportedModelError
from fuseserve.worker.models.gemma2 import Gemma2ForCausalLM
from fuseserve.worker.models.llama import LlamaForCausalLM
from fuseserve.worker.models.mistral import MistralForCausalLM
from fuseserve.worker.models.mixtral import MixtralForCausalLM
from fuseserve.worker.models.opt import OPTForCausalLM
from fuseserve.worker.models.phi3 import Phi3ForCausalLM
from fuseserve.worker.models.qwen2 import Qwen2ForCausalLM
from fuseserve.worker.models.qwen3 import Qwen3ForCausalLM
from fuseserve.worker.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "OPTForCausalLM": OPTForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
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
