"""The rollout path before the request contract, kept for side-by-side benchmarks only: the
lockstep wave driver (all requests advance one turn at a time), its KV-cache turn backend, and
the batch decode loop where every row decodes until the longest is done (finished rows leave
once a quarter of the batch has finished). Reconstructed verbatim from flowrl at commit
617399a (flowrl/engines/hf/engine.py, wave_rollout.py, kv_cache.py, flowrl/agent/driver.py);
the product path is flowrl/engines/hf/scheduler.py. Not imported by flowrl.
"""

# ruff: noqa: E501

import asyncio
import time

import attrs
import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer

from flowrl.engines.hf.sampling import sample_tokens
from flowrl.models.calls import cache_argument


# -- kv_cache.py ------------------------------------------------------------------------------
class PreallocatedLayer(DynamicLayer):
    """One layer's keys and values in buffers (rows, kv heads, capacity, head dim) allocated at
    the first update; later updates write their positions in place and `keys` / `values` are
    views of the filled part. Rows can be repeated (n samples of a prompt) and dropped
    (finished rows), as in DynamicLayer."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity, self.length = capacity, 0

    def update(self, key_states, value_states, *args, **kwargs):
        new = key_states.shape[-2]
        if not self.is_initialized:
            self.dtype, self.device = key_states.dtype, key_states.device
            # keys and values may differ in heads or head size (e.g. multi-head latent attention)
            self.key_buffer = key_states.new_empty(
                *key_states.shape[:2], self.capacity, key_states.shape[-1]
            )
            self.value_buffer = value_states.new_empty(
                *value_states.shape[:2], self.capacity, value_states.shape[-1]
            )
            self.is_initialized = True
        if self.length + new > self.capacity:
            raise RuntimeError(f"KV cache of {self.capacity} positions overflowed")
        self.key_buffer[:, :, self.length : self.length + new] = key_states
        self.value_buffer[:, :, self.length : self.length + new] = value_states
        self.length += new
        self._views()
        return self.keys, self.values

    def _views(self) -> None:
        self.keys = self.key_buffer[:, :, : self.length]
        self.values = self.value_buffer[:, :, : self.length]

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.capacity

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.length:
            self.key_buffer = self.key_buffer.repeat_interleave(repeats, dim=0)
            self.value_buffer = self.value_buffer.repeat_interleave(repeats, dim=0)
            self._views()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.length:
            self.key_buffer = self.key_buffer[indices]
            self.value_buffer = self.value_buffer[indices]
            self._views()

    def grow(self, capacity: int) -> None:
        """Make room for `capacity` positions, keeping the filled ones (a multi-turn rollout
        appends tool output whose length is known only when the tools have answered)."""
        if capacity <= self.capacity:
            return
        self.capacity = capacity
        if self.is_initialized:
            for name in ("key_buffer", "value_buffer"):
                old = getattr(self, name)
                new = old.new_empty(*old.shape[:2], capacity, old.shape[-1])
                new[:, :, : self.length] = old[:, :, : self.length]
                setattr(self, name, new)
            self._views()

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("the rollout engine never crops its cache")


def reserve(cache: Cache, positions: int) -> None:
    """Grow every preallocated layer of `cache` to hold `positions` (at least doubling, so
    appending in steps costs amortised constant copies); a DynamicCache grows by itself."""
    for layer in getattr(cache, "layers", ()):
        if isinstance(layer, PreallocatedLayer) and positions > layer.capacity:
            layer.grow(max(positions, 2 * layer.capacity))


def preallocated_cache(module, capacity: int) -> Cache:
    """A cache of PreallocatedLayers for `module`, or a DynamicCache for models with layers
    that are not full attention (sliding windows, linear attention): their caches differ."""
    config = getattr(module, "config", None)
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    layers = getattr(config, "num_hidden_layers", None)
    if kinds != {"full_attention"} or not layers:
        return DynamicCache(config=config)
    return Cache(layers=[PreallocatedLayer(capacity) for _ in range(layers)])


# -- hf_rollout.py ----------------------------------------------------------------------------
COMPACT_FRACTION = 0.25  # drop finished rows once this share of the active batch has finished
# a shared prompt prefix is prefilled once when that saves this many prompt tokens: below it,
# the extra model call (a read of all weights, ~65 ms for SmolLM2 on CPU) costs more
MIN_SAVED_PREFIX_TOKENS = 64


class LegacyRollout:
    """Generates responses from a causal LM; owns only the (transient) KV cache. Implements
    `flowrl.engines.rollout.RolloutBackend`."""

    def __init__(self, module, tokenizer, device="cpu"):
        self.module, self.tokenizer, self.device = module, tokenizer, torch.device(device)
        self.eos = tokenizer.eos_token_id
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos
        self.cache = None  # lives only inside generate; `offload` drops a leftover one

    def generate(
        self,
        prompts: torch.Tensor,
        prompt_mask: torch.Tensor,
        *,
        n: int = 1,
        max_new_tokens: int = 32,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        do_sample: bool = True,
        generator: torch.Generator | None = None,
        logprobs: bool = False,
    ) -> dict:
        """Sample n responses per prompt.

        Args:
            prompts: (b, p) int64 token ids, left-padded.
            prompt_mask: (b, p) 1 for real tokens, 0 for padding.
            n: samples per prompt; rows come back interleaved (prompt 0's n samples first).
            generator: a CPU generator for sampling (on CUDA, one on the device).
            logprobs: also return each sampled token's log-prob (see `sample_tokens`).

        Returns:
            {"responses": (b*n, t) int64 right-padded with the pad id, "response_mask":
            (b*n, t) int64 covering each response up to and including its first EOS}, t the
            longest response in the batch; with `logprobs`, "logprobs": (b*n, t) float32, 0
            past each response. Ordinary tensors (made outside inference mode), so a train
            engine may use them directly.
        """
        sampling = (temperature, top_k, top_p, do_sample, generator)
        with torch.inference_mode():
            out = self._generate(prompts, prompt_mask, n, max_new_tokens, sampling, logprobs)
        return {key: value.clone() for key, value in out.items()}

    def _generate(self, prompts, prompt_mask, n: int, max_new_tokens: int, sampling, logprobs):
        rows = prompts.shape[0] * n
        if rows == 0 or max_new_tokens <= 0:
            empty = torch.zeros(rows, 0, dtype=torch.long)
            out = {"responses": empty, "response_mask": empty.clone()}
            return {**out, "logprobs": torch.zeros(rows, 0)} if logprobs else out
        logits, mask = self.prefill(prompts, prompt_mask, n, max_new_tokens)  # (r, v)
        position = mask.sum(-1, keepdim=True)  # (r, 1): positions count real tokens from 0
        out = self._decode(logits, mask, position, max_new_tokens, sampling, logprobs)
        self.release()
        return out

    # -- the cache, step by step: `generate` and the multi-turn loop (wave_rollout.py) -------
    def prefill(self, prompts, prompt_mask, n: int, reserve_tokens: int):
        """Open a cache and fill it with the prompts, each sampled n times.

        Args:
            prompts: (b, p) int64 token ids, left-padded; prompt_mask: (b, p).
            n: rows per prompt; rows are interleaved (prompt 0's n rows first).
            reserve_tokens: cache room beyond the prompts (`extend` grows it when needed).

        Returns:
            (next-token logits (b*n, v) float32, the mask of the cache's columns (b*n, c)).
        """
        with torch.inference_mode():
            ids, mask = _trim_left(prompts, prompt_mask)
            self.cache = preallocated_cache(self.module, ids.shape[1] + reserve_tokens)
            logits, mask = self._prefill(ids.to(self.device), mask.to(self.device))  # (b, v)
            if n > 1:  # a prompt's n samples share its keys and values
                self.cache.batch_repeat_interleave(n)
                logits, mask = logits.repeat_interleave(n, 0), mask.repeat_interleave(n, 0)
        return logits, mask

    def extend(self, ids, mask, positions) -> torch.Tensor:
        """Feed ids (r, L) at positions (r, L) into the open cache, whose columns with these
        are mask (r, c); the cache grows to c columns first. -> next-token logits (r, v)."""
        with torch.inference_mode():
            reserve(self.cache, mask.shape[1])
            return self._forward(ids, mask, positions)

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep only the cache rows at indices `rows` (r',) int64, in that order."""
        self.cache.batch_select_indices(rows)

    def release(self) -> None:
        """Drop the open cache."""
        self.cache = None

    def _prefill(self, ids, mask):
        """Fill the cache with the b distinct prompts: (last logits (b, v), the mask of the
        cache's columns). A prefix that every prompt shares (the chat template's system
        prompt, a task's preamble) runs once, for one row; each row's cache then reads
        [prefix | padding | rest of its prompt], which the attention mask and position ids
        (counting real tokens) make equivalent to the left-padded layout."""
        shared = _shared_prefix(ids, mask)
        # worth the extra model call (one more read of the weights) only for enough tokens
        if (len(ids) - 1) * shared < MIN_SAVED_PREFIX_TOKENS:
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            return self._forward(ids, mask, positions), mask
        pads = (1 - mask).sum(-1, keepdim=True)  # (b, 1)
        column = torch.arange(ids.shape[1], device=ids.device)[None]  # (1, p)
        order = torch.where(
            column < shared,
            column + pads,
            torch.where(column < shared + pads, column - shared, column),
        )  # (b, p): prefix, then the padding, then the rest
        ids, mask = ids.gather(1, order), mask.gather(1, order)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        self._forward(ids[:1, :shared], mask[:1, :shared], positions[:1, :shared])
        self.cache.batch_repeat_interleave(len(ids))
        return self._forward(ids[:, shared:], mask, positions[:, shared:]), mask

    def _decode(self, logits, mask, position, max_new_tokens: int, sampling, logprobs) -> dict:
        """The token loop from the prefill's last logits (r, v); position (r, 1) is the next."""
        rows = logits.shape[0]
        out = torch.full((rows, max_new_tokens), self.pad, dtype=torch.long, device=self.device)
        token_logprobs = torch.zeros(rows, max_new_tokens, device=self.device) if logprobs else None
        lengths = torch.zeros(rows, dtype=torch.long, device=self.device)
        active = torch.arange(rows, device=self.device)  # output row of each batch row
        done = torch.zeros(rows, dtype=torch.bool, device=self.device)
        for step in range(max_new_tokens):
            live = ~done
            token = sample_tokens(logits, *sampling, with_logprobs=logprobs)
            if logprobs:
                token, chosen = token
                token_logprobs[active, step] = chosen.masked_fill(done, 0.0)
            token = token.masked_fill(done, self.pad)  # (a,)
            out[active, step] = token
            lengths[active] += live.long()
            done = done | (token == self.eos)
            finished = int(done.sum())  # one host sync per step, as any EOS check needs
            if step == max_new_tokens - 1 or finished == len(done):
                break
            if finished >= max(1.0, COMPACT_FRACTION * len(done)):  # finished rows leave
                keep = (~done).nonzero().squeeze(-1)
                self.cache.batch_select_indices(keep)
                active, token, position = active[keep], token[keep], position[keep]
                mask, done = mask[keep], done[keep]
            mask = torch.cat([mask, mask.new_ones(len(mask), 1)], dim=1)
            logits = self._forward(token[:, None], mask, position)
            position = position + 1
        t = int(lengths.max())
        response_mask = torch.arange(t, device=self.device)[None, :] < lengths[:, None]
        result = {"responses": out[:, :t].cpu(), "response_mask": response_mask.long().cpu()}
        if logprobs:
            result["logprobs"] = (token_logprobs[:, :t] * response_mask).float().cpu()
        return result

    def _forward(self, ids, mask, positions) -> torch.Tensor:
        """One cached model call -> logits (a, v) of the last position, in float32."""
        out = self.module(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            **cache_argument(self.module, self.cache),
            use_cache=True,
            logits_to_keep=1,  # the LM head only where the next token is chosen
        )
        return out.logits[:, -1].float()

    def offload(self, parts: tuple[str, ...]) -> None:
        """With the kv_cache part: drop any cache (and, on CUDA, return its memory). The
        weights are the train engine's module, which moves them itself."""
        if "kv_cache" in parts:
            self.cache = None
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def reload(self, parts: tuple[str, ...]) -> None:
        """Nothing to do: the next `generate` builds the cache at the size it needs."""

    def sync_weights(self, source: torch.nn.Module) -> None:
        """Copy trained weights in, unless this engine already shares the module."""
        if source is not self.module:
            self.module.load_state_dict(source.state_dict())


def _shared_prefix(ids: torch.Tensor, mask: torch.Tensor) -> int:
    """How many leading real tokens all left-padded prompts (b, p) share, leaving each row at
    least one token of its own (its last position gives the first logits)."""
    lengths = mask.sum(-1)  # (b,)
    shortest = int(lengths.min())
    if len(ids) < 2 or shortest < 2:
        return 0
    start = ids.shape[1] - lengths  # each row's first real column
    offsets = torch.arange(shortest - 1, device=ids.device)
    aligned = ids.gather(1, start[:, None] + offsets[None])  # (b, shortest - 1)
    same = (aligned == aligned[:1]).all(0)
    return int(same.long().cumprod(0).sum())


def _trim_left(prompts: torch.Tensor, prompt_mask: torch.Tensor):
    """Drop the left columns that are padding in every row (they cost prefill compute)."""
    used = prompt_mask.bool().any(0).nonzero()
    first = int(used[0]) if len(used) else prompt_mask.shape[1] - 1
    return prompts[:, first:], prompt_mask[:, first:]


# -- wave_rollout.py --------------------------------------------------------------------------
class WaveRollout:
    """A `flowrl.agent.driver.TurnBackend` over a rollout backend with the step-by-step cache
    API (`HFRollout`: prefill, extend, keep_rows, release): `start` prefills, each `turn`
    appends and decodes, `close` drops the cache."""

    def __init__(
        self,
        rollout,
        *,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        do_sample=True,
        generator=None,
        first_turn: list[int] = (),
    ):
        if not all(hasattr(rollout, m) for m in ("prefill", "extend", "keep_rows", "release")):
            raise TypeError(
                f'multi-turn rollouts need a backend with prefill/extend (rollout = "hf"), '
                f"not {type(rollout).__name__}"
            )
        self.rollout, self.device = rollout, rollout.device
        self.eos, self.pad = rollout.eos, rollout.pad
        self.sampling = (temperature, top_k, top_p, do_sample, generator)
        self.temperature = temperature if do_sample and temperature > 0 else 1.0
        # ids every request's first turn is made of (the agent's script_first_turn): decoded
        # as forced tokens, each with the policy's own log-prob of it
        self.first_turn = list(first_turn)
        self.had_turn: set[int] = set()

    def start(self, prompts: torch.Tensor, prompt_mask: torch.Tensor, n: int, reserve_tokens: int):
        """Prefill prompts (b, p) left-padded with prompt_mask (b, p); rows are then the b * n
        requests, interleaved (prompt 0's n samples first). `reserve_tokens`: cache room
        beyond the prompts (it grows when a turn needs more)."""
        logits, mask = self.rollout.prefill(prompts, prompt_mask, n, reserve_tokens)
        self.logits, self.mask = logits, mask  # (r, v) next-token logits, (r, columns)
        self.position = mask.sum(-1)  # (r,) the next position: real tokens so far
        self.rows = list(range(len(logits)))  # the request of each cache row
        self.pending = [[] for _ in self.rows]  # sampled, not yet fed (each turn's last token)

    def turn(self, rows: list[int], append: list[list[int]], limits: list[int]):
        """See `TurnBackend.turn`: [(ids, log-probs)] per row of `rows`."""
        with torch.inference_mode():
            self._select(rows)
            self._extend([self.pending[k] + list(extra) for k, extra in enumerate(append)])
            forced = [self.first_turn if i not in self.had_turn else [] for i in rows]
            self.had_turn.update(rows)
            return self._decode(limits, forced)

    def close(self) -> None:
        self.rollout.release()

    # -- the three steps of a turn -----------------------------------------------------------
    def _select(self, rows: list[int]) -> None:
        """Keep the cache rows of `rows` (a subsequence of the current rows), in order."""
        if rows == self.rows:
            return
        where = {request: k for k, request in enumerate(self.rows)}
        keep = torch.tensor([where[i] for i in rows], dtype=torch.long, device=self.device)
        self.rollout.keep_rows(keep)
        self.logits, self.mask, self.position = (
            self.logits[keep],
            self.mask[keep],
            self.position[keep],
        )
        self.pending = [self.pending[where[i]] for i in rows]
        self.rows = list(rows)

    def _extend(self, chunks: list[list[int]]) -> None:
        """One forward over every row's new ids, left-padded to the longest (r, L)."""
        width = max((len(c) for c in chunks), default=0)
        if width == 0:
            return
        r = len(chunks)
        ids = torch.full((r, width), self.pad, dtype=torch.long)
        new = torch.zeros((r, width), dtype=torch.long)
        for k, chunk in enumerate(chunks):
            if chunk:
                ids[k, width - len(chunk) :] = torch.tensor(chunk)
                new[k, width - len(chunk) :] = 1
        ids, new = ids.to(self.device), new.to(self.device)
        positions = self.position[:, None] + (new.cumsum(-1) - 1).clamp(min=0)  # (r, L)
        self.mask = torch.cat([self.mask, new], dim=1)
        logits = self.rollout.extend(ids, self.mask, positions)  # (r, v)
        fed = new.any(-1, keepdim=True)  # a row with nothing new keeps its logits
        self.logits = torch.where(fed, logits, self.logits)
        self.position = self.position + new.sum(-1)
        self.pending = [[] for _ in chunks]

    def _decode(self, limits: list[int], forced=None) -> list[tuple[list[int], list[float]]]:
        r = len(limits)
        limit = torch.tensor(limits, dtype=torch.long, device=self.device)
        steps = max(limits, default=0)
        script, scripted = _forced(forced or [[]] * r, self.device)  # (r, f), (r,)
        tokens = torch.full((r, max(steps, 0)), self.pad, dtype=torch.long, device=self.device)
        logprobs = torch.zeros((r, max(steps, 0)), device=self.device)
        lengths = torch.zeros(r, dtype=torch.long, device=self.device)
        done = limit <= 0
        logits = self.logits
        for step in range(steps):
            live = ~done
            token = sample_tokens(logits, *self.sampling)  # (r,)
            if step < script.shape[1]:  # a forced turn takes its ids, sampled or not
                token = torch.where(step < scripted, script[:, step], token)
            logprob = torch.log_softmax(logits / self.temperature, -1)
            logprob = logprob.gather(-1, token[:, None]).squeeze(-1)  # (r,)
            tokens[:, step] = torch.where(live, token, self.pad)
            logprobs[:, step] = torch.where(live, logprob, 0.0)
            lengths += live.long()
            ends = live & ((token == self.eos) | (lengths >= limit))  # kept pending, not fed
            done = done | ends
            if bool(done.all()):  # one host sync per step, as any eos check needs
                break
            feed = live & ~ends  # (r,)
            self.mask = torch.cat([self.mask, feed.long()[:, None]], dim=1)
            logits = self.rollout.extend(
                token.masked_fill(~feed, self.pad)[:, None], self.mask, self.position[:, None]
            )
            self.position = self.position + feed.long()
        out = []
        for k, length in enumerate(lengths.tolist()):
            ids = tokens[k, :length].tolist()
            out.append((ids, logprobs[k, :length].tolist()))
            self.pending[k] = ids[-1:]
        return out


def _forced(forced: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's forced ids, right-padded (r, f), and how many each has (r,)."""
    width = max((len(f) for f in forced), default=0)
    script = torch.zeros((len(forced), width), dtype=torch.long)
    for k, ids in enumerate(forced):
        script[k, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    lengths = torch.tensor([len(f) for f in forced], dtype=torch.long)
    return script.to(device), lengths.to(device)


# -- agent/driver.py --------------------------------------------------------------------------
@attrs.define
class WaveStats:
    waves: int = 0
    decode_s: float = 0.0  # wall time inside the engine
    tools_s: float = 0.0  # wall time running tools and interactions
    phases: list = attrs.Factory(list)  # ("decode" | "tools", start, end) in epoch seconds

    def add(self, kind: str, start: float) -> None:
        """Record a phase that began at `start` (time.time()) and ends now."""
        end = time.time()
        self.phases.append((kind, start, end))
        if kind == "decode":
            self.decode_s += end - start
        else:
            self.tools_s += end - start


async def run_waves(episodes: list, backend) -> WaveStats:
    """Run `episodes` (episode.Episode) to the end on `backend`; nothing a request does
    raises here, only the engine's own errors do."""
    stats = WaveStats()
    start = time.time()
    await asyncio.gather(*(episode.start() for episode in episodes))
    stats.add("tools", start)
    active = [i for i, episode in enumerate(episodes) if not episode.done]
    append = {i: [] for i in active}
    while active:
        stats.waves += 1
        start = time.time()
        limits = [episodes[i].turn_limit() for i in active]
        turns = backend.turn(active, [append[i] for i in active], limits)
        stats.add("decode", start)
        for i, (ids, logprobs) in zip(active, turns, strict=True):
            episodes[i].on_turn(ids, logprobs)
        start = time.time()
        waiting = [i for i in active if not episodes[i].done]
        observations = await asyncio.gather(*(episodes[i].advance() for i in waiting))
        append = dict(zip(waiting, observations, strict=True))
        active = [i for i in waiting if not episodes[i].done]
        if waiting:
            stats.add("tools", start)
    start = time.time()
    await asyncio.gather(*(episode.finish() for episode in episodes))
    stats.add("tools", start)
    return stats
