"""Policy update: PPO's clipped surrogate (arXiv 1707.06347) by default, or another policy
loss of the table `flowrl.math.losses.LOSSES` by the `loss` param (GSPO, CISPO, GPG, GMPO,
SAPO, Clip-Cov, KL-Cov) or one of your own by reference ("my_losses.py:topr",
flowrl/math/components.py), with an entropy bonus and an optional KL loss against the
reference (GRPO, arXiv 2402.03300).

reads: prompts, prompt_mask, responses, response_mask, response_attention, advantages,
       old_logprobs (+ ref_logprobs when kl_loss_coef > 0, rollout_logprobs when tis_cap > 0;
       old_logprobs not read when on_policy) -> writes: -
The forward attends to response_attention; the loss counts only response_mask (sampled tokens).
When the rollout's log-probs reach it (generate's return_logprobs), it reports how far they
are from the trainer's before the update (old_logprobs, or this forward's when on_policy), over
response tokens: rollout_logprob_diff_mean and _max (verl's rollout_probs_diff_* compares
probabilities; a bf16 rollout of an fp32 policy shows here in every step).
"""

from __future__ import annotations

import types

import attrs

from flowrl import refs
from flowrl.hooks import MINI_BATCHES, Finding, TruncatedIS
from flowrl.lazy import torch
from flowrl.math import components, ops
from flowrl.math.losses import LOSSES, Chunk, Loss, loss_params, tis_weights
from flowrl.nodespec import NodeSpec
from flowrl.params import (
    MAX_EPOCHS,
    MAX_ROWS,
    MAX_TOKENS,
    Rule,
    above,
    at_least,
    checked,
    count,
    interval,
    one_of,
    positive,
    zero_or,
)

# the table is read when a value is checked, so a loss added to it at run time is accepted too;
# a reference is loaded and checked by the node's check hook, where the graph's folder is known
KNOWN_LOSS = Rule(
    one_of(LOSSES).text + ', or "file.py:function" (a loss of your own)',
    lambda name: name in LOSSES or refs.is_reference(name),
    components.loss_fix,
)


TABLE = Rule(
    "a table of the loss's own params (its record's options)", lambda v: isinstance(v, dict)
)


@attrs.frozen
class Params:
    epochs: int = checked(1, count(1, MAX_EPOCHS))  # passes over the step's rows
    mini_batch_size: int = checked(0, count(0, MAX_ROWS))  # rows per optimizer step; 0 = all
    clip_low: float = checked(0.2, at_least(0))  # ratio floor 1 - clip_low
    clip_high: float = checked(0.2, at_least(0))  # ratio ceiling 1 + clip_high (DAPO: 0.28)
    dual_clip: float = checked(3.0, zero_or(above(1)))  # loss ppo: bound c where A < 0 (verl: 3)
    agg: str = checked("token-mean", one_of(ops.AGG_MODES))  # loss aggregation
    entropy_coef: float = 0.0  # entropy bonus weight
    kl_loss_coef: float = checked(0.0, at_least(0))  # weight of the KL(policy || ref) loss term
    kl_loss_kind: str = checked("k3", components.KNOWN_KL)  # KL estimator of the loss
    temperature: float = checked(1.0, positive())  # divide logits as the sampler did
    on_policy: bool = False  # old log-probs = this forward's, detached (epochs = 1, 1 mini-batch)
    skip_zero_rows: bool = True  # skip rows with no gradient (zero advantage, no KL/entropy)
    loss: str = checked("ppo", KNOWN_LOSS)  # the policy loss: LOSSES, or your own by reference
    tis_cap: float = checked(0.0, at_least(0))  # truncated IS cap C on exp(old - rollout); 0 = off
    norm_length: int = checked(0, count(0, MAX_TOKENS))  # seq-mean-token-sum-norm divisor; 0 = t
    tau_pos: float = checked(1.0, positive())  # loss sapo: gate temperature where A > 0
    tau_neg: float = checked(1.05, positive())  # loss sapo: gate temperature where A < 0
    cov_ratio: float = checked(2e-4, interval(0, 1))  # clip_cov / kl_cov: share of tokens held
    cov_kl_coef: float = checked(1.0, at_least(0))  # loss kl_cov: weight of abs(log r) there
    loss_options: dict = checked({}, TABLE)  # a loss of your own: its own params (its options)


def contributing_rows(advantages, params: Params, loss: Loss | None = None):
    """(b,) bool: rows whose loss terms have a gradient. With no KL or entropy term, a row
    whose advantage is zero everywhere adds exactly zero to the loss and its gradient, so its
    forward and backward are skipped (the loss normaliser still counts it). A loss with
    `all_rows` (Clip-Cov, KL-Cov: a statistic over the chunk's tokens) needs every row.
    `loss`: the params' loss record (default: the built-in of that name)."""
    every = params.kl_loss_coef > 0 or params.entropy_coef > 0 or not params.skip_zero_rows
    if every or (loss or LOSSES[params.loss]).all_rows:
        return torch.ones(advantages.shape[0], dtype=torch.bool)
    return (advantages != 0).any(-1)


class PolicyUpdateWorker:
    """Runs the update; keeps the loss's state across steps (`state_dict`, saved in every
    checkpoint by the pool worker and restored on --resume)."""

    def __init__(self, engine, params: Params):
        self.engine, self.params = engine, params
        self.loss, self.kl = None, None  # resolved at the first call, from the graph's folder
        self.options, self.state, self.loaded = None, {}, None

    def _resolve(self, base_dir) -> None:
        p = self.params
        self.loss = components.resolve_loss(p.loss, base_dir)
        self.kl = components.kl_function(p.kl_loss_kind, base_dir)
        self.options = components.loss_options(self.loss, p.loss, p.loss_options, "update")
        if self.loaded is not None:  # a resumed run: the checkpoint's state
            loaded = self.loaded
            self.state = components.checked_state(self.loss, p.loss, loaded, "the checkpoint")
        else:
            self.state = components.first_state(self.loss, p.loss, self.options)
        self.watch = components.ModuleWatch(self.loss.fn, self.loss.state, self.loss.after_update)

    def __call__(self, batch):
        p = self.params
        if self.loss is None:
            self._resolve(batch.meta.get("base_dir", "."))
        compared = ("rollout_logprob_diff_mean",) if "rollout_logprobs" in batch else ()
        self.diff_max = None  # a device scalar while the update runs: nothing read back
        metrics = self.engine.update(
            batch,
            self.micro_loss,
            epochs=p.epochs,
            mini_batch_size=p.mini_batch_size,
            metrics=("pg_loss", "kl_loss", "entropy") + tuple(self.loss.rates) + compared,
            select=lambda mini: contributing_rows(mini["advantages"], p, self.loss),
            rates=("entropy",) + tuple(self.loss.rates) + compared,
        )
        if compared:  # this rank's largest, over the rows that ran
            metrics["rollout_logprob_diff_max"] = float(self.diff_max or 0.0)
        if self.loss.after_update is not None:
            rates = {key: metrics[key] for key in self.loss.rates}
            self.state = components.next_state(self.loss, p.loss, self.state, rates, self.options)
        if changed := self.watch.changed():
            raise components.ComponentError(
                f'loss "{p.loss}": its file changed the module-level {", ".join(changed)} during '
                "a step; state kept there is not saved in checkpoints (it resets on --resume) "
                "and differs between ranks",
                "keep it in the Loss record's state (docs/extending.md, 'A loss with params "
                "and state')",
            )
        for key, value in self.state.items():  # a loss's numbers, logged each step
            if isinstance(value, int | float) and not isinstance(value, bool):
                metrics[f"loss_state/{key}"] = float(value)
        # rows with a learning signal: a zero gradient over them means the weights no longer
        # respond (the run's guard stops on it); over none, an update is rightly empty
        signal = (batch["advantages"] != 0).any(-1).float()  # (b,)
        metrics["signal_rows"] = float(signal.mean()) if len(signal) else 0.0
        return {}, metrics

    def state_dict(self) -> dict:
        """What a checkpoint keeps of this node: the loss's state (JSON)."""
        return {"loss": self.state if self.loss is not None else (self.loaded or {})}

    def load_state_dict(self, state: dict) -> None:
        self.loaded = state.get("loss", {})
        if self.loss is not None:
            self.state = components.checked_state(
                self.loss, self.params.loss, self.loaded, "the checkpoint"
            )

    def micro_loss(self, micro, counts) -> tuple:
        """The loss of one micro-batch and its metrics (see `TrainEngine.update`)."""
        p = self.params
        # entropy: a loss term only with entropy_coef, else a metric computed without gradients
        entropy = True if p.entropy_coef > 0 else "metric"
        out = self.engine.forward(micro, grad=True, entropy=entropy, temperature=p.temperature)
        logprobs, mask = out["logprobs"], micro["response_mask"]
        old = logprobs.detach() if p.on_policy else micro["old_logprobs"]
        weights = None
        if p.tis_cap > 0:
            weights = tis_weights(old, micro["rollout_logprobs"], p.tis_cap)
        norm_length = p.norm_length or None
        chunk = Chunk(
            counts.num_tokens,
            counts.num_seqs,
            norm_length,
            weights,
            options=self.options,
            state=types.MappingProxyType(self.state),  # read-only: after_update changes it
        )
        returned = self.loss.fn(logprobs, old, micro["advantages"], mask, p, chunk)
        loss, rates = components.checked_loss(self.loss, p.loss, returned)
        inputs = (logprobs.detach(), old, micro["advantages"])
        components.check_finite(self.loss, p.loss, loss.detach(), rates, inputs, mask)
        share = counts.share(mask)
        metrics = {"pg_loss": ops.metric_value(loss)}
        metrics |= {key: rates[key] * share for key in self.loss.rates}
        metrics["entropy"] = (
            ops.metric_value(ops.masked_mean(out["entropy"].detach(), mask)) * share
        )
        if "rollout_logprobs" in micro:
            diff = (old.detach() - micro["rollout_logprobs"]).abs() * mask  # (b, t)
            metrics["rollout_logprob_diff_mean"] = (
                ops.metric_value(ops.masked_mean(diff, mask)) * share
            )
            most = diff.amax()
            self.diff_max = most if self.diff_max is None else torch.maximum(self.diff_max, most)
        if p.entropy_coef > 0:
            loss = loss - p.entropy_coef * chunk.aggregate(out["entropy"], mask, p.agg)
        if p.kl_loss_coef > 0:
            kl = self.kl(logprobs, micro["ref_logprobs"])  # (b, t)
            kl_loss = chunk.aggregate(kl, mask, p.agg)
            loss = loss + p.kl_loss_coef * kl_loss
            metrics["kl_loss"] = float(kl_loss.detach())
        return loss, metrics


def check(params: Params, context) -> list[Finding]:
    """Mini-batches against the step's rows, on_policy against several updates, and the
    loss-only params against the chosen loss."""
    out = MINI_BATCHES.check(params, context)
    mini = params.mini_batch_size
    if params.on_policy and (params.epochs > 1 or 0 < mini < context.rows):
        out.append(
            Finding(
                "on_policy = true reuses the update's own log-probs as the old "
                "ones, which is exact only for one update per batch",
                "set epochs = 1 and mini_batch_size = 0, or on_policy = false with an "
                "old_logprob node",
            )
        )
    return out + loss_findings(params, context)


def quoted(name: str) -> str:
    return f'"{name}"'


def component_findings(params: Params, context) -> tuple[Loss | None, list[Finding]]:
    """The loss record (None when it cannot be used) and the problems of the loss and the KL
    kind the params name, loaded from the graph's folder when they are references."""
    problems, loss = [], None
    try:
        loss = components.resolve_loss(params.loss, context.base_dir)
        problems += components.loss_problems(loss, params.loss, Params, "update.policy")
        if not problems:
            components.loss_options(loss, params.loss, params.loss_options, context.node)
    except components.ComponentError as e:
        problems.append(e)
    try:
        components.kl_function(params.kl_loss_kind, context.base_dir)
    except components.ComponentError as e:
        problems.append(e)
    return (None if problems else loss), [Finding(e.message, e.fix) for e in problems]


def loss_findings(params: Params, context) -> list[Finding]:
    """The loss and KL kind must load and fit (a reference's as a built-in's); a loss-only
    param set away from its default under a loss that does not read it is an error; an `agg`
    other than the one the loss's paper (and verl) fixes is a warning."""
    loss, out = component_findings(params, context)
    if loss is None:
        return out
    defaults = attrs.fields_dict(Params)
    for name in loss_params():
        value = getattr(params, name)
        if name not in loss.params and value != defaults[name].default:
            readers = " or ".join(quoted(n) for n, o in sorted(LOSSES.items()) if name in o.params)
            out.append(
                Finding(
                    f"{name} = {value!r} is read only by loss = {readers}; "
                    f"loss = {quoted(params.loss)} ignores it",
                    f"remove {name}, or set loss to one that reads it",
                )
            )
    if loss.agg and params.agg != loss.agg:
        out.append(
            Finding(
                f'[nodes.{context.node}] loss = "{params.loss}" with agg = "{params.agg}": the '
                f'paper and verl average it as agg = "{loss.agg}"; set that to match them',
                warning=True,
            )
        )
    return out


SPEC = NodeSpec(
    reads=(
        "prompts",
        "prompt_mask",
        "responses",
        "response_mask",
        "response_attention",
        "advantages",
    ),
    writes=(),
    params=Params,
    worker=PolicyUpdateWorker,
    mode="train",
    head="lm",
    optional_reads={
        "old_logprobs": lambda p: not p.on_policy,
        "ref_logprobs": lambda p: p.kl_loss_coef > 0,
        "rollout_logprobs": lambda p: p.tis_cap > 0,
    },
    reads_if_written=("rollout_logprobs",),  # rollout_logprob_diff_* then
    check=check,
    updates_per_step=MINI_BATCHES.updates,
    correction=TruncatedIS(cap="tis_cap"),
)
