"""The CUDA runner of flowrl's own engine: the calls of runner.py over a static slot cache,
decode steps replayed as CUDA graphs, and the next token sampled on the device.

On a GPU a decode step of a small model is Python and kernel launches, not the GPU: the eager
runner's step builds masks and index tensors, launches ~15 kernels per layer and reads every
token back to the host. Here:

- the slot cache is allocated once, from a memory budget (`memory_fraction` of the device),
  at the columns the first requests need rounded up (`COLUMN_STEP`) plus one scratch column,
  and as many slots as fit (at most `max_slots`); requests that do not fit wait (slots.py
  `fits`); a turn longer than the columns regrows it (rare: counted in `regrows`);
- a decode call pads its rows to the next size of `LADDER` and attends to a multiple of
  `WIDTH_STEP` columns; its inputs sit in static buffers, so a call is one CUDA graph replay
  (graphs.py: a width's ladder captured in one pass when the width first comes up, the step
  compiled by inductor first with `compile`). Padding rows and finished rows
  write their keys and values to the scratch column, never to a row's own columns, and their
  logits are not read;
- attention in a decode step folds the query heads that share a KV head into the query
  length (`DecodeCall`): one SDPA call per layer over the cache as it is, with no copy of
  the keys per query head (transformers' sdpa path repeats them when a mask is given);
- `decode_block` samples and feeds `Block.steps` tokens with nothing read back in between:
  uniforms from counter-based streams (sampling.py `stream_uniforms`), finished rows tracked
  on the device, one copy to the host at the end (`launch_block`: queued, read later, so
  the next block can be queued before this one is read).

Prefill stays an eager call (its shapes vary), packed without padding when the model routes
its attention (packed.py, rows of one length attending as one group). With `graphs=False`
every call runs eagerly, on any device: how the CPU tests run everything here but the capture.
A capture that fails (an operation the graph cannot hold) warns once and the runner goes on
eagerly. Graphs are dropped when the cache is reallocated or the module's parameters or
buffers move (an offload), and captured again as they come up; an offload of the kv_cache
part keeps cache and graphs where the device has room.
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F

from flowrl.engines.hf.graphs import (
    LADDER,
    GraphCapture,
    Launched,
    compiled_sampler,
    compiled_step,
)
from flowrl.engines.hf.kv_cache import SlotCache
from flowrl.engines.hf.packed import can_pack, packing
from flowrl.engines.hf.runner import Block, ModelRunner
from flowrl.engines.hf.sampling import sample_tokens, stream_uniforms
from flowrl.errors import FlowrlError
from flowrl.models.calls import cache_argument

WIDTH_STEP = 128  # a decode call attends to a multiple of this many columns
COLUMN_STEP = 256  # the cache's columns: what the first turns need, rounded up to this
LOGIT_BYTES = 12  # per slot and vocabulary entry kept out of the cache's budget: fp32 logits
# (the graphs' output), the model's own logits and sampling's temporaries


class CacheFull(FlowrlError, RuntimeError):
    """The static slot cache cannot hold what a request needs."""


def bucket(n: int, most: int, ladder=LADDER) -> int:
    """The rows a decode call of n rows runs with: the next size of the ladder, at most
    `most` (the cache's slots), at least n."""
    size = next((b for b in ladder if b >= n), n)
    return max(min(size, most), n)


def kv_shape(config) -> tuple[int, int]:
    """(KV heads, head dim) of a decoder's config."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return heads, head_dim


def column_bytes(module, dtype: torch.dtype) -> int:
    """Bytes of one cached column of one slot: keys and values of every layer."""
    heads, head_dim = kv_shape(module.config)
    itemsize = torch.tensor([], dtype=dtype).element_size()
    return 2 * module.config.num_hidden_layers * heads * head_dim * itemsize


def cache_layout(budget: int, per_column: int, columns: int, max_slots: int) -> tuple[int, int]:
    """(slots, columns) of a static cache of at most `budget` bytes holding `columns` columns
    per slot (rounded up to COLUMN_STEP), `per_column` bytes each: as many slots as fit, at
    most `max_slots`. Zero slots: the budget holds not even one."""
    columns = -(-columns // COLUMN_STEP) * COLUMN_STEP
    return min(budget // (columns * per_column), max_slots), columns


def device_budget(device: torch.device, fraction: float) -> int:
    """The slot cache's bytes: `fraction` of the memory of `device` (of a CUDA device, as
    vLLM's gpu_memory_utilization, but for the cache alone: the weights and a colocated train
    engine's state, which grows at its first step, are outside it); of the host's physical
    memory on CPU."""
    if device.type == "cuda":
        return int(fraction * torch.cuda.get_device_properties(device).total_memory)
    import os

    return int(fraction * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


class StaticSlotCache(SlotCache):
    """A slot cache whose buffers are allocated once, zeroed, at (slots, columns)."""

    def __init__(self, module, slots: int, columns: int, dtype, device):
        super().__init__(module.config.num_hidden_layers, slots, columns)
        heads, head_dim = kv_shape(module.config)
        for layer in self.layers:
            layer.dtype, layer.device = dtype, device
            for name in ("key_buffer", "value_buffer"):
                buffer = torch.zeros(slots, heads, columns, head_dim, dtype=dtype, device=device)
                setattr(layer, name, buffer)
            layer.is_initialized = True

    def reserve(self, slots: int, columns: int) -> None:
        if slots > self.slots or columns > self.columns:
            have = f"{self.slots} x {self.columns}"
            raise CacheFull(f"{slots} x {columns} past the static cache's {have}")

    def move(self, src: list[int], dst: list[int], columns: int) -> None:
        """`SlotCache.move` in one gather and one scatter per buffer for all the rows (the
        sources read out before any is written), where the slot cache's slice copies make
        two per row and layer: 48 per leaving row for Qwen2-0.5B."""
        if not src or columns <= 0:
            return
        layer = self.layers[0]
        s, d = (torch.tensor(x, device=layer.key_buffer.device) for x in (src, dst))
        for layer in self.layers:
            for buffer in (layer.key_buffer, layer.value_buffer):
                buffer[d, :, :columns] = buffer[s, :, :columns]


# attention settings the folded decode attention (DecodeCall) cannot honour: config keys
UNSUPPORTED_ATTENTION = ("attn_logit_softcapping",)


def unsupported_attention(module) -> str:
    """What of `module`'s attention the CUDA runner's decode step cannot compute, or "": logit
    softcapping (Gemma 2) or attention sinks (gpt-oss: a `sinks` parameter per layer)."""
    config = module.config
    for key in UNSUPPORTED_ATTENTION:
        if getattr(config, key, None):
            return f"{key} = {getattr(config, key)}"
    if any(name.endswith(".sinks") or name == "sinks" for name, _ in module.named_parameters()):
        return "attention sinks (a `sinks` parameter)"
    return ""


@attrs.define
class DecodeCall:
    """The attention of a decode step (one query per row) over the slot cache as it is."""

    @torch.compiler.disable  # a compiled step runs it as it is (the mask's width varies)
    def attend(self, module, query, key, value, scaling, mask=None, **kwargs):
        """query (b, h, 1, d), key and value (b, kv, w, d), mask (b, 1, 1, w) -> (b, 1, h, d).
        Query head j * g + i reads KV head j (transformers' repeat_kv), so the g query heads
        of a KV head become g queries of one head: (b, kv, g, d) against (b, kv, w, d).
        Softcapping and sinks are refused: this attention would silently leave them out."""
        if kwargs.get("softcap") or kwargs.get("s_aux") is not None:
            raise FlowrlError(
                f"{type(module).__name__} asks the attention for softcapping or sinks, which "
                "the static runner's decode step does not compute: set rollout_options.runner "
                '= "eager"'
            )
        b, h, _, d = query.shape
        kv = key.shape[1]
        q = query.reshape(b, kv, h // kv, d)  # (b, kv, g, d): one query position per row
        out = F.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scaling)
        return out.reshape(b, h, 1, d).transpose(1, 2), None  # (b, 1, h, d)


class StaticRunner(GraphCapture, ModelRunner):
    """The runner.py calls over a `StaticSlotCache` of at most `budget` bytes on `device`
    (`max_slots` slots at most); `graphs`: replay decode steps as CUDA graphs (CUDA only);
    `compile`: the decode step compiled by inductor (`compiled_step`), captured as compiled.

    Attributes:
        captured: {(rows, columns): graph} of the shapes captured so far.
        regrows: times the cache was regrown for a longer turn.
        warnings: why graphs or the compiled step were turned off, if they were.
        capture_s: seconds spent in captures (with their warm-ups and compiles).
    """

    device_sampling = True

    def __init__(
        self, module, device, pad=0, *, budget: int, graphs: bool, max_slots=512, compile=False
    ):
        super().__init__(module, device, pad)
        if not self.packs:
            raise FlowrlError(
                f"the static runner needs a model whose attention layers call transformers' "
                f'attention functions, with attn_implementation "sdpa"; '
                f'{type(module).__name__} does not: set rollout_options.runner = "eager"'
            )
        if graphs and self.device.type != "cuda":
            raise FlowrlError(
                f'rollout_options.runner = "cuda_graph" needs a CUDA device, not '
                f'{self.device}: use "static" (the same calls, eager) or "eager"'
            )
        unsupported = unsupported_attention(module)
        if unsupported:
            raise FlowrlError(
                f"the static runner's decode attention cannot compute {type(module).__name__}'s "
                f'{unsupported}: set rollout_options.runner = "eager"'
            )
        self.budget, self.graphs, self.max_slots = budget, graphs, max_slots
        self.compiled = compiled_step(self._forward) if compile else None
        self.sampler = compiled_sampler() if compile else None  # a block's sampled rows
        self.warnings: list[str] = []  # why graphs, a compiled step or sampler were turned off
        self.capture_s = 0.0  # seconds spent capturing graphs (and compiling), in all
        self.dtype = next(module.parameters()).dtype
        self.per_column = column_bytes(module, self.dtype)
        self.vocab = module.get_output_embeddings().weight.shape[0]
        self.captured: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.pool = None  # the memory pool the graphs share (they replay one at a time)
        self.weights_at = None  # the parameters' addresses the graphs were captured with
        self.regrows = 0

    # -- the cache -----------------------------------------------------------------------------
    def capacity(self, columns: int) -> int:
        if self.cache is not None and columns + 1 <= self.cache.columns:
            return self.cache.slots
        return self._layout(columns)[0]

    def _layout(self, columns: int) -> tuple[int, int]:
        budget = self.budget - self.max_slots * self.vocab * LOGIT_BYTES
        return cache_layout(budget, self.per_column, columns + 1, self.max_slots)

    def reserve(self, slots: int, columns: int) -> None:
        """Room for `slots` slots of `columns` columns (and the scratch column): the static
        cache at its first call, regrown (copied, graphs dropped) only for longer turns."""
        cache = self.cache
        if cache is not None and slots <= cache.slots and columns + 1 <= cache.columns:
            return
        room, width = self._layout(max(columns, cache.columns - 1 if cache is not None else 0))
        if room < slots:
            raise CacheFull(
                f"the rollout's slot cache holds {room} requests of {width} columns in its "
                f"budget ({self.budget / 2**30:.2f} GiB before logits), {slots} asked: raise "
                "rollout_options.memory_fraction, or shorten prompts and max_new_tokens"
            )
        new = StaticSlotCache(self.module, room, width, self.dtype, self.device)
        if cache is not None:
            self.regrows += 1
            rows = min(cache.slots, room)  # the batch's slots: fewer than `slots`
            for old, layer in zip(cache.layers, new.layers, strict=True):
                for name in ("key_buffer", "value_buffer"):
                    buffer = getattr(old, name)[:rows]
                    getattr(layer, name)[:rows, :, : buffer.shape[2]] = buffer
        self.cache = new
        self._forget_graphs()
        self.scratch = width - 1  # no request's column: padding and finished rows write here
        self.ids = torch.zeros(room, 1, dtype=torch.long, device=self.device)  # (s, 1)
        self.positions = torch.full((room, 1), self.scratch, device=self.device)  # (s, 1)
        self.out = torch.zeros(room, self.vocab, device=self.device)  # (s, v) float32
        self.columns = torch.arange(width, device=self.device)

    def drop(self) -> None:
        """Forget every row; the buffers stay allocated (and the graphs valid) for the next."""

    def free(self) -> None:
        """An offload of the kv_cache part: free the cache, the static inputs and outputs and
        the graphs (the next call allocates them again, and captures a width's ladder again
        in one pass), unless the device has room to keep them. Room: what stays free once
        they are kept is at least what they hold, as much again for the train engine's
        step (`keeps_cache`). Kept, the graphs replay at once after the reload, unless the
        weights came back at other addresses (`_check_weights`)."""
        if self.cache is not None and self.keeps_cache():
            return
        self.cache = self.ids = self.positions = self.out = self.columns = None
        self._forget_graphs()

    def held_bytes(self) -> int:
        """Bytes of the cache and the logits buffer (the graphs' pool not counted)."""
        if self.cache is None:
            return 0
        return self.cache.slots * (self.cache.columns * self.per_column + self.vocab * 4)

    def keeps_cache(self) -> bool:
        """Whether an offload keeps the cache and the graphs: a CUDA device whose free
        memory is at least what they hold."""
        if self.device.type != "cuda":
            return False
        free, _ = torch.cuda.mem_get_info(self.device)
        return free >= self.held_bytes()

    # -- the calls -----------------------------------------------------------------------------
    def prefill(self, chunks: list[list[int]], offsets: list[int], lo: int) -> torch.Tensor:
        """New ids of several rows: packed without padding when their lengths differ (rows of
        one length next to each other attend together), else right-padded."""
        if len({len(c) for c in chunks}) > 1:
            return self.packed(chunks, offsets, lo, runs=True)
        return super().prefill(chunks, offsets, lo)

    def decode(self, tokens: list[int], offsets: list[int], lo: int) -> torch.Tensor:
        """One id per row of slots lo..: a graph replay when the rows start at slot 0."""
        if lo != 0:
            return super().decode(tokens, offsets, lo)
        d = len(tokens)
        b = bucket(d, self.cache.slots)
        self._check_weights()
        self.ids[:d, 0] = torch.tensor(tokens, device=self.device)
        self.positions[:d, 0] = torch.tensor(offsets, device=self.device)
        self._pad_rows(d, b)
        self._run(b, self._width(max(offsets) + 1))
        return self.out[:d]  # a view: read before the next call

    def decode_block(self, logits: torch.Tensor, block: Block):
        """`block.steps` decode steps of slots 0..d-1 from the pending `logits` (d, v), each
        sampling every row's next token on the device and feeding it, nothing read back until
        the end. -> (tokens, logprobs): lists (steps, d) on the host, and the logits (d, v)
        after the last fed tokens (a view: read before the next call)."""
        launched = self.launch_block(logits, block)
        return (*launched.read(), launched.logits)

    def launch_block(self, logits: torch.Tensor, block: Block, done=None) -> Launched:
        """`decode_block`'s steps queued on the device, their tokens and log-probs copied to
        the host behind them, nothing waited for: `Launched.read` waits. `done` (d,) bool on
        the device: rows already finished (a block launched before the previous one is
        read, `Decoding._decode_block`), fed nowhere but the scratch column."""
        d, steps, s = len(block.keys), block.steps, block.sampling
        b = bucket(d, self.cache.slots)
        device = self.device
        keys, counters, at, left = (
            torch.tensor(x, dtype=torch.long, device=device)
            for x in (block.keys, block.counters, block.offsets, block.left)
        )
        step = torch.arange(steps, device=device)[:, None]  # (steps, 1)
        uniforms = None if s.greedy else stream_uniforms(keys, counters + step)  # (steps, d)
        tokens = torch.zeros(steps, d, dtype=torch.long, device=device)
        chosen = torch.zeros(steps, d, device=device)
        done = torch.zeros(d, dtype=torch.bool, device=device) if done is None else done
        width = self._width(max(block.offsets) + steps)
        self._check_weights()
        self._pad_rows(d, b)
        for j in range(steps):
            u = None if uniforms is None else uniforms[j]
            token, logprob = self._sample(logits, s, u, block.logprobs)
            logprob = chosen[j] if logprob is None else logprob
            tokens[j], chosen[j] = token, logprob
            if j == block.calls:  # every row has sampled its last token
                break
            done = done | (token == block.eos) | (left <= j + 1)  # not fed: written to scratch
            self.ids[:d, 0] = token
            self.positions[:d, 0] = torch.where(done, self.scratch, at + j)
            self._run(b, width)
            logits = self.out[:d]
        return Launched(torch.stack([tokens.float(), chosen]), done, logits)

    def _sample(self, logits, s, uniform, logprobs: bool):
        """One token per row of logits (d, v) on the device, nothing read back -> (tokens,
        their log-probs or None): the compiled sampler for sampled rows when there is one."""
        if self.sampler is not None and not s.greedy:
            try:
                token, logprob = self.sampler(logits, s.temperature, s.top_k, s.top_p, uniform)
                return token, logprob if logprobs else None
            except Exception as error:  # noqa: BLE001 - inductor's errors are of any kind
                self._turn_off("sampler", error)
        out = sample_tokens(
            logits, s.temperature, s.top_k, s.top_p, s.do_sample, None, logprobs, uniform,
            sync_free=True,
        )  # fmt: skip
        return out if logprobs else (out, None)

    def _pad_rows(self, d: int, b: int) -> None:
        """Rows d..b-1 of a call padded to b feed id 0 at the scratch column."""
        if b > d:
            self.ids[d:b] = 0
            self.positions[d:b] = self.scratch

    def _width(self, columns: int) -> int:
        """The columns a decode call attends to: `columns` rounded up to WIDTH_STEP."""
        return min(-(-columns // WIDTH_STEP) * WIDTH_STEP, self.cache.columns)

    def _step(self, b: int, width: int) -> None:
        """Rows 0..b-1 feed ids[:b] at positions[:b], attending to `width` columns ->
        out[:b], the float32 logits after each: the compiled step when there is one."""
        ids, positions = self.ids[:b], self.positions[:b]  # (b, 1) each
        self.cache.select(0, b, positions, width)
        mask = (self.columns[:width] <= positions)[:, None, None, :]  # (b, 1, 1, width)
        with packing(self.module, DecodeCall()):
            if self.compiled is not None:
                try:
                    self.out[:b].copy_(self.compiled(ids, mask, positions))
                    return
                except Exception as error:  # noqa: BLE001 - inductor's errors are of any kind
                    self._turn_off("compile", error)
            self.out[:b].copy_(self._forward(ids, mask, positions))

    def _forward(self, ids, mask, positions):
        """The model's decode call: ids and positions (b, 1), mask (b, 1, 1, w) -> the
        logits of each row's token (b, v), in the model's dtype. The cache's slot
        bookkeeping and the attention run uncompiled (`torch.compiler.disable` on
        SlotLayer.update and DecodeCall.attend), so a compiled step holds no Python int
        of the call's shape: one compile serves every row count and width."""
        out = self.module(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            **cache_argument(self.module, self.cache),
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1]


def make_runner(module, device, pad: int, options) -> ModelRunner:
    """The runner `options.runner` names (`flowrl.backends.HFOptions`): "auto" is the CUDA
    runner on a CUDA device for a model it can run, else the eager one."""
    device = torch.device(device)
    kind = options.runner
    if kind == "auto":
        kind = "cuda_graph" if device.type == "cuda" and can_pack(module) else "eager"
    if kind == "eager":
        return ModelRunner(module, device, pad)
    budget = device_budget(device, options.memory_fraction)
    graphs = kind == "cuda_graph"
    compile = options.compile == "on" or (options.compile == "auto" and graphs)
    return StaticRunner(
        module,
        device,
        pad,
        budget=budget,
        graphs=graphs,
        max_slots=options.max_slots,
        compile=compile,
    )
