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

In hybrid mode the engine shares its module with the train engine, so a weight sync is free;
a separate copy is refreshed by `sync_weights`. Exactness: greedy output equals transformers
`generate` token for token (tests/unit/test_engines.py, tests/integration/
test_embedded_model.py), and the log-probs of sampled tokens equal the train engine's
(tests/unit/test_hf_scheduler.py). Step cost against decoding rows on the 2-core CPU machine
(SmolLM2-135M fp32): 1 row 65 ms, 4 rows 98, 8 rows 106, 16 rows 123, 32 rows 165 - a step
is bound by reading the weights, so every request that can decode should be in it.
"""

from __future__ import annotations

import itertools
import warnings

import torch

from flowrl import compat
from flowrl.backends import HFOptions
from flowrl.engines.hf.kv_cache import attention_mask, slot_cache
from flowrl.engines.hf.packed import PackedCall, can_pack, groups_of, packing
from flowrl.engines.hf.scheduler import Scheduler
from flowrl.engines.rollout import Request, Result, RolloutBase
from flowrl.models.calls import cache_argument


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
        self.scheduler = Scheduler(self, self._new_cache, self.eos, self.options.lockstep)
        # decoding and joining rows in one call (packed.py); else a call each
        self.packs = can_pack(module)

    @property
    def cache(self):
        """The slot cache while requests run or are held; None when the engine is idle."""
        return self.scheduler.cache

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

    def _new_cache(self, slots: int, columns: int):
        return slot_cache(self.module, slots, columns)

    def _forward(self, ids, offsets, last, lo: int, hi: int) -> torch.Tensor:
        """One model call over cache slots lo..hi-1: row k feeds ids[k] (a, w) at columns
        (= positions) offsets[k]..; -> the logits after each row's last real id, last[k]
        (a,), in float32 (a, v)."""
        cache = self.scheduler.cache
        w = ids.shape[1]
        positions = offsets[:, None] + torch.arange(w, device=ids.device)  # (a, w)
        cache.select(lo, hi, positions)
        eager = getattr(self.module.config, "_attn_implementation", "eager") == "eager"
        dtype = next(self.module.parameters()).dtype
        # the LM head only where a next token is chosen: each row's last real id
        keep = last.unique() if w > 1 else 1  # (k,) sorted
        out = self.module(
            input_ids=ids,
            attention_mask=attention_mask(offsets, w, cache.width, dtype, eager),
            position_ids=positions,
            **cache_argument(self.module, cache),
            use_cache=True,
            logits_to_keep=keep,
        )
        if w == 1:
            return out.logits[:, -1].float()
        pick = torch.searchsorted(keep, last)  # (a,): each row's column among the kept
        return out.logits[torch.arange(len(ids), device=ids.device), pick].float()

    def _forward_packed(self, chunks: list[list[int]], offsets: list[int], lo: int):
        """One model call over slots lo..lo+len(chunks)-1 with their tokens packed into one
        sequence (packed.py): row k feeds chunks[k] at columns offsets[k]..; -> the logits
        after each row's last id, in float32 (a, v)."""
        device, lengths = self.device, [len(c) for c in chunks]
        slots = [lo + k for k, n in enumerate(lengths) for _ in range(n)]
        cols = [o + j for o, n in zip(offsets, lengths, strict=True) for j in range(n)]
        ends = list(itertools.accumulate(lengths, initial=-1))[1:]  # each row's last id
        width = max(cols) + 1
        ids, slots, cols, last = (
            torch.tensor(x, device=device)
            for x in ([t for c in chunks for t in c], slots, cols, ends)
        )
        cache = self.scheduler.cache
        cache.select_packed(slots, cols, lo, lo + len(chunks), width)
        call = PackedCall(cache, groups_of(lengths, offsets, lo, device))
        with packing(self.module, call):
            out = self.module(
                input_ids=ids[None],
                # 4D: taken as it is by the model, and not read (the groups carry the masks)
                attention_mask=torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device),
                position_ids=cols[None],
                **cache_argument(self.module, cache),
                use_cache=True,
                logits_to_keep=last,
            )
        if call.layers_seen == len(cache.layers):
            return out.logits[0].float()
        # the model's layers did not all attend here: its cache writes are at the right
        # columns, so computing the same rows unpacked overwrites them with the right values
        self.packs = False
        warnings.warn(
            f"{type(self.module).__name__} says its attention layers call transformers' "
            f"attention functions, but {call.layers_seen} of {len(cache.layers)} did: this "
            "engine no longer packs a returning request into the decode call",
            stacklevel=2,
        )
        return self._forward_apart(chunks, offsets, lo)

    def _forward_apart(self, chunks: list[list[int]], offsets: list[int], lo: int):
        """What `_forward_packed` computes, in a call per group (packed.py `groups_of`)."""
        out, k = [], 0
        for g in groups_of([len(c) for c in chunks], offsets, lo, "cpu"):
            rows = list(range(k, k + g.hi - g.lo))
            ids = torch.tensor([chunks[r] for r in rows], device=self.device)
            at = torch.tensor([offsets[r] for r in rows], device=self.device)
            last = torch.full((len(rows),), g.width - 1, device=self.device)
            out.append(self._forward(ids, at, last, g.lo, g.hi))
            k += len(rows)
        return torch.cat(out)

    def offload(self, parts: tuple[str, ...]) -> None:
        """With the kv_cache part: wait for the engine to go idle, dropping anything still
        held (and, on CUDA, return the memory). The weights are the train engine's module,
        which moves them itself."""
        if "kv_cache" in parts:
            self.scheduler.idle(drop=True)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def reload(self, parts: tuple[str, ...]) -> None:
        """Nothing to do: the next request builds the cache at the size it needs."""
