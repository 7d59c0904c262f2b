"""The ``fuseserve`` command: generate (pipeline), serve (local stack), gateway, scheduler, worker.

Also ``fuseserve.serve()``, the ``serve`` command from Python (its options are the command's). Nothing
but ``service_cli`` and the package's lazy ``fuseserve.serve`` imports this module
(``docs/architecture.md``, "Layering").
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import TYPE_CHECKING

from fuseserve.config import ATTENTION_BACKENDS
from fuseserve.errors import FuseServeError
from fuseserve.frontend.params import add_cli_flags, cli_kwargs
from fuseserve.parent_death import follow_parent

if TYPE_CHECKING:
    from fuseserve.launcher import LocalServer

DEFAULT_MODEL = "smollm2-135m-instruct"


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="model alias, Hugging Face checkpoint directory or .gguf file (default: %(default)s)",
    )
    p.add_argument(
        "--token-budget",
        type=int,
        default=None,
        help="tokens per forward pass; default: chosen by profiling this device (cached)",
    )
    p.add_argument("--max-num-seqs", type=int, default=256, help="sequences per forward pass (default: 256)")
    p.add_argument(
        "--kv-cache-memory",
        default=None,
        help="KV cache size, bytes or e.g. 512MiB, 2GiB (default: 1GiB on CPU, 85%% of free GPU memory)",
    )
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block (default: 16)")
    p.add_argument(
        "--policy",
        default="splitfuse",
        choices=["splitfuse", "prefill_first", "whole_prompt"],
        help="scheduling policy (default: splitfuse)",
    )
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    p.add_argument(
        "--dtype",
        default=None,
        help="auto, float32, bfloat16, float16 (default: auto = bf16 on GPUs and on CPUs with "
        "AVX512-BF16/AMX, else float32); logits and sampling are fp32 whatever the dtype",
    )
    p.add_argument(
        "--attention-backend",
        default="auto",
        choices=ATTENTION_BACKENDS,
        help="attention kernels: flash-attn (SM80+ GPU), triton (GPU), torch (reference, the CPU path); "
        "auto picks the first that fits this device (default: auto)",
    )


GENERATE_DEFAULTS = {"max_new_tokens": 128, "temperature": 0.0}
"""``fuseserve generate`` defaults that differ from ``SamplingParams``' (greedy, longer answers)."""


def cmd_generate(a: argparse.Namespace) -> int:
    import fuseserve

    pipe = fuseserve.pipeline(
        a.model,
        token_budget=a.token_budget,
        max_num_seqs=a.max_num_seqs,
        kv_cache_memory=a.kv_cache_memory,
        policy=a.policy,
        block_size=a.block_size,
        device=a.device,
        dtype=a.dtype,
        attention_backend=a.attention_backend,
        target_itl=a.target_itl,
        target_prefill_rate=a.target_prefill_rate,
        decode_passes=a.decode_passes,
    )
    try:
        kwargs = cli_kwargs(a)
        for prompt in a.prompts:
            ids = prompt if a.raw else pipe.chat_prompt_ids([{"role": "user", "content": prompt}])
            if a.stream:
                for delta in pipe.stream(ids, **kwargs):
                    print(delta, end="", flush=True)
                print()
            else:
                print(pipe(ids, **kwargs)[0].text)
    finally:
        pipe.close()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fuseserve", description=__doc__)
    parser.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING (default: WARNING)")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser(
        "generate",
        help="generate in this process (pipeline mode) and print the answer",
        description="Generate in this process with Dynamic SplitFuse; prompts go through "
        "the model's chat template unless --raw.",
    )
    g.add_argument("prompts", nargs="+", help="one or more prompts")
    g.add_argument("--stream", action="store_true", help="print text as it is generated")
    g.add_argument(
        "--raw", action="store_true", help="send the prompt as plain text, without the chat template"
    )
    from fuseserve import service_cli

    _engine_args(g)
    service_cli.slo_args(g)
    service_cli.decode_passes_arg(g)
    add_cli_flags(g, GENERATE_DEFAULTS)
    g.set_defaults(func=cmd_generate)

    service_cli.add_parsers(sub, _engine_args)
    from fuseserve import top

    top.add_parser(sub)
    for command in sub.choices.values():  # also accepted after the sub-command
        command.add_argument(
            "--log-level", default=argparse.SUPPRESS, help="DEBUG, INFO, WARNING (default: WARNING)"
        )
    return parser


def serve_args(**overrides) -> argparse.Namespace:
    """The ``fuseserve serve`` options with their CLI defaults, overridden by keyword (tests, benchmarks).

    Raises ``TypeError`` for a name that is not a ``serve`` option.
    """
    args = build_parser().parse_args(["serve"])
    for name, value in overrides.items():
        if not hasattr(args, name):
            raise TypeError(f"unknown serve option {name!r}")
        setattr(args, name, value)
    return args


def serve(
    model: str = DEFAULT_MODEL,
    *,
    workers: int = 1,
    host: str = "127.0.0.1",
    port: int = 8000,
    **options,
) -> LocalServer:
    """Start the persistent stack locally from Python, like ``fuseserve serve``; returns once healthy.

    ``fuseserve.serve``: it lives here because its options are the ``serve`` command's (the launcher
    takes parsed options and imports no CLI). ``options`` are the other ``fuseserve serve`` options by
    their Python names (``token_budget``, ``kv_cache_memory``, ``policy``, ``device``, ``threads``,
    ...). Raises ``TypeError`` for an unknown option and ``FuseServeError`` when a process dies or the
    stack is not healthy in time.
    """
    from fuseserve.launcher import LocalServer, start_stack

    stack, url = start_stack(serve_args(model=model, workers=workers, host=host, port=port, **options))
    return LocalServer(stack, url)


def main(argv: list[str] | None = None) -> int:
    follow_parent()  # a child of ``fuseserve serve`` stops when it dies (``fuseserve.parent_death``)
    parser = build_parser()
    a = parser.parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return a.func(a)
    except FuseServeError as e:
        print(f"fuseserve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
