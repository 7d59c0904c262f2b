"""What ships is what is tested: each service from the built wheel, with only its own requirements.

The editable install reads the source tree, so a module left out of the wheel, a requirement a service
imports but its image lacks, or a top-level ``import torch`` in the gateway goes unseen by every other
test (issue 22: every container crash-looped at import). Here the wheel is built once, and for each
service a fresh venv gets ``deploy/requirements/<service>.in`` (what its image installs) plus the
wheel without dependencies (resolved with ``overrides.txt``, as the images are); then, in that venv:

- ``fuseserve <service> --help`` exits 0 (the CLI imports only what every image has);
- every module of the service's package imports (``fuseserve.gateway.*``, ...), and its entry point;
- the gateway and the scheduler have no torch at all (their images ship none).

The venvs are made with ``uv`` from its cache (seconds once the cache is warm). The CPU torch wheel
comes from ``$FIND_LINKS``, ``/opt/wheels`` where it exists, else PyTorch's CPU index.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
REQUIREMENTS = ROOT / "deploy" / "requirements"
OVERRIDES = REQUIREMENTS / "overrides.txt"  # as deploy/build-images.sh resolves them

# service -> (requirements file, its package, the modules it runs (its CLI command's first), ships torch)
SERVICES = {
    "gateway": ("gateway.in", "fuseserve.gateway", ["fuseserve.gateway.app"], False),
    "scheduler": (
        "scheduler.in",
        "fuseserve.scheduler",
        ["fuseserve.scheduler.service.scheduler_service"],
        False,
    ),
    # the worker also compiles grammars (xgrammar, imported when a constrained request arrives)
    "worker": ("worker-cpu.in", "fuseserve.worker", ["fuseserve.worker.server", "xgrammar"], True),
}

IMPORT_ALL = textwrap.dedent(
    """
    import importlib, pkgutil, sys
    package, entries = sys.argv[1], sys.argv[2:]
    for entry in entries:
        importlib.import_module(entry)
    pkg = importlib.import_module(package)
    for info in pkgutil.walk_packages(pkg.__path__, package + "."):
        importlib.import_module(info.name)
    from fuseserve.cli import build_parser
    build_parser()
    """
)


def _uv() -> str:
    uv = pytest.importorskip("uv", reason="uv is in the dev extras (pip install -e '.[dev]')")
    return uv.find_uv_bin()


def _torch_source() -> list[str]:
    links = os.environ.get("FIND_LINKS") or ("/opt/wheels" if Path("/opt/wheels").is_dir() else "")
    if links:
        return ["--find-links", links]
    return [
        "--extra-index-url",
        "https://download.pytorch.org/whl/cpu",
        "--index-strategy",
        "unsafe-best-match",
    ]


def _run(cmd: list[str], env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}, cwd="/"
    )


def _ok(result: subprocess.CompletedProcess, what: str) -> str:
    assert result.returncode == 0, (
        f"{what} failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    )
    return result.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The fuseserve wheel built from this checkout (what build-images.sh puts in the wheelhouse)."""
    out = tmp_path_factory.mktemp("wheel")
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "-q",
        "--no-deps",
        "--no-build-isolation",
        "-w",
        str(out),
        str(ROOT),
    ]
    _ok(_run(cmd), "pip wheel")
    (found,) = out.glob("fuseserve-*.whl")
    return found


def service_venv(tmp: Path, requirements: Path, wheel: Path) -> Path:
    """A fresh venv holding ``requirements`` and the wheel (no dependencies); returns its python."""
    uv = _uv()
    venv = tmp / "venv"
    env = {"VIRTUAL_ENV": str(venv)}
    _ok(_run([uv, "venv", "-q", "--python", sys.executable, str(venv)]), "uv venv")
    _ok(
        _run(
            [
                uv,
                "pip",
                "install",
                "-q",
                *_torch_source(),
                "--override",
                str(OVERRIDES),
                "-r",
                str(requirements),
            ],
            env=env,
        ),
        f"install {requirements.name}",
    )
    _ok(_run([uv, "pip", "install", "-q", "--no-deps", str(wheel)], env=env), "install the wheel")
    return venv / "bin" / "python"


@pytest.mark.parametrize("service", list(SERVICES))
def test_service_starts_from_the_wheel_with_only_its_requirements(service, wheel, tmp_path):
    requirements, package, entries, ships_torch = SERVICES[service]
    python = service_venv(tmp_path, REQUIREMENTS / requirements, wheel)
    fuseserve = python.parent / "fuseserve"

    help_text = _ok(_run([str(fuseserve), service, "--help"]), f"fuseserve {service} --help")
    assert f"usage: fuseserve {service}" in help_text

    _ok(_run([str(python), "-c", IMPORT_ALL, package, *entries]), f"importing {package}")
    if not ships_torch:
        no_torch = _run([str(python), "-c", "import torch"])
        assert no_torch.returncode != 0, f"the {service} requirements install torch: its image would be GBs"


def test_the_wheel_carries_every_cpp_source_and_header(wheel):
    """The C++ operators compile at first use from the installed package (``kernels/cpu_build.py``):
    every ``kernels/*.cpp`` and the ``*.h`` they include must be in the wheel."""
    import zipfile

    names = set(zipfile.ZipFile(wheel).namelist())
    sources = [p.name for p in sorted((ROOT / "kernels").iterdir()) if p.suffix in (".cpp", ".h")]
    assert "cpu_vec.h" in sources and "cpu_fused.cpp" in sources
    missing = [n for n in sources if f"fuseserve/kernels/{n}" not in names]
    assert not missing, f"not in the wheel: {missing}"


def _names(path: Path) -> set[str]:
    """Distribution names in a requirements file, following ``-r`` includes."""
    import re

    names: set[str] = set()
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith("-r"):
            names |= _names(path.parent / line[2:].strip())
        elif line:
            names.add(re.split(r"[<>=!~;\[ ]", line, maxsplit=1)[0].lower().replace("_", "-"))
    return names


def test_the_worker_image_holds_every_runtime_dependency():
    """The worker image is the full install: each of pyproject's dependencies is in its requirements."""
    import re
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = {
        re.split(r"[<>=!~;\[ ]", d, maxsplit=1)[0].lower().replace("_", "-") for d in project["dependencies"]
    }
    missing = wanted - _names(REQUIREMENTS / "worker-cpu.in")
    assert not missing, f"deploy/requirements/worker-cpu.in lacks {sorted(missing)}"


def test_the_lock_pins_every_direct_dependency():
    """constraints.txt (``./dev.sh lock``) pins each dependency and dev extra, torch and triton aside."""
    import re
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    direct = [*project["dependencies"], *project["optional-dependencies"]["dev"]]
    wanted = {re.split(r"[<>=!~;\[ ]", d, maxsplit=1)[0].lower().replace("_", "-") for d in direct}
    pinned = {
        line.split("==")[0].lower().replace("_", "-")
        for line in (ROOT / "constraints.txt").read_text().splitlines()
        if "==" in line and not line.startswith("#")
    }
    missing = wanted - pinned - {"torch", "triton"}
    assert not missing, f"constraints.txt lacks {sorted(missing)}: run ./dev.sh lock after the suite passes"
