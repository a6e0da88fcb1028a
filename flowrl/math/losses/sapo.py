"""SAPO: a soft, temperature-controlled gate instead of the hard clip (Gao et al., "Soft
Adaptive Policy Optimization", arXiv 2511.20347).

Signature and conventions: `flowrl.math.losses.base`.
"""

from __future__ import annotations

from flowrl.lazy import torch
from flowrl.math import ops
from flowrl.math.losses.base import Chunk, approx_kl


def sapo_loss(logprobs, old_logprobs, advantages, response_mask, params, chunk: Chunk):
    """SAPO loss; (b, t) inputs -> (loss, rates: gate, approx_kl).

    J = 1/G sum_i 1/|y_i| sum_t f_i,t(r_i,t) A_i,t with f(r) = (4 / tau) sigmoid(tau (r - 1))
    and tau = tau_pos where A > 0, tau_neg otherwise (the paper's 1.0 and 1.05: negative
    advantages, which push up many unsampled tokens, are damped faster). The gradient weight
    on grad log pi is f'(r) r = 4 s (1 - s) r with s = sigmoid(tau (r - 1)): 1 at r = 1,
    decaying smoothly as r leaves 1. Loss per token: -f(r) A, aggregated by `params.agg`: the
    paper's 1/G sum_i 1/|y_i| is "seq-mean-token-mean" (verl fixes it), not the node's
    default "token-mean". Rate `gate`: mean 4 s (1 - s).
    """
    mask = response_mask.to(logprobs.dtype)
    ratio = ops.ratio_from_log(logprobs - old_logprobs)
    tau = torch.where(advantages > 0, params.tau_pos, params.tau_neg).to(logprobs.dtype)
    gate = torch.sigmoid(tau * (ratio - 1))
    loss = chunk.weighted(-(4 / tau) * gate * advantages)
    gate = gate.detach()
    rates = {
        "gate": float(ops.masked_mean(4 * gate * (1 - gate), mask)),
        "approx_kl": approx_kl(logprobs, old_logprobs, mask),
    }
    return chunk.aggregate(loss, mask, params.agg), rates
