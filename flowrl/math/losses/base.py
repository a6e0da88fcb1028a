"""What every policy loss shares: the `Chunk` it is computed on and the `Loss` record of the
table (`flowrl.math.losses.LOSSES`), plus truncated importance-sampling weights.

Every loss has one signature,

    loss(logprobs, old_logprobs, advantages, response_mask, params, chunk) -> (loss, rates)

with (b, t) tensors (`logprobs` with grad, `old_logprobs` of the policy that sampled, detached),
`params` the update node's params (a loss reads its own fields from it: `Loss.params` names
them) and `chunk` a `Chunk`. It returns a scalar and a dict of floats over the chunk's trained
tokens (`Loss.rates` names them). Every exp of a log-ratio goes through `ops.ratio_from_log`
(clamped to [-20, 20]) unless the loss says otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from flowrl.math import ops


@attrs.frozen
class Chunk:
    """What a micro-batch's loss needs to know beyond its rows.

    Attributes:
        num_tokens: trained tokens of the whole mini-batch (all micro-batches, all ranks);
            None = this chunk's. With the mini-batch's counts the chunks' losses add up to the
            mini-batch's loss (see `ops.agg_loss`).
        num_seqs: rows of the whole mini-batch; None = this chunk's.
        norm_length: the constant divisor of seq-mean-token-sum-norm; None = t.
        token_weights: (b, t) weights multiplying each token's loss before aggregation (e.g.
            `tis_weights`), or None.
        generator: the torch.Generator of a loss that draws at random (Clip-Cov); None =
            torch's global one, seeded by the run.
        options: the loss's own options (an instance of its record's `options` class, from
            the update node's `loss_options`), or None for a loss without.
        state: the loss's state across steps (its record's `state`), read-only during the
            update (`after_update` changes it once a step); {} for a loss without.
    """

    num_tokens: Any = None
    num_seqs: Any = None
    norm_length: Any = None
    token_weights: Any = None
    generator: Any = None
    options: Any = None
    state: Any = attrs.field(factory=dict)

    def weighted(self, token_loss):
        """token_loss (b, t) times the token weights, if any."""
        return token_loss if self.token_weights is None else token_loss * self.token_weights

    def aggregate(self, token_loss, mask, agg: str):
        """token_loss (b, t) -> scalar by `agg` over the mini-batch's counts (`ops.agg_loss`)."""
        return ops.agg_loss(token_loss, mask, agg, self.num_tokens, self.num_seqs, self.norm_length)


@attrs.frozen
class Loss:
    """One line of the loss table.

    Attributes:
        fn: the loss, with the signature of this module's docstring.
        rates: the per-token rates `fn` reports (averaged over a mini-batch's computed tokens).
        params: the update node's params `fn` reads that no other part of the update reads
            (the loss-only ones: `flowrl check` refuses them set away from their default under
            another loss). `agg` and `norm_length` are not listed: the KL and entropy terms
            read them too.
        all_rows: `fn` needs every row of a micro-batch, those with zero advantage too (a
            statistic over the chunk's tokens), so no row is skipped.
        agg: the aggregation the paper and verl fix for this loss, if any: `flowrl check`
            warns when the node's `agg` differs.
        options: an attrs class of the loss's own params (a loss of the user's: the node's
            `Params` cannot grow), set in the update node's `loss_options` table and checked
            by `flowrl check` like node params; `fn` reads them as `chunk.options`.
        state: options -> the loss's first state, a dict JSON can hold, kept across steps,
            saved in every checkpoint and restored on --resume; `fn` reads it as
            `chunk.state`. None: a loss without state.
        after_update: (state, rates, options) -> the next state (or None: `state` changed in
            place), called once a step after the update with the step's rates (means over
            the update's computed tokens, equal on every rank): PPO's adaptive KL doubles or
            halves its beta here.
    """

    fn: Callable[..., tuple[Any, dict]]
    rates: tuple[str, ...] = ()
    params: tuple[str, ...] = ()
    all_rows: bool = False
    agg: str | None = None
    options: type | None = None
    state: Callable[[Any], dict] | None = None
    after_update: Callable[[dict, dict, Any], dict | None] | None = None


CLIP = ("clip_low", "clip_high")  # the clip range, read by the losses that clip


def approx_kl(logprobs, old_logprobs, mask) -> float:
    """The rate `approx_kl`: mean of old - logp over the trained tokens."""
    return float(ops.masked_mean(old_logprobs - logprobs.detach(), mask))


def tis_weights(old_logprobs, rollout_logprobs, cap: float):
    """Truncated importance-sampling weights between trainer and rollout backend (b, t).

    w = min(exp(old - rollout), C), detached, where `old_logprobs` are the trainer's log-probs
    of the sampled tokens before the update and `rollout_logprobs` the sampler's (vLLM, SGLang:
    they differ by kernels and precision). Multiplying w into the policy-gradient loss corrects
    for sampling from the rollout engine's distribution (Yao et al. 2025, "Your efficient RL
    framework secretly brings you off-policy RL training"; C is verl's `tis_imp_ratio_cap`).
    """
    ratio = ops.ratio_from_log(old_logprobs - rollout_logprobs)
    return ratio.clamp(max=cap).detach()
