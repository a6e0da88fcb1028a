"""One rank of a pool: hosts the pool's models (colocated) and runs its nodes' workers.

The same class runs in-process (local executor) or as a Ray actor (one per rank). It is built
from plain data (`flowrl.runtime.setup.PoolSetup`), so it pickles anywhere. Every method the
walk calls answers with a record (flowrl/runtime/node_call.py): `call` with a `CallResult`,
`transition`, `export_weights` and `import_weights` with a `Timed`, whose wall times the
executor turns into the step's timings and trace.
"""

import copy
import datetime
import json
import os
import time
from pathlib import Path

import attrs
import torch

from flowrl.front import memory, registry
from flowrl.models import lora
from flowrl.protocol import DataProto
from flowrl.runtime import faults
from flowrl.runtime.node_call import CallResult, NodeCall, Timed, call_node
from flowrl.runtime.setup import PoolSetup
from flowrl.runtime.weights import Weights


@attrs.frozen
class _Node:
    """One node on this rank: its call record, and the engine and params its worker was built
    from, kept here so a call with changed params (validation's greedy decoding) rebuilds the
    worker without reading attributes of the user's worker object."""

    call: NodeCall  # holds the params the worker was built with
    uses: str
    engine: object  # the rank's train or rollout engine of the node's model
    worker: object


class PoolWorker:
    def __init__(self, setup: PoolSetup, rank: int = 0, world_size: int = 1, dist_url: str = ""):
        torch.set_num_threads(setup.threads)
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # one "Loading weights" bar per model per rank is noise
        self.setup, self.rank, self.world_size = setup, rank, world_size
        self.step = 0  # the training step of the last call (what a fault point names)
        self._fault("load")
        device = _device(setup.device, rank)
        group = _process_group(setup, rank, world_size, dist_url, device)
        self.train, self.rollout, self.tokenizers = {}, {}, {}
        self.rollout_copies = {}  # model -> the unsharded module an fsdp model generates from
        for name, config in setup.models.items():
            self._load(name, config, device, group)
        self.nodes = {}
        where = f"on pool {setup.pool}, rank {rank}"
        for node in setup.nodes:
            spec = registry.resolve(node.uses, Path(setup.base_dir)).spec
            params = spec.params(**node.params)
            engine = (self.rollout if spec.mode == "rollout" else self.train)[node.model]
            call = NodeCall(node.id, spec, node.rename, params, where)
            self.nodes[node.id] = _Node(call, node.uses, engine, spec.worker(engine, params))

    def _load(self, name: str, config, device: str, group) -> None:
        """Load model `name` onto this rank: its train engine, and its rollout engine when a
        rollout node uses it."""
        from flowrl.engines import TrainEngine, make_rollout
        from flowrl.engines.rollout import mix
        from flowrl.front.sections import rollout_options
        from flowrl.models import load_model

        setup, rank, world_size = self.setup, self.rank, self.world_size
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
        self.train[name] = TrainEngine.from_config(
            module,
            tokenizer,
            config,
            setup,
            name,
            rank=rank,
            world_size=world_size,
            group=group,
            device=device,
        )
        if name in setup.rollout_models:
            # the options are built here from the graph's [models.<name>.rollout_options],
            # checked against the backend's record so an error names that key; make_rollout
            # resolves the same record again for the class (a table line, or a file loaded
            # once: refs keeps it in sys.modules) and takes the options as they are
            self.rollout[name] = make_rollout(
                config.rollout,
                rollout_module,
                tokenizer,
                device,
                options=rollout_options(name, config, Path(setup.base_dir)),
                seed=mix(setup.seed, rank),  # a backend sampling from its own state: per rank
                where=f"pool {setup.pool}, rank {rank}, model {name}",
                base_dir=setup.base_dir,
            )
            if getattr(self.rollout[name], "own_weights", False):  # a server: before generating
                self.rollout[name].sync_weights(rollout_module)

    def call(
        self, node_id: str, batch: DataProto, changes: dict | None = None, record=None
    ) -> CallResult:
        """Run a node on this rank's rows.

        Args:
            changes: params to change for this call ({param: value}, e.g. greedy decoding for
                validation): the worker is built again from the node's engine and the changed
                params.
            record: a `flowrl.runtime.inputs.Recording`, or None: where the call's inputs are
                kept if it fails, or always when run.save_inputs names the node.
        """
        node = self.nodes[node_id]
        call, worker = node.call, node.worker
        if not changes:  # validation's calls (greedy) carry step 0
            self.step = batch.meta.get("step", self.step)
        self._fault(node_id)
        if changes:
            call = attrs.evolve(call, params=attrs.evolve(call.params, **changes))
            worker = call.spec.worker(node.engine, call.params)
        meta = {"rank": self.rank, "world_size": self.world_size, "base_dir": self.setup.base_dir}
        saver = None
        if record is not None:
            saver = record.saver(node_id, node.uses, call.params, self.rank, self.world_size)
        return call_node(call, batch, worker, meta, saver)

    def transition(self, kind: str, model: str, parts: tuple) -> Timed:
        """Move model parts on or off the device, or sync weights: Timed(None, ...)."""
        start = time.time()
        copy = self.rollout_copies.get(model)  # fsdp: the unsharded copy the rollout uses
        if kind == "sync":
            self._fault("sync")
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
        return Timed(None, start, time.time())

    def _trainable(self) -> dict:
        return {name: engine for name, engine in self.train.items() if engine.trainable}

    def state_dict(self) -> dict:
        return {name: engine.state_dict() for name, engine in self._trainable().items()}

    def load_state_dict(self, state: dict) -> None:
        for name, engine_state in state.items():
            self.train[name].load_state_dict(engine_state)

    def node_states(self) -> dict:
        """The state of each node whose worker keeps one (`state_dict()`: update.policy's
        loss state), checked to be JSON a checkpoint can hold."""
        from flowrl.errors import StateError, unstorable

        out = {}
        for node_id, node in self.nodes.items():
            if not callable(getattr(node.worker, "state_dict", None)):
                continue
            state = node.worker.state_dict()
            if problem := unstorable(state):
                raise StateError(
                    f"node {node_id}: its worker's state_dict() returned {problem}, which a "
                    "checkpoint (JSON) cannot store: keep numbers, strings, lists and dicts "
                    "with string keys (float(x) or x.tolist() for a tensor)"
                )
            out[node_id] = state
        return out

    def save(self, directory: str) -> None:
        """ddp: rank 0 writes the trainable models' state to pool-<name>.pt (all ranks hold the
        same after each step). fsdp: every rank writes its shards into pool-<name>/. Rank 0
        writes the node workers' states (the same on every rank) to nodes-<name>.json."""
        self._fault("save")
        states = self.node_states()
        if states and self.rank == 0:
            path = Path(directory) / f"nodes-{self.setup.pool}.json"
            path.write_text(json.dumps(states, sort_keys=True))
        if self.setup.strategy == "fsdp":
            from flowrl.engines.train import sharded_checkpoint

            if self._trainable():
                path = Path(directory) / f"pool-{self.setup.pool}"
                sharded_checkpoint.save(self._trainable(), path, self.rank)
        elif self.rank == 0:
            torch.save(self.state_dict(), Path(directory) / f"pool-{self.setup.pool}.pt")

    def load(self, directory: str) -> None:
        """Load what `save` wrote. A sharded checkpoint loads under any number of ranks and
        under either strategy; a ddp one (a single file) only under ddp."""
        states = Path(directory) / f"nodes-{self.setup.pool}.json"
        if states.exists():
            for node_id, state in json.loads(states.read_text()).items():
                if node_id in self.nodes:
                    self.nodes[node_id].worker.load_state_dict(state)
        sharded = Path(directory) / f"pool-{self.setup.pool}"
        path = sharded.with_name(sharded.name + ".pt")
        if sharded.is_dir():
            from flowrl.engines.train import sharded_checkpoint

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

    def export_weights(self, model: str) -> Timed:
        """Rank 0's weights of `model` as CPU tensors, for a rollout pool: Timed(Weights, ...);
        other ranks return Timed(None, ...) (under fsdp they take part in gathering the shards).
        """
        start = time.time()
        self._fault("export")
        if self.train[model].module is not None and lora.has_adapter(self.train[model].module):
            state = None  # with LoRA (ddp only), the adapter: all ranks hold the same
            if self.rank == 0:
                module = self.train[model].module
                state = {
                    k: v.detach().to("cpu", copy=True) for k, v in lora.weights(module).items()
                }
        else:
            state = self.train[model].full_state()
        return Timed(None if state is None else Weights(state), start, time.time())

    def import_weights(self, model: str, exported: Timed) -> Timed:
        """Load weights sent by `export_weights` into this pool's copy of `model` (whose
        rollout engine shares the module): Timed((the export's start, end), ...), so the walk
        times the export too (its rank never answers to the controller: on Ray the weights go
        worker to worker)."""
        start = time.time()
        self._fault("import")
        with torch.no_grad():  # with LoRA, the adapter
            lora.load_weights(self.train[model].module, exported.value)
        if model in self.rollout:  # a backend with its own copy (sglang) takes them too
            self.rollout[model].sync_weights(self.train[model].module)
        return Timed((exported.start, exported.end), start, time.time())

    def close(self) -> None:
        """Let each rollout backend release what it made (`close()`: a server, temp folders);
        one that fails is reported, the others still close."""
        for name, backend in self.rollout.items():
            close = getattr(backend, "close", None)
            if not callable(close):
                continue
            try:
                close()
            except Exception as e:  # noqa: BLE001 (the run is ending: say it, go on)
                print(f"flowrl: warning: rollout backend of {name}: close() failed: {e}")

    def _fault(self, what: str) -> None:
        """A test's fault set for this rank doing `what` (flowrl/runtime/faults.py)."""
        faults.point(f"{self.setup.pool}.{self.rank}.{what}", self.step)

    def apply(self, fn, *args):
        """`fn(self, *args)` on this rank: how tests and diagnostics look inside a rank (its
        parameters, its shards' bytes, its host) without a method here for each. `fn` must
        pickle (a module-level function); under fsdp, call a collective on every rank."""
        return fn(self, *args)


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
    if world_size > 1:  # a collective whose peer is gone fails after run.call_timeout_s
        timeout = {}
        if setup.collective_timeout_s:
            timeout["timeout"] = datetime.timedelta(seconds=setup.collective_timeout_s)
        dist.init_process_group(
            backend, init_method=url, rank=rank, world_size=world_size, **timeout
        )
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
