"""The `hf` rollout backend: flowrl's own continuous-batching engine over a transformers
causal LM.

It serves the request contract (flowrl/engines/rollout.py): `await generate(request)` per
conversation turn, from any number of concurrent callers. A scheduler loop (scheduler.py; on
the caller's thread when the caller is synchronous, `run`) batches every request ready to
decode into one model call per token; new requests, and requests back from their tools, join
with a prefill of their new tokens only (a request held by id keeps its earlier turns' keys
and values in its cache slot; one back while others decode rides in their decode call,
packed.py); finished requests leave at once and free their slot. What `generate` kept for
`generate`'s own savings stays: a prompt's n samples share one prefill, a prefix all new
prompts share (the chat template's system prompt) is prefilled once, and a prompt arriving
later copies the prefix another request's slot holds (slots.py).
Sampling runs in torch (temperature, top-k, top-p; sampling.py), each request from its own
stream seeded by (seed, turn).

Three parts: the scheduler (scheduler.py) runs the loop; the batch (slots.py, decoding.py)
seats requests in cache slots and lays out each model call; the model runner owns the slot
cache and makes the calls (runner.py on the CPU; on CUDA static.py's, with decode steps as
CUDA graphs and sampling on the device: `HFOptions.runner`). This class builds the runner and
the scheduler and serves the contract.

In hybrid mode the engine shares its module with the train engine, so a weight sync is free;
a separate copy is refreshed by `sync_weights`. A rollout in another dtype than the module's
(`HFOptions.dtype`: bfloat16 on CUDA by default) runs a copy of the module in that dtype, its
own weights, refreshed in place from the train engine's at each sync (no state dict, no new
tensors: CUDA graphs captured over them stay valid); it moves with the model's weights part
(an offload and a reload: the graphs are captured again). Exactness: greedy output equals
transformers `generate` token for token (tests/unit/engines/test_engines.py, tests/integration/
test_embedded_model.py), and the log-probs of sampled tokens equal the train engine's
(tests/unit/engines/hf/test_hf_scheduler.py). Step cost against decoding rows on the 2-core CPU
machine (SmolLM2-135M fp32): 1 row 65 ms, 4 rows 98, 8 rows 106, 16 rows 123, 32 rows 165 - a step
is bound by reading the weights, so every request that can decode should be in it.
"""

from __future__ import annotations

import copy

import torch

from flowrl import compat
from flowrl.backends import HFOptions
from flowrl.engines.hf.scheduler import Scheduler
from flowrl.engines.hf.static import make_runner
from flowrl.engines.host_copies import HostCopies
from flowrl.engines.rollout import Request, Result, RolloutBase
from flowrl.engines.served_weights import refresh_in_place


class HFRollout(RolloutBase):
    """Generates from a causal LM; owns only the KV cache of the requests it serves.
    Implements `flowrl.engines.rollout.RolloutBackend`.

    Args:
        module, tokenizer, device: the model, its tokenizer (eos = the stop token), a device.
        options: `flowrl.backends.HFOptions`, from `[models.<m>.rollout_options]`; with
            `lockstep` it batches bit-reproducibly (scheduler.py): no step while a held
            request is away at its tools. Off by default (it makes decoding wait for tools).
        seed, where: the contract's (each request carries its own seed; unused here).
        lockstep: the old spelling of `options=HFOptions(lockstep=...)`.

    Attributes:
        runner: the model runner (runner.py, static.py): the slot cache and the model calls.
        scheduler: the batching loop (scheduler.py); its `batch` the requests in the slots.
        view: the copy of `module` in the rollout's dtype the runner calls, or None (the
            runner calls `module` itself).
    """

    Options = HFOptions  # its record in flowrl/backends.py says where it runs and what

    def __init__(
        self, module, tokenizer, device="cpu", *, options=None, seed=0, where="", lockstep=None
    ):
        if lockstep is not None:
            compat.warn("HFRollout(lockstep=...)", "HFRollout(options=HFOptions(lockstep=...))")
            options = HFOptions(lockstep=lockstep)
        super().__init__(module, tokenizer, device, options=options, seed=seed, where=where)
        self.eos = tokenizer.eos_token_id
        dtype = rollout_dtype(self.options.dtype, self.device, module)
        self.view = None
        if dtype != next(module.parameters()).dtype:
            self.view = rollout_view(module, dtype)
        self.host = HostCopies()  # where an offloaded view waits (CUDA: page-locked)
        called = module if self.view is None else self.view
        self.runner = make_runner(called, self.device, self.eos, self.options)
        self.scheduler = Scheduler(self.runner, self.eos, self.options.lockstep)

    @property
    def lockstep(self) -> bool:
        return self.scheduler.lockstep

    @lockstep.setter
    def lockstep(self, value: bool) -> None:
        self.scheduler.lockstep = value

    async def generate(self, request: Request) -> Result:
        """Sample one turn (see `RolloutBackend.generate`)."""
        return await self.scheduler.submit(request)

    def run(self, coroutine):
        """Run `coroutine` (requests to this engine) from synchronous code, the model calls on
        this thread (`Scheduler.drive`)."""
        return self.scheduler.drive(coroutine)

    def release(self, request_id: str) -> None:
        """Free the cache slot held for `request_id` (a running request ends "abort")."""
        self.scheduler.release(request_id)

    def idle(self) -> None:
        """Wait until no request runs or is held and the cache is freed (tests, offload)."""
        self.scheduler.idle()

    def sync_weights(self, source) -> None:
        """Take the weights of `source`: into the view in place (cast to its dtype), or into
        the module unless it is `source` itself."""
        if self.view is None:
            super().sync_weights(source)
        else:
            self.weights_version += 1
            refresh_in_place(self.view, source)

    def offload(self, parts: tuple[str, ...]) -> None:
        """With the kv_cache part: wait for the engine to go idle, dropping anything still
        held, and free the cache (on CUDA, return the memory). With the weights part, the
        view's weights move to the host; the module's are the train engine's, which moves
        them itself."""
        if "kv_cache" in parts:
            self.scheduler.idle(drop=True)
            self.runner.free()
        if "weights" in parts and self.view is not None:
            self._move_view("cpu")
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def reload(self, parts: tuple[str, ...]) -> None:
        """The view's weights back on the device; the next request builds the cache."""
        if "weights" in parts and self.view is not None:
            self._move_view(self.device)

    def _move_view(self, device) -> None:
        for i, p in enumerate(self.view.parameters()):
            p.data = self.host.move(("view", i), p.data, device)
        self.host.wait()


def rollout_view(module, dtype: torch.dtype):
    """A copy of `module` in `dtype`, for inference, but for RoPE's frequency buffers
    (`*inv_freq`), kept in float32 as the model computes its rotary angles in float32:
    rounded to bf16 they would be off by up to 0.4%."""
    view = copy.deepcopy(module).to(dtype).requires_grad_(False).eval()
    for name, buffer in module.named_buffers():
        if name.endswith("inv_freq") and buffer.is_floating_point():
            owner, _, leaf = name.rpartition(".")
            target = view.get_submodule(owner) if owner else view
            target._buffers[leaf] = buffer.detach().to(torch.float32, copy=True)
    return view


def rollout_dtype(name: str, device: torch.device, module) -> torch.dtype:
    """The dtype the rollout computes in: `HFOptions.dtype`, "auto" being bfloat16 on CUDA
    and the module's own elsewhere."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else next(module.parameters()).dtype
    return getattr(torch, name)
