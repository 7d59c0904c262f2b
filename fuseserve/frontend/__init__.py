"""The request front end shared by the pipeline and the gateway (``docs/architecture.md``).

- ``encode``: prompts (text, token ids, chat messages) to token ids; the context check.
- ``output``: token events to deltas (incremental detokenizer, stop strings, logprobs), with a hook
  for incremental parsers of the generated text (tool calls).
- ``params``: ``SamplingParams``' fields mapped to the OpenAI body, the CLI and the proto.
- ``openai_params``: an OpenAI request (completions or chat) to validated ``SamplingParams``.
- ``constraints``: the request fields that constrain the output (structured output, tools,
  ``logit_bias``), their shapes and their ``SamplingParams`` keywords.

The pipeline (``fuseserve/pipeline.py``) and the gateway (``services/gateway/``) differ only in I/O.
"""

from fuseserve.frontend.encode import MAX_PROMPTS, PromptEncoder, as_batch, is_token_ids
from fuseserve.frontend.output import Delta, OutputState, TextParser, TokenLogprobs

__all__ = [
    "MAX_PROMPTS",
    "Delta",
    "OutputState",
    "PromptEncoder",
    "TextParser",
    "TokenLogprobs",
    "as_batch",
    "is_token_ids",
]
