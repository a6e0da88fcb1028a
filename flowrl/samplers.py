"""Which prompts a step draws: the data sampler seam (`[data] sampler`).

A sampler is an object with four methods (verl's `data.sampler.class_path` and its curriculum
sampler's `update(batch)` are the model):

    indices = sampler.next(batch_size)        # dataset indices of the next batch's prompts
    sampler.update(indices, scores, step)     # each finished row: its prompt's index, score
    state = sampler.state_dict()              # JSON-able: saved with every checkpoint
    sampler.load_state_dict(state)            # a resumed run draws what it would have drawn

built as `Sampler(size, seed, options)`: the number of prompts in the data set (after
over-long prompts are dropped; index i is the i-th kept prompt), the run's seed, and an
instance of its `Options` attrs record from `[data.sampler_options]` (checked by `flowrl check`
like node params). Given its state and the results it was told, its draws must be
deterministic: no wall clock, no global random state.

When results arrive: `update` is called once per trained batch, in the order steps train, with
every row the step generated (a row per sample: a prompt's index repeats n times), scores as
the reward node wrote them. With `run.staleness = k` the batch of step s is drawn before the
results of steps s-k..s-1 are known (the rollout runs ahead), so a curriculum reacts k steps
later. With refill (DAPO's dynamic sampling) the extra rounds draw from the sampler too, and
the rows a filter drops are reported with the rows it keeps.

`UniformSampler` is the default and the one uniform sampler (each epoch a fresh permutation,
or the data set's order with its option `shuffle = false`; the tail that does not fill a batch
skipped); `PassRateBand` is the built-in curriculum.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import attrs
import numpy as np

from flowrl import contracts
from flowrl.errors import FlowrlError
from flowrl.params import checked, count, interval


@attrs.frozen
class NoOptions:
    """The options of a sampler that has none: `[data.sampler_options]` must stay empty."""


@attrs.frozen
class UniformOptions:
    shuffle: bool = True  # a fresh permutation every epoch; false: the data set's order


class UniformSampler:
    """Every prompt once per epoch, in a permutation seeded by (seed, epoch); with
    `shuffle = false` (`[data.sampler_options]`, or `[data] shuffle`) in the data set's order.
    It ignores results (`learns = False`), so the prompt feed tells it none."""

    Options = UniformOptions
    learns = False

    def __init__(self, size: int, seed: int, options=None, shuffle: bool | None = None):
        options = options or UniformOptions()
        self.size, self.seed = size, seed
        self.shuffle = options.shuffle if shuffle is None else shuffle  # `shuffle`: older form
        self.epoch, self.position = 0, 0  # batches drawn in this epoch

    def _order(self) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.size)
        return np.random.default_rng(self.seed + self.epoch).permutation(self.size)

    def next(self, batch_size: int) -> list[int]:
        if (self.position + 1) * batch_size > self.size:  # the tail does not fill a batch
            self.epoch, self.position = self.epoch + 1, 0
        start = self.position * batch_size
        self.position += 1
        return self._order()[start : start + batch_size].tolist()

    def update(self, indices: Sequence[int], scores: Sequence[float], step: int) -> None:
        """Uniform sampling ignores results."""

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = state["epoch"], state["position"]


@attrs.frozen
class PassRateOptions:
    low: float = checked(0.2, interval(0, 1))  # a prompt is in the band from this pass rate
    high: float = checked(0.8, interval(0, 1))  # to this one
    outside: float = checked(0.1, interval(0, 1))  # draw weight of a prompt outside the band
    unseen: float = checked(1.0, interval(0, 1))  # draw weight of a prompt not yet tried
    window: int = checked(8, count(1, 1 << 20))  # the last this many samples make the rate

    def __attrs_post_init__(self):
        if self.low > self.high:
            raise ValueError(f"low = {self.low} is above high = {self.high}: make low <= high")


class PassRateBand:
    """A curriculum: prefer prompts the policy solves between `low` and `high` of the time.

    Each prompt's pass rate is the mean score of its last `window` samples (a 0/1 scorer's
    scores are passes); a prompt in [low, high] has draw weight 1, one outside `outside`, one
    never tried `unseen`. A batch draws distinct prompts with those weights, from a generator
    seeded by (seed, batches drawn so far), so a run and its resume draw the same prompts. The
    idea is verl users' pass-rate curriculum (and DAPO's observation that a group whose
    samples all pass or all fail teaches GRPO nothing): spend the generation on prompts whose
    groups have a spread of scores.
    """

    Options = PassRateOptions
    learns = True

    def __init__(self, size: int, seed: int, options: PassRateOptions | None = None):
        self.size, self.seed = size, seed
        self.options = options or PassRateOptions()
        self.recent: dict[int, list[float]] = {}  # prompt index -> its last `window` scores
        self.drawn = 0  # batches drawn

    def rates(self) -> np.ndarray:
        """(size,) each prompt's pass rate, nan where never tried."""
        out = np.full(self.size, np.nan)
        for index, scores in self.recent.items():
            out[index] = float(np.mean(scores))
        return out

    def weights(self) -> np.ndarray:
        o, rates = self.options, self.rates()
        inside = (rates >= o.low) & (rates <= o.high)
        weights = np.where(inside, 1.0, o.outside)
        return np.where(np.isnan(rates), o.unseen, weights)

    def next(self, batch_size: int) -> list[int]:
        weights = self.weights()
        if not weights.any():  # every weight 0 (outside = unseen = 0, none in the band)
            weights = np.ones(self.size)
        draw = np.random.default_rng([self.seed, self.drawn])
        self.drawn += 1
        live = int(np.count_nonzero(weights))
        if live < batch_size:  # too few prompts with weight: fill up from the rest, uniformly
            weights = weights + (weights == 0) * 1e-12
        picked = draw.choice(self.size, size=batch_size, replace=False, p=weights / weights.sum())
        return picked.tolist()

    def update(self, indices: Sequence[int], scores: Sequence[float], step: int) -> None:
        for index, score in zip(indices, scores, strict=True):
            recent = self.recent.setdefault(int(index), [])
            recent.append(float(score))
            del recent[: -self.options.window]

    def state_dict(self) -> dict:
        recent = {str(index): scores for index, scores in sorted(self.recent.items())}
        return {"drawn": self.drawn, "recent": recent}

    def load_state_dict(self, state: dict) -> None:
        self.drawn = state["drawn"]
        self.recent = {int(index): list(scores) for index, scores in state["recent"].items()}


class SamplerError(FlowrlError, ValueError):
    """A sampler's draw or state breaks the contract: names the sampler, its file and the fix."""

    def __init__(self, message: str, fix: str):
        super().__init__(f"{message}: {fix}")


def checked_draw(sampler, indices, batch_size: int, size: int) -> list[int]:
    """`indices`, what `sampler.next(batch_size)` returned, as a list of ints, or SamplerError:
    not a sequence of integers (a bool, a float, a string), not `batch_size` of them, one
    outside [0, size) (a -1 would silently take the last prompt)."""
    where = f"data sampler {contracts.place(type(sampler))}: next({batch_size}) returned"
    try:
        drawn = [operator.index(i) for i in indices]
        if any(isinstance(i, bool | np.bool_) for i in indices):
            raise TypeError("a bool")
    except TypeError:
        shown = repr(indices) if len(repr(indices)) < 80 else repr(indices)[:77] + "..."
        raise SamplerError(
            f"{where} {shown}: not a list of integers",
            "return a list of dataset indices, ints (a numpy array's .tolist())",
        ) from None
    if len(drawn) != batch_size:
        raise SamplerError(
            f"{where} {len(drawn)} indices",
            f"return exactly batch_size = {batch_size} (the step trains on what it draws)",
        )
    if bad := [i for i in drawn if not 0 <= i < size]:
        raise SamplerError(
            f"{where} the index {bad[0]}, outside the {size} prompts [0, {size})",
            "return indices of kept prompts, 0 to size - 1 (a negative one is not counted "
            "from the end)",
        )
    return drawn


# [data] sampler = "<name>" for the built-in ones; a user's own is "file.py:Class"
SAMPLERS = {"uniform": UniformSampler, "pass_rate": PassRateBand}
