"""Graph file (TOML) -> GraphSpec, with every error of the file reported together.

    [run]  [data]  [models.<name>]  [pools.<name>]  [nodes.<id>]

A node table holds `uses` (which node module), `model` (for nodes that run a model), `rename`
(declared key -> key in this graph) and the node's params. Command-line overrides
(`run.steps=50`, `nodes.advantage.lam=0.9`, flowrl/front/overrides.py) are applied to the
parsed file and validated like it.
No torch or ray here.
"""

import importlib.util
import re
from pathlib import Path

import attrs

from flowrl.backends import backend as backend_record
from flowrl.backends import multi_turn_names
from flowrl.errors import Collector, GraphErrors, Problem, did_you_mean, one_of
from flowrl.front import registry, schema, sections
from flowrl.front.overrides import TOP_LEVEL, addressable, apply_overrides, said
from flowrl.front.schema import DEFAULT_POOL, GraphSpec, NodeDecl
from flowrl.front.typed_toml import build_attrs, read_toml
from flowrl.nodespec import NodeSpec

NODE_KEYS = ("uses", "model", "rename")


def load(file: str | Path, overrides: list[str] = (), base_dir: str | Path = "") -> GraphSpec:
    """Parse and validate a graph file; raises GraphErrors listing every problem.

    `base_dir`: where its relative paths (node files, data, scorers) resolve; default the
    file's folder (`flowrl replay` loads a run directory's graph.toml against the original's).
    """
    spec, problems = load_partial(file, overrides, base_dir)
    if problems:
        raise GraphErrors(problems)
    return spec


def load_partial(
    file: str | Path, overrides: list[str] = (), base_dir: str | Path = ""
) -> tuple[GraphSpec | None, list[Problem]]:
    """(spec, problems): as `load`, but a file whose every table could be built still gives
    its spec beside its problems (a missing data file, a pool of 3 workers over 2 nodes ...),
    so the later checks (wiring, batch arithmetic, each node's own check hook) can add theirs
    and `flowrl check` shows every error at once. spec is None when a table could not be
    built (then the later checks would only report its absence)."""
    file = str(file)
    errors = Collector(file)
    raw = read_toml(Path(file), errors)
    if errors.problems:
        return None, errors.problems
    overridden = apply_overrides(raw, overrides, errors)
    spec = _build(file, raw, errors, overridden, str(base_dir))
    if spec is not None and errors.renamed:
        spec = attrs.evolve(spec, renamed=tuple(errors.renamed))
    return spec, errors.problems


def _build(file, raw, errors: Collector, overridden: dict[str, str], root="") -> GraphSpec | None:
    """The spec; None when a table (run, data, a model, a pool, a node) could not be built."""
    for key in raw:
        if key not in TOP_LEVEL:
            errors.add(
                f"[{key}]",
                f'unknown table "{key}"{did_you_mean(key, TOP_LEVEL)}',
                f"top-level tables are {one_of(TOP_LEVEL)}",
            )
    run = build_attrs(schema.RunConfig, _table(raw, "run", errors), "run", errors, overridden)
    data = build_attrs(schema.DataConfig, _table(raw, "data", errors), "data", errors, overridden)
    pools = {
        name: build_attrs(schema.PoolConfig, table, f"pools.{name}", errors, overridden)
        for name, table in _tables(raw, "pools", errors).items()
    } or {DEFAULT_POOL: schema.PoolConfig()}
    models = {
        name: build_attrs(schema.ModelConfig, table, f"models.{name}", errors, overridden)
        for name, table in _tables(raw, "models", errors).items()
    }
    folder = Path(root) if root else Path(file).parent
    # a model whose table is wrong stays, as None: its nodes are not told it is unknown
    models = {
        name: m and sections.place(name, m, pools, errors, overridden) for name, m in models.items()
    }
    for name, m in models.items():
        if m:
            sections.check_rollout(name, m, pools, folder, errors, overridden)
    models = {name: m and sections.model_path(m, folder) for name, m in models.items()}
    for name, pool in pools.items():
        if pool:
            sections.check_pool(name, pool, errors)
    for name, model in models.items():  # LoRA adapters are not sharded yet
        pool = pools.get(model.pool) if model else None
        if model and model.lora and pool and pool.strategy == "fsdp":
            errors.add(
                f"[models.{name}] lora",
                f'LoRA on pool "{model.pool}", whose strategy is "fsdp", is not supported',
                f'set strategy = "ddp" on [pools.{model.pool}] (an adapter is small), or drop lora',
            )
    if run:
        sections.check_loggers(run, errors)
    if any(m and m.lora for m in models.values()) and importlib.util.find_spec("peft") is None:
        errors.add("[models] lora", "LoRA needs the package peft", "pip install peft")
    base_dir = Path(root) if root else Path(file).parent
    if data:
        sections.check_data(data, base_dir, errors, overridden)
    nodes, tables = {}, _tables(raw, "nodes", errors)
    for node_id, table in tables.items():
        decl = _node(node_id, table, models, base_dir, errors, overridden)
        if decl is not None:
            nodes[node_id] = decl
    if not raw.get("nodes"):
        errors.add("[nodes]", "the graph has no nodes", "add [nodes.<id>] tables with `uses`")
    built = [run, data, *models.values(), *pools.values()]
    if any(part is None for part in built):
        return None
    if not nodes or len(nodes) < len(tables):
        _checks_above_the_first_failed_node(
            GraphSpec(file, run, data, models, pools, nodes, raw, root), list(tables), errors
        )
        return None
    if errors.problems and set(raw.get("nodes", {})) != set(tables):
        return None  # a node entry that is not a table
    return GraphSpec(file, run, data, models, pools, nodes, raw, root)


def _checks_above_the_first_failed_node(spec: GraphSpec, order: list[str], errors) -> None:
    """A node table that could not be built leaves no spec to wire; the nodes above it in the
    file still get their own checks (an agent's tools, a scorer that does not import), since
    the rows they receive do not depend on it. Those below it might, so they wait."""
    from flowrl.front import batching

    failed = next((i for i, n in enumerate(order) if n not in spec.nodes), len(order))
    above = {n: spec.nodes[n] for n in order[:failed]}
    if not above:
        return
    try:
        batching.unwired_findings(attrs.evolve(spec, nodes=above), errors)
    except Exception:  # a hook tripping over a problem already reported
        pass


def _check_id(head: str, name: str, errors: Collector) -> None:
    if not addressable(name):
        errors.add(
            f'[{head}."{name}"]',
            f'the id "{name}" cannot be named in a command-line override '
            f"({head}.<id>.<key>=value): ids are made of letters, digits, _ and -",
            f'rename it, e.g. to "{re.sub(r"[^A-Za-z0-9_-]", "_", name)}", and every use of it',
        )


def _table(raw, name, errors) -> dict:
    value = raw.get(name, {})
    if not isinstance(value, dict):
        errors.add(f"[{name}]", f'"{name}" must be a table', f"write it as [{name}]")
        return {}
    return value


def _tables(raw, name, errors) -> dict[str, dict]:
    out = {}
    for key, value in _table(raw, name, errors).items():
        _check_id(name, key, errors)
        if isinstance(value, dict):
            out[key] = value
        else:
            errors.add(
                f"[{name}]",
                f'"{name}.{key}" must be a table',
                f"write it as [{name}.{key}] with its keys below",
            )
    return out


def _node(node_id, table, models, base_dir, errors: Collector, overridden) -> NodeDecl | None:
    where = f"[nodes.{node_id}]"
    uses = table.get("uses")
    if not isinstance(uses, str):
        what = "missing `uses`" if uses is None else f'"uses" = {uses!r} should be a string'
        fix = 'name the node module, e.g. uses = "advantage.gae"'
        errors.add(where, said(overridden, f"nodes.{node_id}.uses") + what, fix)
        return None
    try:
        ref = registry.resolve(uses, base_dir)
    except registry.UnknownNode as e:
        hint = did_you_mean(uses, registry.builtin_names())
        errors.add(
            where,
            f"{said(overridden, f'nodes.{node_id}.uses')}{e}{hint}",
            "run `flowrl nodes` for the built-in nodes, or give a "
            "path to a .py file that defines SPEC",
        )
        return None
    except Exception as e:  # a user's node file that fails to import
        errors.add(
            where, f'importing node "{uses}" failed: {type(e).__name__}: {e}', "fix that module"
        )
        return None
    spec = ref.spec
    if spec.rows == "filter" and spec.writes:
        errors.add(
            where,
            f'{uses} is a filter (rows = "filter") but declares writes {list(spec.writes)}: '
            "a filter returns only its keep mask, which the runtime applies and no node reads",
            "declare writes=() in its SPEC, and move any other output into a node of its own",
        )
        return None
    model = table.get("model")
    said_model = said(overridden, f"nodes.{node_id}.model")
    _check_model(where, spec, model, models, base_dir, errors, said_model)
    rename = table.get("rename", {})
    declared = set(spec.reads) | set(spec.writes) | _extra_read_names(spec)
    if not isinstance(rename, dict) or not all(isinstance(v, str) for v in rename.values()):
        errors.add(
            where,
            '`rename` must be a table of key = "new_key"',
            'e.g. rename = { logprobs = "ref_logprobs" }',
        )
        rename = {}
    for key in rename:
        if key not in declared:
            errors.add(
                where,
                f'rename: "{key}" is not a key of {uses}{did_you_mean(key, declared)}',
                f"its keys: {one_of(declared)}",
            )
    param_table = {k: v for k, v in table.items() if k not in NODE_KEYS}
    params = build_attrs(spec.params, param_table, f"nodes.{node_id}", errors, overridden)
    if params is None:
        return None
    return NodeDecl(node_id, uses, spec, params, model, dict(rename), ref.location)


def _extra_read_names(spec: NodeSpec) -> set[str]:
    return set(spec.optional_reads) | set(spec.optional_writes)


def _check_model(where, spec: NodeSpec, model, models, base_dir, errors, said="") -> None:
    """Problems with a node's `model`; `said` names the override that set it, if one did."""
    if not spec.uses_model:
        if model is not None:
            errors.add(
                where,
                f'`model = "{model}"` given, but this node runs no model',
                "remove the `model` line",
            )
        return
    if model is None:
        errors.add(
            where,
            f"this node runs a model ({spec.mode}) but names none",
            f"add model = one of {one_of(models) or '(define a [models.<name>] table)'}",
        )
        return
    names = [m for m in models if addressable(m)]  # suggest only ids that are valid
    if not isinstance(model, str):
        errors.add(
            where, f'{said}"model" = {model!r} should be a string', f"use one of {one_of(names)}"
        )
        return
    if model not in models:
        errors.add(
            where,
            f'{said}unknown model "{model}"{did_you_mean(model, names)}',
            f"define [models.{model}] or use one of {one_of(names) or 'none'}",
        )
        return
    config = models[model]
    if config is None:  # its table has errors, reported there
        return
    if spec.mode == "train" and not config.trainable:
        errors.add(
            where,
            f'this node trains model "{model}", which is frozen',
            f"set trainable = true in [models.{model}], or train another model",
        )
    if spec.head and spec.head != config.head:
        errors.add(
            where,
            f'this node needs a model with head = "{spec.head}", '
            f'but "{model}" has head = "{config.head}"',
            f'use a model with head = "{spec.head}"',
        )
    backend = _record(config.rollout, base_dir)
    if spec.multi_turn and backend and not backend.multi_turn:
        errors.add(
            where,
            f'this node runs multi-turn rollouts, but model "{model}" has rollout = '
            f'"{config.rollout}", which generates single turns only',
            f"set rollout to one of {one_of(multi_turn_names())} in [models.{model}]",
        )


def _record(rollout: str, base_dir):
    """A model's backend record, None when it does not load (check_rollout reported why)."""
    try:
        return backend_record(rollout, base_dir)
    except Exception:
        return None
