"""The policy update (update.policy), plus every few steps the mean response length of the rows
the step rewarded. The worked example of docs/debugging.md: its statistics have a bug that
first shows at step 3.

reads, writes: those of update.policy; params: those of update.policy, and `stats_every`.
"""

import attrs

from flowrl.nodes.update import policy


@attrs.frozen
class Params(policy.Params):
    stats_every: int = 3  # steps between the statistics; 0 = never


def rewarded_lengths(advantages, response_mask):
    """advantages, response_mask (b, t) -> the response lengths (k,) of rows whose advantage
    is positive."""
    lengths = response_mask.sum(-1)  # (b,)
    return lengths[advantages > 0]


class StatsUpdateWorker(policy.PolicyUpdateWorker):
    def __call__(self, batch):
        stats = {}
        every = self.params.stats_every
        if every and batch.meta["step"] % every == 0:
            lengths = rewarded_lengths(batch["advantages"], batch["response_mask"]).float()
            stats["rewarded_length"] = float(lengths.mean()) if len(lengths) else 0.0
        writes, metrics = super().__call__(batch)
        return writes, {**metrics, **stats}


SPEC = attrs.evolve(policy.SPEC, params=Params, worker=StatsUpdateWorker)
