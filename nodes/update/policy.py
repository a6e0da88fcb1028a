"""PPO policy update: clipped surrogate (arXiv 1707.06347) with DAPO's separate low/high clip
ranges (arXiv 2503.14476), dual-clip (arXiv 1912.09729), entropy bonus and an optional KL loss
against the reference (GRPO, arXiv 2402.03300).

reads: prompts, prompt_mask, responses, response_mask, response_attention, advantages,
       old_logprobs (+ ref_logprobs when kl_loss_coef > 0, rollout_logprobs when tis_cap > 0;
       old_logprobs not read when on_policy) -> writes: -
The forward attends to response_attention; the loss counts only response_mask (sampled tokens).
Other policy losses (GSPO, CISPO, GPG, GMPO, SAPO, Clip-Cov, KL-Cov) by the `loss` param.
"""

from __future__ import annotations

import attrs

from flowrl.front.validators import (
    MAX_EPOCHS,
    MAX_ROWS,
    MAX_TOKENS,
    above,
    at_least,
    checked,
    count,
    interval,
    one_of,
    positive,
    zero_or,
)
from flowrl.lazy import torch
from flowrl.math import cov_losses, ops, policy_losses
from flowrl.nodespec import MINI_BATCHES, Finding, NodeSpec

# the per-token rates each loss reports (averaged over the computed tokens of a mini-batch)
RATES = {
    "ppo": ("clip_frac", "clip_frac_lower", "approx_kl"),
    "gspo": ("clip_frac", "approx_kl"),
    "cispo": ("clip_frac", "approx_kl"),
    "gpg": (),
    "gmpo": ("clip_frac", "approx_kl"),
    "sapo": ("gate", "approx_kl"),
    "clip_cov": ("clip_frac", "cov_frac", "approx_kl"),
    "kl_cov": ("cov_frac", "approx_kl"),
}


@attrs.frozen
class Params:
    epochs: int = checked(1, count(1, MAX_EPOCHS))  # passes over the step's rows
    mini_batch_size: int = checked(0, count(0, MAX_ROWS))  # rows per optimizer step; 0 = all
    clip_low: float = checked(0.2, at_least(0))  # ratio floor 1 - clip_low
    clip_high: float = checked(0.2, at_least(0))  # ratio ceiling 1 + clip_high (DAPO: 0.28)
    dual_clip: float = checked(3.0, zero_or(above(1)))  # bound c on negative advantages (verl: 3)
    agg: str = checked("token-mean", one_of(ops.AGG_MODES))  # loss aggregation
    entropy_coef: float = 0.0  # entropy bonus weight
    kl_loss_coef: float = checked(0.0, at_least(0))  # weight of the KL(policy || ref) loss term
    kl_loss_kind: str = checked("k3", one_of(ops.KL_KINDS))  # KL estimator of the loss
    temperature: float = checked(1.0, positive())  # divide logits as the sampler did
    on_policy: bool = False  # old log-probs = this forward's, detached (epochs = 1, 1 mini-batch)
    skip_zero_rows: bool = True  # skip rows with no gradient (zero advantage, no KL/entropy)
    loss: str = checked("ppo", one_of(RATES))  # the policy loss (GSPO, CISPO, ...: see docstring)
    tis_cap: float = checked(0.0, at_least(0))  # truncated IS cap C on exp(old - rollout); 0 = off
    norm_length: int = checked(0, count(0, MAX_TOKENS))  # seq-mean-token-sum-norm divisor; 0 = t
    tau_pos: float = checked(1.0, positive())  # loss sapo: gate temperature where A > 0
    tau_neg: float = checked(1.05, positive())  # loss sapo: gate temperature where A < 0
    cov_ratio: float = checked(2e-4, interval(0, 1))  # clip_cov / kl_cov: share of tokens held
    cov_kl_coef: float = checked(1.0, at_least(0))  # loss kl_cov: weight of abs(log r) there


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
    norm_length=None,
    token_weights=None,
):
    """Clipped surrogate loss; all inputs (b, t). Returns (loss, metrics of this chunk).

    ratio r = exp(logp - old) with logp - old clamped to [-20, 20] (finite gradients for
    extreme tokens); loss per token = max(-A r, -A clip(r, 1 - low, 1 + high)), and with
    dual-clip c, min(that, -A c) where A < 0. Metrics: clip_frac (tokens where the clip
    binds), clip_frac_lower (tokens where the dual-clip bound -A c binds; verl's
    pg_clipfrac_lower), approx_kl (mean old - logp). `token_weights` (b, t), e.g. truncated
    importance-sampling weights (`flowrl.math.policy_losses.tis_weights`), multiply each
    token's loss;
    `norm_length` is the divisor of seq-mean-token-sum-norm (see `ops.agg_loss`).
    """
    ratio = ops.ratio_from_log(logprobs - old_logprobs)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    lower_binds = torch.zeros_like(loss, dtype=torch.bool)
    if dual_clip > 0:
        lower_binds = (advantages < 0) & (loss > -advantages * dual_clip)
        loss = torch.where(lower_binds, -advantages * dual_clip, loss)
    if token_weights is not None:
        loss = loss * token_weights
    mask = response_mask.to(loss.dtype)
    metrics = {
        "clip_frac": float(ops.masked_mean((clipped > unclipped).to(loss.dtype), mask)),
        "clip_frac_lower": float(ops.masked_mean(lower_binds.to(loss.dtype), mask)),
        "approx_kl": float(ops.masked_mean(old_logprobs - logprobs.detach(), mask)),
    }
    return ops.agg_loss(loss, mask, agg, num_tokens, num_seqs, norm_length), metrics


def policy_loss(logprobs, old_logprobs, advantages, response_mask, params: Params, **counts):
    """The policy loss `params.loss` names, on (b, t) tensors -> (loss, rates).

    ppo: `ppo_policy_loss`; gspo, cispo, gpg, gmpo, sapo: `flowrl.math.policy_losses`; clip_cov,
    kl_cov: `flowrl.math.cov_losses`. clip_low / clip_high are each loss's clip range: set the
    papers' values in the graph file (gspo: 3e-4 / 4e-4 with agg = "seq-mean-token-mean";
    gmpo: 0.4 / 0.4, in log space, and a mean over sequences whatever `agg`; cispo: the
    weight's bounds). `counts`: num_tokens, num_seqs, norm_length, token_weights (see
    `ops.agg_loss`).
    """
    p, args = params, (logprobs, old_logprobs, advantages, response_mask)
    clip, agg = {"clip_low": p.clip_low, "clip_high": p.clip_high}, {"agg": p.agg, **counts}
    if p.loss == "ppo":
        return ppo_policy_loss(*args, dual_clip=p.dual_clip, **clip, **agg)
    if p.loss == "gpg":
        return policy_losses.gpg_policy_loss(logprobs, advantages, response_mask, **agg)
    if p.loss == "gmpo":
        weights = {k: counts.get(k) for k in ("num_seqs", "token_weights")}
        return policy_losses.gmpo_policy_loss(*args, **clip, **weights)
    if p.loss == "sapo":
        return policy_losses.sapo_policy_loss(*args, p.tau_pos, p.tau_neg, **agg)
    if p.loss == "clip_cov":
        return cov_losses.clip_cov_policy_loss(*args, **clip, clip_cov_ratio=p.cov_ratio, **agg)
    if p.loss == "kl_cov":
        return cov_losses.kl_cov_policy_loss(*args, p.cov_ratio, p.cov_kl_coef, **agg)
    loss_fn = {"gspo": policy_losses.gspo_policy_loss, "cispo": policy_losses.cispo_policy_loss}
    return loss_fn[p.loss](*args, **clip, **agg)


def contributing_rows(advantages, params: Params):
    """(b,) bool: rows whose loss terms have a gradient. With no KL or entropy term, a row
    whose advantage is zero everywhere adds exactly zero to the loss and its gradient, so its
    forward and backward are skipped (the loss normaliser still counts it). Clip-Cov and
    KL-Cov need every row: their token covariance is taken over all the chunk's tokens."""
    every = params.kl_loss_coef > 0 or params.entropy_coef > 0 or not params.skip_zero_rows
    if every or params.loss in ("clip_cov", "kl_cov"):
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
        totals = dict.fromkeys(("pg_loss", "kl_loss", "entropy") + RATES[p.loss], 0.0)
        norm_length = p.norm_length or None
        for micro in engine.micro_batches(active):
            if len(micro) == 0:
                continue
            out = engine.forward(micro, grad=True, entropy=True, temperature=p.temperature)
            logprobs, mask = out["logprobs"], micro["response_mask"]
            old = logprobs.detach() if p.on_policy else micro["old_logprobs"]
            weights = None
            if p.tis_cap > 0:
                weights = policy_losses.tis_weights(old, micro["rollout_logprobs"], p.tis_cap)
            loss, rates = policy_loss(
                logprobs,
                old,
                micro["advantages"],
                mask,
                p,
                num_tokens=num_tokens,
                num_seqs=num_seqs,
                norm_length=norm_length,
                token_weights=weights,
            )
            totals["pg_loss"] += float(loss.detach())
            share = float(mask.sum()) / computed
            for key in RATES[p.loss]:
                totals[key] += rates[key] * share
            totals["entropy"] += float(ops.masked_mean(out["entropy"].detach(), mask)) * share
            if p.entropy_coef > 0:
                loss = loss - p.entropy_coef * ops.agg_loss(
                    out["entropy"], mask, p.agg, num_tokens, num_seqs, norm_length
                )
            if p.kl_loss_coef > 0:
                kl = ops.kl_estimate(logprobs, micro["ref_logprobs"], p.kl_loss_kind)
                kl_loss = ops.agg_loss(kl, mask, p.agg, num_tokens, num_seqs, norm_length)
                loss = loss + p.kl_loss_coef * kl_loss
                totals["kl_loss"] += float(kl_loss.detach())
            engine.backward(loss)
        totals = {k: engine.all_reduce_sum(v) for k, v in totals.items()}  # same keys on all ranks
        totals["computed_rows"] = engine.all_reduce_sum(len(active)) / num_seqs
        return {**totals, **engine.step()}


def check(params: Params, context) -> list[Finding]:
    out = MINI_BATCHES.check(params, context)
    mini = params.mini_batch_size
    if params.on_policy and (params.epochs > 1 or 0 < mini < context.rows):
        out.append(
            Finding(
                "on_policy = true reuses the update's own log-probs as the old "
                "ones, which is exact only for one update per batch",
                "set epochs = 1 and mini_batch_size = 0, or on_policy = false with an "
                "old_logprob node",
            )
        )
    return out


SPEC = NodeSpec(
    reads=(
        "prompts",
        "prompt_mask",
        "responses",
        "response_mask",
        "response_attention",
        "advantages",
    ),
    writes=(),
    params=Params,
    worker=PolicyUpdateWorker,
    mode="train",
    head="lm",
    optional_reads={
        "old_logprobs": lambda p: not p.on_policy,
        "ref_logprobs": lambda p: p.kl_loss_coef > 0,
        "rollout_logprobs": lambda p: p.tis_cap > 0,
    },
    check=check,
    updates_per_step=MINI_BATCHES.updates,
)
