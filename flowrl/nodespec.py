"""The node contract: what every node module declares, in one `SPEC = NodeSpec(...)` line.

A node is one operation of an algorithm. Its module holds, in this order: a docstring (what,
paper, `reads -> writes`), a `Params` attrs class (the only place defaults live), pure functions
with the math, a worker class if it runs a model, and the SPEC.

Two kinds of node:

- controller nodes give `fn`: `fn(batch, params) -> writes` runs on the controller, no model.
  With `stateful=True` it is `fn(batch, params, state)`, where `state` is a dict the runtime
  keeps across steps and saves in checkpoints as JSON (e.g. an adaptive KL coefficient), so
  it holds numbers, strings, lists and dicts only.
- model nodes give `worker` and `mode`: the runtime builds `worker(engine, params)` once on each
  rank of the pool that hosts the node's model and calls `worker(batch)` with that rank's rows.

Either returns a dict holding exactly the declared `writes`, or a pair `(writes, metrics)` with
metrics a dict of floats, or a triple `(writes, metrics, phases)` with phases a list of
`(name, start, end)` wall-clock spans in epoch seconds (e.g. the agent node's decode and tool
time), which the run's trace shows under the node. A node with `rows="repeat"` returns
`params.n` rows per input row (interleaved: all samples of row 0, then row 1, ...);
`rows="filter"` returns only the key `keep`, a bool (b,) mask, and the runtime drops the other
rows from the step's batch.

What the framework needs to know about a node's params it asks the node, through hooks on the
spec, never by reading a param name itself:
- `check(params, context) -> findings`: the node's own batch checks, run by `flowrl check`;
- `updates_per_step(params, rows) -> int`: optimizer steps per training step (train nodes), which
  sizes the learning-rate schedule;
- `correction(params, reads, node) -> str`: the off-policy correction a train node applies
  itself, in words, so `run.staleness` knows the samples from older weights are corrected
  (`TruncatedIS` names the cap param of truncated importance sampling);
- `tiny(params, base_dir) -> TinyNode`: the params a tiny run (`flowrl run --tiny`) sets on the
  node and what its summary says of it (the agent node scripts a first turn of tool calls);
- `optional_reads` / `optional_writes`: keys read or written only under some params (e.g.
  `old_logprobs` unless `on_policy`);
- `refill` (filter nodes): how many groups to keep and in how many prompt batches, so the
  controller samples more prompts until the filter has kept enough (DAPO's dynamic sampling);
- rollout nodes' params subclass `RolloutParams`, so validation can ask any of them for greedy
  decoding and the compiler can size the KV cache;
- `own_tokenizer` (model nodes): the node writes the text again with its own model's
  tokenizer, so its model need not share the policy's (reward.model);
- `continues` (rollout nodes): a `Continuation`, so run.partial_rollout can continue the
  node's responses over rounds and rebuild its other columns when they end;
- `prompt` (rollout nodes): `(params, base_dir, tokenizer) -> row -> prompt text`, how the
  data loader renders every prompt the node samples from (the agent node shows its tools).

The records that follow one node through the stages: `NodeSpec` (here: what the module declares),
`NodeRef` (registry: where the module is), `NodeDecl` (the graph file's `[nodes.<id>]`, resolved),
`NodeSetup` (runtime/setup.py: the plain data a pool rank builds the node's worker from) and
`NodeCall` (runtime/node_call.py: what every call of the node shares: id, spec, renames, params).

This module imports neither torch nor ray.
"""

import inspect
from collections.abc import Callable
from typing import Any

import attrs

from flowrl import compat, hooks
from flowrl.errors import located
from flowrl.params import MAX_SAMPLES, MAX_TOKENS, checked, count, interval, positive

__all__ = ["GREEDY", "KEEP", "NodeSpec", "RolloutParams", "split_output"]

MODES = ("rollout", "inference", "train")
DISPATCHES = ("split", "broadcast", "rank0")
ROWS = ("same", "repeat", "filter")
HEADS = ("lm", "value")
KEEP = "keep"  # the one key a filter node returns


@attrs.frozen
class RolloutParams:
    """Params every rollout node has (its `Params` subclasses this). Validation sets
    `do_sample = False, n = 1` on every rollout node; the compiler sizes the KV cache from
    `max_new_tokens`."""

    n: int = checked(1, count(1, MAX_SAMPLES))  # samples per prompt
    max_new_tokens: int = checked(32, count(1, MAX_TOKENS))  # response length cap
    temperature: float = checked(1.0, positive())  # sampling temperature
    top_p: float = checked(1.0, interval(0, 1, low_open=True))  # nucleus sampling; 1.0 = off
    top_k: int = checked(0, count(0, MAX_TOKENS))  # top-k sampling; 0 = off
    do_sample: bool = True  # False = greedy (validation uses greedy)


GREEDY = {"do_sample": False, "n": 1}  # what validation sets on every rollout node


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
        optional_reads: key -> params -> bool: further keys, read only when the predicate
            holds (e.g. {"ref_logprobs": lambda p: p.kl_loss_coef > 0}).
        optional_writes: key -> params -> bool: further keys, written only when the
            predicate holds (e.g. generate's rollout_logprobs).
        reads_if_written: further keys read when a node before it in the graph writes them,
            for what the node reports only then (the policy update's rollout_logprobs: how
            far the rollout's log-probs are from the trainer's); never required.
        refill: for a filter node, the `Refill` naming its params: the controller re-runs the
            nodes before it on fresh prompt batches until it has kept enough groups.
        check: (params, CheckContext) -> list of Finding: the node's own checks of its params
            against the step's batch, run at compile time (`flowrl check`).
        updates_per_step: (params, rows) -> optimizer steps the node takes per training step
            on `rows` rows (train nodes; default 1), for the learning-rate schedule.
        correction: (params, reads, node) -> the off-policy correction this train node
            applies under these params, in words naming `node` ("" = none); `reads` are its
            graph keys. `run.staleness` warns when no update of the rollout model corrects.
        tiny: (params, base_dir) -> TinyNode: what a tiny run sets on the node and reports.
        multi_turn: a rollout node that drives its backend turn by turn (the agent node):
            `flowrl check` refuses a model whose backend does not serve that
            (`multi_turn` in flowrl/backends.py).
        scorer_param: the param holding a reward scorer reference ("auto", a built-in name
            or "file.py:function"), for tools that swap scorers (`flowrl run --tiny`).
        continues: a rollout node whose responses run.partial_rollout may continue over
            rounds: the `Continuation` saying how (None: the graph is refused with it).
        prompt: (params, base_dir, tokenizer) -> a renderer, `row -> prompt text`, that the
            data loader templates every prompt with (the agent node's shows the row's tools);
            None: the tokenizer's chat template on the row's messages.
        own_tokenizer: a model node that writes the text it reads again with its own model's
            tokenizer (a reward model with another vocabulary), so its model need not share
            the policy's tokenizer; where its params make it read the policy's ids instead, its
            `check` says whether they fit.
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
    optional_reads: dict[str, Callable[[Any], bool]] = attrs.field(factory=dict)
    optional_writes: dict[str, Callable[[Any], bool]] = attrs.field(factory=dict)
    reads_if_written: tuple[str, ...] = ()
    refill: "hooks.Refill | None" = None
    check: Callable[[Any, hooks.CheckContext], list[hooks.Finding]] | None = None
    updates_per_step: Callable[[Any, int], int] | None = None
    correction: Callable[[Any, tuple[str, ...], str], str] | None = None
    tiny: "Callable[[Any, str], hooks.TinyNode] | None" = None
    multi_turn: bool = False
    scorer_param: str = ""
    continues: "hooks.Continuation | None" = None
    prompt: Callable[[Any, str, Any], Callable[[dict], str]] | None = None
    own_tokenizer: bool = False

    def __attrs_post_init__(self):
        if (self.fn is None) == (self.worker is None):
            raise ValueError("NodeSpec needs exactly one of fn (controller) or worker (model)")
        if (self.worker is None) != (self.mode is None):
            raise ValueError("NodeSpec.mode is set exactly when the node has a worker")
        if not attrs.has(self.params):
            raise ValueError("NodeSpec.params must be an attrs class")
        if self.rows == "repeat" and "n" not in attrs.fields_dict(self.params):
            raise ValueError('NodeSpec with rows="repeat" needs a param `n`')
        if self.mode == "rollout" and not issubclass(self.params, RolloutParams):
            raise ValueError(
                "a rollout node's Params must subclass flowrl.nodespec.RolloutParams "
                "(n, max_new_tokens, temperature, top_p, top_k, do_sample)"
            )
        if self.updates_per_step is not None and self.mode != "train":
            raise ValueError('NodeSpec.updates_per_step is for mode="train" nodes')
        if self.correction is not None and self.mode != "train":
            raise ValueError('NodeSpec.correction is for mode="train" nodes')
        tis = self.correction if isinstance(self.correction, hooks.TruncatedIS) else None
        if tis and tis.cap not in attrs.fields_dict(self.params):
            raise ValueError(f"NodeSpec.correction: TruncatedIS(cap={tis.cap!r}) names no param")
        if self.refill is not None and self.rows != "filter":
            raise ValueError('NodeSpec.refill is for rows="filter" nodes')
        if self.multi_turn and self.mode != "rollout":
            raise ValueError('NodeSpec.multi_turn is for mode="rollout" nodes')
        if self.scorer_param and self.scorer_param not in attrs.fields_dict(self.params):
            raise ValueError(f"NodeSpec.scorer_param names no param: {self.scorer_param!r}")
        if self.own_tokenizer and self.worker is None:
            raise ValueError("NodeSpec.own_tokenizer is for model nodes (a worker)")
        for hook in ("continues", "prompt"):
            if getattr(self, hook) is not None and self.mode != "rollout":
                raise ValueError(f'NodeSpec.{hook} is for mode="rollout" nodes')
        if self.continues is not None:
            self.continues.check(self.writes)
        if self.refill is not None:
            self.refill.check_names(self.params)
        if self.fn is not None:
            _check_fn_arguments(self.fn, self.stateful)

    @property
    def uses_model(self) -> bool:
        return self.worker is not None

    def reads_for(self, params: Any) -> tuple[str, ...]:
        """The keys read under these params: `reads` plus the optional reads that apply."""
        extra = [key for key, wanted in self.optional_reads.items() if wanted(params)]
        return tuple(dict.fromkeys((*self.reads, *extra)))

    def writes_for(self, params: Any) -> tuple[str, ...]:
        """The keys written under these params: `writes` plus the optional writes that apply."""
        extra = [key for key, wanted in self.optional_writes.items() if wanted(params)]
        return tuple(dict.fromkeys((*self.writes, *extra)))

    def findings(self, params: Any, context: hooks.CheckContext) -> list[hooks.Finding]:
        """The `check` hook's findings; a hook that raises is one finding naming it."""
        if self.check is None:
            return []
        try:
            return list(self.check(params, context))
        except Exception as e:  # a node author's hook: its failure is a finding, not a traceback
            return [
                hooks.Finding(
                    f"its check hook {located(self.check)} raised {type(e).__name__}: {e}",
                    "fix that function (it must return a list of Finding)",
                )
            ]

    def updates(self, params: Any, rows: int) -> int:
        """Optimizer steps per training step; 1 for a train node without the hook."""
        return self.updates_per_step(params, rows) if self.updates_per_step else 1

    @property
    def mini_batches(self) -> "hooks.MiniBatches | None":
        """The `MiniBatches` declaration whose `updates` is this node's `updates_per_step`
        (it names the epochs and mini-batch size params), or None."""
        owner = getattr(self.updates_per_step, "__self__", None)
        return owner if isinstance(owner, hooks.MiniBatches) else None


def _check_fn_arguments(fn, stateful: bool) -> None:
    """A controller fn takes (batch, params), or (batch, params, state) when stateful."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or C function: nothing to check
        return
    wanted = ("batch", "params", "state") if stateful else ("batch", "params")
    try:
        signature.bind(*wanted)
    except TypeError:
        pass
    else:
        return
    takes = f"{getattr(fn, '__name__', 'fn')}{signature}"
    if stateful:
        fix = "give it a third parameter, state (a dict kept across steps and checkpointed)"
    else:
        fix = "give it two parameters (batch, params), or set stateful=True to get a state dict"
    raise ValueError(
        f"NodeSpec(stateful={stateful}) calls fn({', '.join(wanted)}), but {located(fn)} is "
        f"{takes}: {fix}"
    )


def split_output(out: Any) -> tuple[dict, dict, list]:
    """A node's return value (writes, (writes, metrics) or (writes, metrics, phases)) as
    (writes, metrics, phases)."""
    if not isinstance(out, tuple):
        return dict(out), {}, []
    if len(out) not in (2, 3):
        raise TypeError(
            f"a node returned a tuple of {len(out)}: return writes, (writes, metrics) or "
            "(writes, metrics, phases)"
        )
    writes, metrics, *phases = out
    return dict(writes), dict(metrics), [tuple(p) for p in (phases[0] if phases else ())]


# MINI_BATCHES, which earlier docs imported from here, keeps that spelling with a warning; the
# other hooks' records are flowrl.api's (flowrl/hooks.py)
__getattr__ = compat.moved_names(__name__)
