"""Package discovery for the wheel: every folder with an ``__init__.py`` under each import root.

The import names (``fuseserve.gateway``, ...) map onto the folders that hold them (``services/gateway``,
...) through ``ROOTS``; the packages are found by walking those folders, never listed by hand, so a new
sub-package cannot be left out of the wheel. A folder of Python files without ``__init__.py`` stops the
build (it would be missing from the wheel). ``tests/deploy/test_wheel_smoke.py`` installs the built
wheel per service and starts each one.
"""

from pathlib import Path

from setuptools import setup

# import root -> folder (docs/architecture.md has the same table)
ROOTS = {
    "fuseserve": "fuseserve",
    "fuseserve.gateway": "services/gateway",
    "fuseserve.scheduler": "services/scheduler",
    "fuseserve.worker": "services/worker",
    "fuseserve.kernels": "kernels",
    "fuseserve.proto": "proto",
}
HERE = Path(__file__).resolve().parent


def discover(roots: dict[str, str]) -> list[str]:
    """Every package under ``roots`` (name -> folder); raises SystemExit for a folder of .py files
    without ``__init__.py``."""
    packages = []
    nested = set(roots.values())
    for name, folder in roots.items():
        base = HERE / folder
        for path in sorted([base, *(p for p in base.rglob("*") if p.is_dir())]):
            rel = path.relative_to(HERE).as_posix()
            if "__pycache__" in path.parts or (path != base and rel in nested):
                continue
            if (path / "__init__.py").is_file():
                packages.append(".".join((name, *path.relative_to(base).parts)))
            elif any(path.glob("*.py")):
                raise SystemExit(f"setup.py: {rel} holds Python files but no __init__.py")
    return packages


setup(packages=discover(ROOTS), package_dir=ROOTS)
