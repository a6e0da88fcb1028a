"""TOML table -> attrs instance: types, unknown keys, validators, every problem collected."""

from typing import Literal

import attrs
import pytest

from flowrl.errors import Collector
from flowrl.front.typed_toml import build_attrs, convert, toml_value, type_name


def _positive(instance, attribute, value):
    if value <= 0:
        raise ValueError(f"{attribute.name} must be > 0, got {value}")


@attrs.frozen
class Table:
    count: int = attrs.field(default=1, validator=_positive)
    rate: float = 0.5
    name: str = "x"
    flag: bool = False
    sizes: list[int] = attrs.field(factory=lambda: [1, 2])
    pair: tuple[float, float] = (0.9, 0.99)
    maybe: str | None = None
    kind: Literal["a", "b"] = "a"


def build(table, overridden=frozenset()):
    errors = Collector("g.toml")
    return build_attrs(Table, table, "t", errors, overridden), errors.problems


def test_good_table_builds_with_conversions():
    value, found = build({"count": 3, "rate": 1, "sizes": [4], "pair": [0.5, 1], "kind": "b"})
    assert found == []
    assert value == Table(count=3, rate=1.0, sizes=[4], pair=(0.5, 1.0), kind="b")
    assert isinstance(value.rate, float) and isinstance(value.pair, tuple)


def test_empty_table_gives_the_defaults():
    assert build({}) == (Table(), [])


@pytest.mark.parametrize(
    ("value", "tp", "expected"),
    [
        (True, int, (None, False)),  # a bool is not a count
        (3, float, (3.0, True)),
        (True, float, (None, False)),
        ("3", int, (None, False)),  # TOML strings are never parsed as numbers
        ([1, "x"], list[int], (None, False)),
        ([1, 2], tuple[int, ...], ((1, 2), True)),
        (None, str | None, (None, False)),  # TOML has no null
        ("b", Literal["a", "b"], ("b", True)),
        ("c", Literal["a", "b"], ("c", False)),
        ({"k": 1}, dict, ({"k": 1}, True)),
        (4, str | int, (4, True)),
    ],
)
def test_convert_checks_toml_types(value, tp, expected):
    converted, good = convert(value, tp)
    assert good == expected[1]
    if good:
        assert converted == expected[0] and type(converted) is type(expected[0])


def test_every_problem_of_a_table_is_reported():
    value, found = build({"cuont": 2, "rate": "fast", "flag": 1})
    assert value is None
    messages = [p.message for p in found]
    assert messages == [
        'unknown key "cuont" (did you mean "count"?)',
        "\"rate\" = 'fast' should be a number",
        '"flag" = 1 should be true or false',
    ]
    assert all(p.where == "[t]" and p.file == "g.toml" for p in found)
    assert found[1].fix == "default: rate = 0.5"


def test_validator_failure_is_a_problem_not_an_exception():
    value, (problem,) = build({"count": 0})
    assert value is None and "count must be > 0, got 0" in problem.message


def test_override_origin_is_named():
    _, (problem,) = build({"rate": "x"}, overridden={"t.rate": "t.rate=x"})
    assert problem.message.startswith('override "t.rate=x": "rate" = \'x\' (from the command')


def test_type_names_and_toml_defaults():
    assert type_name(Literal["a", "b"]) == 'one of "a", "b"'
    assert type_name(list[int]) == "a list of integers"
    assert toml_value(attrs.Factory(lambda: [1, 2])) == "[1, 2]"
    assert toml_value({"a": "b", "c": True}) == '{ a = "b", c = true }'
    assert type_name(str | None) == "a string"
    assert type_name(list[float]) == "a list of numbers"
    assert toml_value(None) == "(unset)"


def test_check_across_fields_is_reported():
    @attrs.frozen
    class Window:
        low: int = 0
        high: int = 1

        def __attrs_post_init__(self):
            if self.low >= self.high:
                raise ValueError(f"low = {self.low} must be below high = {self.high}")

    errors = Collector("g.toml")
    assert build_attrs(Window, {"low": 3}, "w", errors) is None
    (problem,) = errors.problems
    assert problem.where == "[w]" and problem.message == "low = 3 must be below high = 1"


@pytest.mark.parametrize(
    ("text", "where", "key", "seen"),
    [
        ("[x]\na = [\n  1,  # a ] in a comment\n  2,\n\n[y]\nb = 1\n", "line 2", "x.a", "line 6"),
        ('[x]\nb = "[" # [\nc = [[1, 2], [3\n', "line 3", "x.c", "the end of the file"),
    ],
)
def test_an_unclosed_array_is_named_where_it_opens(text, where, key, seen):
    import tomllib

    from flowrl.front.typed_toml import _toml_problem

    with pytest.raises(tomllib.TOMLDecodeError) as raised:
        tomllib.loads(text)
    got_where, message, fix = _toml_problem(str(raised.value), text)
    assert got_where == where
    assert message == f"the array {key} = [ opened on this line is not closed (seen at {seen})"
    assert fix.startswith('close it with "]" after its last element')
