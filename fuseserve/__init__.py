"""fuseserve: LLM serving with Dynamic SplitFuse (DeepSpeed-FastGen), in process or as a service.

import fuseserve
pipe = fuseserve.pipeline("smollm2-135m-instruct")
pipe(["What is 2+2?"], max_new_tokens=32, temperature=0.0)[0].text
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = ["pipeline", "Pipeline", "serve", "Client", "Response", "SamplingParams"]

if TYPE_CHECKING:
    from fuseserve.cli import serve
    from fuseserve.client import Client
    from fuseserve.outputs import Response
    from fuseserve.pipeline import Pipeline, pipeline
    from fuseserve.sampling_params import SamplingParams


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def __getattr__(name: str):  # lazy: importing fuseserve must not import torch
    if name in ("pipeline", "Pipeline"):
        import importlib

        module = importlib.import_module("fuseserve.pipeline")  # binds fuseserve.pipeline to the module,
        return getattr(module, name)  # which is callable (see fuseserve/pipeline.py)
    if name == "serve":
        from fuseserve.cli import serve

        return serve
    if name == "Client":
        from fuseserve.client import Client

        return Client
    if name == "Response":
        from fuseserve.outputs import Response

        return Response
    if name == "SamplingParams":
        from fuseserve.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
