"""PPO policy update: clipped surrogate (arXiv 1707.06347) with DAPO's separate low/high clip
ranges (arXiv 2503.14476), dual-clip (arXiv 1912.09729), entropy bonus and an optional KL loss
against the reference (GRPO, arXiv 2402.03300).

reads: prompts, prompt_mask, responses, response_mask, advantages, old_logprobs
       (+ ref_logprobs when kl_loss_coef > 0; old_logprobs not read when on_policy) -> writes: -
"""

from __future__ import annotations

import attrs

from flowrl import ops
from flowrl.lazy import torch
from flowrl.nodespec import NodeSpec
from flowrl.validators import (
    MAX_EPOCHS,
    MAX_ROWS,
    above,
    at_least,
    checked,
    count,
    one_of,
    positive,
    zero_or,
)


@attrs.frozen
class Params:
    epochs: int = checked(1, count(1, MAX_EPOCHS))  # passes over the step's rows
    mini_batch_size: int = checked(0, count(0, MAX_ROWS))  # rows per optimizer step; 0 = all
    clip_low: float = checked(0.2, at_least(0))  # ratio floor 1 - clip_low
    clip_high: float = checked(0.2, at_least(0))  # ratio ceiling 1 + clip_high (DAPO: 0.28)
    dual_clip: float = checked(0.0, zero_or(above(1)))  # bounds the loss of negative advantages
    agg: str = checked("token-mean", one_of(ops.AGG_MODES))  # loss aggregation
    entropy_coef: float = 0.0  # entropy bonus weight
    kl_loss_coef: float = checked(0.0, at_least(0))  # weight of the KL(policy || ref) loss term
    kl_loss_kind: str = checked("k3", one_of(ops.KL_KINDS))  # KL estimator of the loss
    temperature: float = checked(1.0, positive())  # divide logits as the sampler did
    on_policy: bool = False  # old log-probs = this forward's, detached (epochs = 1, 1 mini-batch)
    skip_zero_rows: bool = True  # skip rows with no gradient (zero advantage, no KL/entropy)


def ppo_policy_loss(
    logprobs,
    old_logprobs,
    advantages,
    response_mask,
    clip_low=0.2,
    clip_high=0.2,
    dual_clip=0.0,
    agg="token-mean",
    num_tokens=None,
    num_seqs=None,
):
    """Clipped surrogate loss; all inputs (b, t). Returns (loss, metrics of this chunk).

    ratio r = exp(logp - old); loss per token = max(-A r, -A clip(r, 1 - low, 1 + high)),
    and with dual-clip c, min(that, -A c) where A < 0.
    """
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    if dual_clip > 0:
        loss = torch.where(advantages < 0, torch.minimum(loss, -advantages * dual_clip), loss)
    mask = response_mask.to(loss.dtype)
    metrics = {
        "clip_frac": float(ops.masked_mean((clipped > unclipped).to(loss.dtype), mask)),
        "approx_kl": float(ops.masked_mean(old_logprobs - logprobs.detach(), mask)),
    }
    return ops.agg_loss(loss, mask, agg, num_tokens, num_seqs), metrics


def contributing_rows(advantages, params: Params):
    """(b,) bool: rows whose loss terms have a gradient. With no KL or entropy term, a row
    whose advantage is zero everywhere adds exactly zero to the loss and its gradient, so its
    forward and backward are skipped (the loss normaliser still counts it)."""
    if params.kl_loss_coef > 0 or params.entropy_coef > 0 or not params.skip_zero_rows:
        return torch.ones(advantages.shape[0], dtype=torch.bool)
    return (advantages != 0).any(-1)


class PolicyUpdateWorker:
    def __init__(self, engine, params: Params):
        self.engine, self.params = engine, params

    def __call__(self, batch):
        p, engine = self.params, self.engine
        steps = [
            self.mini_batch(mini)
            for _ in range(p.epochs)
            for mini in engine.mini_batches(batch, p.mini_batch_size)
        ]
        return {}, ops.mean_metrics(steps)

    def mini_batch(self, mini) -> dict:
        """One optimizer step on this rank's share of a mini-batch; metrics over all ranks."""
        p, engine = self.params, self.engine
        num_tokens = max(engine.all_reduce_sum(float(mini["response_mask"].sum())), 1)
        num_seqs = max(engine.all_reduce_sum(len(mini)), 1)  # normalisers of the mini-batch
        active = mini.index(contributing_rows(mini["advantages"], p))
        computed = max(engine.all_reduce_sum(float(active["response_mask"].sum())), 1)
        # loss terms add up over micro-batches; per-token rates are averaged over computed tokens
        totals = dict.fromkeys(("pg_loss", "kl_loss", "entropy", "clip_frac", "approx_kl"), 0.0)
        for micro in engine.micro_batches(active):
            if len(micro) == 0:
                continue
            out = engine.forward(micro, grad=True, entropy=True, temperature=p.temperature)
            logprobs, mask = out["logprobs"], micro["response_mask"]
            old = logprobs.detach() if p.on_policy else micro["old_logprobs"]
            loss, rates = ppo_policy_loss(
                logprobs,
                old,
                micro["advantages"],
                mask,
                p.clip_low,
                p.clip_high,
                p.dual_clip,
                p.agg,
                num_tokens,
                num_seqs,
            )
            totals["pg_loss"] += float(loss.detach())
            share = float(mask.sum()) / computed
            totals["clip_frac"] += rates["clip_frac"] * share
            totals["approx_kl"] += rates["approx_kl"] * share
            totals["entropy"] += float(ops.masked_mean(out["entropy"].detach(), mask)) * share
            if p.entropy_coef > 0:
                loss = loss - p.entropy_coef * ops.agg_loss(
                    out["entropy"], mask, p.agg, num_tokens, num_seqs
                )
            if p.kl_loss_coef > 0:
                kl = ops.kl_estimate(logprobs, micro["ref_logprobs"], p.kl_loss_kind)
                kl_loss = ops.agg_loss(kl, mask, p.agg, num_tokens, num_seqs)
                loss = loss + p.kl_loss_coef * kl_loss
                totals["kl_loss"] += float(kl_loss.detach())
            engine.backward(loss)
        totals = {k: engine.all_reduce_sum(v) for k, v in totals.items()}  # same keys on all ranks
        totals["computed_rows"] = engine.all_reduce_sum(len(active)) / num_seqs
        return {**totals, **engine.step()}


def _reads(params: Params) -> tuple[str, ...]:
    old = () if params.on_policy else ("old_logprobs",)
    return old + (("ref_logprobs",) if params.kl_loss_coef > 0 else ())


SPEC = NodeSpec(
    reads=("prompts", "prompt_mask", "responses", "response_mask", "advantages"),
    writes=(),
    params=Params,
    worker=PolicyUpdateWorker,
    mode="train",
    head="lm",
    extra_reads=_reads,
)
