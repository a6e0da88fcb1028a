"""The records a node's SPEC hands the framework through its hooks (flowrl/nodespec.py lists
them): what a `check` hook receives and returns (`CheckContext`, `Finding`), and the ready-made
hooks a node names its params in (`MiniBatches`, `Refill`, `TruncatedIS`, `TinyNode`,
`Continuation`). They are public: import them from flowrl.api.

This module imports neither torch nor ray.
"""

import difflib
from collections.abc import Callable
from typing import Any

import attrs


@attrs.frozen
class CheckContext:
    """What a node's `check` may look at, besides its params."""

    node: str  # the node's id in the graph
    rows: int  # rows the node receives in a step (prompts x samples upstream of it)
    samples: int  # samples per prompt upstream of and including the node
    prompts: int  # prompts per step
    workers: int  # ranks of the pool it runs on (1 for a controller node)
    base_dir: str  # the graph file's folder: relative paths in params resolve against it
    model_path: str = ""  # the path of the node's model ("" for a controller node)
    data_sources: tuple = ()  # data.source and data.val_source (built-in names or files)
    policy_path: str = ""  # the rollout model's path: its tokenizer writes the batch's ids


@attrs.frozen
class Finding:
    """One result of a node's `check`: an error (the graph is refused) or a warning."""

    message: str
    fix: str = ""
    warning: bool = False


@attrs.frozen
class MiniBatches:
    """The hooks of a train node that makes several passes over a step's rows in mini-batches:
    `epochs` and `size` name the node's params (0 rows = the whole batch), so a node whose
    params are called differently gets the same checks and schedule arithmetic:

        batching = MiniBatches(epochs="passes", size="minibatch")
        SPEC = NodeSpec(..., check=batching.check, updates_per_step=batching.updates)
    """

    epochs: str = "epochs"
    size: str = "mini_batch_size"

    def updates(self, params: Any, rows: int) -> int:
        """Optimizer steps per training step: passes x mini-batches per pass."""
        size = getattr(params, self.size) or rows
        return getattr(params, self.epochs) * -(-rows // max(size, 1))

    def check(self, params: Any, context: CheckContext) -> list[Finding]:
        out, mini = [], getattr(params, self.size)
        if mini > context.rows:
            out.append(
                Finding(
                    f"{self.size} = {mini} exceeds the {context.rows} rows of a step "
                    f"({context.prompts} prompts x {context.samples} samples)",
                    f"set {self.size} <= {context.rows} (0 = the whole batch)",
                )
            )
        if 0 < mini < context.workers:  # a whole batch smaller than the ranks: the compiler warns
            out.append(
                Finding(
                    f"[nodes.{context.node}] gives {mini} rows to {context.workers} ranks: "
                    "some ranks idle (raise data.batch_size or lower the pool's workers)",
                    warning=True,
                )
            )
        return out


MINI_BATCHES = MiniBatches()  # for params named epochs and mini_batch_size


@attrs.frozen
class Refill:
    """The hook of a filter node whose step refills: `groups` names the param holding how many
    groups (prompts, by `uid`) the step should keep (0 = no refill: train on what is kept) and
    `rounds` the one holding the most prompt batches a step may sample (verl's
    `max_num_gen_batches`). The controller runs the nodes before the filter on a prompt batch,
    keeps what the filter keeps, and repeats on the next prompt batch until `groups` groups are
    kept or `rounds` batches are spent; then it trims to `groups` groups and runs the rest of
    the step once on them."""

    groups: str = "min_groups"
    rounds: str = "max_rounds"

    def of(self, params: Any) -> tuple[int, int]:
        """(groups to keep, most prompt batches) under these params."""
        return int(getattr(params, self.groups)), int(getattr(params, self.rounds))

    def check_names(self, params_class: type) -> None:
        """Both names are params of the node (checked when its SPEC is built)."""
        fields = attrs.fields_dict(params_class)
        for role, name in (("groups", self.groups), ("rounds", self.rounds)):
            if name not in fields:
                close = difflib.get_close_matches(name, fields, n=1)
                hint = f' (did you mean "{close[0]}"?)' if close else ""
                raise ValueError(
                    f'Refill({role}="{name}") names no param of {params_class.__name__}{hint}: '
                    f"name one of its int fields ({', '.join(fields) or 'it has none'})"
                )


@attrs.frozen
class TruncatedIS:
    """The `correction` hook of an update node that weights its loss by truncated importance
    sampling between the trainer's and the rollout's log-probs (min(exp(old - rollout), C)):
    `cap` names the param holding C (0 = off). The correction applies when the cap is set and
    the node reads `rollout_logprobs`; the staleness warning's fix names the param:

        SPEC = NodeSpec(..., correction=TruncatedIS(cap="is_limit"))
    """

    cap: str = "tis_cap"

    def __call__(self, params: Any, reads: tuple[str, ...], node: str) -> str:
        cap = getattr(params, self.cap)
        if "rollout_logprobs" not in reads or not cap:
            return ""
        return f"truncated importance sampling in {node} ({self.cap} = {cap:g}, rollout_logprobs)"


@attrs.frozen
class TinyNode:
    """A node's part in a tiny run (`flowrl run --tiny`, flowrl/front/tiny_run.py), as its
    `tiny` hook returns it: the params the run sets, and what the run's closing summary says
    of the node besides its scorer."""

    params: dict[str, Any] = attrs.field(factory=dict)  # param -> value (bool, int, float, str)
    model_role: str = ""  # e.g. "reward model": the summary lists it as random weights
    tools: tuple[str, ...] = ()  # tools counted from the node's metrics <node>/calls/<tool>[/ok]
    scripted: bool = False  # the tools are called by a scripted first turn, not the policy
    real: dict[str, str] = attrs.field(factory=dict)  # what runs as written: what -> reference
    # interaction name -> where it comes from; counted from <node>/interactions/<name>
    interactions: dict[str, str] = attrs.field(factory=dict)


CONTINUED = ("responses", "response_mask", "rollout_logprobs")  # what rounds append to


@attrs.frozen
class Continuation:
    """The hook of a rollout node whose responses run.partial_rollout continues over rounds
    (flowrl/runtime/partial.py). Each round the runtime calls the node with n = 1 and
    max_new_tokens = the round's tokens on prompts that end with each response so far, and
    appends what it samples to `CONTINUED`: `responses` and `response_mask` (which the node
    writes) and `rollout_logprobs` (kept where the node writes them under its params: its
    `writes` or `optional_writes`). When a response ends, `finish` gives the node's other
    writes for the whole response:

        def finish(rows, tokenizer):    # rows: DataProto of whole responses (responses,
            ...                         #   response_mask (b, t), right-padded)
            return {"response_text": ..., "response_attention": ...}
        SPEC = NodeSpec(..., continues=Continuation(("response_text", "response_attention"),
                                                    finish))

    Attributes:
        columns: the writes `finish` returns (the node's writes besides `CONTINUED`).
        finish: (rows, tokenizer) -> {column: (b, ...) tensor or (b,) array}.
    """

    columns: tuple[str, ...]
    finish: Callable[[Any, Any], dict]

    def check(self, writes: tuple[str, ...]) -> None:
        """Refuse a node whose writes the rounds would not rebuild."""
        if not {"responses", "response_mask"} <= set(writes):
            raise ValueError("NodeSpec.continues needs a node that writes responses, response_mask")
        missing = [k for k in writes if k not in CONTINUED and k not in self.columns]
        if missing:
            raise ValueError(
                f"NodeSpec.continues: the node writes {', '.join(missing)}, which neither the "
                f"rounds ({', '.join(CONTINUED)}) nor Continuation.columns rebuild: add them "
                "to columns and return them from finish"
            )
