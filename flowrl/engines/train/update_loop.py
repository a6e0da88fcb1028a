"""The update loop every train node shares: epochs x mini-batches x micro-batches.

`TrainEngine` (train.py) inherits it, so an update node calls `engine.update(rows, micro_loss,
...)` and writes only the loss of one micro-batch: `update.policy`, `update.critic` and the
custom update node of docs/extending.md all do. The loop uses the engine's `mini_batches`,
`micro_batches`, `all_reduce_sum`, `backward` and `step`.
"""

import attrs

from flowrl.math import ops


@attrs.frozen
class Counts:
    """A mini-batch's counts over all its micro-batches and ranks, for a micro-batch's loss.

    Attributes:
        num_tokens: trained tokens (response_mask) of the mini-batch, at least 1.
        num_seqs: rows of the mini-batch, at least 1.
        computed_tokens: trained tokens of the rows that run (`update`'s `select`), at least 1.
    """

    num_tokens: float
    num_seqs: float
    computed_tokens: float

    def share(self, mask):
        """A micro-batch's share of the computed tokens, by its mask (b, t): weights a
        per-token mean so that the micro-batches' weighted means add up to the mini-batch's.
        A float for a mask on the CPU; on a GPU a float64 tensor, not read back (the update
        loop reads a mini-batch's metrics once, at its end)."""
        return ops.metric_value(mask.sum()) / self.computed_tokens


class UpdateLoop:
    """`update`, for a class with the train engine's batching, collectives and step."""

    def update(
        self,
        rows,
        micro_loss,
        *,
        epochs: int = 1,
        mini_batch_size: int = 0,
        metrics: tuple[str, ...] = (),
        select=None,
        rates: tuple[str, ...] = (),
    ) -> dict:
        """The update loop every train node shares: `epochs` passes over `rows`, each split
        into mini-batches of `mini_batch_size` rows over all ranks (0 = one), one optimizer
        step per mini-batch, its rows in micro-batches whose gradients add up.

        Args:
            rows: this rank's rows (a DataProto with response_mask).
            micro_loss: (micro, counts) -> (loss, metrics): the loss of one micro-batch, with
                the mini-batch's `Counts` to normalise by, so that the micro-batches' losses
                add up to the mini-batch's; its metrics add up over micro-batches and ranks
                (a loss value as it is, a per-token mean times `counts.share(mask)`).
            epochs: passes over the rows.
            mini_batch_size: rows per optimizer step over all ranks; 0 = all.
            metrics: the names `micro_loss` reports, so that a rank with no rows reports
                them too (0) and every rank sums the same keys.
            select: mini-batch -> (b,) bool: the rows that need a forward; the others add
                nothing to the loss or its gradient, but count in `counts`. None = all.
            rates: those of `metrics` that are per-token means (weighted by
                `counts.share`): averaged over the computed tokens of the whole update, so a
                mini-batch whose rows were all skipped adds no zeros to them.

        Returns:
            The metrics averaged over the optimizer steps (`rates` over computed tokens):
            those of `metrics`, the step's (`grad_norm`, `lr`, `nonfinite_skipped`) and, with
            `select`, `computed_rows` (the share of rows that ran) and `skipped_rows` (how
            many rows of an epoch were skipped, counted apart from the rates).
        """
        steps = [
            self._mini_batch_step(mini, micro_loss, metrics, select)
            for _ in range(epochs)
            for mini in self.mini_batches(rows, mini_batch_size)
        ]
        out = ops.mean_metrics([step for step, _ in steps])
        for key in rates:
            weighed = [(step[key], tokens) for step, tokens in steps if tokens > 0]
            total = sum(tokens for _, tokens in weighed)
            out[key] = sum(v * tokens for v, tokens in weighed) / total if total else 0.0
        if select is not None:
            out["skipped_rows"] = sum(step.pop("skipped", 0.0) for step, _ in steps) / epochs
            out.pop("skipped", None)
        return out

    def _mini_batch_step(self, mini, micro_loss, metrics, select) -> dict:
        """One optimizer step on this rank's share of a mini-batch; metrics over all ranks."""
        num_tokens = max(self.all_reduce_sum(float(mini["response_mask"].sum())), 1)
        num_seqs = max(self.all_reduce_sum(len(mini)), 1)  # normalisers of the mini-batch
        active, computed = mini, num_tokens
        if select is not None:
            active = mini.index(select(mini))
            computed = self.all_reduce_sum(float(active["response_mask"].sum()))
        counts = Counts(num_tokens, num_seqs, max(computed, 1))
        totals = dict.fromkeys(metrics, 0.0)
        device = getattr(self, "device", None)
        for micro in self.micro_batches(active):
            if len(micro) == 0:  # a rank may get no rows; it still steps below
                continue
            if device is not None and not str(device).startswith("cpu"):
                micro = micro.to(device)  # the loss on the device, next to the log-probs
            loss, values = micro_loss(micro, counts)
            for key, value in values.items():
                totals[key] += value
            self.backward(loss)
        # same keys on all ranks; a device metric is read back here, once per mini-batch
        totals = {k: self.all_reduce_sum(float(v)) for k, v in totals.items()}
        if select is not None:
            ran = self.all_reduce_sum(len(active))
            totals["computed_rows"] = ran / num_seqs
            totals["skipped"] = self.all_reduce_sum(len(mini)) - ran
        return {**totals, **self.step()}, computed
