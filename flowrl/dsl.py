"""Graph file (TOML) -> GraphSpec, with every error of the file reported together.

    [run]  [data]  [models.<name>]  [pools.<name>]  [nodes.<id>]

A node table holds `uses` (which node module), `model` (for nodes that run a model), `rename`
(declared key -> key in this graph) and the node's params. Command-line overrides
(`run.steps=50`, `nodes.advantage.lam=0.9`) are applied to the parsed file and validated like it.
No torch or ray here.
"""

import importlib.util
import types
import typing
from pathlib import Path
from typing import Any

import attrs
import toml

from flowrl import registry, schema
from flowrl.errors import Collector, did_you_mean, one_of
from flowrl.nodespec import NodeSpec

TOP_LEVEL = ("run", "data", "models", "pools", "nodes")
NODE_KEYS = ("uses", "model", "rename")
DEFAULT_POOL = "main"


@attrs.frozen
class NodeDecl:
    """One `[nodes.<id>]` table, resolved."""

    id: str
    uses: str
    spec: NodeSpec
    params: Any  # an instance of spec.params
    model: str | None
    rename: dict[str, str]  # declared key -> graph key
    location: str  # file:line of the node's SPEC

    @property
    def reads(self) -> tuple[str, ...]:
        return tuple(self.rename.get(k, k) for k in self.spec.reads_for(self.params))

    @property
    def writes(self) -> tuple[str, ...]:
        return tuple(self.rename.get(k, k) for k in self.spec.writes)

    @property
    def mode(self) -> str | None:
        return self.spec.mode


@attrs.frozen
class GraphSpec:
    file: str
    run: schema.RunConfig
    data: schema.DataConfig
    models: dict[str, schema.ModelConfig]
    pools: dict[str, schema.PoolConfig]
    nodes: dict[str, NodeDecl]  # in file order
    raw: dict  # the file's tables after overrides, for the run directory

    @property
    def base_dir(self) -> Path:
        return Path(self.file).parent

    def pool_of(self, node_id: str) -> str | None:
        """The pool that runs a node: its model's pool, or for a rollout node the model's
        rollout_pool when it has one; None for a controller node."""
        decl = self.nodes[node_id]
        if decl.model is None:
            return None
        model = self.models[decl.model]
        if decl.mode == "rollout" and model.rollout_pool:
            return model.rollout_pool
        return model.pool

    def models_on(self, pool: str) -> dict[str, schema.ModelConfig]:
        """The models a pool loads. A model whose rollout runs on another pool is there too,
        frozen: that pool generates with it and receives its weights after each update."""
        out = {m: c for m, c in self.models.items() if c.pool == pool}
        for name, config in self.models.items():
            if config.rollout_pool == pool and config.pool != pool:
                out[name] = attrs.evolve(config, pool=pool, trainable=False)
        return out


def load(file: str | Path, overrides: list[str] = ()) -> GraphSpec:
    """Parse and validate a graph file; raises GraphErrors listing every problem."""
    file = str(file)
    errors = Collector(file)
    try:
        raw = toml.loads(Path(file).read_text())
    except FileNotFoundError:
        errors.add("file", "no such file", "check the path")
        errors.raise_if_any()
    except toml.TomlDecodeError as e:
        errors.add(f"line {e.lineno}", f"not valid TOML: {e.msg}", "fix the syntax on that line")
        errors.raise_if_any()
    overridden = apply_overrides(raw, overrides, errors)
    spec = _build(file, raw, errors, overridden)
    errors.raise_if_any()
    return spec


def apply_overrides(raw: dict, overrides: list[str], errors: Collector) -> set[str]:
    """Set `a.b.c=value` entries in `raw` (values parsed as TOML); returns the dotted keys set.

    `models.x.lr`, `pools.x.workers` and `nodes.x.lam` must name an existing model, pool or node.
    """
    done = set()
    for item in overrides:
        path, sep, text = item.partition("=")
        parts = path.strip().split(".")
        if not sep or len(parts) < 2 or not all(parts):
            errors.add(
                "command line",
                f'override "{item}" is not table.key=value',
                "write e.g. run.steps=50 or nodes.advantage.lam=0.9",
            )
            continue
        head, name = parts[0], parts[1]
        if head not in TOP_LEVEL:
            errors.add(
                "command line",
                f'override "{item}": unknown table "{head}"{did_you_mean(head, TOP_LEVEL)}',
                f"tables: {one_of(TOP_LEVEL)}",
            )
            continue
        table = raw.setdefault(head, {})
        if len(parts) > 2 and head in ("models", "pools", "nodes") and name not in table:
            errors.add(
                "command line",
                f'override "{item}": no [{head}.{name}] in the file{did_you_mean(name, table)}',
                f"{head} here: {one_of(table) or 'none'}",
            )
            continue
        for part in parts[1:-1]:
            table = table.setdefault(part, {})
        table[parts[-1]] = _parse_value(text.strip())
        done.add(path.strip())
    return done


def _parse_value(text: str) -> Any:
    try:
        return toml.loads(f"v = {text}")["v"]
    except toml.TomlDecodeError:
        return text  # a bare word, e.g. backend=local


def _build(file, raw, errors: Collector, overridden: set[str]) -> GraphSpec | None:
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
    models = {name: _place(name, m, pools, errors) for name, m in models.items() if m}
    for name, pool in pools.items():
        if pool:
            _check_pool(name, pool, errors)
    if run:
        _check_loggers(run, errors)
    if any(m and m.lora for m in models.values()) and importlib.util.find_spec("peft") is None:
        errors.add("[models] lora", "LoRA needs the package peft", "pip install peft")
    base_dir = Path(file).parent
    nodes = {}
    for node_id, table in _tables(raw, "nodes", errors).items():
        decl = _node(node_id, table, models, base_dir, errors, overridden)
        if decl is not None:
            nodes[node_id] = decl
    if not raw.get("nodes"):
        errors.add("[nodes]", "the graph has no nodes", "add [nodes.<id>] tables with `uses`")
    if errors.problems:
        return None
    return GraphSpec(file, run, data, models, pools, nodes, raw)


def _table(raw, name, errors) -> dict:
    value = raw.get(name, {})
    if not isinstance(value, dict):
        errors.add(f"[{name}]", f'"{name}" must be a table', f"write it as [{name}]")
        return {}
    return value


def _tables(raw, name, errors) -> dict[str, dict]:
    out = {}
    for key, value in _table(raw, name, errors).items():
        if isinstance(value, dict):
            out[key] = value
        else:
            errors.add(
                f"[{name}]",
                f'"{name}.{key}" must be a table',
                f"write it as [{name}.{key}] with its keys below",
            )
    return out


def _place(name, model: schema.ModelConfig, pools, errors) -> schema.ModelConfig:
    """Fill in the pool of a model that names none, when there is only one pool."""
    if not model.pool:
        if len(pools) == 1:
            model = attrs.evolve(model, pool=next(iter(pools)))
        else:
            errors.add(
                f"[models.{name}]",
                "no pool given and the graph has several pools",
                f"set pool to one of {one_of(pools)}",
            )
    elif model.pool not in pools:
        errors.add(
            f"[models.{name}]",
            f'pool "{model.pool}" is not defined{did_you_mean(model.pool, pools)}',
            f"pools: {one_of(pools)}",
        )
    if model.rollout_pool and model.rollout_pool not in pools:
        errors.add(
            f"[models.{name}] rollout_pool",
            f'pool "{model.rollout_pool}" is not defined{did_you_mean(model.rollout_pool, pools)}',
            f'pools: {one_of(pools)}; or leave rollout_pool out to generate on "{model.pool}"',
        )
    return model


def _check_pool(name: str, pool: schema.PoolConfig, errors: Collector) -> None:
    """A pool spanning nodes splits its ranks evenly over them, one placement bundle each."""
    where = f"[pools.{name}]"
    if pool.nodes > pool.workers:
        errors.add(
            where, f"nodes = {pool.nodes} but only {pool.workers} workers", "set nodes <= workers"
        )
    elif pool.workers % pool.nodes:
        errors.add(
            where,
            f"workers = {pool.workers} do not split evenly over nodes = {pool.nodes}",
            "make workers a multiple of nodes",
        )
    if pool.nodes > 1 and pool.strategy in ("PACK", "STRICT_PACK"):
        errors.add(
            f"{where} strategy",
            f"{pool.strategy} puts the pool's bundles on one node, but nodes = {pool.nodes}",
            'use "STRICT_SPREAD" (one node per bundle) or "SPREAD", or leave strategy out',
        )


def _check_loggers(run: schema.RunConfig, errors: Collector) -> None:
    """A logger whose package is missing fails here, not after the models have loaded."""
    for name in run.loggers:
        package = schema.LOGGER_PACKAGES[name]
        if package and importlib.util.find_spec(package) is None:
            errors.add(
                "[run] loggers",
                f'"{name}" needs the package {package}, which is not installed',
                f"pip install {package}  (or pip install 'flowrl[{name}]'); "
                f'or remove "{name}" from loggers',
            )


def _node(node_id, table, models, base_dir, errors: Collector, overridden) -> NodeDecl | None:
    where = f"[nodes.{node_id}]"
    uses = table.get("uses")
    if not isinstance(uses, str):
        errors.add(where, "missing `uses`", 'name the node module, e.g. uses = "advantage.gae"')
        return None
    try:
        ref = registry.resolve(uses, base_dir)
    except registry.UnknownNode as e:
        hint = did_you_mean(uses, registry.builtin_names())
        errors.add(
            where,
            f"{e}{hint}",
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
    model = table.get("model")
    _check_model(where, spec, model, models, errors)
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
    return set(spec.optional_reads)


def _check_model(where, spec: NodeSpec, model, models, errors: Collector) -> None:
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
    if model not in models:
        errors.add(
            where,
            f'unknown model "{model}"{did_you_mean(model, models)}',
            f"define [models.{model}] or use one of {one_of(models) or 'none'}",
        )
        return
    config = models[model]
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


def build_attrs(cls, table: dict, where: str, errors: Collector, overridden=frozenset()):
    """An instance of attrs class `cls` from a TOML table, or None after reporting problems."""
    attrs.resolve_types(cls)
    fields = attrs.fields_dict(cls)
    kwargs, ok = {}, True
    for key, value in table.items():
        origin = " (from the command line)" if f"{where}.{key}" in overridden else ""
        if key not in fields:
            errors.add(
                f"[{where}]",
                f'unknown key "{key}"{origin}{did_you_mean(key, fields)}',
                f"keys here: {one_of(fields) or 'none'}",
            )
            ok = False
            continue
        converted, good = _convert(value, fields[key].type)
        if not good:
            errors.add(
                f"[{where}]",
                f'"{key}" = {value!r}{origin} should be {_type_name(fields[key].type)}',
                f"default: {key} = {_toml_value(fields[key].default)}",
            )
            ok = False
            continue
        kwargs[key] = converted
    if not ok:
        return None
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as e:
        errors.add(f"[{where}]", str(e), "see docs/graph-file.md for the allowed values")
        return None


def _convert(value, tp) -> tuple[Any, bool]:
    """(value converted to tp, True) or (None, False) when the TOML value has the wrong type."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        for arg in args:
            if arg is not type(None):
                converted, good = _convert(value, arg)
                if good:
                    return converted, True
        return None, False
    if origin is typing.Literal:
        return value, value in args
    if tp is bool:
        return value, isinstance(value, bool)
    if tp is int:
        return value, isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        good = isinstance(value, int | float) and not isinstance(value, bool)
        return (float(value) if good else None), good
    if tp is str:
        return value, isinstance(value, str)
    if origin in (list, tuple) or tp in (list, tuple):
        if not isinstance(value, list):
            return None, False
        item_type = args[0] if args else Any
        items = [_convert(v, item_type) if item_type is not Any else (v, True) for v in value]
        if not all(good for _, good in items):
            return None, False
        seq = [v for v, _ in items]
        return (tuple(seq) if (origin or tp) is tuple else seq), True
    if origin is dict or tp is dict:
        return value, isinstance(value, dict)
    return value, True  # Any or an unchecked type


def _type_name(tp) -> str:
    if typing.get_origin(tp) is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    return names.get(tp, "a list" if typing.get_origin(tp) in (list, tuple) else str(tp))


def _toml_value(value) -> str:
    if isinstance(value, attrs.Factory):
        value = value.factory()
    if value is None:
        return "(unset)"
    return toml.dumps({"v": value}).strip()[4:]
