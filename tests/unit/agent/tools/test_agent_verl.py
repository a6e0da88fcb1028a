"""verl's tools and interactions as they are: the tool YAML and its `config`, optional schema
arguments, release counted whatever fails, BaseInteraction classes through the adapter and
the interaction YAML; `flowrl check` against verl rows; verl's character truncation; and
timeouts that hold for a blocking async tool and a tool that never returns."""

import asyncio
import textwrap
import threading
import time

import attrs
import pytest

from flowrl.agent.chat import truncate_chars
from flowrl.agent.interactions import load_interactions
from flowrl.agent.parsers import ToolCall
from flowrl.agent.tools import timeouts
from flowrl.agent.tools.toolbox import Toolbox
from flowrl.hooks import CheckContext
from flowrl.nodes import agent

TOOLS = '''
import asyncio, time, threading

COUNTS = {"create": 0, "release": 0}
NEVER = threading.Event()


class Response:
    def __init__(self, text):
        self.text = text


class Base:
    def __init__(self, config, tool_schema):
        self.config, self.tool_schema = config, tool_schema
        self.name = tool_schema.function.name

    async def create(self, instance_id=None, **kwargs):
        COUNTS["create"] += 1
        return instance_id, Response("")

    async def calc_reward(self, instance_id, **kwargs):
        return 0.0

    async def release(self, instance_id, **kwargs):
        COUNTS["release"] += 1


class Sandbox(Base):
    """Reads its config as verl's SandboxFusionTool does; returns a list from calc_reward."""

    def __init__(self, config, tool_schema):
        super().__init__(config, tool_schema)
        self.url = config["sandbox_fusion_url"]

    async def execute(self, instance_id, parameters, **kwargs):
        text = f"{self.url} ran {parameters['code']} t={parameters.get('timeout')}"
        return Response(text), 0.0, {}

    async def calc_reward(self, instance_id, **kwargs):
        return [1.0, 0.5]


class RaisesReward(Base):
    async def execute(self, instance_id, parameters, **kwargs):
        return Response("ok"), 0.0, {}

    async def calc_reward(self, instance_id, **kwargs):
        raise RuntimeError("reward service down")


class FailsCreate(Base):
    async def create(self, instance_id=None, ground_truth=None, **kwargs):
        raise ValueError("no ground truth")

    async def execute(self, instance_id, parameters, **kwargs):
        return Response("never"), 0.0, {}


class Blocks(Base):
    async def execute(self, instance_id, parameters, **kwargs):
        time.sleep(3600)  # blocking I/O inside async def: verl's usual execute shape


class Hangs(Base):
    async def execute(self, instance_id, parameters, **kwargs):
        NEVER.wait()


class Interaction:
    def __init__(self, config):
        self.config, self.name = config, config["name"]
        self.live = {}

    async def start_interaction(self, instance_id=None, ground_truth=None, **kwargs):
        self.live[instance_id] = ground_truth
        return instance_id

    async def generate_response(self, instance_id, messages, **kwargs):
        done = self.live[instance_id] in messages[-1]["content"]
        return done, "right" if done else "again", float(done), {"turn": 1}

    async def finalize_interaction(self, instance_id, **kwargs):
        del self.live[instance_id]


class JudgeInteraction(Interaction):
    pass


class WrongInit(Interaction):
    def __init__(self, name):  # not verl's signature: fails every request
        self.name = name
'''


def schema(name, required=("code",)):
    properties = {"code": {"type": "string", "description": "c"}}
    properties["timeout"] = {"type": "integer", "description": "seconds"}
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": name,
            "parameters": {"type": "object", "properties": properties, "required": list(required)},
        },
    }


def yaml_of(*tools) -> str:
    import yaml

    items = [
        {
            "class_name": f"verl_tools.{cls}",
            "config": {"type": "native", **config},
            "tool_schema": s,
        }
        for cls, config, s in tools
    ]
    return yaml.safe_dump({"tools": items})


@pytest.fixture
def tools_dir(tmp_path):
    (tmp_path / "verl_tools.py").write_text(TOOLS)
    return tmp_path


def counts(box):
    import sys

    return sys.modules[type(box.tools[0].tool).__module__].COUNTS


def run(coroutine):
    return asyncio.run(coroutine)


def test_the_tool_yaml_gives_config_and_schema_and_optional_arguments_stay_optional(tools_dir):
    config = {"sandbox_fusion_url": "http://sandbox:8080/run_code"}
    (tools_dir / "tools.yaml").write_text(yaml_of(("Sandbox", config, schema("code_interpreter"))))
    box = Toolbox([], tools_dir, "tools.yaml")
    assert box.names == ["code_interpreter"] and box.tools[0].tool.config["type"] == "native"
    session = box.open({})

    async def go():
        await session.start()
        out = await session.call(ToolCall("code_interpreter", {"code": "1+1"}), 1.0)
        return out, await session.close()

    out, (rewards, errors) = run(go())
    assert out.status == "ok" and out.text == "http://sandbox:8080/run_code ran 1+1 t=None"
    assert rewards == {"code_interpreter": [1.0, 0.5]} and errors == []  # a list, kept
    assert counts(box) == {"create": 1, "release": 1}


def test_release_runs_when_calc_reward_raises_and_when_a_sibling_create_fails(tools_dir):
    (tools_dir / "tools.yaml").write_text(
        yaml_of(("RaisesReward", {}, schema("a")), ("FailsCreate", {}, schema("b")))
    )
    box = Toolbox([], tools_dir, "tools.yaml")
    before = dict(counts(box))
    session = box.open({"tools_kwargs": {"a": {}, "b": {}}})  # both tools, as the row asks

    async def go():
        with pytest.raises(ValueError, match="no ground truth"):
            await session.start()  # a is created, b's create raises
        return await session.close()

    rewards, errors = run(go())
    assert rewards == {} and errors == ["a: release: RuntimeError: reward service down"]
    after = counts(box)
    # one instance created (a), one released: a's release ran although calc_reward raised
    assert after["create"] - before["create"] == 1 and after["release"] - before["release"] == 1


def test_verl_interactions_from_their_yaml_and_class_reference(tools_dir):
    (tools_dir / "interaction.yaml").write_text(
        textwrap.dedent(
            """
            interaction:
              - name: judge
                class_name: verl_tools.Interaction
                config: {strict: true}
            """
        )
    )
    (judge,) = load_interactions("", "interaction.yaml", tools_dir).values()
    assert judge.instance.config == {"strict": True, "name": "judge"}  # name injected as verl

    async def go():
        await judge.start("r1", ground_truth="72", name="judge")
        first = await judge.reply("r1", [{"role": "assistant", "content": "70"}])
        second = await judge.reply("r1", [{"role": "assistant", "content": "#### 72"}])
        await judge.finish("r1")
        return first, second

    assert run(go()) == ((False, "again", 0.0), (True, "right", 1.0))
    assert judge.instance.live == {}
    (single,) = load_interactions("verl_tools.py:JudgeInteraction", "", tools_dir).values()
    assert single.instance.name == "judge"  # verl's default: the class name, no "Interaction"


def check(tools_dir, rows=None, **params):
    if rows is not None:
        import json

        (tools_dir / "rows.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    p = attrs.evolve(agent.Params(), **params)
    context = CheckContext("generate", 8, 2, 4, 1, str(tools_dir), "", ("rows.jsonl",))
    return agent.check(p, context)


def test_check_refuses_an_interaction_class_that_would_fail_every_request(tools_dir):
    (finding,) = check(tools_dir, interaction="verl_tools.py:WrongInit")
    assert not finding.warning and "unexpected keyword argument 'config'" in finding.message


def test_check_warns_about_rows_whose_tools_kwargs_would_be_ignored(tools_dir):
    good = {"tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "1"}}}}
    rows = [
        {"extra_info": good},
        {"extra_info": {"tools_kwargs": {"calc_gsm8k_rewrd": {}}}},  # misspelled
        {"extra_info": {"need_tools_kwargs": True}},
        {"extra_info": {"tools_kwargs": {"guess": {"create_kwargs": {}}}}},
    ]
    (tools_dir / "guess.py").write_text(
        "class Guess:\n"
        "    def __init__(self, secret: int):\n        self.secret = secret\n"
        "    def guess(self, n: int) -> str:\n"
        '        """Guess.\n\n        Args:\n            n: a number.\n        """\n'
        "        return str(n == self.secret)\n"
    )
    findings = check(tools_dir, rows, tools=("answer_check", "guess.py:Guess"))
    messages = [f.message for f in findings if f.warning]
    assert any('row 1 (1 of 4 rows): tools_kwargs names "calc_gsm8k_rewrd"' in m for m in messages)
    assert any("row 2 (1 of 4 rows): need_tools_kwargs is true" in m for m in messages)
    # rows 1-2 see every tool (none named right), row 3 names guess: each lacks its secret
    guess = "row 1 (3 of 4 rows): guess requires create_kwargs ['secret']"
    assert any(guess in m for m in messages)
    assert not any("row 0" in m for m in messages) and len(messages) == 3


@pytest.mark.parametrize(
    ("side", "expected"),
    [
        ("left", "abcd...(truncated)"),
        ("right", "(truncated)...wxyz"),
        ("middle", "ab...(truncated)...yz"),
    ],
)
def test_tool_output_is_cut_in_characters_with_verls_sides(side, expected):
    text = "abcdefghijklmnopqrstuvwxyz"
    assert truncate_chars(text, 4, side) == expected and truncate_chars("abc", 4, side) == "abc"


def test_a_ten_megabyte_output_is_cut_before_it_is_tokenized():
    from flowrl.agent.chat import ChatTokens
    from flowrl.testing import tiny_tokenizer

    chat = ChatTokens(tiny_tokenizer())
    text = truncate_chars("x" * 10_000_000, 256, "middle")
    cut, _ = chat.truncate(text, 64)
    assert len(text) == 256 + len("...(truncated)...") and len(cut) < 200


@pytest.mark.parametrize("tool", ["Blocks", "Hangs"])
def test_a_blocking_or_hung_async_tool_times_out_without_stalling_others(tools_dir, tool):
    # a name of its own: the other case's abandoned threads still run (the cap is per tool)
    slow = f"slow_{tool.lower()}"
    (tools_dir / "tools.yaml").write_text(
        yaml_of((tool, {}, schema(slow)), ("Sandbox", {"sandbox_fusion_url": "u"}, schema("fast")))
    )
    box = Toolbox([], tools_dir, "tools.yaml")
    sessions = [box.open({}) for _ in range(3)]
    before = timeouts.stuck_threads(slow)

    async def go():
        for session in sessions:
            await session.start()
        hung = [s.call(ToolCall(slow, {"code": "x"}), 0.2) for s in sessions]
        fast = [s.call(ToolCall("fast", {"code": "y"}), 5.0) for s in sessions]
        return await asyncio.gather(*hung, *fast)

    start = time.perf_counter()
    results = run(go())
    assert time.perf_counter() - start < 3.0  # the timeout held; nothing waited on the tool
    assert [r.status for r in results] == ["timeout"] * 3 + ["ok"] * 3
    assert timeouts.stuck_threads(slow) - before == 3
    threads = [t for t in threading.enumerate() if t.name == f"flowrl-tool:{slow}"]
    assert threads and all(t.daemon for t in threads)  # never keeps the process alive


def test_a_tool_with_too_many_stuck_calls_is_not_started_again():
    never = threading.Event()
    started = []

    def hang():
        started.append(1)
        never.wait()

    async def go():
        out = []
        for _ in range(timeouts.MAX_STUCK + 2):
            try:
                await timeouts.run_call("hang_test", hang, {}, 0.05)
            except timeouts.ToolStuck:
                out.append("refused")
            except TimeoutError:
                out.append("timeout")
        return out

    outcome = run(go())
    assert outcome == ["timeout"] * timeouts.MAX_STUCK + ["refused"] * 2
    assert len(started) == timeouts.MAX_STUCK  # threads stop growing at the cap
    release(never, "hang_test")


def release(never: threading.Event, name: str) -> None:
    """Let a hung tool's threads return: none of its calls is counted as stuck after."""
    never.set()
    for thread in [t for t in threading.enumerate() if t.name == f"flowrl-tool:{name}"]:
        thread.join(5)
    assert timeouts.stuck_threads(name) == 0


def test_calls_in_flight_count_toward_a_hung_tools_cap():
    """A tool that has hung once: calls started together while others are in flight (they may
    hang too) stop at the cap; checking only the abandoned ones let them all start."""
    import asyncio

    never = threading.Event()
    started = []

    def hang():
        started.append(1)
        never.wait()

    async def attempt():
        try:
            await timeouts.run_call("flight_test", hang, {}, 0.05)
        except timeouts.ToolStuck:
            return "refused"
        except TimeoutError:
            return "timeout"

    async def go():
        first = await attempt()  # one abandoned call
        return [first, *await asyncio.gather(*(attempt() for _ in range(timeouts.MAX_STUCK)))]

    outcome = run(go())
    # 1 abandoned + 3 in flight reach the cap: the 4th of the second wave is refused
    assert outcome == ["timeout"] * timeouts.MAX_STUCK + ["refused"]
    assert len(started) == timeouts.MAX_STUCK == timeouts.stuck_threads("flight_test")
    release(never, "flight_test")


def test_a_failed_call_of_a_verl_tool_gets_verls_zero_step_reward(tools_dir):
    (tools_dir / "tools.yaml").write_text(yaml_of(("Hangs", {}, schema("slow"))))
    session = Toolbox([], tools_dir, "tools.yaml").open({})

    async def go():
        await session.start()
        unknown = await session.call(ToolCall("nope", {}), 1.0)
        missing = await session.call(ToolCall("slow", {}), 1.0)  # "code" is required
        return unknown, missing

    # verl's _call_tool returns 0.0 for any call that fails, and the loop keeps it
    assert [r.reward for r in run(go())] == [0.0, 0.0]


def test_check_warns_about_rows_whose_interaction_kwargs_the_interaction_cannot_take(tools_dir):
    (tools_dir / "strict.py").write_text(
        "class StrictInteraction:\n"
        "    def __init__(self, config):\n        self.name = config['name']\n"
        "    async def start_interaction(self, instance_id=None, ground_truth=None):\n"
        "        return instance_id\n"
        "    async def generate_response(self, instance_id, messages, **kwargs):\n"
        "        return True, '', 0.0, {}\n"
    )
    rows = [{"extra_info": {"interaction_kwargs": {"ground_truth": "1", "query": "q"}}}]
    findings = check(tools_dir, rows, interaction="strict.py:StrictInteraction")
    (message,) = [f.message for f in findings if "interaction" in f.message]
    assert "row 0 (1 of 1 rows): interaction: start_interaction: got an unexpected" in message
