"""One rank of a pool: hosts the pool's models (colocated) and runs its nodes' workers.

The same class runs in-process (local executor) or as a Ray actor (one per rank). It receives
only plain data (model configs, node `uses` and params as dicts) so it pickles anywhere.
`call` and `transition` return tuples whose last element is the (start, end) wall time, which
the executor turns into the step's timings and trace.
"""

import copy
import os
import time
from pathlib import Path

import attrs
import torch

from flowrl.front import memory, registry, schema
from flowrl.models import lora
from flowrl.protocol import DataProto
from flowrl.runtime.node_call import call_node


@attrs.frozen
class NodeSetup:
    id: str
    uses: str
    params: dict
    model: str
    rename: dict


@attrs.frozen
class PoolSetup:
    """What a rank needs to build itself: plain data, picklable for Ray."""

    pool: str
    device: str
    threads: int
    seed: int
    base_dir: str
    models: dict  # name -> schema.ModelConfig
    total_steps: dict  # trainable model name -> optimizer steps in the run
    rollout_models: tuple  # models used in rollout mode (get a rollout engine)
    nodes: tuple  # NodeSetup for every node that runs on this pool
    strategy: str = "ddp"  # "ddp" or "fsdp" (flowrl/engines/sharding.py)
    sharded: tuple = ()  # the models fsdp shards here


class PoolWorker:
    def __init__(self, setup: PoolSetup, rank: int = 0, world_size: int = 1, dist_url: str = ""):
        from flowrl.engines import TrainEngine, make_rollout
        from flowrl.models import load_model

        torch.set_num_threads(setup.threads)
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # one "Loading weights" bar per model per rank is noise
        self.setup, self.rank, self.world_size = setup, rank, world_size
        device = _device(setup.device, rank)
        group = _process_group(setup, rank, world_size, dist_url, device)
        self.train, self.rollout, self.tokenizers = {}, {}, {}
        self.rollout_copies = {}  # model -> the unsharded module an fsdp model generates from
        for name, config in setup.models.items():
            torch.manual_seed(setup.seed)  # the same initial value head on every rank
            module, tokenizer = load_model(
                config.path, head=config.head, dtype=config.dtype, seed=setup.seed
            )
            if config.lora:  # only the adapter trains; flowrl/models/lora.py
                lora.add_adapter(module, config.lora)
            module.to(device)
            self.tokenizers[name] = tokenizer
            rollout_module = module
            if name in setup.sharded and name in setup.rollout_models:
                rollout_module = _rollout_copy(module, config, setup.device)
                self.rollout_copies[name] = rollout_module
            self.train[name] = TrainEngine(
                module,
                tokenizer,
                trainable=config.trainable,
                lr=config.lr,
                weight_decay=config.weight_decay,
                betas=tuple(config.betas),
                warmup_steps=config.warmup_steps,
                schedule=config.schedule,
                min_lr_ratio=config.min_lr_ratio,
                total_steps=setup.total_steps.get(name, 1),
                grad_clip=config.grad_clip,
                micro_tokens=config.micro_tokens,
                device=device,
                rank=rank,
                world_size=world_size,
                group=group,
                strategy="fsdp" if name in setup.sharded else "ddp",
                param_dtype=config.param_dtype,
                activation_checkpointing=config.activation_checkpointing,
            )
            if name in setup.rollout_models:
                where = f"pool {setup.pool}, rank {rank}, model {name}"
                self.rollout[name] = make_rollout(
                    config.rollout, rollout_module, tokenizer, device, where
                )
        self.workers = {}
        for node in setup.nodes:
            spec = registry.resolve(node.uses, Path(setup.base_dir)).spec
            params = spec.params(**node.params)
            engine = (self.rollout if spec.mode == "rollout" else self.train)[node.model]
            self.workers[node.id] = (spec.worker(engine, params), node.rename, spec)

    def call(self, node_id: str, batch: DataProto, overrides: dict | None = None, record=None):
        """Run a node on this rank's rows: (writes as DataProto, metrics, (start, end) times).

        `record` (a `flowrl.runtime.inputs.Recording`, or None) says where the call's inputs
        are kept if it fails, or always when run.save_inputs names the node."""
        start = time.time()
        worker, rename, spec = self.workers[node_id]
        if overrides:  # e.g. greedy decoding for validation
            worker = spec.worker(worker.engine, attrs.evolve(worker.params, **overrides))
        where = f"on pool {self.setup.pool}, rank {self.rank}"
        meta = {"rank": self.rank, "world_size": self.world_size, "base_dir": self.setup.base_dir}
        saver = None
        if record is not None:
            uses = next(n.uses for n in self.setup.nodes if n.id == node_id)
            saver = record.saver(node_id, uses, worker.params, self.rank, self.world_size)
        params = getattr(worker, "params", None)  # decides the optional writes
        out, metrics = call_node(
            node_id, spec, rename, batch, worker, where, meta, saver, params=params
        )
        return out, metrics, (start, time.time())

    def transition(self, kind: str, model: str, parts: tuple):
        """Move model parts on or off the device, or sync weights: (None, (start, end))."""
        start = time.time()
        copy = self.rollout_copies.get(model)  # fsdp: the unsharded copy the rollout uses
        if kind == "sync":
            if model in self.rollout:
                if copy is not None:  # gathered one parameter at a time
                    self.train[model].copy_weights_to(copy)
                self.rollout[model].sync_weights(self.train[model].module if copy is None else copy)
        else:
            train_parts = tuple(p for p in parts if p not in ("kv_cache", "rollout_weights"))
            getattr(self.train[model], kind)(train_parts)
            if "rollout_weights" in parts and copy is not None:
                copy.to(self.train[model].device if kind == "reload" else "cpu")
            if model in self.rollout:  # a backend with weights of its own: they are the copy's
                moved = tuple("weights" if p == "rollout_weights" else p for p in parts)
                getattr(self.rollout[model], kind)(moved)  # each backend moves what it holds
        return None, (start, time.time())

    def _trainable(self) -> dict:
        return {name: engine for name, engine in self.train.items() if engine.trainable}

    def state_dict(self) -> dict:
        return {name: engine.state_dict() for name, engine in self._trainable().items()}

    def load_state_dict(self, state: dict) -> None:
        for name, engine_state in state.items():
            self.train[name].load_state_dict(engine_state)

    def save(self, directory: str) -> None:
        """ddp: rank 0 writes the trainable models' state to pool-<name>.pt (all ranks hold the
        same after each step). fsdp: every rank writes its shards into pool-<name>/."""
        if self.setup.strategy == "fsdp":
            from flowrl.engines import sharded_checkpoint

            if self._trainable():
                path = Path(directory) / f"pool-{self.setup.pool}"
                sharded_checkpoint.save(self._trainable(), path, self.rank)
        elif self.rank == 0:
            torch.save(self.state_dict(), Path(directory) / f"pool-{self.setup.pool}.pt")

    def load(self, directory: str) -> None:
        """Load what `save` wrote. A sharded checkpoint loads under any number of ranks and
        under either strategy; a ddp one (a single file) only under ddp."""
        sharded = Path(directory) / f"pool-{self.setup.pool}"
        path = sharded.with_name(sharded.name + ".pt")
        if sharded.is_dir():
            from flowrl.engines import sharded_checkpoint

            sharded_checkpoint.load(self._trainable(), sharded)
        elif path.exists():
            if self.setup.strategy == "fsdp":
                raise ValueError(
                    f"{path} was written under strategy ddp; resume it with "
                    f'pools.{self.setup.pool}.strategy="ddp" (a run saved under fsdp resumes '
                    "under either strategy)"
                )
            # tensors and plain containers only: loading someone's run never runs code
            self.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))

    def export_weights(self, model: str):
        """Rank 0's weights of `model` as CPU tensors, for a rollout pool: (state, (start, end));
        other ranks return (None, ...) (under fsdp they take part in gathering the shards)."""
        start = time.time()
        if self.train[model].module is not None and lora.has_adapter(self.train[model].module):
            state = None  # with LoRA (ddp only), the adapter: all ranks hold the same
            if self.rank == 0:
                module = self.train[model].module
                state = {
                    k: v.detach().to("cpu", copy=True) for k, v in lora.weights(module).items()
                }
            return state, (start, time.time())
        return self.train[model].full_state(), (start, time.time())

    def import_weights(self, model: str, exported: tuple):
        """Load weights sent by `export_weights` into this pool's copy of `model` (whose
        rollout engine shares the module): (None, (start, end))."""
        start = time.time()
        state, _ = exported
        with torch.no_grad():
            lora.load_weights(self.train[model].module, state)  # with LoRA, the adapter
        if model in self.rollout:  # a backend with its own copy (sglang) takes them too
            self.rollout[model].sync_weights(self.train[model].module)
        return None, (start, time.time())

    def where(self) -> dict:
        """Where this rank runs: Ray node id (when under Ray), host and process id."""
        import socket

        node = ""
        try:
            import ray

            if ray.is_initialized():
                node = ray.get_runtime_context().get_node_id()
        except ImportError:
            pass
        return {"node_id": node, "host": socket.gethostname(), "pid": os.getpid()}

    def parameters(self, model: str) -> dict:
        """The model's whole parameters as CPU tensors (for tests and weight-sync checks);
        under fsdp a collective: call it on every rank."""
        engine = self.train[model]
        return engine.sharding.full_state(engine.module, self.rank, everywhere=True)

    def rollout_parameters(self, model: str) -> dict:
        """The weights the rollout engine of `model` generates from, as CPU tensors."""
        module = self.rollout_copies.get(model, self.train[model].module)
        return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}

    def local_bytes(self, model: str) -> dict:
        """Bytes of `model` this rank holds: {"weights", "optimizer"} (its shards under fsdp)."""
        from flowrl.engines import sharding

        return sharding.local_bytes(self.train[model])

    def ping(self) -> int:
        return self.rank


def _process_group(setup: PoolSetup, rank: int, world_size: int, url: str, device: str):
    """The pool's process group (gloo on CPU, nccl on cuda): over its ranks when it has
    several; over this process alone for fsdp on one rank (FSDP2 needs a group, and a local
    run reuses the one it made for an earlier pool). None for ddp on one rank."""
    import torch.distributed as dist

    if world_size == 1 and (setup.strategy != "fsdp" or dist.is_initialized()):
        return dist.group.WORLD if dist.is_initialized() else None
    if setup.device == "cuda":
        torch.cuda.set_device(device)
    backend = "gloo" if setup.device == "cpu" else "nccl"
    if world_size > 1:
        dist.init_process_group(backend, init_method=url, rank=rank, world_size=world_size)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return dist.group.WORLD


def _rollout_copy(module, config, device: str):
    """An unsharded copy of `module` for the rollout engine of a model fsdp shards, in the
    dtype passes compute in (bf16 on cuda with param_dtype), without gradients."""
    from flowrl.models.loading import DTYPES

    dtype = DTYPES[memory.compute_dtype(config, device, sharded=True)]
    return copy.deepcopy(module).to(dtype).requires_grad_(False).eval()


def _device(kind: str, rank: int) -> str:
    if kind == "cuda":
        return "cuda:0" if os.environ.get("CUDA_VISIBLE_DEVICES") else f"cuda:{rank}"
    return "cpu"


def pool_setups(plan) -> dict[str, PoolSetup]:
    """The PoolSetup of every pool that hosts a model, from the plan alone."""
    spec, out = plan.spec, {}
    for name, pool in plan.pools.items():
        if not pool.configs:
            continue
        nodes = tuple(
            NodeSetup(n, d.uses, attrs.asdict(d.params), d.model, d.rename)
            for n, d in ((n, spec.nodes[n]) for n in pool.node_ids)
        )
        rollout = tuple(
            sorted({spec.nodes[n].model for n in pool.node_ids if spec.nodes[n].mode == "rollout"})
        )
        held = {spec.nodes[n].model for n in plan.held}  # they skip run.critic_warmup steps
        total = {
            m: count * (spec.run.steps - (spec.run.critic_warmup if m in held else 0))
            for m, count in pool.updates_per_step.items()
        }
        out[name] = PoolSetup(
            name,
            pool.device,
            pool.cpus_per_worker,
            spec.run.seed,
            str(spec.base_dir),
            pool.configs,
            total,
            rollout,
            nodes,
            pool.strategy,
            pool.sharded,
        )
    return out


__all__ = ["PoolWorker", "PoolSetup", "NodeSetup", "pool_setups", "schema"]
