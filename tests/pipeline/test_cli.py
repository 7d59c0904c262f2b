"""The ``fuseserve`` command in a subprocess: generate (plain and streamed), --help, a clear error."""

from __future__ import annotations

import subprocess
import sys

import pytest

TIMEOUT = 180


def fuseserve(*args: str, timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fuseserve.cli", *args], capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_generate_answers_paris(smollm2_source, stream):
    args = [
        "generate",
        "--model",
        str(smollm2_source.path),
        "What is the capital of France?",
        "--token-budget",
        "64",
    ]
    if stream:
        args.append("--stream")
    r = fuseserve(*args, "--kv-cache-memory", "128MiB")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "Traceback" not in r.stderr


def test_help_exits_zero():
    r = fuseserve("--help", timeout=60)
    assert r.returncode == 0 and "generate" in r.stdout
    r = fuseserve("generate", "--help", timeout=60)
    assert r.returncode == 0 and "--token-budget" in r.stdout and "--stream" in r.stdout


def test_missing_model_is_one_clear_error(tmp_path):
    missing = tmp_path / "no-such-model"
    r = fuseserve("generate", "--model", str(missing), "Hello", "--token-budget", "64", timeout=60)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, r.stderr
    assert "error" in lines[0] and str(missing) in lines[0]
    assert r.stdout == ""


def test_serve_model_positional_and_front_end_options_reach_the_gateway():
    from fuseserve.cli import build_parser
    from fuseserve.launcher import gateway_argv
    from fuseserve.service_cli import serve_options

    argv = [
        "serve",
        "HuggingFaceTB/SmolLM2-135M-Instruct",
        "--served-model-name",
        "a",
        "b",
        "--max-model-len",
        "512",
    ]
    options = serve_options(
        build_parser().parse_args([*argv, "--chat-template", "t.jinja", "--tokenizer", "tok"])
    )
    assert options.model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    child, _ = gateway_argv(options, "redis://x")
    assert child[child.index("--served-model-name") :][:9] == [
        "--served-model-name", "a", "b", "--max-model-len", "512", "--chat-template", "t.jinja", "--tokenizer", "tok",
    ]  # fmt: skip
    gw = build_parser().parse_args(child)
    assert gw.model == options.model
    assert gw.served_model_name == ["a", "b"] and gw.max_model_len == 512
    assert (gw.chat_template, gw.tokenizer) == ("t.jinja", "tok")
    assert serve_options(build_parser().parse_args(["serve"])).model == "smollm2-135m-instruct"
