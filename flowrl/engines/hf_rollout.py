"""The `hf` rollout backend: flowrl's own decode loop over a transformers causal LM.

Our own decode loop rather than `generate`, for three savings `generate` does not make: each
distinct prompt is prefilled once and its KV cache repeated for its n samples; a prefix that
all prompts share (the chat template's system prompt) is prefilled once for the whole batch;
rows that emit EOS leave the batch and the cache (once a quarter of the batch has finished).
Then one model call per token, sampling in torch (temperature, top-k, top-p; sampling.py). In
hybrid mode the engine shares its module with the train engine, so a weight sync is free; a
separate copy is refreshed by `sync_weights`. Exactness: greedy output equals `generate` token
for token (tests/unit/test_engines.py, tests/integration/test_embedded_model.py).

The KV cache is preallocated (kv_cache.py) and written in place. Step cost against active rows
on the 2-core CPU machine (SmolLM2-135M fp32): 1 row 65 ms, 4 rows 98, 8 rows 106, 16 rows
123, 32 rows 165 - batching samples is nearly free, and dropping finished rows saves less than
linearly, hence the 1/4 threshold below.
"""

import torch

from flowrl.engines.forward import cache_argument
from flowrl.engines.kv_cache import preallocated_cache, reserve
from flowrl.engines.sampling import sample_tokens

COMPACT_FRACTION = 0.25  # drop finished rows once this share of the active batch has finished
# a shared prompt prefix is prefilled once when that saves this many prompt tokens: below it,
# the extra model call (a read of all weights, ~65 ms for SmolLM2 on CPU) costs more
MIN_SAVED_PREFIX_TOKENS = 64


class HFRollout:
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
