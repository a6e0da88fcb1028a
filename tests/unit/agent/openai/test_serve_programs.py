"""Agent programs run per episode (flowrl/serve/programs.py, program_rows.py): results,
every kind of failure with its first error and file:line, the concurrency bound, commands."""

import asyncio
import sys
import time

import pytest

openai = pytest.importorskip("openai")

from flowrl.agent.scripted import ScriptedTurns  # noqa: E402
from flowrl.serve.app import Keys  # noqa: E402
from flowrl.serve.endpoint import Endpoint  # noqa: E402
from flowrl.serve.program_rows import program_rows  # noqa: E402
from flowrl.serve.programs import load_program, run_episodes  # noqa: E402
from flowrl.serve.record import Recorder  # noqa: E402
from flowrl.serve.server import Server  # noqa: E402
from flowrl.testing import tiny_tokenizer  # noqa: E402

pytestmark = pytest.mark.slow  # starts a server; some tests start child processes

PROGRAMS = """
import asyncio, threading, time
import openai

HI = [{"role": "user", "content": "Hi"}]


def ask(base_url, api_key):
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    return client.chat.completions.create(model="tiny", messages=HI, max_tokens=4, seed=0)


def rewarded(base_url, api_key, row):
    ask(base_url, api_key)
    return 0.5 + row["index"]


async def answered(base_url, api_key, row):
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    r = await client.chat.completions.create(model="tiny", messages=HI, max_tokens=4, seed=0)
    return {"answer": r.choices[0].message.content}


def crashes(base_url, api_key, row):
    ask(base_url, api_key)
    raise ValueError("the agent broke")


def hangs(base_url, api_key, row):
    time.sleep(3)
    return 1.0


def silent(base_url, api_key, row):
    return 1.0


def nothing(base_url, api_key, row):
    ask(base_url, api_key)


def forged(base_url, api_key, row):
    ask(base_url, "ep-someone-elses")
    return 1.0


RUNNING = [0, 0]  # now, most at once


async def counted(base_url, api_key, row):
    RUNNING[0] += 1
    RUNNING[1] = max(RUNNING)
    await asyncio.sleep(0.05)
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    await client.chat.completions.create(model="tiny", messages=HI, max_tokens=2, seed=0)
    RUNNING[0] -= 1
    return 1.0


CROWD = [0, 0]  # sync episodes now, most at once
LOCK = threading.Lock()


def crowd(base_url, api_key, row):
    with LOCK:
        CROWD[0] += 1
        CROWD[1] = max(CROWD)
    time.sleep(0.5)
    ask(base_url, api_key)
    with LOCK:
        CROWD[0] -= 1
    return 1.0


ENDED = []  # what a call still sampling when its episode's time ran out got


def stuck(base_url, api_key, row):
    try:
        ask(base_url, api_key)
    except openai.APIStatusError as e:
        ENDED.append(e.status_code)
    return 1.0
"""


@pytest.fixture(scope="module")
def served():
    tokenizer = tiny_tokenizer()
    script = {
        s: [tokenizer("Hello")["input_ids"] + [tokenizer.eos_token_id]] * 64 for s in [_seed0()]
    }
    backend = ScriptedTurns(script)
    backend.tokenizer = tokenizer
    endpoint = Endpoint(backend, model_name="tiny", recorder=Recorder())
    with Server(endpoint, Keys(required=True)) as server:
        yield server


def _seed0():
    from flowrl.engines.rollout import mix

    return mix(0, 0)


@pytest.fixture(scope="module")
def programs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("programs")
    (folder / "agents.py").write_text(PROGRAMS)
    return folder


def episodes(served, program, rows=2, concurrency=4, timeout_s=10.0, cwd="."):
    rows = [{"prompt": [], "extra_info": {}, "index": k, "sample": 0} for k in range(rows)]
    return asyncio.run(
        run_episodes(
            rows,
            program,
            served.endpoint,
            served.keys,
            served.base_url,
            concurrency=concurrency,
            timeout_s=timeout_s,
            cwd=str(cwd),
        )
    )


def test_rewards_and_answers_come_back_with_the_calls(served, programs):
    out = episodes(served, load_program("agents.py:rewarded", programs))
    assert [o.kind for o in out] == ["ok", "ok"] and [o.reward for o in out] == [0.5, 1.5]
    assert all(len(o.calls) == 1 and o.calls[0].completion_ids for o in out)
    out = episodes(served, load_program("agents.py:answered", programs))
    assert [o.answer for o in out] == ["Hell", "Hell"] and out[0].reward is None  # max_tokens=4


@pytest.mark.parametrize(
    "name, kind, says",
    [
        ("crashes", "error", "ValueError: the agent broke ("),
        ("silent", "never_called", "returned without calling the endpoint"),
        ("nothing", "bad_return", "returned NoneType"),
        ("forged", "error", "AuthenticationError"),
    ],
)
def test_failures_are_the_episodes_with_their_first_error(served, programs, name, kind, says):
    before = served.endpoint.stats["errors/invalid_api_key"]
    (out,) = episodes(served, load_program(f"agents.py:{name}", programs), rows=1)
    assert out.kind == kind and says in out.error
    if name == "crashes":  # the line that raised, in the program's file
        assert out.error.endswith(f"{programs / 'agents.py'}:26)")
    if name == "forged":  # refused, counted; the episode's own key was never used
        assert served.endpoint.stats["errors/invalid_api_key"] == before + 1 and not out.calls


def test_a_hang_times_out_and_its_key_is_closed(served, programs):
    (out,) = episodes(served, load_program("agents.py:hangs", programs), rows=1, timeout_s=0.3)
    assert out.kind == "timeout" and "ran past 0.3 s" in out.error
    assert not served.keys.episodes  # every key closed: a late call is refused


def test_sync_episodes_each_get_a_thread(served, programs):
    """More sync episodes than the loop's default thread pool has threads run at once (one
    waiting for a thread would spend its time limit waiting)."""
    function = load_program("agents.py:crowd", programs)
    out = episodes(served, function, rows=16, concurrency=16)
    assert all(o.kind == "ok" for o in out)
    assert function.__globals__["CROWD"][1] == 16


class Endless:
    """A backend whose requests never finish."""

    def __init__(self):
        self.tokenizer = tiny_tokenizer()

    async def generate(self, request):
        await asyncio.sleep(3600)


def test_a_call_still_sampling_when_time_runs_out_is_dropped(programs):
    endpoint = Endpoint(Endless(), model_name="tiny", recorder=Recorder())
    with Server(endpoint, Keys(required=True)) as server:
        function = load_program("agents.py:stuck", programs)
        (out,) = episodes(server, function, rows=1, timeout_s=0.5)
        assert out.kind == "timeout"
        ended = function.__globals__["ENDED"]
        for _ in range(100):  # the program's thread gets its answer soon after
            if ended:
                break
            time.sleep(0.05)
        assert ended == [409] and not endpoint.inflight


def test_concurrency_is_bounded(served, programs):
    function = load_program("agents.py:counted", programs)
    out = episodes(served, function, rows=8, concurrency=3)
    assert all(o.kind == "ok" for o in out)
    assert function.__globals__["RUNNING"][1] == 3


COMMAND = """
import json, os, sys
import openai
row = json.load(sys.stdin)
assert json.loads(os.environ["FLOWRL_ROW"]) == row
if row["index"] == 1:
    sys.exit("no luck")
client = openai.OpenAI(max_retries=0)
hi = [{"role": "user", "content": "Hi"}]
r = client.chat.completions.create(model="tiny", messages=hi, max_tokens=4, seed=0)
print("some log line")
print(json.dumps({"reward": 2.0}))
"""


def test_a_command_gets_the_endpoint_in_its_environment(served, tmp_path):
    (tmp_path / "agent.py").write_text(COMMAND)
    out = episodes(served, f"{sys.executable} agent.py", rows=2, cwd=tmp_path)
    assert out[0].kind == "ok" and out[0].reward == 2.0 and len(out[0].calls) == 1
    assert (
        out[1].kind == "error"
        and "exited with code 1" in out[1].error
        and "no luck" in out[1].error
    )


def test_a_hanging_command_is_killed(served, tmp_path):
    (tmp_path / "sleeper.py").write_text("import time\ntime.sleep(30)\n")
    (out,) = episodes(served, f"{sys.executable} sleeper.py", rows=1, timeout_s=1.0, cwd=tmp_path)
    assert out.kind == "timeout" and out.seconds < 10


def test_rows_train_the_sampled_tokens_from_the_rows_prompt(served, programs):
    tokenizer = tiny_tokenizer()
    out = episodes(served, load_program("agents.py:rewarded", programs), rows=1)
    out += episodes(served, load_program("agents.py:crashes", programs), rows=1)
    prompt = list(out[0].calls[0].prompt_ids)
    rows = program_rows(out, [prompt, prompt], tokenizer, tokenizer.pad_token_id, "reward")
    assert rows["response_mask"][0].sum() == len(out[0].calls[0].completion_ids)
    assert rows["response_mask"][1].sum() == 0  # a failed episode trains on nothing
    assert rows["scores"].tolist() == [0.5, 0.0]
    assert [i["termination"] for i in rows["rollout_info"]] == ["stop", "error"]
    # a first call that does not start from the row's prompt: an error, nothing trained
    other = program_rows(out[:1], [[5, 6, 7]], tokenizer, tokenizer.pad_token_id, "answer")
    assert other["response_mask"].sum() == 0
    assert "does not start from the row's prompt" in other["rollout_info"][0]["error"]
