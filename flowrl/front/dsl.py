"""Graph file (TOML) -> GraphSpec, with every error of the file reported together.

    [run]  [data]  [models.<name>]  [pools.<name>]  [nodes.<id>]

A node table holds `uses` (which node module), `model` (for nodes that run a model), `rename`
(declared key -> key in this graph) and the node's params. Command-line overrides
(`run.steps=50`, `nodes.advantage.lam=0.9`, flowrl/front/overrides.py) are applied to the
parsed file and validated like it.
No torch or ray here.
"""

import errno
import importlib.util
import re
from pathlib import Path

import attrs

from flowrl.backends import ROLLOUT_BACKENDS, multi_turn_names
from flowrl.errors import Collector, GraphErrors, Problem, did_you_mean, one_of
from flowrl.front import registry, schema
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
    # a model whose table is wrong stays, as None: its nodes are not told it is unknown
    models = {name: m and _place(name, m, pools, errors, overridden) for name, m in models.items()}
    folder = Path(root) if root else Path(file).parent
    models = {name: m and _model_path(m, folder) for name, m in models.items()}
    for name, pool in pools.items():
        if pool:
            _check_pool(name, pool, errors)
    for name, model in models.items():  # LoRA adapters are not sharded yet
        pool = pools.get(model.pool) if model else None
        if model and model.lora and pool and pool.strategy == "fsdp":
            errors.add(
                f"[models.{name}] lora",
                f'LoRA on pool "{model.pool}", whose strategy is "fsdp", is not supported',
                f'set strategy = "ddp" on [pools.{model.pool}] (an adapter is small), or drop lora',
            )
    if run:
        _check_loggers(run, errors)
    if any(m and m.lora for m in models.values()) and importlib.util.find_spec("peft") is None:
        errors.add("[models] lora", "LoRA needs the package peft", "pip install peft")
    base_dir = Path(root) if root else Path(file).parent
    if data:
        _check_data(data, base_dir, errors, overridden)
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


def _model_path(model: schema.ModelConfig, folder: Path) -> schema.ModelConfig:
    """The one rule for a model path (docs/graph-file.md): "tiny" and the embedded alias are
    themselves; an absolute path is that directory; a relative path is a directory relative
    to the graph file's folder when one exists there (or when it starts with ./ or ../),
    else a Hugging Face hub name. Resolved here, so loading and sizing read the same path."""
    path = model.path
    if path == "tiny" or path in schema.KNOWN_SIZES or Path(path).is_absolute():
        return model
    candidate = folder / path
    if candidate.exists() or path.startswith(("./", "../")):
        return attrs.evolve(model, path=str(candidate.resolve()))
    return model


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


def _check_data(data: schema.DataConfig, base_dir: Path, errors: Collector, overridden) -> None:
    """A data file must exist and have a format the loader reads (its rows are read at run);
    validation must not be the training file itself (docs/data.md)."""
    files = [
        Path(s) if Path(s).is_absolute() else base_dir / s for s in (data.source, data.val_source)
    ]
    if (
        data.val_source
        and data.source not in schema.BUILTIN_SOURCES
        and files[0].resolve() == files[1].resolve()
    ):
        errors.add(
            "[data] val_source",
            f'val_source names the training file "{data.source}": validation would measure '
            "prompts the policy trains on",
            "leave val_source out (run.val_size rows of the file are then held out of training), "
            "or name a file of other rows",
        )
    for key in ("source", "val_source"):
        source = getattr(data, key)
        if not source or source in schema.BUILTIN_SOURCES:
            continue
        path = Path(source) if Path(source).is_absolute() else base_dir / source
        origin = said(overridden, f"data.{key}")
        if path.suffix not in schema.DATA_SUFFIXES:
            errors.add(
                f"[data] {key}",
                f'{origin}"{source}" is neither a built-in source nor a data file',
                f"use {one_of(schema.BUILTIN_SOURCES)} or a "
                f"{' / '.join(schema.DATA_SUFFIXES)} file in verl's format",
            )
        elif not path.is_file():
            errors.add(
                f"[data] {key}",
                f"{origin}{path}: {_not_a_file(path)}",
                "data paths are relative to the graph file's folder; name one .parquet or "
                ".jsonl file",
            )


def _not_a_file(path: Path) -> str:
    """Why an existing-looking data path is no file (the loader says the same at run)."""
    try:
        if path.is_dir():
            return "a directory, not a data file"
        path.stat()
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "a loop of symbolic links"
        if path.is_symlink():
            return "a symbolic link to a file that does not exist"
        return "no such data file" if isinstance(e, FileNotFoundError) else str(e.strerror)
    return "not a regular file"


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


def _place(name, model: schema.ModelConfig, pools, errors, overridden) -> schema.ModelConfig:
    """Fill in the pool of a model that names none, when there is only one pool."""
    pools = {p: c for p, c in pools.items() if addressable(p)}  # suggest only valid ids
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
            f'{said(overridden, f"models.{name}.pool")}pool "{model.pool}" is not defined'
            f"{did_you_mean(model.pool, pools)}",
            f"pools: {one_of(pools)}",
        )
    if model.rollout_pool and model.rollout_pool not in pools:
        errors.add(
            f"[models.{name}] rollout_pool",
            f'{said(overridden, f"models.{name}.rollout_pool")}pool "{model.rollout_pool}" is '
            f"not defined{did_you_mean(model.rollout_pool, pools)}",
            f'pools: {one_of(pools)}; or leave rollout_pool out to generate on "{model.pool}"',
        )
    _check_rollout_device(name, model, pools, errors, overridden)
    _check_rollout_dtype(name, model, errors, overridden)
    return model


def _check_rollout_device(name, model: schema.ModelConfig, pools, errors, overridden) -> None:
    """A rollout backend that runs on one kind of device only (sglang: "cuda") needs its
    rollout pool to be one."""
    record = ROLLOUT_BACKENDS.get(model.rollout)
    need, pool = record.device if record else None, model.rollout_pool or model.pool
    if need is None or pool not in pools or pools[pool].device == need:
        return
    override = said(overridden, f"models.{name}.rollout") or said(
        overridden, f"pools.{pool}.device"
    )
    errors.add(
        f"[models.{name}] rollout",
        f'{override}rollout = "{model.rollout}" runs on "{need}" only, but its pool "{pool}" has '
        f'device = "{pools[pool].device}"',
        f'set device = "{need}" in [pools.{pool}], or rollout = "hf" (CPU and GPU)',
    )


def _check_rollout_dtype(name, model: schema.ModelConfig, errors, overridden) -> None:
    """SGLang's attention kernels (flashinfer, fa3) are bf16 / fp16: a float32 model is refused
    here, before any model loads, not handed to them."""
    if model.rollout != "sglang" or model.dtype in ("bfloat16", "float16"):
        return
    override = said(overridden, f"models.{name}.dtype") or said(
        overridden, f"models.{name}.rollout"
    )
    errors.add(
        f"[models.{name}] dtype",
        f'{override}rollout = "sglang" serves 16-bit weights, but dtype = "{model.dtype}"',
        f'set dtype = "bfloat16" in [models.{name}] (or "float16"), or rollout = "hf"',
    )


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
    if pool.nodes > 1 and pool.placement in ("PACK", "STRICT_PACK"):
        errors.add(
            f"{where} placement",
            f"{pool.placement} puts the pool's bundles on one node, but nodes = {pool.nodes}",
            'use "STRICT_SPREAD" (one node per bundle) or "SPREAD", or leave placement out',
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
    _check_model(where, spec, model, models, errors, said(overridden, f"nodes.{node_id}.model"))
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


def _check_model(where, spec: NodeSpec, model, models, errors: Collector, said="") -> None:
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
    backend = ROLLOUT_BACKENDS.get(config.rollout)
    if spec.multi_turn and backend and not backend.multi_turn:
        errors.add(
            where,
            f'this node runs multi-turn rollouts, but model "{model}" has rollout = '
            f'"{config.rollout}", which generates single turns only',
            f"set rollout to one of {one_of(multi_turn_names())} in [models.{model}]",
        )
