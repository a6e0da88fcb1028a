"""A loss's own params and state (docs/extending.md, "A loss with params and state"): its
record's `options` built from the update node's `loss_options` table, its `state` made,
advanced after each update and checked to be what a checkpoint (JSON) holds, and the watch on
its file's module-level names that refuses state kept there (it would reset on --resume and
differ between ranks); and `ComponentError`, the error of a loss or KL kind that cannot be used.
`flowrl.math.components` re-exports these for the update node."""

from __future__ import annotations

import sys

from flowrl.errors import Collector, FlowrlError, located
from flowrl.lazy import torch
from flowrl.math.losses import Loss


class ComponentError(FlowrlError, ValueError):
    """A loss or KL kind that cannot be used, with where it is and what to do."""

    def __init__(self, message: str, fix: str = ""):
        super().__init__(f"{message}: {fix}" if fix else message)
        self.message, self.fix = message, fix


STATE_FIX = (
    "give the Loss record state=first_state (options -> dict) and after_update=next_state "
    '((state, rates, options) -> dict) (docs/extending.md, "A loss with params and state")'
)


def loss_options(loss: Loss, name: str, table: dict, node: str):
    """The instance of the loss's own options class (`Loss.options`) from the update node's
    `loss_options` table, checked like node params; None for a loss without options (then
    the table must be empty). Raises ComponentError listing every problem."""
    if loss.options is None:
        if table:
            raise ComponentError(
                f'[nodes.{node}] loss_options: loss "{name}" has no options of its own, but '
                f"loss_options sets {sorted(table)}",
                "remove loss_options, or give the loss's Loss record options=<attrs class>",
            )
        return None
    from flowrl.front.typed_toml import build_attrs

    errors = Collector(f"[nodes.{node}]")
    built = build_attrs(loss.options, table, f"nodes.{node}.loss_options", errors)
    if errors.problems:
        text = "; ".join(f"{p.where}: {p.message}" for p in errors.problems)
        fixes = "; ".join(p.fix for p in errors.problems if p.fix)
        raise ComponentError(f'loss "{name}": {text}', fixes or "see the loss's options class")
    return built


def first_state(loss: Loss, name: str, options) -> dict:
    """The loss's first state (`Loss.state(options)`), checked: a dict JSON can hold."""
    if loss.state is None:
        return {}
    return checked_state(loss, name, loss.state(options), "state(options)")


def next_state(loss: Loss, name: str, state: dict, rates: dict, options) -> dict:
    """The loss's state after a step's update (`Loss.after_update`), checked."""
    if loss.after_update is None:
        return state
    work = dict(state)
    returned = loss.after_update(work, dict(rates), options)
    return checked_state(loss, name, work if returned is None else returned, "after_update")


def checked_state(loss: Loss, name: str, state, what: str) -> dict:
    """`state`, what the loss's `what` returned, if it is a dict a checkpoint (JSON) can store."""
    from flowrl.errors import StateError, unstorable

    function = loss.state if what.startswith("state") else loss.after_update
    where = f'loss "{name}": {located(function)}'
    if not isinstance(state, dict):
        raise StateError(f"{where}: {what} returned a {type(state).__name__}: {STATE_FIX}")
    if problem := unstorable(state):
        raise StateError(
            f"{where}: {what} returned {problem}, which a checkpoint (JSON) cannot store: keep "
            "numbers, strings, lists and dicts with string keys (float(x) for a tensor)"
        )
    return state


class ModuleWatch:
    """What a loss's file keeps at module level, to find state kept there: a value rebound or
    changed in place between steps. Such state is not saved in checkpoints, so it silently
    resets on --resume, and it is per process, so the ranks of a pool would differ: the loss
    is refused, with the fix (its record's `state`). Built-in losses are not watched."""

    def __init__(self, *functions):
        modules = {getattr(f, "__module__", None) for f in functions if f is not None}
        self.modules = [
            sys.modules[m]
            for m in sorted(filter(None, modules))
            if m in sys.modules and not m.startswith("flowrl.")
        ]
        self.seen = self.snapshot()

    def snapshot(self) -> dict:
        return {
            (module.__name__, key): _fingerprint(value)
            for module in self.modules
            for key, value in vars(module).items()
            if not key.startswith("__")
        }

    def changed(self) -> list[str]:
        """The module-level names changed since the last call."""
        now = self.snapshot()
        out = sorted(
            name for (mod, name), mark in now.items() if self.seen.get((mod, name)) != mark
        )
        self.seen = now
        return out


def _fingerprint(value):
    """What changes when a module-level value is rebound or, for a list, dict, set, tensor or
    array, changed in place (other objects by identity: a logger's own caches are no state)."""
    if torch.is_tensor(value):
        return id(value), value._version
    if isinstance(value, list | dict | set | bytearray):
        try:
            return id(value), hash(repr(value))
        except Exception:  # an element whose repr fails: the container's identity
            return id(value)
    if type(value).__name__ == "ndarray" and getattr(value, "nbytes", 1 << 30) <= 1 << 20:
        return id(value), hash(value.tobytes())
    return id(value)
