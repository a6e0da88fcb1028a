"""Validators that state their rule, for the fields of graph tables and node `Params`.

Each is an attrs validator, so a class checks itself when built; each also carries its rule as
text ("> 0", "from 1 to 65_536", 'one of "k1", "k2"'), so a bad value's message and the TOML
reference (docs/graph-file.md) say what is allowed. flowrl/front/typed_toml.py runs them one field
at a time, so every bad value of a table is reported, not only the first. Non-finite floats
(nan, inf) are refused for every float field before these run. No torch or ray here.

    @attrs.frozen
    class Params:
        n: int = checked(1, count(1, MAX_SAMPLES))  # samples per prompt
        top_p: float = checked(1.0, interval(0, 1, low_open=True))  # nucleus sampling
"""

import math
from collections.abc import Callable
from typing import Any

import attrs

# Upper bounds that no real run reaches; past them a value is a typo, refused before anything
# is allocated.
MAX_STEPS = 10**9  # training steps, optimizer steps, step intervals
MAX_ROWS = 10**7  # prompts per step, rows per mini-batch, held-out prompts
MAX_DATASET = 10**9  # prompts in a data set
MAX_TOKENS = 10**7  # prompt length, new tokens, tokens per micro-batch, top-k
MAX_SAMPLES = 65_536  # samples per prompt
MAX_WORKERS = 65_536  # ranks of a pool, machines of a pool, CPUs of a Ray cluster
MAX_PER_WORKER = 1024  # devices or CPUs of one rank
MAX_EPOCHS = 10_000  # passes over one step's rows
MAX_PARAMS = 10**14  # parameters of a model
MAX_MEMORY_GB = 100_000  # memory of one device
MAX_WAIT_S = 7 * 24 * 3600.0  # a time limit: a week
MAX_SEED = 2**32 - 1


@attrs.frozen
class Rule:
    """An attrs validator with its rule in words.

    Attributes:
        text: what a good value is, completing "must be ...", e.g. "> 0" or "from 1 to 8".
        test: value -> True when the value is good.
        fix: bad value -> what to do instead (e.g. a did-you-mean); None = set the default.
    """

    text: str
    test: Callable[[Any], bool]
    fix: Callable[[Any], str] | None = None

    def __call__(self, instance, attribute, value) -> None:
        if not self.test(value):
            raise ValueError(f"{attribute.name} = {value!r} is not allowed: must be {self.text}")


def checked(default, rule: Rule):
    """An attrs field with a default and its rule; a list default is copied per instance."""
    if isinstance(default, list):
        return attrs.field(factory=lambda: list(default), validator=rule)
    return attrs.field(default=default, validator=rule)


def one_of(choices) -> Rule:
    """An enumeration: the value is one of `choices`."""
    choices = tuple(choices)
    names = (f'"{c}"' if isinstance(c, str) else repr(c) for c in choices)
    return Rule("one of " + ", ".join(names), lambda v: v in choices)


def count(least: int = 0, most: int | None = None) -> Rule:
    """An integer from `least` to `most` (a size, a number of steps...)."""
    text = f"from {least} to {most:_}" if most is not None else f">= {least}"
    return Rule(text, lambda v: v >= least and (most is None or v <= most))


def at_least(low: float, most: float | None = None, open_low: bool = False) -> Rule:
    """A number above `low` (or from it, unless open_low), at most `most`."""
    low_text = f"> {low}" if open_low else f">= {low}"
    text = low_text if most is None else f"{low_text} and <= {most:_}"

    def test(v):
        return (v > low if open_low else v >= low) and (most is None or v <= most)

    return Rule(text, test)


def above(low: float) -> Rule:
    """A number > low."""
    return at_least(low, open_low=True)


def positive(most: float | None = None) -> Rule:
    """A number > 0 (a learning rate, a temperature...)."""
    return at_least(0, most, open_low=True)


def interval(low: float, high: float, low_open: bool = False, high_open: bool = False) -> Rule:
    """A number in an interval such as [0, 1] or (0, 1]."""
    text = f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"

    def test(v):
        above = v > low if low_open else v >= low
        below = v < high if high_open else v <= high
        return above and below

    return Rule(text, test)


def zero_or(rule: Rule, meaning: str = "off") -> Rule:
    """0 (meaning `meaning`) or a value that passes `rule`, e.g. dual_clip: 0 or > 1."""
    return Rule(f"0 ({meaning}) or {rule.text}", lambda v: v == 0 or rule.test(v))


def pair(rule: Rule) -> Rule:
    """A list of two values, each passing `rule` (e.g. AdamW's betas)."""
    return Rule(
        f"a list of 2 numbers, each {rule.text}",
        lambda v: len(v) == 2 and all(rule.test(x) for x in v),
    )


def not_empty() -> Rule:
    return Rule("a non-empty string", lambda v: bool(v))


def finite(value: Any) -> bool:
    """False when `value`, or any number in a list of them, is nan or infinite."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list | tuple):
        return all(finite(v) for v in value)
    return True


def fix_for(validator, value) -> str:
    """What a rule says to do about a bad value ("" when it says nothing: set the default)."""
    if isinstance(validator, Rule) and validator.fix is not None:
        return validator.fix(value)
    return ""


def describe(validator) -> str:
    """The rule of a field's validator in words ("" when unknown), for messages and docs."""
    if validator is None:
        return ""
    if isinstance(validator, Rule):
        return validator.text
    options = getattr(validator, "_original_options", getattr(validator, "options", None))
    if options is not None:
        return one_of(options).text  # attrs.validators.in_
    parts = getattr(validator, "_validators", None)  # attrs.validators.and_ / a list
    if parts:
        return " and ".join(t for t in (describe(v) for v in parts) if t)
    return ""
