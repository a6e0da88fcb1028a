"""What `--resume` checks before it loads any model: the checkpoint is complete (its manifest,
flowrl/runtime/checkpoint.py), the run's files can be written, and the graph given is the run's.

Graph differences are read off the resolved graphs (every table's values after defaults), so
writing out a default is no difference. Those a resume cannot honour are refused with the fix:
models, nodes and their params, pools, data (file, order, batch shape) and the seed. Those that
change no state are allowed and logged (`HARMLESS`: steps, logging, validation and checkpoint
cadence, the backend). `--allow-graph-change` accepts every difference knowingly. An accepted
graph replaces RUN_DIR/graph.toml (the next resume compares with it), and metrics.jsonl gets a
`graph_change` event listing the differences.
"""

import fnmatch
import json
import os
import stat
from pathlib import Path

import attrs
import toml

import flowrl
from flowrl.errors import GraphErrors
from flowrl.front import dsl
from flowrl.runtime import checkpoint
from flowrl.runtime.checkpoint import manifest
from flowrl.runtime.run_dir import RunDirError

HARMLESS = (
    "run.steps",
    "run.val_every",
    "run.val_size",
    "run.save_every",
    "run.keep_checkpoints",
    "run.log_samples",
    "run.loggers",
    "run.save_inputs",
    "run.save_inputs_last",
    "run.max_nonfinite_steps",
    "run.max_restarts",
    "run.restart_backoff_s",
    "run.restart_wait_s",
    "run.call_timeout_s",
    "run.term_grace_s",
    "run.backend",
    "run.num_cpus",
    "run.out_dir",
    "data.val_source",
    "pools.*.cpus_per_worker",
    "nodes.*.timeout_s",  # a scorer's time limit and process count change no state
    "nodes.*.workers",
)
ABSENT = "(absent)"
WRITTEN = ("metrics.jsonl", "samples.jsonl", "trace.json", "graph.toml", "run.json")


def choose(run_dir: Path, asked: Path | None, command: str) -> Path:
    """The checkpoint to resume from: `asked`, else the newest; refused, naming the newest
    complete one and the command that uses it, when it is incomplete or corrupted."""
    found = checkpoint.checkpoints(run_dir)
    if asked is None and not found:
        raise RunDirError(
            f"--resume {run_dir}: no checkpoint in {run_dir / 'checkpoints'} (the run stopped "
            f"before its first checkpoint): start again with: {command}"
        )
    target = asked or found[-1]
    problems = checkpoint.problems(target)
    if not problems:
        return target
    good = checkpoint.newest_complete(run_dir, below=target)
    offer = (
        f"The newest complete checkpoint is {good}: resume from it with: {command} --resume {good}"
        if good
        else f"No complete checkpoint is older: start again with: {command}"
    )
    raise RunDirError(
        f"checkpoint {target} is incomplete or corrupted: {'; '.join(problems)}. {offer}"
    )


def prepare(run_dir: Path, asked, spec, allow: bool, command: str) -> tuple[Path, list[str]]:
    """Every check of a resume that needs no model: files writable, checkpoint complete, graph
    the run's. Returns (the checkpoint to load, the graph's differences to `record` once the
    models have loaded)."""
    check_writable(run_dir)
    directory = choose(run_dir, asked, command)
    changes = compare_graph(run_dir, spec, allow, command)
    made_with = manifest(directory).get("flowrl_version")
    if made_with != flowrl.__version__:
        print(f"{directory} was written by flowrl {made_with}; this is {flowrl.__version__}")
    return directory, changes


def record(run_dir: Path, spec, directory: Path, changes: list[str]) -> None:
    """A resume that goes ahead with a changed graph: say so, make it the run's graph.toml and
    log the differences (a `graph_change` event in metrics.jsonl)."""
    if not changes:
        return
    print(f"the graph differs from the run's ({run_dir / 'graph.toml'}); continuing with:")
    for line in changes:
        print(f"  {line}")
    row = {"event": "graph_change", "from_step": manifest(directory)["step"], "changes": changes}
    try:
        accept(run_dir, spec)
        with open(run_dir / "metrics.jsonl", "a") as log:
            log.write(json.dumps(row) + "\n")
    except OSError as e:
        raise RunDirError(
            f"--resume {run_dir}: its graph.toml or metrics.jsonl could not be written "
            f"({e.strerror or e}); nothing was trained. Free space or make them writable"
        ) from e


def check_writable(run_dir: Path) -> None:
    """Refuse a resume whose files cannot be written, before anything is changed (by mode,
    not only by access(): a file made read-only stays so for root too)."""
    for name in (*WRITTEN, "checkpoints", "."):
        path = run_dir / name
        if not path.exists():
            continue
        mode = path.stat().st_mode
        if not (mode & stat.S_IWUSR) or not os.access(path, os.W_OK):
            what = "folder" if path.is_dir() else "file"
            raise RunDirError(
                f"--resume {run_dir}: the {what} {path} is read-only; a resume writes it. Make "
                f"it writable (chmod u+w {path}) and resume again; nothing was changed"
            )


def compare_graph(run_dir: Path, spec, allow: bool, command: str) -> list[str]:
    """The differences between the run's graph.toml and `spec`, as lines; raises when one
    cannot resume correctly and `allow` is False."""
    old = _old_spec(run_dir)
    changes, unsafe = [], []
    for key, line in differences(flat(old), flat(spec)):
        changes.append(line)
        if not any(fnmatch.fnmatchcase(key, p) for p in HARMLESS):
            unsafe.append(line)
    if unsafe and not allow:
        shown = unsafe if len(unsafe) <= 25 else [*unsafe[:24], f"... and {len(unsafe) - 24} more"]
        listed = "\n".join(f"  {line}" for line in shown)
        raise RunDirError(
            f"--resume {run_dir}: the graph given differs from the run's "
            f"({run_dir / 'graph.toml'}) where a resume cannot continue correctly (models, "
            f"nodes, pools, data, batch shape or seed):\n{listed}\n"
            f"Resume with the graph and overrides the run was started with ({_started(run_dir)}),"
            " or add --allow-graph-change to continue with the changed graph knowingly"
        )
    return changes


def differences(before: dict, after: dict) -> list[tuple[str, str]]:
    """(key, "key: old -> new") for each value that differs; a model, pool or node only one
    side has is one line ("nodes.values: added (uses values)"), not one per param."""

    def entity(key: str) -> str | None:
        parts = key.split(".")
        return ".".join(parts[:2]) if parts[0] in ("models", "pools", "nodes") else None

    out, said = [], set()
    for key in sorted(set(before) | set(after)):
        old, new = before.get(key, ABSENT), after.get(key, ABSENT)
        if old == new:
            continue
        whole = entity(key)
        one_side = whole and not all(
            any(k.startswith(whole + ".") for k in side) for side in (before, after)
        )
        if one_side:
            if whole not in said:
                said.add(whole)
                uses = after.get(f"{whole}.uses") or before.get(f"{whole}.uses")
                how = f" (uses {uses})" if uses else ""
                out.append((whole, f"{whole}: {'added' if old is ABSENT else 'removed'}{how}"))
            continue
        out.append((key, f"{key}: {_show(old)} -> {_show(new)}"))
    return out


def accept(run_dir: Path, spec) -> None:
    """The changed graph becomes the run's graph.toml (written atomically)."""
    temp = run_dir / "graph.toml.tmp"
    temp.write_text(toml.dumps(spec.raw))
    temp.replace(run_dir / "graph.toml")


def flat(spec) -> dict:
    """Every resolved value of a graph as `table.key` (or `table.name.key`) -> value."""
    out = {}
    for table in ("run", "data"):
        for key, value in attrs.asdict(getattr(spec, table)).items():
            out[f"{table}.{key}"] = value
    for table in ("models", "pools"):
        for name, config in getattr(spec, table).items():
            for key, value in attrs.asdict(config).items():
                out[f"{table}.{name}.{key}"] = value
    for node_id, decl in spec.nodes.items():
        out[f"nodes.{node_id}.uses"] = decl.uses
        out[f"nodes.{node_id}.model"] = decl.model
        out[f"nodes.{node_id}.rename"] = dict(decl.rename)
        params = attrs.asdict(decl.params) if attrs.has(type(decl.params)) else {}
        for key, value in params.items():
            out[f"nodes.{node_id}.{key}"] = value
    return out


def _old_spec(run_dir: Path):
    """The run's graph as it was resolved when it started (relative paths from where the graph
    file was: run.json's base_dir)."""
    try:
        base_dir = json.loads((run_dir / "run.json").read_text())["base_dir"]
    except (OSError, ValueError, KeyError):
        base_dir = ""
    try:
        return dsl.load(run_dir / "graph.toml", base_dir=base_dir)
    except GraphErrors as e:
        raise RunDirError(
            f"--resume {run_dir}: its graph.toml no longer checks, so the graph given cannot be "
            f"compared with it:\n{e.report()}\nRestore what it refers to, or start a new run"
        ) from None


def _started(run_dir: Path) -> str:
    try:
        return json.loads((run_dir / "run.json").read_text())["command"]
    except (OSError, ValueError, KeyError):
        return f"see {run_dir / 'graph.toml'}"


def _show(value) -> str:
    text = json.dumps(value) if not isinstance(value, str) else f'"{value}"'
    return text if len(text) <= 80 else text[:77] + "..."
