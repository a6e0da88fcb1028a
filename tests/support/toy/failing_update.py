"""The built-in policy update, made to fail at one step (for the replay tests and
docs/debugging.md): with `fail_at_step = N`, step N's update raises; 0 never fails."""

import attrs

from flowrl.nodes.update import policy


@attrs.frozen
class Params(policy.Params):
    fail_at_step: int = 0  # the step whose update raises; 0 = none


class FailingUpdateWorker(policy.PolicyUpdateWorker):
    def __call__(self, batch):
        step = batch.meta["step"]
        if step == self.params.fail_at_step:
            raise ValueError(f"update_policy: a deliberate failure at step {step}")
        return super().__call__(batch)


SPEC = attrs.evolve(policy.SPEC, params=Params, worker=FailingUpdateWorker)
