"""How a train engine's model spans its pool's ranks: the `strategy` of `[pools.<name>]`.

- "ddp" (`Replicated`): every rank holds the whole model, its gradients and its optimizer
  state; after the backward passes one all-reduce over a flat buffer sums the gradients. On
  cuda, a model's `param_dtype` makes forward passes compute in that dtype under autocast
  while the weights, gradients and optimizer stay in the weights' dtype (fp32 master weights).
- "fsdp" (`FullyShard`): PyTorch's FSDP2 (`fully_shard`) on each decoder layer and on the
  root (the engine's `ResponseForward`, which owns the embeddings, final norm and head). Each rank
  holds 1/ranks of every parameter, gradient and AdamW moment as DTensor shards; a layer's
  weights are all-gathered before its forward and its gradients reduce-scattered after its
  backward. On cuda, a model's `param_dtype` makes FSDP2 gather and compute in that dtype
  while the shards, the gradient reduction and the optimizer stay in the weights' dtype.

Both give the engine the same small interface: `wrap`, `reduce_grads`, `clip_grads`,
`copy_weights` (into a rollout copy), `full_state` (for a rollout pool and export) and
`move_weights` (offload); sharded checkpoints are sharded_checkpoint.py. The numbers agree: a
2-rank fsdp update equals the 1-rank update (tests/integration/test_fsdp.py).

Under fsdp every rank must make the same collective calls in the same order, so ranks make
the same number of forward (and backward) passes: see `TrainEngine.micro_batches`.
"""

import contextlib

import torch
import torch.distributed as dist

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def make_sharding(strategy: str, group=None, world_size: int = 1, device="cpu", compute=None):
    """The sharding of `strategy` ("ddp" or "fsdp") over `group`; `compute`: the dtype
    forward passes compute in on cuda (a torch dtype: FSDP2's param_dtype, autocast under
    ddp), or None to compute in the weights' dtype."""
    if strategy == "ddp":
        return Replicated(group, world_size, device, compute)
    if strategy == "fsdp":
        return FullyShard(group, world_size, device, compute)
    raise ValueError(f'strategy must be "ddp" or "fsdp", got {strategy!r}')


class Replicated:
    """ddp: a whole copy of the model on each rank; gradients summed with one all-reduce."""

    sharded = False

    def __init__(self, group=None, world_size: int = 1, device="cpu", compute=None):
        self.group, self.world_size = group, world_size
        self.autocast_to = compute if torch.device(device).type == "cuda" else None

    def wrap(self, scorer: torch.nn.Module, layers) -> None:
        """Nothing to do: each rank's module is the whole model."""

    def computing(self):
        """The context forward passes run in: autocast to `compute` on cuda, else none."""
        if self.autocast_to is None:
            return contextlib.nullcontext()
        return torch.autocast("cuda", dtype=self.autocast_to)

    def no_grad(self):
        return torch.inference_mode()

    def after_inference(self, scorer) -> None:
        """Nothing stays gathered after a forward without gradients."""

    def reduce_grads(self, params: list) -> None:
        """Sum each parameter's .grad over the ranks: one collective over a flat buffer."""
        if self.world_size == 1:
            return
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
        offset = 0
        for p in params:
            p.grad = flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()

    def clip_grads(self, params: list, max_norm: float) -> float:
        """Clip to the global gradient norm; returns the norm before clipping."""
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))

    def copy_weights(self, module: torch.nn.Module, target: torch.nn.Module) -> None:
        """Copy the module's weights into `target`, an unsharded module of the same model
        (nothing to do when a colocated rollout engine shares the module itself)."""
        if target is not module:
            with torch.no_grad():
                target.load_state_dict(module.state_dict())

    def full_state(self, module: torch.nn.Module, rank: int, everywhere: bool = False):
        """Rank 0's state dict as CPU copies (None on other ranks, which hold the same, unless
        `everywhere`)."""
        if rank != 0 and not everywhere:
            return None
        return {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}

    def move_weights(self, scorer: torch.nn.Module, device, host) -> None:
        # through `.data`, tensor by tensor: `module.to` would move the grads along with the
        # weights, and the `.grad` setter refuses a grad on another device than its weight;
        # `host` (host_copies.HostCopies) keeps their page-locked host buffers
        for i, tensor in enumerate([*scorer.parameters(), *scorer.buffers()]):
            tensor.data = host.move(("weights", i), tensor.data, device)


class FullyShard(Replicated):
    """fsdp: FSDP2 over the pool's ranks (gloo on CPU, nccl on cuda)."""

    sharded = True

    def __init__(self, group=None, world_size: int = 1, device="cpu", compute=None):
        from torch.distributed.device_mesh import DeviceMesh

        super().__init__(group or dist.group.WORLD, world_size)
        self.autocast_to = None  # FSDP2 gathers the weights in the compute dtype instead
        kind = torch.device(device).type
        self.mesh = DeviceMesh.from_group(self.group, kind)
        self.compute = compute if kind == "cuda" else None  # fp32 on CPU

    def wrap(self, scorer: torch.nn.Module, layers) -> None:
        """fully_shard each decoder layer, then the root; gradients are summed over ranks
        (not averaged: losses are already normalised by the global token counts)."""
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy()
        if self.compute is not None:  # gather and compute in bf16, reduce in fp32
            policy = MixedPrecisionPolicy(param_dtype=self.compute, reduce_dtype=torch.float32)
        for layer in layers:
            fully_shard(layer, mesh=self.mesh, mp_policy=policy)
        fully_shard(scorer, mesh=self.mesh, mp_policy=policy)
        for module in [*layers, scorer]:
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM / AVG

    def no_grad(self):
        # not inference_mode: FSDP2 allocates its gathered buffers once, and buffers made in
        # inference mode cannot take part in a later backward
        return torch.no_grad()

    def after_inference(self, scorer) -> None:
        """The root keeps its gathered weights after a forward (for the backward that usually
        follows); after one without gradients nothing follows, so give them back."""
        scorer.reshard()

    def reduce_grads(self, params: list) -> None:
        """Nothing: each layer's backward reduce-scattered its gradients into the shards."""

    def clip_grads(self, params: list, max_norm: float) -> float:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)  # a DTensor: norm of all shards
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    def copy_weights(self, module: torch.nn.Module, target: torch.nn.Module) -> None:
        """Gather each parameter whole and copy it into `target` (in its dtype), one at a
        time, so a rank never holds a second whole copy; a collective per parameter."""
        params = dict(target.named_parameters())
        with torch.no_grad():
            for name, param in module.named_parameters():
                params[name].copy_(param.detach().full_tensor())

    def full_state(self, module: torch.nn.Module, rank: int, everywhere: bool = False):
        """The whole state dict as CPU tensors on rank 0 (None on the others, unless
        `everywhere`); a collective."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=not everywhere)
        state = get_model_state_dict(module, options=options)
        if everywhere:
            return {k: v.detach().to("cpu", copy=True) for k, v in state.items()}
        return state if rank == 0 else None

    def move_weights(self, scorer: torch.nn.Module, device, host) -> None:
        # FSDP2's Module._apply re-registers the moved shards; gradients, which exist only
        # inside an update, move along (pageable: `host` is not used for the shards)
        scorer.to(device)


# -- measurement ---------------------------------------------------------------------------


def local_bytes(engine) -> dict:
    """Bytes this rank holds of an engine's weights and optimizer state (its shards under
    fsdp, everything under ddp): {"weights", "optimizer"}."""

    def size(t) -> int:
        local = t.to_local() if hasattr(t, "to_local") else t
        return local.numel() * local.element_size()

    states = engine.optimizer.state.values() if engine.optimizer else []
    return {
        "weights": sum(size(p) for p in engine.module.parameters()),
        "optimizer": sum(size(v) for s in states for k, v in s.items() if k != "step"),
    }


def compute_dtype(name: str):
    """The torch dtype of a model's `param_dtype` setting ("" = None: the weights' dtype)."""
    return DTYPES[name] if name else None


__all__ = ["FullyShard", "Replicated", "compute_dtype", "local_bytes", "make_sharding"]
