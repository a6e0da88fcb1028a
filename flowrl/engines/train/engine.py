"""The train engine: one model on one rank, its optimizer and schedule, forward passes that
return per-response-token log-probs (or values), gradient sync across the pool's ranks under
its strategy (ddp or fsdp: sharding.py), offload/reload, checkpoints.

Frozen models (a reference policy) use the same engine with trainable=False: forward only.

The forward pass (forward.py) does only the work the outputs need: padding columns are trimmed,
the LM head runs only at the positions that predict response tokens, and a prompt repeated over
its n samples runs once. Measured on the 2-core CPU machine, SmolLM2-135M, 4 prompts x 8
samples (prompt width 46, up to 20 response tokens), median of 3: forward + backward 10.7 s ->
5.2 s with the shared prompts; log-probs and gradients agree (tests/unit/engines/test_engines.py).
"""

import math

import torch
import torch.distributed as dist

from flowrl.engines.host_copies import HostCopies
from flowrl.engines.train import sharding
from flowrl.engines.train.forward import ResponseForward, checkpoint_layers, decoder_layers
from flowrl.engines.train.update_loop import UpdateLoop
from flowrl.math import ops
from flowrl.models import lora
from flowrl.protocol import DataProto

HOST = "cpu"
PARTS = ("weights", "grads", "optimizer")
# repeated prompts run once when that saves this many prompt tokens: below it, the extra
# backbone call (one more read of the weights) costs about as much as it saves
MIN_SAVED_PROMPT_TOKENS = 64
PROBED_TENSORS = 4  # the smallest weights read after each step for non-finite values


class TrainEngine(UpdateLoop):
    def __init__(
        self,
        module,
        tokenizer,
        *,
        trainable: bool = True,
        lr: float = 1e-6,
        weight_decay: float = 0.0,
        betas=(0.9, 0.999),
        warmup_steps: int = 0,
        schedule: str = "constant",
        min_lr_ratio: float = 0.0,
        total_steps: int = 1,
        grad_clip: float = 1.0,
        micro_tokens: int = 4096,
        device="cpu",
        rank: int = 0,
        world_size: int = 1,
        group=None,
        strategy: str = "ddp",
        param_dtype: str = "",
        activation_checkpointing: bool = False,
    ):
        self.module, self.tokenizer, self.trainable = module, tokenizer, trainable
        self.device, self.rank, self.world_size, self.group = device, rank, world_size, group
        self.grad_clip, self.micro_tokens = grad_clip, micro_tokens
        # micro-batches of rows sorted by length on CUDA; in order on CPU, where the n samples
        # of a prompt then share a micro-batch and its prompt's forward (MIN_SAVED_PROMPT_TOKENS)
        self.by_length = torch.device(device).type == "cuda"
        self.is_value = hasattr(module, "value_head")
        self.checkpointing = activation_checkpointing
        self.forwards = 0  # forward passes run (fsdp keeps them equal across ranks)
        if activation_checkpointing and trainable:
            checkpoint_layers(decoder_layers(module))
        if not trainable:
            module.requires_grad_(False)
        module.eval()  # no dropout in RL updates: the sampled policy is the one we score
        # the whole forward is one call of the root module, as FSDP2's hooks need
        self.forward_module = ResponseForward(module)
        compute = sharding.compute_dtype(param_dtype)
        self.sharding = sharding.make_sharding(strategy, group, world_size, device, compute)
        self.host_copies = HostCopies()  # where offloaded tensors wait (CUDA: page-locked)
        self.sharding.wrap(self.forward_module, decoder_layers(module))
        self.optimizer = self.scheduler = None
        self.resident = {"weights"}  # the parts now on `device` (see offload / reload)
        if trainable:
            # fused: one kernel over all parameters (the shards under fsdp); on the 2-core CPU
            # machine a step over SmolLM2-135M takes 0.08 s against 0.45 s for the default
            self.optimizer = torch.optim.AdamW(
                module.parameters(),
                lr=lr,
                betas=tuple(betas),
                weight_decay=weight_decay,
                fused=_fused_adamw(module),
            )
            factor = lr_factor(schedule, warmup_steps, total_steps, min_lr_ratio)
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, factor)
            self.resident |= {"grads", "optimizer"}

    @classmethod
    def from_config(
        cls, module, tokenizer, config, setup, name: str, *, rank, world_size, group, device
    ) -> "TrainEngine":
        """The engine of model `name` on one rank of a pool: `config` its [models.<name>] table
        (flowrl/front/schema.py ModelConfig: optimizer, schedule, micro_tokens, dtypes) and
        `setup` the pool's PoolSetup (flowrl/runtime/setup.py: the model's optimizer steps in
        the run, whether fsdp shards it); `group` the pool's process group (None: one rank)."""
        return cls(
            module,
            tokenizer,
            trainable=config.trainable,
            lr=config.lr,
            weight_decay=config.weight_decay,
            betas=tuple(config.betas),
            warmup_steps=config.warmup_steps,
            schedule=config.schedule,
            min_lr_ratio=config.min_lr_ratio,
            total_steps=setup.optimizer_steps.get(name, 1),
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

    # -- batching ------------------------------------------------------------------------------
    def micro_batches(self, rows):
        """Contiguous row chunks whose padded size, rows x (prompt + response) columns after
        trimming the columns that are padding in every row of the chunk, fits micro_tokens
        (at least one row per chunk). A bound on activations: shared prompts cost less.

        For training loops: under fsdp each chunk must get one `forward(grad=True)` and one
        `backward`, and the ranks must make as many of each (every pass is a collective); a
        rank with fewer chunks makes up the difference with passes on a padding row, with no
        gradient, once the loop is done (before the code after the loop runs).
        """
        return self._equal_passes(self._split(rows), grad=True)

    def _split(self, rows) -> list:
        return [rows.index(part) for part in self._parts(rows)]

    def _parts(self, rows) -> list[list[int]]:
        """The row indices of each micro-batch: in order, or longest first when `by_length`
        (on CUDA: rows of like lengths share a micro-batch, which pads them less)."""
        if len(rows) == 0:
            return [[]]
        prompt = rows["prompt_mask"].sum(-1).tolist()  # left-padded: trimmed width = longest
        response = ops.response_attention(rows).sum(-1).tolist()  # no holes: the trimmed width
        order = list(range(len(rows)))
        if self.by_length:
            order.sort(key=lambda i: -(prompt[i] + response[i]))
        bounds, start, wide = [], 0, (0, 0)
        for k, i in enumerate(order):
            grown = (max(wide[0], prompt[i]), max(wide[1], response[i]))
            if k > start and (k - start + 1) * sum(grown) > self.micro_tokens:
                bounds.append((start, k))
                start, grown = k, (prompt[i], response[i])
            wide = grown
        bounds.append((start, len(order)))
        return [order[a:b] for a, b in bounds]

    def passes(self, chunks: list):
        """`chunks` (micro-batches of rows, or anything a caller runs one forward per item of,
        such as index tensors) for passes without gradients: as they are (ddp), or under fsdp
        followed by passes on a padding row until this rank has made as many as the busiest
        rank, since every pass is a collective. Iterate it once, one forward per chunk."""
        return self._equal_passes(chunks, grad=False)

    def _equal_passes(self, parts: list, grad: bool):
        """`parts` as they are (ddp), or under fsdp a generator that yields them and then runs
        passes on a padding row until this rank has made as many as the busiest rank."""
        if not self.sharding.sharded:
            return parts
        most = self._all_reduce(sum(1 for p in parts if len(p)), dist.ReduceOp.MAX)

        def walk():
            start = self.forwards
            yield from parts
            for _ in range(int(most) - (self.forwards - start)):
                pad = torch.full((1, 1), self.tokenizer.pad_token_id or 0)
                one = torch.ones(1, 1, dtype=torch.long)
                row = DataProto.from_dict(
                    {"prompts": pad, "prompt_mask": one, "responses": pad, "response_mask": one}
                )
                out = self.forward(row, grad=grad)
                if grad:  # a zero loss: the collectives of a backward, no gradient
                    self.backward(sum(v.sum() for v in out.values()) * 0.0)

        return walk()

    def mini_batches(self, rows, size: int) -> list:
        """This rank's part of each mini-batch of `size` rows over all ranks (0 = one); every
        rank gets the same number of parts, so their optimizer steps line up."""
        total = self.all_reduce_sum(len(rows))
        return rows.chunk(math.ceil(total / size) if size else 1)

    def infer(self, rows, **kwargs) -> dict:
        """`forward` without gradients over micro-batches, outputs (b, t) in the rows' order."""
        indices = self._parts(rows)
        parts = self.passes([rows.index(i) for i in indices])
        outs = [self.forward(m, grad=False, **kwargs) for m in parts]
        where = torch.tensor([i for part in indices for i in part], dtype=torch.long)
        return {key: _placed(torch.cat([p[key] for p in outs]), where) for key in outs[0]}

    # -- forward -------------------------------------------------------------------------------
    def forward(self, rows, *, grad: bool, entropy: bool = False, temperature: float = 1.0) -> dict:
        """Per response token, for rows with prompts, prompt_mask (b, p) left-padded and
        responses, response_attention (b, t) right-padded (every real token, tool output too;
        see `ops.response_attention`): {"logprobs" (b, t)[, "entropy" (b, t)]} for an LM,
        {"values" (b, t)} for a value model; zero where response_attention is 0 (callers mask
        losses with response_mask). Logits are divided by `temperature`. `entropy`: True, or
        "metric" (the same values, without gradients). With `grad` the outputs stay on the
        engine's device, for a loss computed there (the update loop moves each micro-batch
        there); without, they come back to the host."""
        b, t = rows["responses"].shape
        if b == 0:
            empty = torch.zeros(0, t)
            return {"values": empty} if self.is_value else {"logprobs": empty, "entropy": empty}
        self.forwards += 1
        with torch.enable_grad() if grad else self.sharding.no_grad(), self.sharding.computing():
            out, keep = self._forward(rows, entropy, temperature, grad)
        if not grad:
            self.sharding.after_inference(self.forward_module)
        # outside inference mode, so callers may use the results in a graph
        return {k: _pad_right(v * keep, t, host=not grad) for k, v in out.items()}

    def _forward(self, rows, entropy: bool, temperature: float, grad: bool):
        prompts, prompt_mask = _trim(rows["prompts"], rows["prompt_mask"], left=True)
        responses, attention = _trim(rows["responses"], ops.response_attention(rows), left=False)
        prompts, prompt_mask = prompts.to(self.device), prompt_mask.to(self.device)
        responses, attention = responses.to(self.device), attention.to(self.device)
        share = self._share_prompts(prompts, prompt_mask, grad)
        module = self.forward_module
        out = module(prompts, prompt_mask, responses, attention, entropy, temperature, share)
        return out, attention

    def _share_prompts(self, prompts, prompt_mask, grad: bool) -> bool:
        """Run each distinct prompt once (`ResponseForward.hidden`) when that saves enough
        tokens; never under fsdp or while recomputing checkpointed layers, which cannot run a
        layer twice."""
        if self.sharding.sharded or (grad and self.checkpointing):
            return False
        distinct = torch.unique(torch.cat([prompts, prompt_mask], dim=1), dim=0)  # (g, 2p)
        return (len(prompts) - len(distinct)) * prompts.shape[1] >= MIN_SAVED_PROMPT_TOKENS

    # -- update --------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> dict:
        """Sum grads over ranks, clip, AdamW step, schedule step: {"grad_norm", "lr"}."""
        params = [p for p in self.module.parameters() if p.requires_grad]
        for p in params:  # a rank with no rows still joins the sum, with zeros
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        self.sharding.reduce_grads(params)
        norm = self.sharding.clip_grads(params, self.grad_clip if self.grad_clip > 0 else math.inf)
        lr = self.optimizer.param_groups[0]["lr"]
        finite = math.isfinite(norm)  # the same on every rank: the grads were summed
        broken = 0.0
        if finite:  # a NaN or inf loss or gradient would poison every weight: skip the step
            self.optimizer.step()
            self.scheduler.step()
            # a finite step can still overflow the weights (a learning rate far too large,
            # weight decay multiplying them by 1 - lr * decay), every tensor alike: the few
            # smallest tensors say so, for a read of thousands of values, not of every weight
            # (a pass over all of SmolLM2's took 0.2 s a step; weights broken in part make the
            # next step's loss non-finite, which skips that step and is counted the same)
            probes = sorted(params, key=lambda p: _local(p).numel())[:PROBED_TENSORS]
            broken = float(not all(bool(torch.isfinite(_local(p)).all()) for p in probes))
            broken = self._all_reduce(broken, dist.ReduceOp.MAX)
        self.optimizer.zero_grad(set_to_none=True)
        return {
            "grad_norm": norm,
            "lr": lr,
            "nonfinite_skipped": float(not finite),
            "nonfinite_weights": broken,
        }

    def all_reduce_sum(self, value: float) -> float:
        return self._all_reduce(value, dist.ReduceOp.SUM)

    def _all_reduce(self, value: float, op) -> float:
        if self.world_size == 1:
            return float(value)
        tensor = torch.tensor([float(value)], dtype=torch.float64)
        dist.all_reduce(tensor, op=op, group=self.group)
        return float(tensor)

    # -- weights for others --------------------------------------------------------------------
    def copy_weights_to(self, target: torch.nn.Module) -> None:
        """Copy the whole weights into `target` (an unsharded module of the model, e.g. the
        rollout copy of an fsdp model), gathered one parameter at a time under fsdp."""
        self.sharding.copy_weights(self.module, target)

    def full_state(self) -> dict | None:
        """The whole state dict as CPU tensors on rank 0, None on the others (a collective
        under fsdp): for a rollout pool's copy and for tests."""
        return self.sharding.full_state(self.module, self.rank)

    # -- residency -----------------------------------------------------------------------------
    def offload(self, parts) -> None:
        """Move parts ("weights", "grads", "optimizer") to host memory: under fsdp, this
        rank's shards."""
        self._move(parts, HOST)
        self.resident -= set(parts)
        if torch.device(self.device).type == "cuda":
            torch.cuda.empty_cache()  # give the freed blocks back, e.g. to a colocated engine

    def reload(self, parts) -> None:
        """Move parts back to `device`; a frozen model has only weights."""
        self._move(parts, self.device)
        self.resident |= set(parts) & set(PARTS if self.trainable else ("weights",))

    def _move(self, parts, device) -> None:
        unknown = set(parts) - set(PARTS)
        if unknown:
            raise ValueError(f"unknown model parts {sorted(unknown)}; parts are {PARTS}")
        host = self.host_copies
        if "weights" in parts:
            self.sharding.move_weights(self.forward_module, device, host)
        if "grads" in parts:
            for i, p in enumerate(self.module.parameters()):
                if p.grad is not None:
                    p.grad.data = host.move(("grad", i), p.grad.data, device)
        if "optimizer" in parts and self.optimizer is not None:
            for i, state in enumerate(self.optimizer.state.values()):
                for key, value in state.items():
                    if torch.is_tensor(value) and key != "step":  # a scalar, placed on load
                        state[key] = host.move(("optimizer", i, key), value, device)
        host.wait()

    # -- checkpoints (ddp; fsdp checkpoints are sharding.save / load) --------------------------
    def state_dict(self) -> dict:
        out = {"module": lora.weights(self.module)}  # with LoRA, the adapter only
        if self.trainable:
            out |= {
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
            }
        return out

    def load_state_dict(self, state: dict) -> None:
        lora.load_weights(self.module, state["module"])
        if self.trainable and "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])


def lr_factor(kind: str, warmup: int, total: int, floor: float):
    """Multiplier of the peak lr at optimizer step k: linear warmup over `warmup` steps, then
    constant, or a cosine from 1 down to `floor` at step `total`."""
    if kind not in ("constant", "cosine"):
        raise ValueError(f'schedule must be "constant" or "cosine", got {kind!r}')

    def factor(k: int) -> float:
        if k < warmup:
            return (k + 1) / warmup
        if kind == "constant":
            return 1.0
        progress = min(1.0, (k - warmup) / max(1, total - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def _fused_adamw(module: torch.nn.Module) -> bool:
    """Fused AdamW runs on CPU and CUDA for floating-point parameters."""
    params = list(module.parameters())
    return bool(params) and all(
        p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params
    )


def _trim(tokens: torch.Tensor, mask: torch.Tensor, left: bool):
    """Drop the columns that are padding in every row: on the left of left-padded prompts,
    on the right of right-padded responses (at least one column stays)."""
    used = mask.bool().any(0).nonzero()
    if left:
        first = int(used[0]) if len(used) else mask.shape[1] - 1
        return tokens[:, first:], mask[:, first:]
    end = int(used[-1]) + 1 if len(used) else 1
    return tokens[:, :end], mask[:, :end]


def _placed(values: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """Rows computed in the order `where` (row k of `values` is row where[k]), put back in
    order."""
    out = torch.empty_like(values)
    out[where] = values
    return out


def _pad_right(x: torch.Tensor, t: int, host: bool = True) -> torch.Tensor:
    x = x.cpu() if host else x
    return torch.nn.functional.pad(x, (0, t - x.shape[1])) if x.shape[1] < t else x


def _local(parameter):
    """This rank's part of a parameter (its shard under fsdp)."""
    return parameter.to_local() if hasattr(parameter, "to_local") else parameter
