"""Rows in verl's dataset format, from .parquet or .jsonl files.

Each row: `prompt` (a list of {role, content} chat messages, or a plain string),
`data_source`, `reward_model.ground_truth`, and optional `extra_info` (multi-turn rows: verl's
`tools_kwargs`, `interaction_kwargs`, `need_tools_kwargs`) and `agent_name` (kept in
`extra_info`, where the agent node reads it).
"""

import errno
import json
import stat
from pathlib import Path

from flowrl.errors import FlowrlError


class DataError(FlowrlError, ValueError):
    """A data file that cannot be read, or a row that is not in verl's format."""


MAGIC = {  # a compressed file, by its first bytes, whatever its name says
    b"\x1f\x8b": ("gzip", "gunzip -k"),
    b"BZh": ("bzip2", "bunzip2 -k"),
    b"\xfd7zXZ\x00": ("xz", "unxz -k"),
    b"\x28\xb5\x2f\xfd": ("zstd", "unzstd"),
    b"PK\x03\x04": ("zip", "unzip"),
}
PARQUET = b"PAR1"  # a parquet file starts and ends with it
SOURCE_HINT = (
    'data.source takes "arithmetic", "calculator" or a .parquet / .jsonl file, relative to the '
    "graph file's folder"
)


def load_rows(path: str | Path) -> list[dict]:
    """The rows of a .parquet or .jsonl file, each checked (`_check`); raises DataError naming
    the file, and the row and column where there is one, for every way a file can be wrong."""
    path = Path(path)
    head, size = _open(path)
    for magic, (kind, command) in MAGIC.items():
        if head.startswith(magic):
            raise DataError(
                f"{path}: a {kind}-compressed file, not {path.suffix or 'plain'} data: decompress "
                f"it first ({command} {path.name}) and point data.source at the result"
            )
    if head.startswith(PARQUET) and path.suffix != ".parquet":
        raise DataError(f"{path}: a parquet file named {path.suffix!r}: rename it to .parquet")
    if path.suffix == ".parquet":
        rows = _parquet(path, head, size)
    elif path.suffix in (".jsonl", ".json"):
        rows = _json_lines(path)
    else:
        raise DataError(f"{path}: unknown data format {path.suffix!r}; use .parquet or .jsonl")
    if not rows:
        raise DataError(
            f"{path}: the file has no rows (only a header, or blank lines): {SOURCE_HINT}"
        )
    return [_check(row, path, where) for where, row in rows]


def _open(path: Path) -> tuple[bytes, int]:
    """(the first bytes, the size) of a data file; DataError for anything but a readable,
    non-empty regular file (missing, a link to nothing, a link loop, a directory, empty)."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        what = (
            "a symbolic link to a file that does not exist"
            if path.is_symlink()
            else "no such data file"
        )
        raise DataError(f"{path}: {what} ({SOURCE_HINT})") from None
    except OSError as e:  # ELOOP: a link loop; EACCES
        reason = "a loop of symbolic links" if e.errno == errno.ELOOP else e.strerror
        raise DataError(f"{path}: cannot be read: {reason} ({SOURCE_HINT})") from None
    if stat.S_ISDIR(mode):
        raise DataError(
            f"{path}: a directory, not a data file: name one .parquet or .jsonl file in it"
        )
    if not stat.S_ISREG(mode):
        raise DataError(f"{path}: not a regular file (a device or a pipe): {SOURCE_HINT}")
    try:
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError as e:
        raise DataError(f"{path}: cannot be read ({e.strerror or e})") from None
    if not head:
        raise DataError(f"{path}: the file is empty (0 bytes): {SOURCE_HINT}")
    return head, path.stat().st_size


def _parquet(path: Path, head: bytes, size: int) -> list[tuple[str, dict]]:
    if not head.startswith(PARQUET):
        raise DataError(
            f"{path}: not a parquet file (it does not begin with PAR1; JSON lines or CSV saved "
            "under a .parquet name?)"
        )
    with open(path, "rb") as f:
        f.seek(max(size - 4, 0))
        if f.read(4) != PARQUET:
            raise DataError(
                f"{path}: a truncated parquet file (its footer is missing: an interrupted "
                "download or copy); write or copy it again"
            )
    import pyarrow
    import pyarrow.parquet as pq

    try:
        rows = pq.read_table(path).to_pylist()
    except (pyarrow.ArrowException, OSError, ValueError) as e:
        raise DataError(f"{path}: a damaged parquet file ({e})") from None
    return [(f"row {i}", row) for i, row in enumerate(rows)]


def _json_lines(path: Path) -> list[tuple[str, dict]]:
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
            array = (
                " (one JSON array: write one object per line)" if line.lstrip()[:1] == "[" else ""
            )
            raise DataError(f"{path}, line {number}: a row must be a JSON object {{...}}{array}")
        rows.append((f"line {number}", row))
    return rows


def _check(row: dict, path: Path, where: str) -> dict:
    """A row in verl's format, normalised; DataError naming file, row and column otherwise."""
    at = f"{path}, {where}"
    if "chosen" in row or "rejected" in row:  # a preference pair (TRL, verl reward-model data)
        from flowrl.data.preferences import preference_row

        row = preference_row(row, at)
    prompt = row.get("prompt")
    if "prompt" not in row:
        raise DataError(f'{at}: no "prompt" column (a list of {{"role", "content"}} messages)')
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    if not isinstance(prompt, list):
        raise DataError(
            f'{at}, column "prompt": a {type(prompt).__name__}; it must be a list of '
            '{"role", "content"} messages, or a string'
        )
    if not prompt:
        raise DataError(f'{at}, column "prompt": an empty message list; give at least one message')
    for k, m in enumerate(prompt):
        if not (
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
        ):
            raise DataError(
                f'{at}, column "prompt", message {k}: {_short(m)}; each message must be '
                '{"role": "...", "content": "..."} with text values'
            )
    reward = row.get("reward_model")
    if not isinstance(reward, dict) or "ground_truth" not in reward:
        raise DataError(
            f'{at}, column "reward_model": {_short(reward)}; it must hold "ground_truth" '
            '(write "reward_model": {"ground_truth": "..."})'
        )
    extra = row.get("extra_info")
    if extra is not None and not isinstance(extra, dict):
        raise DataError(
            f'{at}, column "extra_info": a {type(extra).__name__} ({_short(extra)}); it must be '
            "an object of named values (a dict), or absent"
        )
    source = row.get("data_source")
    if source is not None and not isinstance(source, str):
        raise DataError(f'{at}, column "data_source": {_short(source)}; it must be a string')
    extra = dict(extra or {})
    if row.get("agent_name") is not None:  # verl: "tool_agent" or "single_turn_agent"
        extra.setdefault("agent_name", row["agent_name"])
    return {
        "prompt": [dict(m) for m in prompt],
        "data_source": source or "unknown",
        "reward_model": dict(reward),
        "extra_info": extra,
    }


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
