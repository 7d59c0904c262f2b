"""Product files over 400 lines and product functions over 60 lines (issue 23's limits).

    python -m benchmarks.code_size [REPO]

The product is ``fuseserve/``, ``services/``, ``kernels/`` and ``proto/`` (generated ``*_pb2*`` stubs
excluded). A function's length runs from its ``def`` line to its last line (decorators not counted,
its docstring and nested functions counted); methods are named ``Class.method``. Prints one line per
file or function over its limit, then the count; exits 1 when there is any.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

PRODUCT = ("fuseserve", "services", "kernels", "proto")
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60


def product_files(repo: Path) -> Iterator[Path]:
    """The product's Python files under ``repo``, generated stubs excluded."""
    for root in PRODUCT:
        for path in sorted((repo / root).rglob("*.py")):
            if "_pb2" not in path.name:
                yield path


def long_functions(tree: ast.AST, prefix: str = "") -> Iterator[tuple[str, int, int]]:
    """``(qualified name, def line, lines)`` of each function in ``tree`` over ``MAX_FUNCTION_LINES``."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            lines = node.end_lineno - node.lineno + 1
            if lines > MAX_FUNCTION_LINES:
                yield prefix + node.name, node.lineno, lines
            yield from long_functions(node, f"{prefix}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            yield from long_functions(node, f"{prefix}{node.name}.")
        else:
            yield from long_functions(node, prefix)


def over_limits(repo: Path) -> list[str]:
    """One line per product file or function over its limit."""
    found = []
    for path in product_files(repo):
        text = path.read_text()
        rel = path.relative_to(repo)
        num_lines = len(text.splitlines())
        if num_lines > MAX_FILE_LINES:
            found.append(f"file {rel}: {num_lines} lines (limit {MAX_FILE_LINES})")
        for name, lineno, lines in long_functions(ast.parse(text, str(rel))):
            found.append(f"function {rel}:{lineno} {name}: {lines} lines (limit {MAX_FUNCTION_LINES})")
    return found


def main(argv: list[str]) -> int:
    repo = Path(argv[0] if argv else Path(__file__).resolve().parent.parent)
    found = over_limits(repo)
    for line in found:
        print(line)
    print(f"{len(found)} over the limits")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
