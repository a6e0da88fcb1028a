"""Errors a user can act on: each names the file, the table, the key and the fix.

Checks collect every problem of a file and raise them together (`GraphErrors`), so one run of
`flowrl check` shows all that is wrong, not the first thing.

Every error flowrl raises for a user's mistake or a failed run derives from `FlowrlError`
(GraphErrors, DataError, ModelNotFound, ScorerError, UnknownNode, the runtime's NodeFailure):
its message is complete, so the CLI prints it without a traceback.
"""

import difflib
import functools
import inspect
import re
import sysconfig
import traceback
from collections.abc import Iterable
from pathlib import Path

import attrs


@attrs.frozen
class Problem:
    """One thing wrong with a graph file."""

    file: str
    where: str  # the table, e.g. "[nodes.values]" or "command line"
    message: str  # what is wrong, naming the key
    fix: str = ""  # what to do about it

    def __str__(self) -> str:
        text = f"{self.file}: {self.where}: {self.message}"
        return f"{text}\n    fix: {self.fix}" if self.fix else text


class FlowrlError(Exception):
    """Base of flowrl's errors: the message says what is wrong, where, and what to do."""


class InfraError(FlowrlError, RuntimeError):
    """What a request ran on failed, not the model: its engine died or aborted it, a service
    its tools call is down. The request is counted as `infra_failed` and left out of its
    group's statistics and of the loss, never scored as if the model had failed
    (flowrl/runtime/executor.py: `_after_requests`; docs/recovery.md)."""


# connection failures of the HTTP clients engines and services are reached with, by name (the
# clients are optional: none is imported to ask)
CONNECTION_ERRORS = (
    "ConnectError",  # httpx
    "ConnectTimeout",
    "RemoteProtocolError",
    "ReadError",
    "ClientConnectionError",  # aiohttp
    "ServerDisconnectedError",
    "APIConnectionError",  # openai
)


def is_infra(error: BaseException) -> bool:
    """Whether `error` is an infrastructure failure (InfraError, a refused or dropped
    connection) rather than a fault of the request's own code or of the model's output."""
    if isinstance(error, InfraError | ConnectionError):
        return True
    return any(t.__name__ in CONNECTION_ERRORS for t in type(error).__mro__)


class GraphErrors(FlowrlError):
    """All the problems found in one graph file."""

    def __init__(self, problems: Iterable[Problem]):
        self.problems = list(problems)
        super().__init__(self.report())

    def report(self) -> str:
        n = len(self.problems)
        head = f"{n} error{'s' if n != 1 else ''}:"
        return "\n".join([head, *(f"  {p}" for p in self.problems)])


class Collector:
    """Gathers problems for one file; `raise_if_any()` raises them together."""

    def __init__(self, file: str):
        self.file = file
        self.problems: list[Problem] = []
        self.renamed: list[str] = []  # old spellings used: warnings (`check --strict` refuses)

    def add(self, where: str, message: str, fix: str = "") -> None:
        self.problems.append(Problem(self.file, where, message, fix))

    def rename(self, where: str, old: str, new: str, removed_in: str) -> None:
        """Note that the file says `old`, the old spelling of `new`."""
        self.renamed.append(
            f'{where} "{old}" is the old name of "{new}" and goes in flowrl {removed_in}: '
            f"write {new} = ... (CHANGELOG.md)"
        )

    def raise_if_any(self) -> None:
        if self.problems:
            raise GraphErrors(self.problems)


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """' (did you mean "x"?)' for the closest choice, or ''."""
    close = difflib.get_close_matches(word, sorted(choices), n=1, cutoff=0.6)
    return f' (did you mean "{close[0]}"?)' if close else ""


def one_of(choices: Iterable[str]) -> str:
    return ", ".join(f'"{c}"' for c in sorted(choices))


_FLOWRL = Path(__file__).resolve().parent
# code that is neither flowrl's nor the user's: the standard library and installed packages
_LIBRARIES = tuple(
    Path(p).resolve() for p in {sysconfig.get_paths()[k] for k in ("stdlib", "purelib", "platlib")}
)


def where_raised(error: BaseException) -> str:
    """file:line where `error` began: in the error it was raised from, if any (the first cause
    first), the deepest frame of the user's own code (not flowrl's, not a library's), else
    flowrl's deepest frame of `error`; '' when it carries no traceback."""
    chain, seen = [], set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        chain.append(error)
        error = error.__cause__ or error.__context__
    for cause in reversed(chain):
        for frame in reversed(traceback.extract_tb(cause.__traceback__)):
            if _users(Path(frame.filename)):
                return f"{shown_path(frame.filename)}:{frame.lineno}"
    frames = traceback.extract_tb(chain[0].__traceback__) if chain else []
    return f"{shown_path(frames[-1].filename)}:{frames[-1].lineno}" if frames else ""


def described(error: BaseException) -> str:
    """ "Type: message (file:line)", the line from `where_raised` (none added when the message
    names a file:line of its own)."""
    text = f"{type(error).__name__}: {error}"
    if re.search(r"\.py:\d+", text):  # the message names its place already
        return text
    where = where_raised(error)
    return text + (f" ({where})" if where else "")


def _users(path: Path) -> bool:
    path = path.resolve()
    mine = (_FLOWRL, (_FLOWRL / "nodes").resolve(), *_LIBRARIES)
    return path.is_file() and not any(path.is_relative_to(root) for root in mine)


def shown_path(file: str) -> str:
    """A file relative to the working directory when below it."""
    try:
        return str(Path(file).resolve().relative_to(Path.cwd()))
    except ValueError:
        return file


def located(function) -> str:
    """`name (file:line)` of a function (a bound method's, a partial's, or a callable object's
    class's `__call__`), for messages about a user's code; the bare name when it has no code."""
    target = inspect.unwrap(function)
    if isinstance(target, functools.partial):
        target = target.func
    target = getattr(target, "__func__", target)  # a bound method
    call = vars(type(target)).get("__call__")  # a callable object: its class's __call__
    code = getattr(target, "__code__", None) or getattr(call, "__code__", None)
    name = getattr(target, "__qualname__", type(target).__qualname__)
    return f"{name} ({shown_path(code.co_filename)}:{code.co_firstlineno})" if code else name


class StateError(FlowrlError, TypeError):
    """A state a checkpoint keeps (a node's, a loss's, a sampler's) that JSON cannot hold:
    names its owner, the value and the fix."""


def unstorable(value, path: str = "state") -> str:
    """'' when JSON stores `value` as it is, else where the first value it cannot is and what
    it is, e.g. "state['seen'] = {1, 2} (a set)"."""
    if value is None or isinstance(value, bool | int | float | str):
        return ""
    if isinstance(value, list):
        return next((p for i, v in enumerate(value) if (p := unstorable(v, f"{path}[{i}]"))), "")
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                return f"the key {key!r} ({type(key).__name__}) in {path}"
            if problem := unstorable(item, f"{path}[{key!r}]"):
                return problem
        return ""
    shown = repr(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    return f"{path} = {shown} (a {type(value).__name__})"
