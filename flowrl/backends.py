"""The tables of backends: the executors a run may use and the rollout backends a model may
use, as the front end knows them, without importing any.

`run.backend` (or `flowrl run --backend`) names an executor in `EXECUTORS`: how a plan's pool
calls reach the ranks (flowrl/runtime/executor.py). Adding one is one module plus one line
there; its module is imported only when a run starts.

A graph picks a rollout backend per model with `rollout = "<name>"` in `[models.<name>]`: a
`Backend` record in `ROLLOUT_BACKENDS`. The record
says where the class is (imported only when a pool builds it: flowrl/engines/rollout.py has
the contract and `make_rollout`), the one kind of pool device it runs on, the optional
package it needs and how to install that, and whether it serves multi-turn rollouts (the
agent node). `flowrl check` reads all of it here, where neither torch nor the package need be
installed. A backend's own settings are an attrs record (`Backend.options`), filled from
`[models.<m>.rollout_options]` and checked like node params. Adding a backend is a folder under
flowrl/engines/ plus one line in `ROLLOUT_BACKENDS`; a backend in a user's own file is named by
reference, `rollout = "my_rollout.py:MyRollout"`, and its class says the same facts as class
attributes (`record_of`; docs/extending.md).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import attrs

from flowrl import contracts, refs
from flowrl.params import checked, count, interval, one_of, positive


@attrs.frozen
class NoOptions:
    """The settings of a backend that has none: `rollout_options` must stay empty."""


RUNNERS = ("auto", "eager", "static", "cuda_graph")
ROLLOUT_DTYPES = ("auto", "float32", "bfloat16", "float16")
COMPILE = ("auto", "on", "off")


@attrs.frozen
class HFOptions:
    """flowrl's own engine (`rollout = "hf"`)."""

    # lockstep: no decode step while a request held for its next turn is away at its tools, so
    # a rollout is a function of its seeds (engines/hf/scheduler.py); decoding waits for tools
    lockstep: bool = False  # batch bit-reproducibly (decoding waits for tools)
    # the model runner (engines/hf/runner.py, static.py): "eager" (the CPU path), "static" (a
    # preallocated cache, device sampling, eager calls), "cuda_graph" (static, decode steps as
    # CUDA graphs); "auto" = cuda_graph on a CUDA device, eager elsewhere
    runner: str = checked("auto", one_of(RUNNERS))  # auto: cuda_graph on CUDA, eager on CPU
    # the static cache's share of the device's memory (of the host's on CPU), like vLLM's
    # gpu_memory_utilization but for the cache alone
    memory_fraction: float = checked(0.1, interval(0, 1, low_open=True))  # of memory, for the cache
    # requests a static cache holds at most (vLLM's max_num_seqs); more wait for a slot
    max_slots: int = checked(512, count(1, 65_536))  # slots of the static cache, at most
    # what a static runner computes and caches in: "auto" = bfloat16 on CUDA, else the model's;
    # another dtype than the model's is a copy of its weights, refreshed in place at each sync
    dtype: str = checked("auto", one_of(ROLLOUT_DTYPES))  # auto: bfloat16 on CUDA, else the model's
    # the static runner's decode step compiled by torch.compile (inductor) before it is
    # captured: RMSNorm, rotary and SiLU-mul fused; "auto" = on for cuda_graph, off elsewhere
    compile: str = checked("auto", one_of(COMPILE))  # auto: on for cuda_graph, else off


@attrs.frozen
class SGLangOptions:
    """An in-process SGLang engine (`rollout = "sglang"`); its seed is `run.seed` (and rank)."""

    # of the GPU memory free when the engine starts (engines/sglang/backend.py)
    mem_fraction_static: float = checked(0.5, interval(0, 1, low_open=True))  # weights + KV
    verify: bool = False  # read pushed weights back and compare
    bucket_mb: float = checked(512.0, positive(1 << 20))  # MB pushed per update call


@attrs.frozen
class Backend:
    """One rollout backend's record.

    Attributes:
        ref: "package.module:Class" of the class (flowrl/refs.py loads it).
        device: the only pool device it runs on ("cuda"), or None for any.
        dtypes: the model dtypes it serves (SGLang's kernels: 16-bit); () for any.
        package: the package it imports that flowrl does not install ("" = none).
        install: the command that installs `package`.
        multi_turn: it serves a conversation turn by turn (requests with a request id,
            its earlier turns' KV reused: flowrl/engines/rollout.py), as the agent node
            needs; without it `uses = "agent"` is refused.
        options: the attrs class of its own settings, built from the graph's
            `[models.<m>.rollout_options]` and passed to the constructor as `options`.
    """

    ref: str
    device: str | None = None
    dtypes: tuple[str, ...] = ()
    package: str = ""
    install: str = ""
    multi_turn: bool = False
    options: type = NoOptions


# run.backend -> "package.module:Class" of its executor, the default first
EXECUTORS = {
    "ray": "flowrl.runtime.ray_executor:RayExecutor",
    "local": "flowrl.runtime.local_executor:LocalExecutor",
}

ROLLOUT_BACKENDS = {
    # flowrl's own continuous-batching engine (CPU and CUDA)
    "hf": Backend("flowrl.engines.hf.engine:HFRollout", multi_turn=True, options=HFOptions),
    # an in-process SGLang engine (GPU); earlier turns come from its radix prefix cache
    "sglang": Backend(
        "flowrl.engines.sglang.backend:SGLangRollout",
        device="cuda",
        dtypes=("bfloat16", "float16"),
        package="sglang",
        install='pip install -e ".[sglang]" in a checkout, or pip install "flowrl[sglang]"',
        multi_turn=True,
        options=SGLangOptions,
    ),
}


def is_reference(name: str) -> bool:
    """A backend named by reference ("file.py:Class", "package.module:Class"), not by table."""
    return ":" in name


def backend(name: str, base_dir: str | Path = ".") -> Backend:
    """The record of backend `name`: a line of the table, or for a reference the record its
    class states (`record_of`; the class is imported). ValueError naming the backends there
    are, or why the reference does not load."""
    if is_reference(name):
        return record_of(refs.load(name, base_dir, what="rollout backend"), name)
    if name not in ROLLOUT_BACKENDS:
        choices = ", ".join(f'"{n}"' for n in sorted(ROLLOUT_BACKENDS))
        raise ValueError(
            f'unknown rollout backend "{name}"; the backends are: {choices}, or your own '
            'class by reference ("my_rollout.py:MyRollout")'
        )
    return ROLLOUT_BACKENDS[name]


def record_of(cls: type, ref: str) -> Backend:
    """The record of a backend class named by reference: its class attributes `runs_on`
    (a device kind or None), `dtypes`, `multi_turn` and `Options` (defaults: any device, any
    dtype, single-turn, no options; flowrl.engines.rollout.RolloutBase has them)."""
    return Backend(
        ref,
        device=getattr(cls, "runs_on", None),
        dtypes=tuple(getattr(cls, "dtypes", ())),
        multi_turn=bool(getattr(cls, "multi_turn", False)),
        options=getattr(cls, "Options", NoOptions),
    )


BACKEND_METHODS = ("generate", "run", "release", "offload", "reload", "sync_weights")
BACKEND_INIT = (("module", "tokenizer", "device"), {"options": None, "seed": 0, "where": ""})
BACKEND_FIX = (
    "a rollout backend is a class built as Backend(module, tokenizer, device, *, options, seed, "
    "where) with `async def generate(request) -> Result`: subclass flowrl.api.RolloutBase "
    '(docs/extending.md, "A rollout backend")'
)


def class_problems(cls) -> list[tuple[str, str]]:
    """(what is wrong, fix) with a backend class named by reference: the contract's methods
    (those `RolloutBase` does not give it), `generate` async, `Options` an attrs class, the
    constructor's shape (flowrl/contracts.py)."""
    out = contracts.class_problems(
        cls,
        "rollout backend",
        methods=BACKEND_METHODS if not _has_base(cls) else ("generate",),
        coroutines=("generate",),
        init=BACKEND_INIT,
        init_fix=BACKEND_FIX,
    )
    return out + _server_problems(cls) if isinstance(cls, type) else out


# ServerRollout's routes for the weights: the method each needs the subclass to write
WEIGHT_ROUTES = {"directory": "load_weights", "buckets": "load_weight_buckets"}


def _server_problems(cls) -> list[tuple[str, str]]:
    """A ServerRollout subclass (flowrl/engines/server.py) names a route for the weights and
    writes its method: found at check, not at the first sync."""
    if not _has_base(cls, "ServerRollout"):
        return []
    where, route = contracts.place(cls), getattr(cls, "weights_as", None)
    if route not in WEIGHT_ROUTES:
        routes = ", ".join(f'"{r}"' for r in WEIGHT_ROUTES)
        fix = f'set weights_as to one of {routes} (docs/extending.md, "A server backend")'
        return [(f"{where}: weights_as = {route!r}", fix)]
    method = getattr(cls, WEIGHT_ROUTES[route])
    if getattr(method, "__qualname__", "").startswith("ServerRollout."):
        return [
            (
                f'{where} has weights_as = "{route}" but no {WEIGHT_ROUTES[route]}',
                f"write {WEIGHT_ROUTES[route]}: how the server takes the weights "
                '(docs/extending.md, "A server backend")',
            )
        ]
    return []


def _has_base(cls, base: str = "RolloutBase") -> bool:
    """`cls` subclasses `base` (read by name: flowrl.engines is not imported here)."""
    return any(getattr(k, "__name__", "") == base for k in getattr(cls, "__mro__", ()))


def missing_package(name: str) -> str:
    """The package backend `name` needs when it is not installed here, else "". Looked up with
    importlib.util.find_spec, which finds a package without importing it."""
    record = ROLLOUT_BACKENDS.get(name)
    package = record.package if record else ""
    return package if package and importlib.util.find_spec(package) is None else ""


def multi_turn_names() -> list[str]:
    """The backends that serve the agent node, for a fix text."""
    return [name for name, b in ROLLOUT_BACKENDS.items() if b.multi_turn]
