"""The rollout engine: sampling with a KV cache, n samples per prompt, stop at EOS.

Our own decode loop rather than `generate`: one prefill of the (left-padded) prompts, then one
model call per token. Rows that emit EOS leave the batch (and the KV cache) at once, so a step
costs only the rows still generating. In hybrid mode the engine shares its module with the
train engine, so a weight sync is free; a separate copy is refreshed by `sync_weights`.
"""

import time

import torch
from transformers import DynamicCache


class RolloutEngine:
    def __init__(self, module, tokenizer, device: str = "cpu"):
        self.module, self.tokenizer, self.device = module, tokenizer, device
        self.eos = tokenizer.eos_token_id
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos
        self.cache = None
        self.last_seconds = 0.0

    @torch.no_grad()
    def generate(
        self,
        prompts,
        prompt_mask,
        *,
        n: int = 1,
        max_new_tokens: int = 32,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        do_sample: bool = True,
        generator: torch.Generator | None = None,
    ) -> dict:
        """prompts, prompt_mask (b, p) left-padded -> responses, response_mask (b*n, t).

        Samples are interleaved (prompt 0's n samples first). The mask covers the response up
        to and including the first EOS; t is the longest response in the batch.
        """
        start = time.time()
        ids = prompts.repeat_interleave(n, 0).to(self.device)  # (r, p), r = b * n
        mask = prompt_mask.repeat_interleave(n, 0).to(self.device)
        rows = ids.shape[0]
        out = torch.full((rows, max(max_new_tokens, 1)), self.pad, dtype=torch.long)
        lengths = torch.zeros(rows, dtype=torch.long)
        if rows == 0 or max_new_tokens == 0:
            return {"responses": out[:, :0], "response_mask": out[:, :0]}
        self.cache = DynamicCache()
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = self._forward(ids, mask, positions)
        active = torch.arange(rows)  # output rows still generating
        next_position = positions[:, -1] + 1
        for step in range(max_new_tokens):
            token = _pick(logits, temperature, top_k, top_p, do_sample, generator)  # (a,)
            out[active, step] = token.cpu()
            lengths[active] = step + 1
            alive = token != self.eos
            if step == max_new_tokens - 1 or not alive.any():
                break
            if not alive.all():  # finished rows leave the batch and the cache
                keep = alive.nonzero().squeeze(-1)
                active, token, mask = active[keep.cpu()], token[keep], mask[keep]
                next_position = next_position[keep]
                for layer in self.cache.layers:
                    layer.batch_select_indices(keep)
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
            logits = self._forward(token[:, None], mask, next_position[:, None])
            next_position = next_position + 1
        self.cache = None
        t = int(lengths.max())
        response_mask = (torch.arange(t)[None, :] < lengths[:, None]).long()
        self.last_seconds = time.time() - start
        return {"responses": out[:, :t], "response_mask": response_mask}

    def _forward(self, ids, mask, positions) -> torch.Tensor:
        out = self.module(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1].float()  # (a, v)

    def offload(self) -> None:
        self.cache = None  # the KV cache lives only during generate; nothing to keep

    def reload(self) -> None:
        pass

    def sync_weights(self, source: torch.nn.Module) -> None:
        """Copy trained weights in, unless this engine already shares the module."""
        if source is not self.module:
            self.module.load_state_dict(source.state_dict())


def _pick(logits, temperature, top_k, top_p, do_sample, generator) -> torch.Tensor:
    """logits (a, v) -> one token per row: greedy, or sampled with temperature/top-k/top-p."""
    if not do_sample or temperature == 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k > 0:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = cumulative - sorted_logits.softmax(-1) > top_p  # keep the first token past top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
