"""A rollout backend that samples with stale weights, found from what a step already has: the
log-probs the backend reports for the tokens it sampled (`rollout_logprobs`) against the
trainer's for the same tokens before the update (`old_logprobs`). They agree up to kernels and
precision (a few hundredths of a nat per token); a backend that kept its first weights, or
whose `sync_weights` does not reach its server, drifts away from the trainer step by step. The
mean gap is logged every step as `rollout/logprob_gap`; past `TOLERANCE` the run warns once,
naming the backend. Checked only where the two should agree: a synchronous run (staleness 0,
no partial rollouts), temperature-only sampling (top-p and top-k change the distribution), a
step with both keys (`generate`'s `return_logprobs = true` and an old_logprob node).
"""

import sys

from flowrl.nodespec import RolloutParams

TOLERANCE = 0.1  # nats per token, averaged over a step's sampled tokens


class StaleWeights:
    """Watches each step's batch for the gap; `observe(step, batch)` -> metrics to log."""

    def __init__(self, spec):
        rollout = [d for d in spec.nodes.values() if isinstance(d.params, RolloutParams)]
        self.model = rollout[0].model if rollout else None
        self.backend = spec.models[self.model].rollout if self.model else ""
        plain = all(d.params.top_p == 1.0 and d.params.top_k == 0 for d in rollout)
        synchronous = spec.run.staleness == 0 and spec.run.partial_rollout == 0
        self.active = bool(rollout) and plain and synchronous
        self.warned = False

    def observe(self, step: int, batch) -> dict:
        keys = batch.keys()
        if not self.active or "rollout_logprobs" not in keys or "old_logprobs" not in keys:
            return {}
        mask = batch["response_mask"].bool()
        if not mask.any():
            return {}
        gap = (batch["rollout_logprobs"] - batch["old_logprobs"]).abs()[mask].mean()
        gap = float(gap)
        if gap > TOLERANCE and not self.warned:
            self.warned = True
            print(
                f'flowrl: warning: step {step}: rollout backend "{self.backend}" of model '
                f"{self.model} reports log-probs {gap:.3f} nats per token away from the "
                f"trainer's for the same tokens (tolerance {TOLERANCE}): it is likely sampling "
                "with stale weights. A backend with its own copy of the weights must take them "
                "in sync_weights at every sync (subclass flowrl.api.ServerRollout: "
                'docs/extending.md, "A server backend"); or its log-probs are not those of '
                "the sampled tokens at the sampling temperature",
                file=sys.stderr,
            )
        return {"rollout/logprob_gap": gap}
