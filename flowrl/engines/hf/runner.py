"""The model runner of flowrl's own engine: the one object that makes the model calls and owns
the slot cache they read and write (kv_cache.py).

The batch (slots.py) decides who sits in which slot and lays out each call: which slots, which
tokens at which columns, packed or right-padded. It hands the call to the runner and gets the
logits of each row's last token back; nothing in the runner reaches back into the batch.

    runner.reserve(slots, columns)          room for that many slots of that many columns
    runner.move(src, dst, columns)          copy slots' cached columns (swaps, prefix copies)
    runner.prefill(chunks, offsets, lo)     rows of several new ids each, right-padded
    runner.decode(tokens, offsets, lo)      one new id per row
    runner.packed(chunks, offsets, lo)      rows of any lengths in one sequence (packed.py)
    runner.drop()                           forget every row (the engine goes idle)
    runner.free()                           free the cache's memory (an offload)
    runner.decode_block(logits, block)      a runner that samples on the device: `Block`

`ModelRunner` here is the eager runner, the CPU path: a cache that grows by doubling, every
call a plain forward of the model, and the next token drawn on the host (sampling.py). The
CUDA runner (static.py) keeps the same calls over a preallocated cache, replays decode steps as
CUDA graphs and samples on the device.
"""

from __future__ import annotations

import itertools
import warnings

import attrs
import torch

from flowrl.engines.hf.kv_cache import attention_mask, slot_cache
from flowrl.engines.hf.packed import PackedCall, can_pack, groups_of, packing
from flowrl.models.calls import cache_argument


@attrs.frozen
class Block:
    """Decode steps a runner that samples on the device makes without reading anything back
    (`device_sampling`): each step samples a token for every decoding row (slots 0..d-1) from
    the pending logits and feeds it. Per row, lists of d: its stream's key (0: greedy) and
    its next draw's counter, the column of its next token, and how many tokens it may still
    sample; a row that samples `eos` or its last token is not fed (its later writes go to a
    scratch column) and its later tokens are not its own. All rows share `sampling`."""

    keys: list[int]
    counters: list[int]
    offsets: list[int]
    left: list[int]
    sampling: object  # rollout.Sampling
    logprobs: bool
    steps: int
    eos: int

    @property
    def calls(self) -> int:
        """Model calls the block makes: one per step, but none after the last when every
        row samples its last token there (nothing is left to feed)."""
        return self.steps - (max(self.left) <= self.steps)


class ModelRunner:
    """The eager runner over `module` on `device`; `pad` fills the columns a right-padded call
    writes past a row's last id (never attended to)."""

    # the next token is drawn on the host from each request's torch.Generator (sampling.py);
    # a runner that samples on the device says True and has `decode_block`
    device_sampling = False

    def __init__(self, module, device, pad: int = 0):
        self.module, self.device, self.pad = module, torch.device(device), pad
        self.cache = None
        self.packs = can_pack(module)  # decoding and joining rows in one call (packed.py)

    # -- the cache -----------------------------------------------------------------------------
    def reserve(self, slots: int, columns: int) -> None:
        """Room for `slots` rows of `columns` columns: a cache of that size at first, later at
        least doubling what grows (amortised constant copies)."""
        if self.cache is None:
            self.cache = slot_cache(self.module, slots, columns)
        else:
            self.cache.reserve(slots, columns)

    def capacity(self, columns: int) -> int | None:
        """The most slots of `columns` columns the cache can hold; None: no limit."""
        return None

    def move(self, src: list[int], dst: list[int], columns: int) -> None:
        """Copy the first `columns` columns of slots `src` onto slots `dst` (see
        `SlotCache.move`); nothing to do before the first call."""
        if self.cache is not None:
            self.cache.move(src, dst, columns)

    def drop(self) -> None:
        """Forget every row: the cache is freed."""
        self.cache = None

    def free(self) -> None:
        """Free the cache's memory (an offload of the kv_cache part)."""
        self.cache = None

    # -- the calls -----------------------------------------------------------------------------
    def prefill(self, chunks: list[list[int]], offsets: list[int], lo: int) -> torch.Tensor:
        """Row k (slot lo + k) feeds chunks[k] at columns offsets[k].., right-padded to the
        longest chunk -> the logits after each chunk's last id, float32 (a, v)."""
        w = max(len(c) for c in chunks)
        ids = torch.full((len(chunks), w), self.pad, dtype=torch.long)
        for k, chunk in enumerate(chunks):
            ids[k, : len(chunk)] = torch.tensor(chunk, dtype=torch.long)
        last = torch.tensor([len(c) - 1 for c in chunks], device=self.device)
        at = torch.tensor(offsets, dtype=torch.long, device=self.device)
        width = max(offsets) + w  # one past the last column written, known here
        return self.padded(ids.to(self.device), at, last, lo, lo + len(chunks), width)

    def decode(self, tokens: list[int], offsets: list[int], lo: int) -> torch.Tensor:
        """Row k (slot lo + k) feeds tokens[k] at column offsets[k] -> logits (a, v)."""
        ids = torch.tensor(tokens, dtype=torch.long)[:, None].to(self.device)
        at = torch.tensor(offsets, dtype=torch.long, device=self.device)
        last = torch.zeros(len(tokens), dtype=torch.long, device=self.device)
        return self.padded(ids, at, last, lo, lo + len(tokens), max(offsets) + 1)

    def padded(self, ids, offsets, last, lo: int, hi: int, width: int | None = None):
        """One model call over cache slots lo..hi-1: row k feeds ids[k] (a, w) at columns
        (= positions) offsets[k]..; -> the logits after each row's last real id, last[k]
        (a,), in float32 (a, v). `width`: the columns the call attends to (default: read
        from the device, one past the last column written)."""
        cache = self.cache
        w = ids.shape[1]
        positions = offsets[:, None] + torch.arange(w, device=ids.device)  # (a, w)
        cache.select(lo, hi, positions, width)
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

    def packed(
        self, chunks: list[list[int]], offsets: list[int], lo: int, runs: bool = False
    ) -> torch.Tensor:
        """One model call over slots lo..lo+len(chunks)-1 with their tokens packed into one
        sequence (packed.py): row k feeds chunks[k] at columns offsets[k]..; -> the logits
        after each row's last id, in float32 (a, v). `runs`: rows of one length next to each
        other attend as one group (`groups_of`)."""
        device, lengths = self.device, [len(c) for c in chunks]
        slots = [lo + k for k, n in enumerate(lengths) for _ in range(n)]
        cols = [o + j for o, n in zip(offsets, lengths, strict=True) for j in range(n)]
        ends = list(itertools.accumulate(lengths, initial=-1))[1:]  # each row's last id
        width = max(cols) + 1
        ids, slots, cols, last = (
            torch.tensor(x, device=device)
            for x in ([t for c in chunks for t in c], slots, cols, ends)
        )
        cache = self.cache
        cache.select_packed(slots, cols, lo, lo + len(chunks), width)
        call = PackedCall(cache, groups_of(lengths, offsets, lo, device, runs))
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
        return self._apart(chunks, offsets, lo, runs)

    def _apart(self, chunks, offsets, lo: int, runs: bool) -> torch.Tensor:
        """What `packed` computes, in a call per group (packed.py `groups_of`)."""
        out, k = [], 0
        for g in groups_of([len(c) for c in chunks], offsets, lo, "cpu", runs):
            rows = list(range(k, k + g.hi - g.lo))
            ids = torch.tensor([chunks[r] for r in rows], device=self.device)
            at = torch.tensor([offsets[r] for r in rows], device=self.device)
            last = torch.full((len(rows),), g.width - 1, device=self.device)
            out.append(self.padded(ids, at, last, g.lo, g.hi))
            k += len(rows)
        return torch.cat(out)
