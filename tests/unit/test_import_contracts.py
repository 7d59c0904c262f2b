"""The layering contracts (``pyproject.toml`` ``[tool.importlinter]``; ``docs/architecture.md``,
"Layering") hold on the working tree, and each breaks when a forbidden import is added; no two product
modules share a file name.

import-linter finds a package's modules under the package's folder, but the import names map onto
other folders (``setup.py`` ``ROOTS``: ``fuseserve.gateway`` is ``services/gateway``, ...), so it runs
on a tree that puts each folder under its import name: links to the working tree for the real check,
a copy for the broken ones. ``lint-imports`` runs in a subprocess, where ``fuseserve`` is that tree.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "pyproject.toml"
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"
CONTRACTS = {c["id"]: c for c in tomllib.loads(CONFIG.read_text())["tool"]["importlinter"]["contracts"]}


def _roots() -> dict[str, str]:
    """``setup.py``'s ``ROOTS`` (import name -> folder), read without running setup()."""
    for node in ast.parse((ROOT / "setup.py").read_text()).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "ROOTS":
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py defines no ROOTS")


ROOTS = _roots()


def package_tree(dest: Path, *, copy: bool) -> Path:
    """``dest`` holding each import root's folder under its import name: copied, or linked (a root with
    roots nested in it becomes a folder of links to its entries). Returns ``dest``."""
    for name, folder in sorted(ROOTS.items(), key=lambda item: item[0].count(".")):
        source, target = ROOT / folder, dest.joinpath(*name.split("."))
        if copy:
            shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"), dirs_exist_ok=True)
        elif any(other.startswith(name + ".") for other in ROOTS):
            target.mkdir(parents=True)
            for entry in source.iterdir():
                if entry.name != "__pycache__":
                    (target / entry.name).symlink_to(entry)
        else:
            target.symlink_to(source, target_is_directory=True)
    return dest


def lint_imports(tree: Path) -> tuple[int, str]:
    """Run ``lint-imports`` on ``tree`` with this repository's contracts: (exit status, output)."""
    assert LINT_IMPORTS.exists(), "import-linter is a dev extra: pip install -e '.[dev]'"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")])),
    }
    proc = subprocess.run(
        [str(LINT_IMPORTS), str(CONFIG), "--no-cache", "--no-logo"],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return proc.returncode, proc.stdout + proc.stderr


def verdicts(output: str) -> dict[str, str]:
    """``{contract id: "KEPT" | "BROKEN"}`` from lint-imports' summary lines."""
    out = {}
    for line in output.splitlines():
        for cid, contract in CONTRACTS.items():
            for verdict in ("KEPT", "BROKEN"):
                if line.startswith(f"{contract['name']} {verdict}"):
                    out[cid] = verdict
    return out


def test_every_contract_is_kept(tmp_path):
    status, output = lint_imports(package_tree(tmp_path, copy=False))
    assert verdicts(output) == dict.fromkeys(CONTRACTS, "KEPT"), output
    assert status == 0, output


SCHEDULER = ROOT / ROOTS["fuseserve.scheduler"]
SCHEDULER_SHELL = {p.stem for p in (SCHEDULER / "service").glob("*.py")} - {"__init__"}
"""The scheduler's service shell (``services/scheduler/service/``: Redis, gRPC, Prometheus)."""


def test_the_planner_and_the_shell_cover_the_scheduler():
    """Every module of ``services/scheduler/`` is a planner module (the contract's source), and every
    one of ``services/scheduler/service/`` is the I/O shell; the shell has the modules it had."""
    planner = {m.removeprefix("fuseserve.scheduler.") for m in CONTRACTS["planner"]["source_modules"]}
    modules = {p.stem for p in SCHEDULER.glob("*.py")} - {"__init__"}
    assert modules == planner
    assert {"scheduler_service", "redis_io", "grpc_worker", "worker_leases"} <= SCHEDULER_SHELL


def test_no_two_product_modules_share_a_name():
    """A module's file name says what it holds, once: no two modules under the import roots share a
    file name (``__init__.py`` aside), as three ``metrics.py`` once did."""
    paths: dict[str, set[str]] = {}
    for folder in ROOTS.values():
        for path in (ROOT / folder).rglob("*.py"):
            if path.name != "__init__.py" and "__pycache__" not in path.parts:
                paths.setdefault(path.name, set()).add(path.relative_to(ROOT).as_posix())
    assert len(paths) > 50  # the walk found the modules
    assert {name: sorted(found) for name, found in paths.items() if len(found) > 1} == {}


def test_each_shell_module_does_io(tmp_path):
    """The line is drawn honestly: each shell module imports redis, grpc or prometheus_client itself
    (one that stops doing so belongs to the planner and its contract)."""
    script = (
        "import grimp\n"
        "g = grimp.build_graph('fuseserve', include_external_packages=True, cache_dir=None)\n"
        f"for m in sorted({sorted(SCHEDULER_SHELL)!r}):\n"
        "    io = g.find_modules_directly_imported_by('fuseserve.scheduler.service.' + m)\n"
        "    print(m, sorted(io & {'redis', 'grpc', 'prometheus_client'}))\n"
    )
    tree = package_tree(tmp_path, copy=False)
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=tree, env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == len(SCHEDULER_SHELL) and all(not line.endswith("[]") for line in lines), lines


@pytest.mark.parametrize(
    ("path", "line", "broken", "reported"),
    [
        pytest.param(
            "fuseserve/gateway/render.py",
            "import fuseserve.worker.runner",
            {"services"},
            "fuseserve.gateway.render -> fuseserve.worker.runner",
            id="gateway-imports-worker",
        ),
        pytest.param(  # the violation fixed by fuseserve/pass_shape.py
            "fuseserve/scheduler/scheduler.py",
            "from fuseserve.worker.latency_model import PassShape",
            {"services"},
            "fuseserve.scheduler.scheduler -> fuseserve.worker.latency_model",
            id="scheduler-imports-worker",
        ),
        pytest.param(  # a shared module importing one side makes the sides depend on each other
            "fuseserve/pass_shape.py",
            "import fuseserve.worker.runner",
            {"core", "services"},
            "fuseserve.pass_shape -> fuseserve.worker.runner",
            id="core-imports-worker",
        ),
        pytest.param(
            "fuseserve/scheduler/placement.py",
            "import redis",
            {"planner"},
            "fuseserve.scheduler.placement -> redis",
            id="planner-imports-redis",
        ),
        pytest.param(  # indirect: engine_core -> scheduler_metrics -> prometheus_client
            "fuseserve/scheduler/engine_core.py",
            "import fuseserve.scheduler.service.scheduler_metrics",
            {"planner"},
            "fuseserve.scheduler.service.scheduler_metrics -> prometheus_client",
            id="planner-imports-shell",
        ),
        pytest.param(  # the violation fixed by fuseserve/frontend/constraints.py
            "fuseserve/frontend/openai_params.py",
            "from fuseserve.gateway.protocol import ChatCompletionRequest",
            {"frontend"},
            "fuseserve.frontend.openai_params -> fuseserve.gateway.protocol",
            id="frontend-imports-gateway",
        ),
        pytest.param(  # the cycle broken by moving serve_args into fuseserve.cli
            "fuseserve/launcher.py",
            "from fuseserve.cli import build_parser",
            {"cli", "cli-launcher"},
            "fuseserve.launcher -> fuseserve.cli",
            id="launcher-imports-cli",
        ),
    ],
)
def test_a_forbidden_import_breaks_its_contract(tmp_path, path, line, broken, reported):
    """``path``: the module in the copied tree (by import name), which gets ``line`` appended."""
    tree = package_tree(tmp_path, copy=True)
    module = tree / path
    assert module.is_file()
    with module.open("a") as f:
        f.write(f"\n{line}  # added by tests/unit/test_import_contracts.py\n")
    status, output = lint_imports(tree)
    assert status != 0, output
    assert verdicts(output) == {cid: "BROKEN" if cid in broken else "KEPT" for cid in CONTRACTS}, output
    assert reported in output, output
