"""Validators that state their rule: what they accept, and the words messages and docs use."""

import math

import attrs
import pytest

from flowrl.errors import Collector
from flowrl.front.typed_toml import build_attrs
from flowrl.params import (
    above,
    at_least,
    checked,
    count,
    describe,
    finite,
    interval,
    not_empty,
    one_of,
    pair,
    positive,
    zero_or,
)


@pytest.mark.parametrize(
    ("rule", "good", "bad", "text"),
    [
        (count(1, 8), [1, 8], [0, 9], "from 1 to 8"),
        (count(0), [0, 10**12], [-1], ">= 0"),
        (positive(), [1e-9, 5.0], [0.0, -1.0], "> 0"),
        (at_least(0, 10), [0, 10], [-0.1, 10.5], ">= 0 and <= 10"),
        (above(1), [1.01], [1.0], "> 1"),
        (interval(0, 1, low_open=True), [1.0, 0.5], [0.0, 1.01], "in (0, 1]"),
        (interval(0, 1, high_open=True), [0.0, 0.999], [1.0, -0.1], "in [0, 1)"),
        (zero_or(above(1)), [0.0, 1.5], [0.5, 1.0, -2.0], "0 (off) or > 1"),
        (
            pair(interval(0, 1)),
            [[0.0, 1.0]],
            [[0.5], [0.5, 2.0], [0.1, 0.2, 0.3]],
            "a list of 2 numbers, each in [0, 1]",
        ),
        (one_of(("a", "")), ["a", ""], ["b", "A"], 'one of "a", ""'),
        (not_empty(), ["x"], [""], "a non-empty string"),
    ],
)
def test_rule_accepts_refuses_and_says_its_rule(rule, good, bad, text):
    assert all(rule.test(v) for v in good)
    assert not any(rule.test(v) for v in bad)
    assert rule.text == text == describe(rule)


def test_nan_fails_every_numeric_rule():
    for rule in (positive(), at_least(0), interval(0, 1), count(0, 5), above(1)):
        assert not rule.test(math.nan)
    assert not finite(math.inf) and not finite([0.9, math.nan]) and finite([0.9, 0.99])


def test_a_failing_rule_raises_with_the_field_name():
    @attrs.frozen
    class Params:
        n: int = checked(1, count(1, 4))

    with pytest.raises(ValueError, match=r"n = 5 is not allowed: must be from 1 to 4"):
        Params(n=5)


def test_checked_copies_a_list_default_per_instance():
    @attrs.define
    class Params:
        betas: list = checked([0.9, 0.99], pair(interval(0, 1)))

    first = Params()
    first.betas.append(1.0)
    assert Params().betas == [0.9, 0.99]


def test_attrs_own_validators_are_described_in_words():
    assert describe(attrs.validators.in_(("mean", "max"))) == 'one of "mean", "max"'
    both = attrs.validators.and_(attrs.validators.in_((1, 2)), count(1))
    assert describe(both) == "one of 1, 2 and >= 1"
    assert describe(attrs.validators.instance_of(int)) == ""


def test_a_user_node_with_attrs_in_gets_the_allowed_values():
    @attrs.frozen
    class Params:
        mode: str = attrs.field(default="mean", validator=attrs.validators.in_(("mean", "max")))

    errors = Collector("g.toml")
    assert build_attrs(Params, {"mode": "median"}, "nodes.adv", errors) is None
    (problem,) = errors.problems
    assert problem.message == '"mode" = \'median\' is not allowed: must be one of "mean", "max"'
