"""A KV cache of slots for the continuous-batching engine (scheduler.py): one row per request.

Each layer keeps one buffer (slots, kv heads, capacity, head dim) for keys and one for values.
A request owns a slot; its tokens fill the slot's columns 0..len-1 in order, with no padding
anywhere, so a token's column is its position. A model call covers a contiguous range of slots
(`select`), and each row writes its new tokens at its own offset (`cols`): a row joining with
new tokens and a row decoding one token can sit side by side without holes. The attention
mask a call needs is 4D (per row and query: the columns up to the query's own), which
transformers takes as it is (masking_utils: "already prepared, or custom").

Buffers start zeroed: a masked column is multiplied by an attention weight of exactly 0, and
0 * NaN (uninitialised memory) would still be NaN. Columns past a row's length hold stale but
finite values (an earlier request's, or the padding of a call), never attended to.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer


class SlotLayer(DynamicLayer):
    """One layer's keys and values in slot buffers, allocated at the first update with the
    cache's current slot and column counts."""

    def __init__(self, cache: SlotCache):
        super().__init__()
        self.owner = cache

    def update(self, key_states, value_states, *args, **kwargs):
        """key_states (a, h, w, d) of the selected slots -> (keys, values) (a, h, width, d)."""
        c = self.owner
        if not self.is_initialized:
            self.dtype, self.device = key_states.dtype, key_states.device
            self.key_buffer = key_states.new_zeros(
                c.slots, key_states.shape[1], c.columns, key_states.shape[-1]
            )
            self.value_buffer = value_states.new_zeros(
                c.slots, value_states.shape[1], c.columns, value_states.shape[-1]
            )
            self.is_initialized = True
        if c.packed is not None:  # one sequence (1, h, t, d), token j for slot rows[j]
            rows, cols = c.packed  # (t,), (t,); the attention reads the buffers (packed.py)
            self.key_buffer[rows, :, cols] = key_states[0].transpose(0, 1)
            self.value_buffer[rows, :, cols] = value_states[0].transpose(0, 1)
            return key_states, value_states
        rows = torch.arange(c.lo, c.hi, device=key_states.device)[:, None]  # (a, 1)
        # advanced indices on dims 0 and 2 around a slice put them first: (a, w, h, d)
        self.key_buffer[rows, :, c.cols] = key_states.transpose(1, 2)
        self.value_buffer[rows, :, c.cols] = value_states.transpose(1, 2)
        self.keys = self.key_buffer[c.lo : c.hi, :, : c.width]
        self.values = self.value_buffer[c.lo : c.hi, :, : c.width]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.owner.width

    def get_max_length(self) -> int:
        return self.owner.columns

    def resize(self, slots: int, columns: int) -> None:
        """New zeroed buffers of (slots, ..., columns) holding the old contents."""
        if not self.is_initialized:
            return
        for name in ("key_buffer", "value_buffer"):
            old = getattr(self, name)
            new = old.new_zeros(slots, old.shape[1], columns, old.shape[-1])
            new[: old.shape[0], :, : old.shape[2]] = old
            setattr(self, name, new)

    def move_rows(self, src: list[int], dst: list[int], columns: int) -> None:
        """Copy rows `src` onto rows `dst`, their first `columns` columns: a source that is
        also a destination is read out before any row is written. Plain slice copies: an
        assignment through index tensors gathers into a temporary and scatters, 2-3x slower
        for SmolLM2's rows on one CPU thread (a swap of two rows of 150 columns in all 30
        layers: 7-9 ms against 3-6 ms)."""
        written = set(dst)
        for buffer in (self.key_buffer, self.value_buffer):
            rows = [
                buffer[s, :, :columns].clone() if s in written else buffer[s, :, :columns]
                for s in src
            ]
            for d, row in zip(dst, rows, strict=True):
                buffer[d, :, :columns] = row

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("the slot cache is rewound per row, by its offsets")


class SlotCache(Cache):
    """Slot buffers for every layer, and what the next model call reads and writes:
    slots lo..hi-1, each writing its tokens at the columns `cols` (a, w), and attending to
    the first `width` columns."""

    def __init__(self, num_layers: int, slots: int, columns: int):
        self.slots, self.columns = slots, columns
        self.lo = self.hi = self.width = 0
        self.cols = None
        self.packed = None  # (slots, columns) of each token of a packed call (select_packed)
        super().__init__(layers=[SlotLayer(self) for _ in range(num_layers)])

    @torch.compiler.disable  # a compiled decode step (static.py) runs it as it is: its
    # slots, widths and layer index are Python ints a compiled graph would be specialised on
    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """The layer's `SlotLayer.update`."""
        return self.layers[layer_idx].update(key_states, value_states, *args, **kwargs)

    def select(self, lo: int, hi: int, cols: torch.Tensor, width: int | None = None) -> None:
        """The next call covers slots lo..hi-1, row k writing at columns cols[k] (a, w) and
        attending to the first `width` columns (default: one past the last written, read
        from the device)."""
        self.lo, self.hi, self.cols, self.packed = lo, hi, cols, None
        self.width = int(cols.max()) + 1 if width is None else width

    def select_packed(self, slots, cols, lo: int, hi: int, width: int) -> None:
        """The next call is one packed sequence (packed.py): token j writes slot slots[j] at
        column cols[j] ((t,) each), within slots lo..hi-1 and the first `width` columns."""
        self.packed = (slots, cols)
        self.lo, self.hi, self.width = lo, hi, width

    def reserve(self, slots: int, columns: int) -> None:
        """Room for `slots` rows of `columns` columns, at least doubling what grows, so that
        growing step by step costs amortised constant copies."""
        if slots <= self.slots and columns <= self.columns:
            return
        if slots > self.slots:
            self.slots = max(slots, 2 * self.slots)
        if columns > self.columns:
            self.columns = max(columns, 2 * self.columns)
        for layer in self.layers:
            layer.resize(self.slots, self.columns)

    def move(self, src: list[int], dst: list[int], columns: int) -> None:
        """Copy the first `columns` columns of slots `src` onto slots `dst` (a swap when
        dst is src reversed: the right-hand side is read before it is written)."""
        if not src or columns <= 0 or not self.layers[0].is_initialized:
            return
        for layer in self.layers:
            layer.move_rows(src, dst, columns)


def attention_mask(offsets: torch.Tensor, w: int, width: int, dtype, eager: bool):
    """The 4D mask of a call: row k's query j sits at column offsets[k] + j and sees the
    columns up to its own (earlier tokens of the row, all real). (a, 1, w, width): bool for
    SDPA (True = attend), additive float for eager attention."""
    query = offsets[:, None] + torch.arange(w, device=offsets.device)  # (a, w)
    column = torch.arange(width, device=offsets.device)
    allowed = column[None, None, :] <= query[:, :, None]  # (a, w, width)
    if not eager:
        return allowed[:, None]
    zero = torch.zeros((), dtype=dtype, device=offsets.device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)[:, None]


def slot_cache(module, slots: int, columns: int) -> SlotCache:
    """A slot cache for `module`, which must have full attention in every layer (a sliding
    window or linear attention needs another cache and mask) and an attention implementation
    that takes a 4D mask (sdpa, eager)."""
    config = module.config
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"}:
        raise NotImplementedError(
            f"the hf rollout backend batches requests of full-attention models only; "
            f"{type(module).__name__} has layers {sorted(kinds)}"
        )
    implementation = getattr(config, "_attn_implementation", None) or "eager"
    if implementation not in ("sdpa", "eager"):
        raise NotImplementedError(
            f'the hf rollout backend needs attn_implementation "sdpa" or "eager" (a 4D '
            f'mask per request), not "{implementation}"'
        )
    return SlotCache(config.num_hidden_layers, slots, columns)
