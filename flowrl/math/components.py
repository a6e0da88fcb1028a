"""Policy losses and KL kinds of your own, chosen by reference where a node chooses a built-in
by name: `update.policy`'s `loss` and `kl_loss_kind`, `reward.kl_penalty`'s `kl_kind`.

    loss = "my_losses.py:topr"        # a function with the loss signature, or a `Loss` record
    kl_loss_kind = "my_kl.py:k_half"  # kl(logprobs, ref_logprobs) -> (b, t)

A reference is "file.py:name" (relative to the graph file's folder) or "package.module:name",
loaded through the one resolver (flowrl/refs.py). A built-in and a reference are checked the
same way, twice: at `flowrl check` (it loads, its signature binds, its record's params, rates and
aggregation are right: `loss_problems`, `kl_problems`) and at each call (what it returns:
`checked_loss`, `CheckedKL`). Every message names the reference, the function's file:line and
the fix. (Advantage estimators are nodes, chosen by `uses`: docs/extending.md.)
"""

from __future__ import annotations

import functools
import inspect
import math

import attrs

from flowrl import refs
from flowrl.errors import did_you_mean, located
from flowrl.lazy import torch
from flowrl.math import losses, ops
from flowrl.math.loss_state import (  # noqa: F401 (update.policy reads them here)
    STATE_FIX,
    ComponentError,
    ModuleWatch,
    checked_state,
    first_state,
    loss_options,
    next_state,
)
from flowrl.math.losses import Loss
from flowrl.params import Rule, one_of

LOSS_ARGUMENTS = ("logprobs", "old_logprobs", "advantages", "response_mask", "params", "chunk")
KL_ARGUMENTS = ("logprobs", "ref_logprobs")
OWN_LOSS = 'write your own in a file and name it: loss = "my_losses.py:my_loss"'


def _load(ref: str, base_dir, what: str):
    """The object a reference names; its file's own import errors as a ComponentError."""
    try:
        return refs.load(ref, base_dir, what, error=ComponentError)
    except ComponentError:
        raise
    except Exception as e:  # the user's file raised while it was imported
        raise ComponentError(
            f'{what} "{ref}": importing it failed: {type(e).__name__}: {e}', "fix that file"
        ) from e


def _binding_problem(function, arguments: tuple) -> str:
    """'' when `function(*arguments)` binds, else what is wrong."""
    try:
        inspect.signature(function).bind(*arguments)
    except TypeError as e:
        return f"cannot be called as ({', '.join(arguments)}): {e}"
    except ValueError:  # no signature to read (a builtin)
        pass
    return ""


# -- losses --------------------------------------------------------------------------------------


def loss_fix(name) -> str:
    """The fix of a loss name that is neither built in nor a reference."""
    close = did_you_mean(str(name), losses.LOSSES).strip(" ()")
    return f"{close + ' Or ' if close else ''}{OWN_LOSS} (docs/extending.md, 'A policy loss')"


def resolve_loss(name: str, base_dir=".") -> Loss:
    """The `Loss` record `name` names: a built-in of `losses.LOSSES`, or a reference to a `Loss`
    record or to a loss function (taken as `Loss(function)`: no rates, params or agg)."""
    if name in losses.LOSSES:  # read at the call: a line added to the table at run time counts
        return losses.LOSSES[name]
    if not refs.is_reference(name):
        raise ComponentError(f'loss "{name}" is not a built-in loss', loss_fix(name))
    target = _load(name, base_dir, "loss")
    if isinstance(target, Loss):
        return target
    if callable(target) and not inspect.isclass(target):
        return Loss(target)
    raise ComponentError(
        f'loss "{name}" names a {type(target).__name__}',
        "name a function with the loss signature, or a flowrl.api.Loss record",
    )


def loss_problems(loss: Loss, name: str, params_class: type, node: str) -> list[ComponentError]:
    """What `flowrl check` refuses in a loss record: a function that cannot be called with the
    loss signature, params the node does not have, rates that are not names, an unknown agg."""
    where, out = f'loss "{name}": {located(loss.fn)}', []
    if problem := _binding_problem(loss.fn, LOSS_ARGUMENTS):
        out.append(ComponentError(f"{where} {problem}", f"take ({', '.join(LOSS_ARGUMENTS)})"))
    fields = attrs.fields_dict(params_class)
    for field, value in (("params", loss.params), ("rates", loss.rates)):
        if not isinstance(value, tuple | list) or not all(isinstance(v, str) for v in value):
            out.append(
                ComponentError(
                    f"{where}: its record's {field} = {value!r} is not a tuple of names",
                    f'write {field}=("a", "b"), or {field}=("a",) for one',
                )
            )
    unknown = [p for p in loss.params if isinstance(p, str) and p not in fields]
    for param in unknown:
        out.append(
            ComponentError(
                f'{where} declares the param "{param}", which {node} does not have'
                + did_you_mean(param, fields),
                f"a loss reads its node's params (docs/graph-file.md, {node}): name one of them, "
                "or write an update node of your own for a param of its own",
            )
        )
    if loss.agg is not None and loss.agg not in ops.AGG_MODES:
        modes = ", ".join(f'"{m}"' for m in ops.AGG_MODES)
        out.append(ComponentError(f'{where}: agg = "{loss.agg}" is unknown', f"use one of {modes}"))
    if loss.options is not None and not (inspect.isclass(loss.options) and attrs.has(loss.options)):
        out.append(
            ComponentError(
                f"{where}: its record's options = {loss.options!r} is not an attrs class",
                "decorate the class of the loss's own params with @attrs.frozen",
            )
        )
    for field in ("state", "after_update"):
        value = getattr(loss, field)
        if value is not None and (not callable(value) or inspect.isclass(value)):
            out.append(
                ComponentError(
                    f"{where}: its record's {field} = {value!r} is not a function",
                    STATE_FIX,
                )
            )
    if loss.after_update is not None and loss.state is None:
        out.append(ComponentError(f"{where}: its record has after_update but no state", STATE_FIX))
    return out


def checked_loss(loss: Loss, name: str, out) -> tuple:
    """`out`, a loss call's return value, as (scalar loss, {rate: float}) after checking it
    against the record: a scalar with a gradient, exactly the declared rates, each a number."""
    where = f'loss "{name}": {located(loss.fn)}'
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict)):
        raise ComponentError(
            f"{where} returned a {type(out).__name__}", "return (loss, rates): a scalar and a dict"
        )
    value, rates = out
    if not torch.is_tensor(value) or value.dim() != 0:
        shape = tuple(value.shape) if hasattr(value, "shape") else type(value).__name__
        raise ComponentError(
            f"{where} returned a loss of shape {shape}, not a scalar",
            "reduce the per-token loss (b, t) with chunk.aggregate(token_loss, response_mask, "
            "params.agg), which also makes the micro-batches add up to the mini-batch's loss",
        )
    if not value.requires_grad:
        raise ComponentError(
            f"{where} returned a loss without a gradient",
            "compute it from logprobs, which carry the gradient (no .detach() or .item())",
        )
    declared = tuple(loss.rates)
    missing = [r for r in declared if r not in rates]
    extra = [r for r in rates if r not in declared]
    if missing:
        raise ComponentError(
            f"{where} declares the rates {missing} but returned no value for them",
            "return each in its rates dict, or drop it from its Loss record's rates",
        )
    if extra:
        raise ComponentError(
            f"{where} returned the rates {extra}, which its record does not declare",
            f"declare them, Loss(fn, rates={declared + tuple(extra)}), so that they are "
            "logged, or leave them out",
        )
    return value, {key: _number(where, key, rate) for key, rate in rates.items()}


def check_finite(loss: Loss, name: str, value, rates: dict, inputs: tuple, mask) -> None:
    """A loss or rate that is not finite while its inputs are (on the trained tokens: `inputs`
    (b, t) tensors, `mask` (b, t)) is the loss's own doing: ComponentError naming it, rather
    than a skipped step blamed later on the learning rate. Non-finite inputs are the model's
    (its weights), left to the run's guard."""
    bad = [] if bool(torch.isfinite(value)) else [f"a loss of {float(value)}"]
    bad += [f'the rate "{k}" = {v}' for k, v in rates.items() if not math.isfinite(v)]
    trained = mask.bool()
    if not bad or not all(bool(torch.isfinite(x[trained]).all()) for x in inputs):
        return
    raise ComponentError(
        f'loss "{name}": {located(loss.fn)} returned {" and ".join(bad)} from finite inputs',
        "fix its formula: a log of 0, a division by a zero count or std, an exp of a log-ratio "
        "without ops.ratio_from_log's clamp",
    )


def _number(where: str, key: str, rate) -> float:
    if torch.is_tensor(rate) and rate.numel() == 1:
        return float(rate)
    if isinstance(rate, int | float) and not isinstance(rate, bool):
        return float(rate)
    shape = tuple(rate.shape) if hasattr(rate, "shape") else type(rate).__name__
    raise ComponentError(
        f'{where} returned the rate "{key}" as {shape}, not a number',
        "return one float per rate, a mean over the chunk's trained tokens",
    )


# -- KL kinds ------------------------------------------------------------------------------------


def kl_fix(kind) -> str:
    close = did_you_mean(str(kind), ops.KL_KINDS).strip(" ()")
    own = 'write your own, kl(logprobs, ref_logprobs) -> (b, t), and name it "my_kl.py:kl"'
    return f"{close + ' Or ' if close else ''}{own}"


KNOWN_KL = Rule(  # the rule of a node's KL kind param; a reference is loaded by its check hook
    one_of(ops.KL_KINDS).text + ', or "file.py:function" (a KL estimator of your own)',
    lambda kind: kind in ops.KL_KINDS or refs.is_reference(kind),
    kl_fix,
)


def kl_function(kind: str, base_dir="."):
    """The per-token KL estimator `kind` names: `kl(logprobs, ref_logprobs) -> (b, t)`, a
    built-in of `ops.KL_KINDS` or a reference (its output checked at each call)."""
    if kind in ops.KL_KINDS:
        return functools.partial(ops.kl_estimate, kind=kind)
    if not refs.is_reference(kind):
        raise ComponentError(f'KL kind "{kind}" is not a built-in one', kl_fix(kind))
    function = _load(kind, base_dir, "KL kind")
    for problem in kl_problems(function, kind):
        raise problem
    return CheckedKL(function, kind)


def kl_problems(function, kind: str) -> list[ComponentError]:
    """What `flowrl check` refuses in a KL kind by reference."""
    if not callable(function) or inspect.isclass(function):
        what = f'KL kind "{kind}" names a {type(function).__name__}'
        return [ComponentError(what, "name a function kl(logprobs, ref_logprobs) -> (b, t)")]
    if problem := _binding_problem(function, KL_ARGUMENTS):
        where = f'KL kind "{kind}": {located(function)}'
        return [ComponentError(f"{where} {problem}", "take (logprobs, ref_logprobs)")]
    return []


@attrs.frozen
class CheckedKL:
    """A KL kind by reference whose every output is checked: one value per token."""

    function: object
    kind: str

    def __call__(self, logprobs, ref_logprobs):
        out = self.function(logprobs, ref_logprobs)
        if not torch.is_tensor(out) or out.shape != logprobs.shape:
            shape = tuple(out.shape) if hasattr(out, "shape") else type(out).__name__
            raise ComponentError(
                f'KL kind "{self.kind}": {located(self.function)} returned {shape} for '
                f"log-probs of shape {tuple(logprobs.shape)}",
                "return the per-token estimate, shaped like logprobs (b, t): the node masks "
                "and aggregates it",
            )
        return out
