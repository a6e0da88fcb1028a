"""The shape a class of the user's must have where flowrl builds it (a rollout backend, a data
sampler): checked at `flowrl check`, before any model loads, so that a plain function, a
missing method, a sync `generate`, options that are not an attrs class or an old constructor
shape is a problem naming the class, its file and the fix, never a traceback mid-run.

What such a class *returns* is checked where it comes back: a backend's results in
flowrl/engines/rollout.py (`checked_result`), a sampler's draws in flowrl/samplers.py
(`checked_draw`), states in a checkpoint in flowrl/runtime/node_call.py (`unstorable`).
No torch here.
"""

from __future__ import annotations

import inspect

import attrs

from flowrl.errors import shown_path


def place(obj) -> str:
    """`Name (file:line)` of a class or function, for messages; the bare name without source."""
    name = getattr(obj, "__qualname__", type(obj).__qualname__)
    try:
        file = inspect.getsourcefile(obj)
        line = inspect.getsourcelines(obj)[1]
    except (TypeError, OSError):
        return name
    return f"{name} ({shown_path(file)}:{line})"


def class_problems(
    cls,
    what: str,
    *,
    methods: tuple[str, ...],
    coroutines: tuple[str, ...] = (),
    init: tuple[tuple, dict],
    init_fix: str,
) -> list[tuple[str, str]]:
    """(what is wrong, the fix) for each way `cls` misses the contract of a `what` ("rollout
    backend"): not a class, a method of `methods` missing or not callable, one of `coroutines`
    not `async def`, an `Options` that is not an attrs class, a constructor that cannot be
    called with `init` (positional args, keyword args)."""
    if not inspect.isclass(cls):
        kind = "function" if inspect.isroutine(cls) else type(cls).__name__
        return [(f"names a {kind}, {place(cls)}, where a class is needed", init_fix)]
    out, where = [], place(cls)
    missing = [m for m in methods if not callable(getattr(cls, m, None))]
    if missing:
        out.append((f"{where} has no method {', '.join(missing)}", f"a {what} defines {methods}"))
    for name in coroutines:
        method = getattr(cls, name, None)
        if callable(method) and not inspect.iscoroutinefunction(method):
            out.append((f"{where}: {name} is not async", f"write it as `async def {name}(...)`"))
    options = getattr(cls, "Options", None)
    if options is not None and not (inspect.isclass(options) and attrs.has(options)):
        out.append(
            (
                f"{where}: its Options, {place(options)}, is not an attrs class",
                "decorate it with @attrs.frozen (its fields are the table's keys, checked "
                "like node params)",
            )
        )
    args, kwargs = init
    try:
        inspect.signature(cls).bind(*args, **kwargs)
    except TypeError as e:
        shown = [*map(str, args), *(f"{k}=..." for k in kwargs)]
        out.append(
            (f"{where} cannot be built as {cls.__name__}({', '.join(shown)}): {e}", init_fix)
        )
    except ValueError:  # no signature to read
        pass
    return out
