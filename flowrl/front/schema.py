"""The tables of a graph file, as attrs classes: the only place their defaults live.

`[run]`, `[data]`, `[models.<name>]` and `[pools.<name>]` map onto the classes here; a node's
own parameters live in its module's `Params` class. docs/graph-file.md documents every field.
`GraphSpec` is a whole parsed file (flowrl/front/dsl.py builds it), `NodeDecl` one of its nodes.
No torch or ray here.
"""

from pathlib import Path
from typing import Any

import attrs

from flowrl.backends import EXECUTORS, ROLLOUT_BACKENDS, is_reference  # torch-free
from flowrl.models import lora
from flowrl.nodespec import HEADS, NodeSpec
from flowrl.params import (
    MAX_DATASET,
    MAX_MEMORY_GB,
    MAX_PARAMS,
    MAX_PER_WORKER,
    MAX_ROWS,
    MAX_SEED,
    MAX_STEPS,
    MAX_TOKENS,
    MAX_WAIT_S,
    MAX_WORKERS,
    Rule,
    at_least,
    checked,
    count,
    interval,
    not_empty,
    one_of,
    pair,
    positive,
)

BACKENDS = tuple(EXECUTORS)  # run.backend: "ray" or "local"
SCHEDULES = ("constant", "cosine")
OFFLOAD = ("never", "always", "auto")
DEVICES = ("cpu", "cuda")
PLACEMENTS = ("", "PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")  # "" = auto
STRATEGIES = ("ddp", "fsdp")  # training strategies (flowrl/engines/train/sharding.py)
DTYPES = ("float32", "bfloat16", "float16")
# run.loggers: each logger's pip package ("" = none needed); flowrl/runtime/loggers.py has them
LOGGER_PACKAGES = {"jsonl": "", "tensorboard": "tensorboard", "wandb": "wandb"}
BUILTIN_SOURCES = (
    "arithmetic",
    "calculator",
    "arithmetic_preferences",
    "calculator_tools",
)  # data.source names that are not files (flowrl/data/)
DATA_SUFFIXES = (".parquet", ".jsonl", ".json")  # data files the loader reads
DEFAULT_POOL = "main"  # the pool of a graph that declares none

# What a prompt batch holds before any node runs (flowrl/data/loader.py builds it).
DATASET_KEYS = (
    "prompts",
    "prompt_mask",
    "uid",
    "prompt_text",
    "raw_prompt",
    "ground_truth",
    "data_source",
    "extra_info",
)


def _backend_name() -> Rule:
    """A name in the one table of rollout backends, or a reference to a user's class (loaded
    and checked with the graph, flowrl/front/sections.py)."""
    names = one_of(ROLLOUT_BACKENDS).text
    return Rule(
        f'{names}, or "file.py:Class"',
        lambda name: name in ROLLOUT_BACKENDS or is_reference(name),
    )


def _names() -> Rule:
    """A list of distinct, non-empty names (e.g. node ids)."""

    def test(value) -> bool:
        good = all(isinstance(v, str) and v for v in value)
        return good and len(set(value)) == len(value)

    return Rule("a list of distinct node ids", test)


def _loggers() -> Rule:
    names = one_of(LOGGER_PACKAGES)
    return Rule(f"a list, each {names.text}", lambda v: all(n in LOGGER_PACKAGES for n in v))


def _options() -> Rule:
    """A backend's or a sampler's own keys are checked against its options record
    (sections.py)."""
    return Rule("a table of its options (below)", lambda v: isinstance(v, dict))


def _lora() -> Rule:
    text = (
        "{} (off) or a table of rank (an integer > 0), alpha (> 0) and target_modules "
        '("all-linear" or a list of module names)'
    )
    return Rule(text, lambda v: not lora.settings_problem(v))


@attrs.frozen
class RunConfig:
    steps: int = checked(20, count(1, MAX_STEPS))  # training steps (one batch each)
    seed: int = checked(0, count(0, MAX_SEED))  # seeds data order, sampling and initialisation
    backend: str = checked("ray", one_of(BACKENDS))  # or "local"
    out_dir: str = "runs"  # run directories go under it
    num_cpus: int = checked(0, count(0, MAX_WORKERS))  # for Ray; 0 = all cores
    val_every: int = checked(0, count(0, MAX_STEPS))  # 0 = first and last only
    val_size: int = checked(64, count(0, MAX_ROWS))  # held-out prompts; 0 = off (docs/data.md)
    save_every: int = checked(0, count(0, MAX_STEPS))  # 0 = at the end only
    keep_checkpoints: int = checked(2, count(1, MAX_STEPS))  # newest kept
    log_samples: int = checked(2, count(0, MAX_ROWS))  # generations per step
    # stop after this many steps in a row whose updates did nothing: a non-finite loss or
    # gradient norm (that optimizer step is skipped: the weights stay as they were), or a
    # gradient norm of 0 over rows with a learning signal (flowrl/runtime/guards.py)
    max_nonfinite_steps: int = checked(3, count(1, MAX_STEPS))
    # stop after this many steps in a row that trained on nothing (more than half of the
    # requests failed, so the update was skipped, or no response had a sampled token)
    max_failed_steps: int = checked(2, count(1, MAX_STEPS))
    save_inputs: list[str] = checked([], _names())  # nodes whose inputs are kept, to replay
    save_inputs_last: int = checked(1, count(1, MAX_STEPS))  # of the last K steps
    loggers: list[str] = checked([], _loggers())  # jsonl (always), tensorboard, wandb
    critic_warmup: int = checked(0, count(0, MAX_STEPS))  # first N steps train only the critic
    staleness: int = checked(0, count(0, MAX_STEPS))  # k > 0: generate k steps ahead (async)
    partial_rollout: int = checked(0, count(0, MAX_TOKENS))  # tokens a round; 0 = off (async)
    # a lost rank (process, node, a call past call_timeout_s) is made again and the run goes on
    # from its newest checkpoint, at most this many times (docs/recovery.md); 0 = it stops
    max_restarts: int = checked(3, count(0, MAX_STEPS))  # lost ranks recovered from; 0 = stop
    restart_backoff_s: float = checked(2.0, at_least(0, 3600))  # doubled each in a row
    restart_wait_s: float = checked(300.0, at_least(0, MAX_WAIT_S))  # for Ray's room again
    call_timeout_s: float = checked(3600.0, at_least(0, MAX_WAIT_S))  # no answer; 0 = none
    term_grace_s: float = checked(20.0, at_least(0, MAX_WAIT_S))  # SIGTERM: checkpoint first


@attrs.frozen
class DataConfig:
    source: str = checked("arithmetic", not_empty())  # "arithmetic", or a .parquet / .jsonl file
    val_source: str = ""  # default: the task's split, or val_size rows of the file held out
    batch_size: int = checked(4, count(1, MAX_ROWS))  # prompts per step
    max_prompt_len: int = checked(256, count(1, MAX_TOKENS))  # longer are dropped
    train_size: int = checked(0, count(0, MAX_DATASET))  # synthetic task; 0 = all
    shuffle: bool = True  # reshuffled every epoch from the seed
    sampler: str = checked("uniform", not_empty())  # "uniform", "pass_rate" or "file.py:Class"
    sampler_options: dict = attrs.field(factory=dict, validator=_options())  # see below


@attrs.frozen
class ModelConfig:
    path: str = checked("smollm2-135m-instruct", not_empty())  # alias, HF dir, hub name, "tiny"
    trainable: bool = False  # frozen models (reference) are never updated
    head: str = checked("lm", one_of(HEADS))  # "value" for critics
    pool: str = ""  # which pool hosts it; may be left out when there is one pool
    rollout_pool: str = ""  # pool of its rollout engine; "" = the same (hybrid engine)
    rollout: str = checked("hf", _backend_name())  # rollout backend (flowrl/backends.py)
    rollout_options: dict = attrs.field(factory=dict, validator=_options())  # see below
    dtype: str = checked("float32", one_of(DTYPES))  # of the weights
    lr: float = checked(1e-6, positive())  # AdamW peak learning rate
    weight_decay: float = checked(0.0, at_least(0))  # AdamW decoupled weight decay
    betas: list[float] = checked([0.9, 0.999], pair(interval(0, 1, high_open=True)))  # AdamW betas
    warmup_steps: int = checked(0, count(0, MAX_STEPS))  # linear, optimizer steps
    schedule: str = checked("constant", one_of(SCHEDULES))  # after warmup
    min_lr_ratio: float = checked(0.0, interval(0, 1))  # cosine floor, as a fraction of lr
    grad_clip: float = checked(1.0, at_least(0))  # max global grad norm; 0 = off
    micro_tokens: int = checked(4096, count(1, MAX_TOKENS))  # tokens per micro-batch
    n_params: int = checked(0, count(0, MAX_PARAMS))  # 0 = known from the path
    lora: dict = attrs.field(factory=dict, validator=_lora())  # rank, alpha, target_modules
    param_dtype: str = checked("", one_of(("", *DTYPES)))  # cuda: compute dtype; "" = dtype
    activation_checkpointing: bool = False  # recompute each decoder layer in backward


@attrs.frozen
class PoolConfig:
    workers: int = checked(1, count(1, MAX_WORKERS))  # ranks (one process each)
    device: str = checked("cpu", one_of(DEVICES))  # "cpu" or "cuda"
    devices_per_worker: int = checked(1, count(1, MAX_PER_WORKER))  # GPUs per rank
    cpus_per_worker: int = checked(1, count(1, MAX_PER_WORKER))  # torch threads per rank
    offload: str = checked("auto", one_of(OFFLOAD))  # never/always/auto
    device_memory_gb: float = checked(0.0, at_least(0, MAX_MEMORY_GB))  # 0 = per device
    nodes: int = checked(1, count(1, MAX_WORKERS))  # machines the pool spans
    strategy: str = checked("ddp", one_of(STRATEGIES))  # "ddp" (replicated) or "fsdp" (sharded)
    placement: str = checked("", one_of(PLACEMENTS))  # Ray; "" = PACK or STRICT_SPREAD


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
        return tuple(self.rename.get(k, k) for k in self.spec.writes_for(self.params))

    @property
    def mode(self) -> str | None:
        return self.spec.mode


@attrs.frozen
class GraphSpec:
    """A parsed and validated graph file: its tables as the classes above, nodes resolved."""

    file: str
    run: RunConfig
    data: DataConfig
    models: dict[str, ModelConfig]
    pools: dict[str, PoolConfig]
    nodes: dict[str, NodeDecl]  # in file order
    raw: dict  # the file's tables after overrides, for the run directory
    root: str = ""  # where relative paths resolve, when not the file's folder (replay)
    renamed: tuple[str, ...] = ()  # a warning per old spelling of a key the file uses

    @property
    def base_dir(self) -> Path:
        return Path(self.root) if self.root else Path(self.file).parent

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

    def models_on(self, pool: str) -> dict[str, ModelConfig]:
        """The models a pool loads. A model whose rollout runs on another pool is there too,
        frozen: that pool generates with it and receives its weights after each update."""
        out = {m: c for m, c in self.models.items() if c.pool == pool}
        for name, config in self.models.items():
            if config.rollout_pool == pool and config.pool != pool:
                out[name] = attrs.evolve(config, pool=pool, trainable=False)
        return out


# Sizes of the aliases, for memory estimates without loading anything: parameters, layers and
# the width of one layer's keys (kv heads x head dim). Other paths are read from config.json.
KNOWN_SIZES = {
    "smollm2-135m-instruct": {"params": 134_515_008, "layers": 30, "kv_dim": 192},
    "tiny": {"params": 40_000, "layers": 2, "kv_dim": 32},
}
