"""The option tables (``fuseserve/options.py``): every flag, child command line and pipeline keyword
follows from ``EngineConfig``, ``RequestLimits`` and ``ServeOptions``. No model, no processes."""

from __future__ import annotations

import inspect

import pytest

from fuseserve.cli import build_parser, serve_args
from fuseserve.config import DEFAULT_MODEL, POLICIES, EngineConfig, RequestLimits
from fuseserve.errors import InvalidParameterError
from fuseserve.launcher import gateway_argv, scheduler_argv, worker_argv
from fuseserve.options import flag_of, from_cli_args, from_keywords, name_of, rows, to_keywords
from fuseserve.serve_options import ServeOptions
from fuseserve.service_cli import serve_options

REQUIRED = {"gateway": ["--redis-url", "redis://x"], "scheduler": ["--redis-url", "redis://x"]}
REQUIRED |= {"worker": ["--redis-url", "redis://x"], "generate": ["a prompt"]}
COMMANDS = ("generate", "serve", "gateway", "scheduler", "worker")


def _parse(argv: list[str]):
    return build_parser().parse_args(argv)


@pytest.mark.parametrize("command", COMMANDS)
def test_each_command_parses_to_the_table_defaults(command):
    args = _parse([command, *REQUIRED.get(command, [])])
    assert from_cli_args(ServeOptions, args) == ServeOptions()
    assert from_cli_args(EngineConfig, args) == EngineConfig()
    if command in ("generate", "serve", "gateway", "worker"):
        assert args.model == DEFAULT_MODEL


def _other_value(f, hint):
    """A value of option ``f`` that is not its default and that its flag can carry."""
    choices = f.metadata["argparse"].get("choices")
    if choices:
        return next(c for c in choices if c != f.default)
    if f.default is True or f.default is False:
        return not f.default
    if name_of(f) == "served_model_name":
        return ["a", "b"]
    if name_of(f) == "lora_modules":
        return ["a=/x", "b=/y"]
    if name_of(f) == "kv_cache_memory":
        return "64MiB"
    if name_of(f) == "simulate_slowdown":
        return "2"
    if name_of(f) == "api_key":
        return "sk-secret"
    if float in getattr(hint, "__args__", (hint,)):
        return 0.5 if f.default is None else f.default + 0.5
    if int in getattr(hint, "__args__", (hint,)):
        return 3 if f.default is None else f.default + 3
    return "x"


def _changed() -> ServeOptions:
    """Serve options with every option set to a value other than its default."""
    values = {name_of(f): _other_value(f, hint) for f, hint in rows(ServeOptions)}
    return from_keywords(ServeOptions, values)


def test_serve_hands_each_child_every_option_its_command_offers():
    options = _changed()
    argv, env = gateway_argv(options, "redis://x")
    children = {
        "scheduler": scheduler_argv(options, "redis://x"),
        "worker": worker_argv(options, "redis://x", 0),
        "gateway": argv,
    }
    for command, child in children.items():
        parsed = _parse(child)
        assert parsed.command == command
        for f, _ in rows(ServeOptions, command):
            value = to_keywords(options)[name_of(f)]
            if f.metadata["env"]:  # a secret: in the environment, never on the command line
                assert flag_of(f) not in child and str(value) not in child
                assert env == {f.metadata["env"]: value}
            else:
                assert getattr(parsed, name_of(f)) == value, (command, name_of(f))


def test_serve_flags_and_keywords_build_the_same_options():
    options = _changed()
    argv = ["serve"]
    for f, _ in rows(ServeOptions, "serve"):
        value = to_keywords(options)[name_of(f)]
        if isinstance(value, bool):
            argv.append(flag_of(f))
        else:
            argv += [flag_of(f), *(map(str, value) if isinstance(value, list) else [str(value)])]
    assert serve_options(_parse(argv)) == options
    assert serve_args(**to_keywords(options)) == options
    with pytest.raises(TypeError, match="unknown serve option 'nope'"):
        serve_args(nope=1)


def test_a_child_gets_only_what_differs_from_the_default():
    options = ServeOptions()
    assert scheduler_argv(options, "redis://x") == [
        "--log-level", "WARNING", "scheduler", "--redis-url", "redis://x", "--metrics-port", "0",
    ]  # fmt: skip
    assert gateway_argv(options, "redis://x") == (
        ["--log-level", "WARNING", "gateway", "--redis-url", "redis://x"],
        {},
    )


def test_every_engine_option_is_a_pipeline_keyword():
    from fuseserve.pipeline import Pipeline, pipeline

    config = from_keywords(EngineConfig, to_keywords(EngineConfig()))
    assert config == EngineConfig()
    assert "prefix_caching" in to_keywords(config) and "tensor_parallel_size" in to_keywords(config)
    assert inspect.signature(pipeline).parameters["model"].default == DEFAULT_MODEL
    with pytest.raises(TypeError, match="unknown pipeline keyword 'nope'"):
        Pipeline("no-such-model", nope=1)  # refused before the model is looked for
    with pytest.raises(InvalidParameterError, match="tensor_parallel_size"):
        Pipeline("no-such-model", tensor_parallel_size=0)


def test_policy_names_are_the_schedulers():
    from fuseserve.scheduler.policies import get_policy

    assert [get_policy(name).name for name in POLICIES] == list(POLICIES)
    assert EngineConfig().policy in POLICIES


def test_limits_flags_keep_the_gateways_names_and_statuses():
    flags = {f.name: (flag_of(f), f.metadata["status"]) for f, _ in rows(RequestLimits)}
    assert flags["max_body_bytes"] == ("--max-body-bytes", 413)
    assert flags["max_concurrent_per_key"] == ("--max-concurrent-per-key", 429)
    assert from_cli_args(
        RequestLimits, _parse(["gateway", "--redis-url", "x", "--max-n", "3"])
    ) == RequestLimits(max_n=3)
