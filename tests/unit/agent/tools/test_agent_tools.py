"""Tools: schemas from type hints and docstrings, references, class and verl-shaped tools
through a session, argument checks, the parsers, and the built-in calculator and answer check.
The python tool's sandbox has its own file (test_agent_sandbox.py)."""

import asyncio
import json

import pytest

from flowrl.agent.parsers import ToolCall, make_parser, parse_hermes, tag_parser
from flowrl.agent.tools.builtin import calc
from flowrl.agent.tools.session import bind_arguments
from flowrl.agent.tools.toolbox import (
    ClassTool,
    FunctionTool,
    Toolbox,
    ToolError,
    VerlTool,
    function_schema,
    make_tool,
)


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("347*28", "9716"),
        ("(2 + 3) * -4", "-20"),
        ("7/2", "3.5"),
        ("8/2", "4"),
        ("2**10", "1024"),
        ("17 // 5 + 17 % 5", "5"),
        ("1/3", "0.3333333333"),
    ],
)
def test_calculator_evaluates_arithmetic(expression, value):
    assert calc(expression) == value


@pytest.mark.parametrize(
    ("expression", "says"),
    [
        ("__import__('os').system('true')", "unsupported"),
        ("abs(-1)", "unsupported"),
        ("x + 1", "unsupported"),
        ("9**9**9", "more than 100 digits"),
        ("10**60 * 10**60", "more than 100 digits"),
        ("1" * 201, "longer than 200"),
        ("2 +", "not an arithmetic expression"),
        ("(-1)**0.5", "not a real number"),
    ],
)
def test_calculator_refuses_what_is_not_bounded_arithmetic(expression, says):
    with pytest.raises(ValueError, match=says):
        calc(expression)


def test_calculator_refuses_division_by_zero():
    with pytest.raises(ZeroDivisionError):
        calc("1/0")


def test_schema_comes_from_type_hints_and_docstring():
    schema = function_schema(calc)["function"]
    assert schema["name"] == "calc"
    assert schema["parameters"]["required"] == ["expression"]
    assert schema["parameters"]["properties"]["expression"]["type"] == "string"
    assert "347*28" in schema["parameters"]["properties"]["expression"]["description"]


def test_a_function_without_a_documented_argument_is_refused():
    def bare(x: int) -> str:
        return str(x)

    with pytest.raises(ToolError, match="Google-style docstring"):
        FunctionTool(bare)


def test_references_resolve_built_ins_files_and_modules(tmp_path):
    (tmp_path / "my_tools.py").write_text(
        'def echo(text: str) -> str:\n    """Echo.\n\n    Args:\n        text: any.\n    """\n'
        "    return text\n"
    )
    assert make_tool("calculator", tmp_path).names == ["calc"]
    assert make_tool("python").names == ["python"]
    assert isinstance(make_tool("answer_check"), ClassTool)
    assert make_tool("my_tools.py:echo", tmp_path).names == ["echo"]
    assert make_tool("flowrl.agent.tools.builtin:calc").names == ["calc"]
    with pytest.raises(ToolError, match="no file"):
        make_tool("missing.py:echo", tmp_path)
    with pytest.raises(ToolError, match='has no "nope"'):
        make_tool("my_tools.py:nope", tmp_path)
    with pytest.raises(ToolError, match="write"):
        make_tool("not_a_reference")
    with pytest.raises(ToolError, match="tools named twice: calc"):
        Toolbox(["calculator", "flowrl.agent.tools.builtin:calc"])


def test_bind_arguments_checks_names_and_json_types():
    def f(a: int, b: str = "x", c: bool = False) -> str:
        return ""

    assert bind_arguments(f, {"a": 1}) == ({"a": 1}, None)
    assert 'argument "a" must be of type integer, got str' in bind_arguments(f, "7")[1]
    assert "must be of type integer, got bool" in bind_arguments(f, {"a": True})[1]
    assert "must be of type boolean" in bind_arguments(f, {"a": 1, "c": 1})[1]
    assert "bad arguments" in bind_arguments(f, {"z": 1})[1]
    assert "bad arguments" in bind_arguments(f, {})[1]
    # a tag call's single string goes to the only required parameter
    assert bind_arguments(calc, "2*3") == ({"expression": "2*3"}, None)

    def two(a: str, b: str) -> str:
        return a + b

    assert "takes 2 arguments" in bind_arguments(two, "x")[1]


def test_hermes_parser_reads_objects_strings_and_reports_malformed_calls():
    text = (
        '<tool_call>{"name": "calc", "arguments": {"expression": "2*3"}}</tool_call>'
        '<tool_call>{"name": "calc", "arguments": "{\\"expression\\": \\"4*5\\"}"}</tool_call>'
        '<tool_call>{"arguments": {}}</tool_call><tool_call>{"name": "calc", "argu'
    )
    calls = parse_hermes(text)
    assert calls[0] == ToolCall("calc", {"expression": "2*3"})
    assert calls[1] == ToolCall("calc", {"expression": "4*5"})
    assert calls[2].error == 'the call needs a "name" string'
    assert calls[3].error == "the <tool_call> block is not closed"
    assert parse_hermes("no call here") == []


def test_tag_parser_reads_the_tools_tags_only():
    parse = tag_parser(["calc"])
    assert parse("x <calc> 2*3 </calc> <b>bold</b>") == [ToolCall("calc", "2*3")]
    assert parse("<calc>2*3").__len__() == 1 and parse("<calc>2*3")[0].error
    assert tag_parser([])("<calc>1</calc>") == []


def test_user_parser_from_a_file(tmp_path):
    (tmp_path / "p.py").write_text(
        "def parse(text):\n    return [('calc', {'expression': text.split('=')[1]})]\n"
    )
    parse = make_parser("p.py:parse", ["calc"], tmp_path)
    assert parse("calc=2*3") == [ToolCall("calc", {"expression": "2*3"})]


def run(coroutine):
    return asyncio.run(coroutine)


def test_answer_check_scores_like_verls_gsm8k_tool():
    box = Toolbox(["answer_check"])
    session = box.open(
        {"tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "72"}}}}
    )

    async def go():
        await session.start()
        wrong = await session.call(ToolCall("calc_gsm8k_reward", {"answer": "70"}), 1.0)
        right = await session.call(ToolCall("calc_gsm8k_reward", {"answer": "72"}), 1.0)
        return wrong, right, (await session.close())[0]

    wrong, right, rewards = run(go())
    assert wrong.text == "Current parsed answer='70' reward=0.0" and wrong.reward == -0.05
    assert right.text.endswith("reward=1.0") and right.reward == 0.0
    assert rewards == {"AnswerCheck": 1.0}


class ToolResponse:  # verl's response object: the adapter reads `.text`
    def __init__(self, text):
        self.text = text


class VerlShaped:
    """A tool written against verl's BaseTool interface (async create/execute/...)."""

    tool_schema = {
        "type": "function",
        "function": {
            "name": "guess",
            "description": "Guess the secret.",
            "parameters": {
                "type": "object",
                "properties": {"number": {"type": "integer", "description": "a guess"}},
                "required": ["number"],
            },
        },
    }
    released = []

    def __init__(self, config, tool_schema):
        self.name = tool_schema.function.name  # as verl's BaseTool reads it
        self.instances = {}

    async def create(self, instance_id, secret=0, **kwargs):
        self.instances[instance_id] = {"secret": secret, "best": 0.0}
        return instance_id, ToolResponse("")

    async def execute(self, instance_id, parameters, **kwargs):
        state = self.instances[instance_id]
        hit = float(parameters["number"] == state["secret"])
        state["best"] = max(state["best"], hit)
        return ToolResponse("yes" if hit else "no"), hit, {}

    async def calc_reward(self, instance_id, **kwargs):
        return self.instances[instance_id]["best"]

    async def release(self, instance_id, **kwargs):
        VerlShaped.released.append(self.instances.pop(instance_id)["secret"])


def test_a_verl_shaped_tool_runs_through_the_adapter(tmp_path):
    tool = VerlTool(VerlShaped)
    assert tool.names == ["guess"] and tool.tool.name == "guess"
    box = Toolbox([])
    box.tools, box.names = [tool], ["guess"]
    session = box.open({"tools_kwargs": {"guess": {"create_kwargs": {"secret": 7}}}})
    VerlShaped.released.clear()

    async def go():
        await session.start()
        miss = await session.call(ToolCall("guess", {"number": 3}), 1.0)
        bad = await session.call(ToolCall("guess", {"numbr": 7}), 1.0)
        hit = await session.call(ToolCall("guess", {"number": 7}), 1.0)
        return miss, bad, hit, (await session.close())[0]

    miss, bad, hit, rewards = run(go())
    assert (miss.text, miss.reward, hit.text, hit.reward) == ("no", 0.0, "yes", 1.0)
    assert bad.status == "invalid"
    assert rewards == {"guess": 1.0} and VerlShaped.released == [7]


def test_verl_shaped_class_without_a_schema_is_refused():
    class NoSchema(VerlShaped):
        tool_schema = None

    with pytest.raises(ToolError, match="tool_schema"):
        VerlTool(NoSchema)


def test_make_tool_picks_the_adapter_for_verl_shaped_classes(tmp_path):
    assert isinstance(make_tool(f"{__name__}:VerlShaped"), VerlTool)
    assert json.loads(json.dumps(make_tool(f"{__name__}:VerlShaped").schemas[0]))
