"""Command-line overrides: `run.steps=50`, `nodes.advantage.lam=0.9`, set in a parsed graph.

Values are parsed as TOML (a bare word such as `backend=local` is a string), then the file is
validated as if it had been written that way; problems quote the override that caused them.
A table id can be named in an override only when it has no dot: `addressable` is the rule.
No torch or ray here.
"""

import re
import tomllib
from typing import Any

from flowrl.errors import Collector, did_you_mean, one_of

TOP_LEVEL = ("run", "data", "models", "pools", "nodes")
ID = re.compile(r"[A-Za-z0-9_-]+")  # node, model and pool ids that overrides can name


def apply_overrides(raw: dict, overrides: list[str], errors: Collector) -> dict[str, str]:
    """Set `a.b.c=value` entries in `raw` (values parsed as TOML).

    Returns dotted key -> the override that set it, so later problems can quote it.
    `models.x.lr`, `pools.x.workers` and `nodes.x.lam` must name an existing model, pool or node.
    """
    done = {}
    for item in overrides:
        path, sep, text = item.partition("=")
        parts = path.strip().split(".")
        if not sep or len(parts) < 2 or not all(p.strip() for p in parts):
            errors.add(
                "command line",
                f'override "{item}" is not table.key=value',
                "write e.g. run.steps=50 or nodes.advantage.lam=0.9",
            )
            continue
        problem = _override_problem(raw, parts)
        if problem:
            errors.add("command line", f'override "{item}": {problem[0]}', problem[1])
            continue
        table = raw.setdefault(parts[0], {})
        for part in parts[1:-1]:
            table = table.setdefault(part, {})
        table[parts[-1]] = _parse_value(text.strip())
        done[path.strip()] = item
    return done


def _override_problem(raw: dict, parts: list[str]) -> tuple[str, str] | None:
    """(message, fix) when the dotted key `parts` cannot be set in `raw`, else None."""
    head, name = parts[0], parts[1]
    if head not in TOP_LEVEL:
        return f'unknown table "{head}"{did_you_mean(head, TOP_LEVEL)}', (
            f"tables: {one_of(TOP_LEVEL)}"
        )
    if head in ("models", "pools", "nodes"):
        if len(parts) == 2:
            return f"[{head}.{name}] is a table, not a value", (
                f"set one of its keys, e.g. {head}.{name}.<key>=value"
            )
        table = raw.get(head)
        tables = table if isinstance(table, dict) else {}
        if name not in tables:
            ids = [i for i in tables if addressable(i)]
            return f"no [{head}.{name}] in the file{did_you_mean(name, ids)}", (
                f"{head} here: {one_of(ids) or 'none'}"
            )
    table = raw
    for depth, part in enumerate(parts[:-1]):
        table = table.get(part, {})
        if not isinstance(table, dict):
            where = ".".join(parts[: depth + 1])
            return f'"{where}" is a value in the file, not a table', f"set {where}=value instead"
    return None


def said(overridden: dict[str, str], key: str) -> str:
    """'override "KEY=VALUE": ' when the command line set the dotted `key`, else ''."""
    item = overridden.get(key)
    return f'override "{item}": ' if item is not None else ""


def addressable(name: str) -> bool:
    """Whether a table id can be named in a dotted override: letters, digits, _ and -."""
    return bool(ID.fullmatch(name))


def _parse_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text  # a bare word, e.g. backend=local
