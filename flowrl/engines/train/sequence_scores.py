"""One score per sequence from a value model, read the way a sequence classifier reads it.

transformers' `*ForSequenceClassification` (and so TRL's RewardTrainer and verl's reward-model
worker) applies its `score` head to the hidden state of the last real token: the rightmost
token whose id is not the config's `pad_token_id` (which handles left and right padding alike),
or the last token when the config has no pad id. A critic is read differently: its value at
response token k comes from the state *before* token k (engines/train/forward.py), so a reward model
must not reuse the critic's per-token values, or it never sees the final token.

Sequences here are joined prompt + response rows with an attention mask that may hold holes
(left-padded prompts, right-padded responses); position ids count real tokens, so the padding
changes nothing (rotary attention depends only on distances).
"""

import torch

from flowrl.math import ops


def read_positions(ids: torch.Tensor, mask: torch.Tensor, pad_id: int | None) -> torch.Tensor:
    """ids, mask (b, s) -> (b,): where a sequence classifier reads each row: the rightmost
    attended token whose id is not `pad_id` (transformers' rule: a trailing eos that doubles as
    the pad token is skipped); a row whose attended tokens are all `pad_id` reads its last one."""
    real = mask.bool()
    if pad_id is not None:
        not_pad = real & (ids != pad_id)
        real = torch.where(not_pad.any(-1, keepdim=True), not_pad, real)
    return ops.last_one(real)


def joined(rows) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch's prompts (b, p) left-padded and responses (b, t) right-padded, with every real
    response token (tool output too) -> ids, mask (b, p + t)."""
    ids = torch.cat([rows["prompts"], rows["responses"]], dim=1)
    mask = torch.cat([rows["prompt_mask"], ops.response_attention(rows)], dim=1)
    return ids, mask


def forward_scores(engine, ids, mask, *, grad: bool) -> torch.Tensor:
    """One micro-batch: ids, mask (b, s) -> scores (b,) from `engine`'s value model (a
    TrainEngine), with autograd when `grad`. One call of the engine's root module, as fsdp
    needs."""
    if len(ids) == 0:
        return torch.zeros(0)
    used = mask.bool().any(0).nonzero()  # drop columns that are padding in every row
    first, end = (int(used[0]), int(used[-1]) + 1) if len(used) else (0, 1)
    ids, mask = ids[:, first:end].to(engine.device), mask[:, first:end].to(engine.device)
    pad_id = getattr(engine.module.config, "pad_token_id", None)
    at = read_positions(ids, mask, pad_id)
    engine.forwards += 1
    empty = ids[:, :0]
    with torch.enable_grad() if grad else engine.sharding.no_grad():
        scores = engine.forward_module(ids, mask, empty, empty, read_at=at)["scores"]
    if not grad:
        engine.sharding.after_inference(engine.forward_module)
        scores = scores.cpu()
    return scores


def chunks(mask: torch.Tensor, micro_tokens: int, group: int = 1) -> list[torch.Tensor]:
    """Row indices of micro-batches of at most `micro_tokens` padded tokens (rows x longest
    row), whole groups of `group` consecutive rows each (a chosen / rejected pair stays
    together), at least one group each."""
    lengths = mask.sum(-1).tolist()
    bounds, start, longest = [], 0, 0
    for first in range(0, len(lengths), group):
        end = min(first + group, len(lengths))
        grown = max([longest, *lengths[first:end]])
        if first > start and (end - start) * grown > micro_tokens:
            bounds.append((start, first))
            start, grown = first, max(lengths[first:end])
        longest = grown
    bounds.append((start, len(lengths)))
    return [torch.arange(a, b) for a, b in bounds]


def infer_scores(engine, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """ids, mask (b, s) -> scores (b,) without gradients, over micro-batches of the engine's
    `micro_tokens` (under fsdp every rank makes as many passes: `TrainEngine.passes`)."""
    parts = engine.passes(chunks(mask, engine.micro_tokens))
    scores = [forward_scores(engine, ids[part], mask[part], grad=False) for part in parts]
    return torch.cat(scores) if scores else torch.zeros(0)
