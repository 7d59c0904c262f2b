"""Container health check: ``python -m fuseserve.healthcheck URL`` exits 0 when URL answers 2xx.

Used by the images' ``HEALTHCHECK`` and ``docker-compose.yml``. A module rather than an inline
``python -c "..."`` because Podman's Docker-compatible API splits a health check's arguments on
spaces, which breaks any inline program; this command has no argument with a space in it.
"""

from __future__ import annotations

import sys
import urllib.error
import urllib.request


def main(argv: list[str] | None = None) -> int:
    """Return 0 if ``argv[0]`` (a URL) answers with a 2xx status within 3 s, else 1."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m fuseserve.healthcheck URL", file=sys.stderr)
        return 2
    try:
        with urllib.request.urlopen(args[0], timeout=3) as response:
            return 0 if 200 <= response.status < 300 else 1
    except (urllib.error.URLError, OSError) as exc:
        print(f"{args[0]}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
