"""Triton, imported once for every kernel module: compiled on CUDA, interpreted on CPU.

On a machine without CUDA the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``). Triton
decides this when it is first imported, and torch imports it as soon as ``transformers`` loads a
model, so a CPU process that wants these kernels must start with ``TRITON_INTERPRET=1`` in its
environment (the test suite's conftest sets it); this module sets it only if triton is not loaded yet
and the variable is unset (``TRITON_INTERPRET=0`` keeps compiled kernels, e.g. to compile for a GPU
target without one). The interpreter cannot multiply bfloat16 operands (it keeps them as raw 16-bit
integers), so there bfloat16 tiles are widened to float32 before ``tl.dot``; compiled kernels use the
tensor cores in the input dtype.

Kernel modules import ``triton`` and ``tl`` from here, so that the choice is made before triton loads.
"""

from __future__ import annotations

import os
import sys

import torch

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") is None:
    # the interpreter is chosen when a function is decorated, triton's own library functions included
    if "triton" in sys.modules:
        raise ImportError(
            "no CUDA device: Triton kernels can only run interpreted, but triton was imported (by torch, "
            "when transformers loads a model) before TRITON_INTERPRET=1 was set; start the process "
            "with TRITON_INTERPRET=1 in its environment"
        )
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"  # kernels run in Triton's interpreter

__all__ = ["INTERPRETED", "tl", "triton"]
