"""Tool schemas come from type hints without transformers, and equal transformers' own."""

import enum
import subprocess
import sys
from pathlib import Path
from typing import Any, Literal

import pytest
from transformers.utils import get_json_schema

from flowrl.agent.tools import ToolError, builtin
from flowrl.agent.tools.schema import function_schema

ROOT = Path(__file__).resolve().parents[4]


class Unit(enum.Enum):
    METRE = "m"
    FOOT = "ft"


def convert(value: float, unit: Unit, digits: int = 2) -> str:
    """Convert a length.

    Args:
        value: the length, a number
            that may span lines.
        unit (str): the unit to convert to.
        digits: decimals to keep.

    Returns:
        The converted length as text.
    """


def search(query: str, tags: list[str], limit: int | None = None, mode: str = "any") -> dict:
    """Search the notes.

    Args:
        query: words to look for
        tags: tags a note must have
        limit: at most this many
        mode: how tags combine (choices: ["any", "all"])
    """


def mixed(
    pair: tuple[int, str],
    table: dict[str, float],
    either: int | str,
    choice: Literal["a", "b", 3],
    anything: Any,
    rows: list[dict[str, int]] | None,
) -> None:
    """Every kind of hint.

    Args:
        pair: two things
        table: numbers by name
        either: a number or a name
        choice: one of three
        anything: whatever
        rows: optional rows
    """


class Notes:
    def add(self, text: str) -> str:
        """Add a note.

        Args:
            text: the note
        """


@pytest.mark.parametrize(
    "function", [builtin.calc, builtin.python, convert, search, mixed, Notes.add, Notes().add]
)
def test_schema_equals_transformers(function):
    assert function_schema(function) == get_json_schema(function)


def no_hint(x) -> str:
    """No hint.

    Args:
        x: something
    """


def undocumented(x: int) -> str:
    """Says nothing about x."""


class Custom:
    pass


def custom(x: Custom) -> str:
    """A custom class.

    Args:
        x: a thing
    """


@pytest.mark.parametrize(
    ("function", "words"),
    [(no_hint, "no type hint"), (undocumented, "does not describe 'x'"), (custom, "no JSON form")],
)
def test_bad_tools_are_refused_with_the_fix(function, words):
    with pytest.raises(ToolError, match=words) as info:
        function_schema(function)
    assert "Google-style docstring" in str(info.value)


def test_schemas_import_no_transformers():
    code = (
        "import sys; sys.modules['torch'] = None; sys.modules['transformers'] = None\n"
        "from flowrl.agent.tools.toolbox import Toolbox\n"
        "box = Toolbox(['calculator', 'python', 'answer_check'])\n"
        "assert box.names[0] == 'calc', box.names\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr
