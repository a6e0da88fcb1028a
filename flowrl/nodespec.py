"""The node contract: what every node module declares, in one `SPEC = NodeSpec(...)` line.

A node is one operation of an algorithm. Its module holds, in this order: a docstring (what,
paper, `reads -> writes`), a `Params` attrs class (the only place defaults live), pure functions
with the math, a worker class if it runs a model, and the SPEC.

Two kinds of node:

- controller nodes give `fn`: `fn(batch, params) -> writes` runs on the controller, no model.
  With `stateful=True` it is `fn(batch, params, state)`, where `state` is a dict the runtime
  keeps across steps and saves in checkpoints (e.g. an adaptive KL coefficient).
- model nodes give `worker` and `mode`: the runtime builds `worker(engine, params)` once on each
  rank of the pool that hosts the node's model and calls `worker(batch)` with that rank's rows.

Either returns a dict holding exactly the declared `writes`, or a pair `(writes, metrics)` with
metrics a dict of floats. A node with `rows="repeat"` returns `params.n` rows per input row
(interleaved: all samples of row 0, then row 1, ...); `rows="filter"` returns only the key
`keep`, a bool (b,) mask, and the runtime drops the other rows from the step's batch.

This module imports neither torch nor ray.
"""

from collections.abc import Callable
from typing import Any

import attrs

MODES = ("rollout", "inference", "train")
DISPATCHES = ("split", "broadcast", "rank0")
ROWS = ("same", "repeat", "filter")
HEADS = ("lm", "value")
KEEP = "keep"  # the one key a filter node returns


def _one_of(choices):
    def check(instance, attribute, value):
        if value is not None and value not in choices:
            raise ValueError(f"NodeSpec.{attribute.name} must be one of {choices}, got {value!r}")

    return check


@attrs.frozen
class NodeSpec:
    """Declaration of one node: keys in and out, params, where and how it runs.

    Attributes:
        reads: batch keys the node reads.
        writes: batch keys the node writes (empty for a pure sink such as an update).
        params: an attrs class; its fields are the node's TOML parameters.
        fn: controller function, for nodes without a model.
        worker: worker class, for nodes that run a model.
        mode: how the worker uses its model: rollout, inference or train.
        head: the model head the worker needs: "lm" or "value".
        dispatch: how rows reach the pool's ranks: split (default), broadcast, rank0.
        rows: "same", "repeat" (params.n samples per row) or "filter".
        groups: the math needs several samples per prompt (grouped by `uid`).
        stateful: fn takes a third argument, a dict kept across steps.
        extra_reads: params -> further keys read only under some settings.
    """

    reads: tuple[str, ...]
    writes: tuple[str, ...]
    params: type
    fn: Callable[..., Any] | None = None
    worker: type | None = None
    mode: str | None = attrs.field(default=None, validator=_one_of(MODES))
    head: str | None = attrs.field(default=None, validator=_one_of(HEADS))
    dispatch: str = attrs.field(default="split", validator=_one_of(DISPATCHES))
    rows: str = attrs.field(default="same", validator=_one_of(ROWS))
    groups: bool = False
    stateful: bool = False
    extra_reads: Callable[[Any], tuple[str, ...]] | None = None

    def __attrs_post_init__(self):
        if (self.fn is None) == (self.worker is None):
            raise ValueError("NodeSpec needs exactly one of fn (controller) or worker (model)")
        if (self.worker is None) != (self.mode is None):
            raise ValueError("NodeSpec.mode is set exactly when the node has a worker")
        if not attrs.has(self.params):
            raise ValueError("NodeSpec.params must be an attrs class")
        if self.rows == "repeat" and "n" not in attrs.fields_dict(self.params):
            raise ValueError('NodeSpec with rows="repeat" needs a param `n`')

    @property
    def uses_model(self) -> bool:
        return self.worker is not None

    def reads_for(self, params: Any) -> tuple[str, ...]:
        """The keys read under these params: `reads` plus any `extra_reads(params)`."""
        extra = self.extra_reads(params) if self.extra_reads else ()
        return tuple(dict.fromkeys((*self.reads, *extra)))


def split_output(out: Any) -> tuple[dict, dict]:
    """A node's return value as (writes, metrics)."""
    if isinstance(out, tuple):
        writes, metrics = out
        return dict(writes), dict(metrics)
    return dict(out), {}
