"""The tables of a graph file, as attrs classes: the only place their defaults live.

`[run]`, `[data]`, `[models.<name>]` and `[pools.<name>]` map onto the classes here; a node's
own parameters live in its module's `Params` class. docs/graph-file.md documents every field.
"""

import attrs

from flowrl import lora
from flowrl.engines.rollout import ROLLOUT_BACKENDS  # torch-free: the table, no backend

BACKENDS = ("ray", "local")
HEADS = ("lm", "value")
SCHEDULES = ("constant", "cosine")
OFFLOAD = ("never", "always", "auto")
DEVICES = ("cpu", "cuda")
STRATEGIES = ("", "PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")  # "" = auto
DTYPES = ("float32", "bfloat16", "float16")
# run.loggers: each logger's pip package ("" = none needed); flowrl/runtime/loggers.py has them
LOGGER_PACKAGES = {"jsonl": "", "tensorboard": "tensorboard", "wandb": "wandb"}


def _choice(*choices):
    return attrs.validators.in_(choices)


def _rollout_backend(instance, attribute, value):
    """A name in the one table of rollout backends (flowrl/engines/rollout.py)."""
    if value not in ROLLOUT_BACKENDS:
        raise ValueError(f"'{attribute.name}' must be in {tuple(ROLLOUT_BACKENDS)} (got {value!r})")


def _loggers(instance, attribute, value):
    for name in value:
        if name not in LOGGER_PACKAGES:
            choices = tuple(LOGGER_PACKAGES)
            raise ValueError(f"'{attribute.name}' entries must be in {choices} (got {name!r})")


def _lora(instance, attribute, value):
    problem = lora.settings_problem(value)
    if problem:
        raise ValueError(problem)


def _positive(instance, attribute, value):
    if value <= 0:
        raise ValueError(f"{attribute.name} must be > 0, got {value}")


def _non_negative(instance, attribute, value):
    if value < 0:
        raise ValueError(f"{attribute.name} must be >= 0, got {value}")


@attrs.frozen
class RunConfig:
    steps: int = attrs.field(default=20, validator=_positive)  # training steps (one batch each)
    seed: int = 0  # seeds data order, sampling and initialisation
    backend: str = attrs.field(default="ray", validator=_choice(*BACKENDS))  # or "local"
    out_dir: str = "runs"  # run directories go under it
    num_cpus: int = attrs.field(default=0, validator=_non_negative)  # for Ray; 0 = all cores
    val_every: int = attrs.field(default=0, validator=_non_negative)  # 0 = first and last only
    val_size: int = attrs.field(default=64, validator=_non_negative)  # held-out prompts; 0 = off
    save_every: int = attrs.field(default=0, validator=_non_negative)  # 0 = at the end only
    keep_checkpoints: int = attrs.field(default=2, validator=_positive)  # newest kept
    log_samples: int = attrs.field(default=2, validator=_non_negative)  # generations per step
    loggers: list[str] = attrs.field(factory=list, validator=_loggers)  # jsonl, tensorboard, wandb


@attrs.frozen
class DataConfig:
    source: str = "arithmetic"  # "arithmetic", or a .parquet / .jsonl file in verl's format
    val_source: str = ""  # default: the validation split of `source`
    batch_size: int = attrs.field(default=4, validator=_positive)  # prompts per step
    max_prompt_len: int = attrs.field(default=256, validator=_positive)  # longer are dropped
    train_size: int = attrs.field(default=0, validator=_non_negative)  # synthetic task; 0 = all
    shuffle: bool = True  # reshuffled every epoch from the seed


@attrs.frozen
class ModelConfig:
    path: str = "smollm2-135m-instruct"  # alias, HF directory or cached hub name; "tiny"
    trainable: bool = False  # frozen models (reference) are never updated
    head: str = attrs.field(default="lm", validator=_choice(*HEADS))  # "value" for critics
    pool: str = ""  # which pool hosts it; may be left out when there is one pool
    rollout_pool: str = ""  # pool of its rollout engine; "" = the same (hybrid engine)
    rollout: str = attrs.field(default="hf", validator=_rollout_backend)  # the rollout backend
    dtype: str = attrs.field(default="float32", validator=_choice(*DTYPES))  # of the weights
    lr: float = attrs.field(default=1e-6, validator=_positive)  # AdamW peak learning rate
    weight_decay: float = 0.0  # AdamW decoupled weight decay
    betas: list[float] = attrs.field(factory=lambda: [0.9, 0.999])  # AdamW betas
    warmup_steps: int = attrs.field(default=0, validator=_non_negative)  # linear, optimizer steps
    schedule: str = attrs.field(default="constant", validator=_choice(*SCHEDULES))  # after warmup
    min_lr_ratio: float = 0.0  # cosine floor, as a fraction of lr
    grad_clip: float = 1.0  # max global grad norm; 0 = off
    micro_tokens: int = attrs.field(default=4096, validator=_positive)  # tokens per micro-batch
    n_params: int = attrs.field(default=0, validator=_non_negative)  # 0 = known from the path
    lora: dict = attrs.field(factory=dict, validator=_lora)  # {rank, alpha, target_modules}; {} off


@attrs.frozen
class PoolConfig:
    workers: int = attrs.field(default=1, validator=_positive)  # ranks (one process each)
    device: str = attrs.field(default="cpu", validator=_choice(*DEVICES))  # "cpu" or "cuda"
    devices_per_worker: int = attrs.field(default=1, validator=_positive)  # GPUs per rank
    cpus_per_worker: int = attrs.field(default=1, validator=_positive)  # torch threads per rank
    offload: str = attrs.field(default="auto", validator=_choice(*OFFLOAD))  # never/always/auto
    device_memory_gb: float = attrs.field(default=0.0, validator=_non_negative)  # 0 = per device
    nodes: int = attrs.field(default=1, validator=_positive)  # machines the pool spans
    # Ray placement-group strategy; "" = PACK on one node, STRICT_SPREAD over several
    strategy: str = attrs.field(default="", validator=_choice(*STRATEGIES))


TABLES = {"run": RunConfig, "data": DataConfig}

# Sizes of the aliases, for memory estimates without loading anything: parameters, layers and
# the width of one layer's keys (kv heads x head dim). Other paths are read from config.json.
KNOWN_SIZES = {
    "smollm2-135m-instruct": {"params": 134_515_008, "layers": 30, "kv_dim": 192},
    "tiny": {"params": 40_000, "layers": 2, "kv_dim": 32},
}
