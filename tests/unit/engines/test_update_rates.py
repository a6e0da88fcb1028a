"""A loss's logged rates are means over the rows the update computed: a mini-batch whose rows
were all skipped (zero advantage) adds no zeros to them, and the skipped rows are counted
apart (`skipped_rows`)."""

import pytest

from flowrl.engines import TrainEngine
from flowrl.testing import tiny_model, tiny_tokenizer, update_batch


def test_a_rate_that_is_always_one_is_logged_as_one_with_a_skipped_mini_batch():
    engine = TrainEngine(tiny_model(seed=0), tiny_tokenizer(), lr=1e-3)
    rows = update_batch(b=4)
    advantages = rows["advantages"].clone()
    advantages[:2] = 0  # the first mini-batch of two rows: nothing to compute
    advantages[2:] = rows["response_mask"][2:].float()
    rows["advantages"] = advantages

    def micro_loss(micro, counts):
        out = engine.forward(micro, grad=True)
        mask = micro["response_mask"]
        loss = -(out["logprobs"] * micro["advantages"] * mask).sum() / counts.num_tokens
        return loss, {"always_one": 1.0 * counts.share(mask), "pg_loss": float(loss.detach())}

    metrics = engine.update(
        rows,
        micro_loss,
        mini_batch_size=2,
        metrics=("always_one", "pg_loss"),
        select=lambda mini: (mini["advantages"] != 0).any(-1),
        rates=("always_one",),
    )
    assert metrics["always_one"] == pytest.approx(1.0)  # was 0.5: the skipped step's zero
    assert metrics["skipped_rows"] == 2
    assert metrics["computed_rows"] == pytest.approx(0.5)  # mean over the two optimizer steps
