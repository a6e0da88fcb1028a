"""`flowrl check` of an agent node against its data rows: what would otherwise only show at run
time as requests that score 0 or end in `error`.

For each data file (the built-in sources make no per-row kwargs): rows whose `tools_kwargs`
name a tool the node does not have (a misspelling: the row then sees every tool and its
create_kwargs reach none), rows that lack a create kwarg a tool requires (read from the
signature of `create` / `__init__`), rows with `need_tools_kwargs = true` and no
`tools_kwargs`, and, with verl interactions, rows whose `interaction_kwargs.name` picks none.
Each is a warning naming the file, the first row and how many rows; the run still starts.

Reads parquet with pyarrow and jsonl with json: no torch, no data package import.
"""

from __future__ import annotations

import json
from pathlib import Path

from flowrl.hooks import CheckContext, Finding

MAX_ROWS = 5000  # rows looked at per file: a check stays well under a second


def _rows(path: Path) -> list[dict]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).slice(0, MAX_ROWS).to_pylist()
    rows = []
    with open(path, encoding="utf-8-sig") as f:
        for line in f:
            if line.strip():
                rows.append(json.loads(line))
            if len(rows) >= MAX_ROWS:
                break
    return rows


def row_problems(row: dict, toolbox, interactions: dict) -> list[str]:
    """What in one row's verl fields would fail or be ignored at run time."""
    extra = row.get("extra_info") if isinstance(row.get("extra_info"), dict) else {}
    if (row.get("agent_name") or extra.get("agent_name")) == "single_turn_agent":
        return []
    kwargs = extra.get("tools_kwargs") or {}
    known = {key for tool in toolbox.tools for key in tool.keys()}
    out = [
        f'tools_kwargs names "{name}", not a tool of the node'
        for name in kwargs
        if name not in known
    ]
    if extra.get("need_tools_kwargs") and not kwargs:
        out.append("need_tools_kwargs is true but the row has no tools_kwargs")
    chosen = toolbox.select({**extra, "tools_kwargs": kwargs})
    for tool in chosen:
        entry = next((kwargs[k] for k in tool.keys() if k in kwargs), {}) or {}
        given = set((entry.get("create_kwargs") or {}) if isinstance(entry, dict) else {})
        missing = [k for k in tool.create_kwargs_needed() if k not in given]
        if missing:
            out.append(f"{tool.names[0]} requires create_kwargs {missing}, the row gives none")
    kwargs = extra.get("interaction_kwargs") or {}
    chosen = interactions.get("", interactions.get(kwargs.get("name")))
    if interactions and chosen is None:
        out.append(
            f"interaction_kwargs.name = {kwargs.get('name')!r} is not one of {sorted(interactions)}"
        )
    elif chosen is not None:
        out += [f"interaction: {problem}" for problem in chosen.refuses(kwargs)]
    return out


def row_findings(toolbox, interactions: dict, context: CheckContext) -> list[Finding]:
    """Warnings, one per kind of problem and file: the first row, and how many rows."""
    out = []
    for source in context.data_sources:
        path = Path(source) if Path(source).is_absolute() else Path(context.base_dir) / source
        if path.suffix not in (".parquet", ".jsonl", ".json") or not path.is_file():
            continue  # a built-in task, or a missing file the run reports
        try:
            rows = _rows(path)
        except Exception:
            continue  # the data loader names a broken file
        seen: dict[str, list[int]] = {}
        for index, row in enumerate(rows):
            for problem in row_problems(row, toolbox, interactions):
                seen.setdefault(problem, []).append(index)
        for problem, indices in seen.items():
            out.append(
                Finding(
                    f"{path.name}, row {indices[0]} ({len(indices)} of {len(rows)} rows): "
                    f"{problem}; such requests score without the tool or end in error",
                    warning=True,
                )
            )
    return out
