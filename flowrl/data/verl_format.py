"""Rows in verl's dataset format, from .parquet or .jsonl files.

Each row: `prompt` (a list of {role, content} chat messages, or a plain string),
`data_source`, `reward_model.ground_truth`, and optional `extra_info` (multi-turn rows: verl's
`tools_kwargs`, `interaction_kwargs`, `need_tools_kwargs`) and `agent_name` (kept in
`extra_info`, where the agent node reads it).
"""

import json
from pathlib import Path

from flowrl.errors import FlowrlError


class DataError(FlowrlError, ValueError):
    """A data file that cannot be read, or a row that is not in verl's format."""


def load_rows(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        raise DataError(
            f'{path}: no such data file (data.source takes "arithmetic", "calculator" or a '
            ".parquet / .jsonl path relative to the graph file)"
        )
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
    elif path.suffix in (".jsonl", ".json"):
        rows = _json_lines(path)
    else:
        raise DataError(f"{path}: unknown data format {path.suffix!r}; use .parquet or .jsonl")
    return [_check(row, path, i) for i, row in enumerate(rows)]


def _json_lines(path: Path) -> list[dict]:
    """One JSON object per non-empty line; a bad line is named by file and line number."""
    rows = []
    for number, raw in enumerate(path.read_bytes().splitlines(), start=1):
        try:
            line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
        except UnicodeDecodeError:
            raise DataError(f"{path}, line {number}: not UTF-8 text") from None
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(
                f"{path}, line {number}, column {e.colno}: not valid JSON ({e.msg})"
            ) from None
        if not isinstance(row, dict):
            raise DataError(f"{path}, line {number}: a row must be a JSON object {{...}}")
        rows.append(row)
    return rows


def _check(row: dict, path: Path, index: int) -> dict:
    where = f"{path}, row {index}"
    if "chosen" in row or "rejected" in row:  # a preference pair (TRL, verl reward-model data)
        from flowrl.data.preferences import preference_row

        row = preference_row(row, where)
    prompt = row.get("prompt")
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    if not isinstance(prompt, list) or not all(
        isinstance(m, dict) and "role" in m and "content" in m for m in prompt
    ):
        raise DataError(
            f'{where}: "prompt" must be a list of {{"role", "content"}} messages or a string'
        )
    reward = row.get("reward_model") or {}
    if not isinstance(reward, dict) or "ground_truth" not in reward:
        raise DataError(
            f'{where}: missing "reward_model.ground_truth" (write '
            '"reward_model": {"ground_truth": "..."})'
        )
    extra = dict(row.get("extra_info") or {})
    if row.get("agent_name") is not None:  # verl: "tool_agent" or "single_turn_agent"
        extra.setdefault("agent_name", row["agent_name"])
    return {
        "prompt": [dict(m) for m in prompt],
        "data_source": row.get("data_source") or "unknown",
        "reward_model": dict(reward),
        "extra_info": extra,
    }
