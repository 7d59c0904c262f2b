"""Sub-commands of the persistent stack: serve, gateway, scheduler, worker."""

from __future__ import annotations


def add_parsers(sub, engine_args) -> None:
    """Register the service sub-commands (filled in by the server stack)."""
