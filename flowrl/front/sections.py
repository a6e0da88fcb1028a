"""Checks of the graph file's [data], [models], [pools] and [run] tables that span fields or
reach outside the file (flowrl/front/dsl.py builds the tables, then calls these): a data file
exists and can be read, a model's path, the pool a model is placed on, its rollout device and
dtype, a pool's layout, the loggers' packages. Every problem goes to the `Collector` with the
file's key and the fix. No torch or ray here.
"""

import errno
import importlib.util
from pathlib import Path

import attrs

from flowrl import contracts, refs
from flowrl.backends import backend, class_problems, is_reference
from flowrl.errors import Collector, did_you_mean, one_of
from flowrl.front import schema
from flowrl.front.overrides import addressable, said
from flowrl.front.typed_toml import build_attrs
from flowrl.samplers import SAMPLERS, NoOptions


def model_path(model: schema.ModelConfig, folder: Path) -> schema.ModelConfig:
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


def check_data(data: schema.DataConfig, base_dir: Path, errors: Collector, overridden) -> None:
    """A data file must exist and have a format the loader reads (its rows are read at run);
    validation must not be the training file itself (docs/data.md); the sampler loads."""
    check_sampler(data, base_dir, errors, overridden)
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
        origin = said(overridden, f"data.{key}")
        if source.startswith("verifiers:"):  # a verifiers environment's tasks
            ref = source.removeprefix("verifiers:")
            if ref.endswith(".py") and not (base_dir / ref).is_file():
                errors.add(
                    f"[data] {key}",
                    f'{origin}"{source}": no file {base_dir / ref}',
                    "give the environment's file relative to the graph, or an installed id",
                )
            continue
        path = Path(source) if Path(source).is_absolute() else base_dir / source
        if path.suffix not in schema.DATA_SUFFIXES:
            errors.add(
                f"[data] {key}",
                f'{origin}"{source}" is neither a built-in source nor a data file',
                f"use {one_of(schema.BUILTIN_SOURCES)}, a "
                f"{' / '.join(schema.DATA_SUFFIXES)} file in verl's format or "
                '"verifiers:<env>"',
            )
        elif not path.is_file():
            errors.add(
                f"[data] {key}",
                f"{origin}{path}: {_not_a_file(path)}",
                "data paths are relative to the graph file's folder; name one .parquet or "
                ".jsonl file",
            )


SAMPLER_METHODS = ("next", "update", "state_dict", "load_state_dict")


def sampler_class(data: schema.DataConfig, base_dir: Path):
    """The class `[data] sampler` names: a built-in ("uniform", "pass_rate") or a user's
    "file.py:Class" (flowrl/samplers.py says what it must do)."""
    if data.sampler in SAMPLERS:
        return SAMPLERS[data.sampler]
    if ":" not in data.sampler:
        raise ValueError(
            f'"{data.sampler}" is not a sampler{did_you_mean(data.sampler, SAMPLERS)}: use '
            f'{one_of(SAMPLERS)}, or your own class as "file.py:Class"'
        )
    return refs.load(data.sampler, base_dir, what="sampler")


def check_sampler(data: schema.DataConfig, base_dir: Path, errors: Collector, overridden):
    """`[data] sampler` loads, has the sampler's methods, and `[data.sampler_options]` are
    its options."""
    where, said_it = "[data] sampler", said(overridden, "data.sampler")
    try:
        cls = sampler_class(data, base_dir)
    except Exception as e:  # a user's file may raise anything while loading
        errors.add(where, f"{said_it}{e}", 'see docs/data.md, "Choosing the prompts"')
        return
    problems = contracts.class_problems(
        cls,
        "sampler",
        methods=SAMPLER_METHODS,
        init=(("size", "seed", "options"), {}),
        init_fix="a sampler is a class built as Sampler(size, seed, options) with "
        "next(batch_size), update(indices, scores, step), state_dict() and "
        "load_state_dict(state) (docs/data.md)",
    )
    for message, fix in problems:
        errors.add(where, f'{said_it}"{data.sampler}" {message}', fix)
    options = getattr(cls, "Options", NoOptions)
    if problems and not (isinstance(options, type) and attrs.has(options)):
        return
    build_attrs(options, data.sampler_options, "data.sampler_options", errors, overridden)


def sampler_options(data: schema.DataConfig, base_dir: Path):
    """The options instance of the run's sampler, from its checked table."""
    errors = Collector("[data]")
    cls = sampler_class(data, base_dir)
    options = getattr(cls, "Options", NoOptions)
    built = build_attrs(options, data.sampler_options, "data.sampler_options", errors)
    errors.raise_if_any()
    return cls, built


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


def place(name, model: schema.ModelConfig, pools, errors, overridden) -> schema.ModelConfig:
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
    return model


def check_rollout(name, model: schema.ModelConfig, pools, folder: Path, errors, overridden):
    """A model's rollout backend: it loads (a reference), runs on the model's rollout pool's
    device and serves its dtype, and `[models.<m>.rollout_options]` are its options."""
    try:
        record = backend(model.rollout, folder)
    except Exception as e:  # a user's file may raise anything while loading
        errors.add(
            f"[models.{name}] rollout",
            f"{said(overridden, f'models.{name}.rollout')}{e}",
            'name a backend of the table ("hf", "sglang") or a class "file.py:Class" '
            "(docs/extending.md)",
        )
        return
    if is_reference(model.rollout):
        where = f"[models.{name}] rollout"
        cls = refs.load(record.ref, folder, what="rollout backend")
        for message, fix in class_problems(cls):
            said_it = said(overridden, f"models.{name}.rollout")
            errors.add(where, f'{said_it}"{model.rollout}" {message}', fix)
        if not attrs.has(record.options):
            return
    check_rollout_device(name, model, record, pools, errors, overridden)
    check_rollout_dtype(name, model, record, errors, overridden)
    build_attrs(
        record.options, model.rollout_options, f"models.{name}.rollout_options", errors, overridden
    )


def rollout_options(name: str, model: schema.ModelConfig, folder: Path):
    """The options instance of model `name`'s rollout backend, from its checked
    `rollout_options` table (the pool worker builds the backend with it)."""
    errors = Collector(f"[models.{name}]")
    record = backend(model.rollout, folder)
    options = build_attrs(
        record.options, model.rollout_options, f"models.{name}.rollout_options", errors
    )
    errors.raise_if_any()
    return options


def check_rollout_device(name, model: schema.ModelConfig, record, pools, errors, overridden):
    """A rollout backend that runs on one kind of device only (sglang: "cuda") needs its
    rollout pool to be one."""
    need, pool = record.device, model.rollout_pool or model.pool
    if need is None or pool not in pools or pools[pool] is None or pools[pool].device == need:
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


def check_rollout_dtype(name, model: schema.ModelConfig, record, errors, overridden) -> None:
    """A backend that serves some dtypes only (SGLang's attention kernels, flashinfer and fa3,
    are bf16 / fp16) refuses the others here, before any model loads."""
    if not record.dtypes or model.dtype in record.dtypes:
        return
    override = said(overridden, f"models.{name}.dtype") or said(
        overridden, f"models.{name}.rollout"
    )
    allowed = " or ".join(f'"{d}"' for d in record.dtypes)
    errors.add(
        f"[models.{name}] dtype",
        f'{override}rollout = "{model.rollout}" serves dtype {allowed}, but dtype = '
        f'"{model.dtype}"',
        f'set dtype = "{record.dtypes[0]}" in [models.{name}], or rollout = "hf"',
    )


def check_pool(name: str, pool: schema.PoolConfig, errors: Collector) -> None:
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


def check_loggers(run: schema.RunConfig, errors: Collector) -> None:
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
