"""Option tables: a dataclass whose fields carry their flag, help and readers, and what follows from it.

A field declared with :func:`option` is one option: its default, its ``--help`` line and the
sub-commands that offer its flag (``commands``), which are also the processes ``fuseserve serve``
hands it to. A field whose type is itself a table nests that table in place (``ServeOptions.engine``
is an ``EngineConfig``). From the table follow, as vLLM's ``EngineArgs.add_cli_args`` /
``from_cli_args`` do:

- each sub-command's flags: :func:`add_cli_args` (``fuseserve/cli.py``, ``fuseserve/service_cli.py``);
- the table from the parsed flags: :func:`from_cli_args` (the entry points read nothing else);
- a child process's command line and secret environment: :func:`to_argv`, :func:`to_env`
  (``fuseserve/launcher.py``);
- the table from Python keywords and back: :func:`from_keywords`, :func:`to_keywords`
  (``fuseserve.pipeline(**kw)``, ``fuseserve.serve(**kw)``).

The tables: ``EngineConfig`` and ``RequestLimits`` (``fuseserve/config.py``) and ``ServeOptions``
(``fuseserve/serve_options.py``). ``SamplingParams`` has its own (``fuseserve/frontend/params.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import types
import typing
from collections.abc import Iterator
from typing import Any


def option(
    default: Any,
    help: str | None,
    *,
    commands: tuple[str, ...] = (),
    name: str | None = None,
    flag: str | None = None,
    help_for: dict[str, str | None] | None = None,
    env: str | None = None,
    metadata: dict[str, Any] | None = None,
    **argparse_kw: Any,
) -> Any:
    """A table field: ``default`` and the facts every surface derives from it.

    help: the ``--help`` line (argparse's ``%(default)s`` shows the default). commands: the
    sub-commands offering the flag (``generate``, ``serve``, ``gateway``, ``scheduler``, ``worker``);
    ``serve`` passes the option to each child whose command is listed; none: a keyword only.
    name: the keyword and the parsed flag's name when they differ from the field's
    (``prefix_caching`` for ``enable_prefix_caching``). flag: the flag when it is not
    ``--name-with-dashes`` (``--no-name`` for a switch that is on by default). help_for: the help of
    a command where it reads differently (None: no help). env: the variable ``serve`` hands the value
    to a child in, instead of argv (a secret stays out of ``ps``). metadata: more facts
    (``RequestLimits``' HTTP status). argparse_kw: ``choices``, ``metavar``, ``type``.
    """
    facts = {"help": help, "commands": commands, "name": name, "flag": flag, "help_for": help_for or {}}
    facts |= {"env": env, "argparse": argparse_kw, **(metadata or {})}
    return dataclasses.field(default=default, metadata=facts)


@functools.cache
def _fields(cls: type) -> tuple[tuple[dataclasses.Field, Any], ...]:
    """``(field, resolved type)`` of each field of the table ``cls``."""
    hints = typing.get_type_hints(cls)
    return tuple((f, hints[f.name]) for f in dataclasses.fields(cls))


def _table(hint: Any) -> type | None:
    """The nested table class a field's type names, else None."""
    return hint if isinstance(hint, type) and dataclasses.is_dataclass(hint) else None


def name_of(f: dataclasses.Field) -> str:
    """The option's keyword and parsed flag name."""
    return f.metadata.get("name") or f.name


def flag_of(f: dataclasses.Field) -> str:
    """The option's flag: ``--name-with-dashes``, ``--no-name`` for a switch on by default."""
    if f.metadata.get("flag"):
        return f.metadata["flag"]
    return ("--no-" if f.default is True else "--") + name_of(f).replace("_", "-")


def rows(cls: type, command: str | None = None) -> Iterator[tuple[dataclasses.Field, Any]]:
    """The options of ``cls``, nested tables in place, in declaration order; with ``command``, only
    those it offers. Yields ``(field, resolved type)``."""
    for f, hint in _fields(cls):
        if (sub := _table(hint)) is not None:
            yield from rows(sub, command)
        elif "commands" in f.metadata and (command is None or command in f.metadata["commands"]):
            yield f, hint


def _base_type(hint: Any) -> tuple[Any, bool]:
    """``(element type, is_list)``: None stripped (``int | None`` → int), a mixed union read as text
    (``int | str | None`` → str: ``"512MiB"``)."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = args[0] if len(args) == 1 else str
    if typing.get_origin(hint) is list:
        return typing.get_args(hint)[0], True
    return hint, False


def add_cli_args(parser: argparse.ArgumentParser, cls: type, command: str) -> None:
    """Add the flag of each option of ``cls`` that ``command`` offers, in declaration order.

    A boolean is a switch that flips its default; a list takes one or more values (``nargs="+"``);
    the rest parse as the field's type. The parsed value is named ``name_of(field)``.
    """
    for f, hint in rows(cls, command):
        facts = f.metadata
        help_for = facts["help_for"]
        kw = {"dest": name_of(f), "default": f.default, **facts["argparse"]}
        kw["help"] = help_for[command] if command in help_for else facts["help"]
        typ, is_list = _base_type(hint)
        if typ is bool:
            kw["action"] = "store_false" if f.default else "store_true"
        else:
            kw.setdefault("type", typ)
            if is_list:
                kw["nargs"] = "+"
        parser.add_argument(flag_of(f), **kw)


def from_cli_args(cls: type, args: argparse.Namespace) -> Any:
    """``cls`` from parsed flags: each option the parsed sub-command (``args.command``) offers takes
    its flag's value, every other option its default."""
    values = {}
    for f, hint in _fields(cls):
        if (sub := _table(hint)) is not None:
            values[f.name] = from_cli_args(sub, args)
        elif args.command in f.metadata.get("commands", ()):
            values[f.name] = getattr(args, name_of(f))
    return cls(**values)


def _values(table: Any, command: str) -> Iterator[tuple[dataclasses.Field, Any]]:
    """``(field, value)`` of each option of ``table`` (nested tables in place) that ``command`` offers."""
    for f, hint in _fields(type(table)):
        value = getattr(table, f.name)
        if _table(hint) is not None:
            yield from _values(value, command)
        elif command in f.metadata.get("commands", ()):
            yield f, value


def to_argv(table: Any, command: str) -> list[str]:
    """The flags that give ``command``'s process the values of ``table`` it offers: each one that is
    not its default (the child's flag has the same default), a secret aside (``to_env``)."""
    argv: list[str] = []
    for f, value in _values(table, command):
        if f.metadata["env"] or value == f.default:
            continue
        if isinstance(value, bool):
            argv.append(flag_of(f))  # the switch flips the default
        elif isinstance(value, list | tuple):
            argv += [flag_of(f), *map(str, value)]
        else:
            argv += [flag_of(f), str(value)]
    return argv


def to_env(table: Any, command: str) -> dict[str, str]:
    """The environment that gives ``command``'s process the secrets of ``table`` that are set."""
    return {f.metadata["env"]: str(v) for f, v in _values(table, command) if f.metadata["env"] and v}


def from_keywords(cls: type, keywords: dict[str, Any], what: str = "option") -> Any:
    """``cls`` from keywords named as the options are (``name_of``); nested tables are filled from the
    same keywords; a plain field (no ``option``) by its field name. Raises ``TypeError`` naming the
    keywords that are no option of ``cls`` (``what``: how the message calls them)."""
    left = dict(keywords)
    table = _build(cls, left)
    if left:
        raise TypeError(f"unknown {what}{'s' if len(left) > 1 else ''} {', '.join(map(repr, left))}")
    return table


def _build(cls: type, left: dict[str, Any]) -> Any:
    values = {}
    for f, hint in _fields(cls):
        if (sub := _table(hint)) is not None:
            values[f.name] = _build(sub, left)
        elif name_of(f) in left:
            values[f.name] = left.pop(name_of(f))
    return cls(**values)


def to_keywords(table: Any) -> dict[str, Any]:
    """``{keyword: value}`` of every field of ``table``, nested tables flattened (``from_keywords``' inverse)."""
    out = {}
    for f, hint in _fields(type(table)):
        value = getattr(table, f.name)
        if _table(hint) is not None:
            out |= to_keywords(value)
        else:
            out[name_of(f)] = value
    return out
