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

from fuseserve.config import DEFAULT_MODEL, EngineConfig
from fuseserve.errors import FuseServeError
from fuseserve.frontend.params import add_cli_flags, cli_kwargs
from fuseserve.options import add_cli_args, from_cli_args, from_keywords, to_keywords
from fuseserve.parent_death import follow_parent
from fuseserve.serve_options import ServeOptions

if TYPE_CHECKING:
    from fuseserve.launcher import LocalServer


GENERATE_DEFAULTS = {"max_new_tokens": 128, "temperature": 0.0}
"""``fuseserve generate`` defaults that differ from ``SamplingParams``' (greedy, longer answers)."""


def cmd_generate(a: argparse.Namespace) -> int:
    import fuseserve

    pipe = fuseserve.pipeline(a.model, **to_keywords(from_cli_args(EngineConfig, a)))
    try:
        kwargs = cli_kwargs(a)
        for prompt in a.prompts:
            ids = prompt if a.raw else pipe.chat_prompt_ids([{"role": "user", "content": prompt}])
            if a.stream:
                for delta in pipe.stream(ids, lora=a.lora, **kwargs):
                    print(delta, end="", flush=True)
                print()
            else:
                print(pipe(ids, lora=a.lora, **kwargs)[0].text)
    finally:
        pipe.close()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fuseserve", description=__doc__)
    log_help = f"DEBUG, INFO, WARNING (default: {ServeOptions.log_level})"
    parser.add_argument("--log-level", default=ServeOptions.log_level, help=log_help)
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
    g.add_argument(
        "--lora",
        default=None,
        metavar="NAME",
        help="generate with this LoRA adapter of --lora-modules (default: the base model)",
    )
    add_cli_args(g, ServeOptions, "generate")  # --model and the engine's flags
    add_cli_flags(g, GENERATE_DEFAULTS)
    g.set_defaults(func=cmd_generate)
    from fuseserve import service_cli

    service_cli.add_parsers(sub)
    from fuseserve import top

    top.add_parser(sub)
    for command in sub.choices.values():  # also accepted after the sub-command
        command.add_argument("--log-level", default=argparse.SUPPRESS, help=log_help)
    return parser


def serve_args(**overrides) -> ServeOptions:
    """The ``fuseserve serve`` options with their defaults, overridden by keyword (tests, benchmarks).

    Keywords name the options as ``fuseserve.serve()`` does. Raises ``TypeError`` for a name that is
    not a ``serve`` option.
    """
    return from_keywords(ServeOptions, overrides, "serve option")


def serve(model: str = DEFAULT_MODEL, **options) -> LocalServer:
    """Start the persistent stack locally from Python, like ``fuseserve serve``; returns once healthy.

    ``fuseserve.serve``: it lives here because its options are the ``serve`` command's (the launcher
    takes a ``ServeOptions`` and imports no CLI). ``options`` are the other ``fuseserve serve``
    options by their Python names (``workers``, ``host``, ``port``, ``token_budget``,
    ``kv_cache_memory``, ``policy``, ``device``, ``threads``, ...: ``fuseserve.serve_options``).
    Raises ``TypeError`` for an unknown option and ``FuseServeError`` when a process dies or the
    stack is not healthy in time.
    """
    from fuseserve.launcher import LocalServer, start_stack

    stack, url = start_stack(serve_args(model=model, **options))
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
