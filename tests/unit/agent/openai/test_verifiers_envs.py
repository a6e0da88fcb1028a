"""verifiers environments (0.4's `verifiers.v1`) as a rollout source, against the real
`verifiers` package: the environment's tasks as prompt rows, its episodes run by the
environment's own protocol and rubric with flowrl's in-process harness, every call going
through verifiers' interception to flowrl's endpoint with the episode's key and recorded
there, each episode one training row (the calls extend each other), the rubric's reward the
episode's; several episodes at once; the graph-level run (`--tiny`)."""

import asyncio
import re
from pathlib import Path

import pytest

pytest.importorskip("verifiers.v1")

import flowrl.nodes  # noqa: E402
from flowrl.serve.app import Keys  # noqa: E402
from flowrl.serve.endpoint import Endpoint  # noqa: E402
from flowrl.serve.program_rows import program_rows  # noqa: E402
from flowrl.serve.programs import run_episodes  # noqa: E402
from flowrl.serve.record import Recorder, segments  # noqa: E402
from flowrl.serve.server import Server  # noqa: E402
from flowrl.serve.verifiers_envs import VerifiersProgram, task_rows  # noqa: E402
from flowrl.testing import run_tiny, tiny_tokenizer, write_graph  # noqa: E402

pytestmark = pytest.mark.slow  # importing verifiers takes seconds; servers start

NODES = str(Path(__file__).resolve().parents[4] / "nodes")
if NODES not in flowrl.nodes.__path__:  # an editable install of another checkout
    flowrl.nodes.__path__.insert(0, NODES)

# a multi-turn guessing game written to verifiers' published API: the environment answers
# each guess, the rubric scores the trace
GAME = '''
import re
import verifiers.v1 as vf

TRIES = 3
SEEN = []  # (target, the assistant turns) of every scored episode


def guess_of(text):
    found = re.findall(r"\\d", text or "")
    return int(found[-1]) if found else None


class GuessData(vf.TaskData):
    target: int


class GuessTask(vf.Task[GuessData]):
    @vf.reward
    async def solved(self, task: GuessData, trace: vf.Trace) -> float:
        turns = [m.content for m in trace.assistant_messages]
        SEEN.append((task.target, turns))
        return score(task.target, turns)


def score(target, turns):
    """1 for the number guessed, else a little for each turn and the first one's length"""
    if target in [guess_of(t) for t in turns[:TRIES]]:
        return 1.0
    return 0.25 * len(turns) + 0.01 * len(turns[0] or "")


class GuessTaskset(vf.Taskset[GuessTask]):
    def load(self):
        for target in (3, 7, 5, 1):
            data = GuessData(system_prompt="Guess my number.", prompt="1 to 8?", target=target)
            yield GuessTask(data, self.config.task)


class GuessConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig(max_turns=TRIES)


class GuessEnv(vf.Env[GuessConfig]):
    async def run(self, task, agents):
        async with agents.agent.interaction(task) as chat:
            turn = await chat.turn()
            while not turn.terminated:
                guess = guess_of(turn.last_reply)
                if guess == task.data.target:
                    break
                low = guess is None or guess < task.data.target
                turn = await chat.turn("higher" if low else "lower")


__all__ = ["GuessTaskset", "GuessEnv"]
'''


@pytest.fixture(scope="module")
def game(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vf")
    (folder / "guess_vf.py").write_text(GAME)
    return folder


def test_the_environments_tasks_are_prompt_rows(game):
    rows = task_rows("verifiers:guess_vf.py", str(game))
    assert [r["extra_info"]["task"] for r in rows] == [0, 1, 2, 3]
    assert rows[0]["prompt"] == [
        {"role": "system", "content": "Guess my number."},
        {"role": "user", "content": "1 to 8?"},
    ]
    assert rows[0]["data_source"] == "verifiers:guess_vf.py"


class Guesser:
    """A rollout backend whose every turn is "guess K" and its end token, K from the call's
    seed (the endpoint gives each call its own): turns a chat template renders back as
    sampled, so an episode's calls extend each other."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    async def generate(self, request):
        from flowrl.engines.rollout import Result

        text = f"guess {request.seed % 8 + 1}"
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        ids = ids + [self.tokenizer.eos_token_id]
        return Result(ids, [-0.5] * len(ids), "stop")

    def release(self, request_id: str) -> None:
        pass


def test_episodes_run_the_protocol_and_rubric_through_the_endpoint(game):
    import guess_vf  # the module verifiers loaded (its folder is on sys.path)

    tokenizer = tiny_tokenizer()
    endpoint = Endpoint(Guesser(tokenizer), model_name="policy", recorder=Recorder())
    program = VerifiersProgram("verifiers:guess_vf.py", str(game))
    rows = task_rows("verifiers:guess_vf.py", str(game))
    episodes = [
        {"prompt": r["prompt"], "extra_info": r["extra_info"], "index": k, "sample": s}
        for k, r in enumerate(rows)
        for s in range(2)
    ]
    guess_vf.SEEN.clear()
    with Server(endpoint, Keys(required=True)) as server:
        outcomes = asyncio.run(
            run_episodes(
                episodes,
                program.episode,
                endpoint,
                server.keys,
                server.base_url,
                concurrency=8,
                timeout_s=120,
            )
        )
    assert [o.kind for o in outcomes] == ["ok"] * 8, [o.error for o in outcomes]
    assert len(guess_vf.SEEN) == 8
    for o in outcomes:
        # every model turn of the episode went through the endpoint, recorded as one call
        assert 1 <= len(o.calls) <= 3
        said = [tokenizer.decode(c.completion_ids, skip_special_tokens=True) for c in o.calls]
        (target,) = {t for t, turns in guess_vf.SEEN if turns == said}
        # the rubric's reward is the episode's
        assert o.reward == guess_vf.score(target, said)
        # each call's prompt extends the last: one training row, nothing dropped
        assert len(segments(o.calls)) == 1
    prompts = [  # the rows' prompt ids, as the data loader templates them
        tokenizer.apply_chat_template(e["prompt"], add_generation_prompt=True)["input_ids"]
        for e in episodes
    ]
    out = program_rows(outcomes, prompts, tokenizer, 0, "reward")
    assert [info["segments_dropped"] for info in out["rollout_info"]] == [0] * 8
    assert out["scores"].tolist() == pytest.approx([o.reward for o in outcomes])  # float32
    assert int(out["response_mask"].sum()) == sum(
        len(c.completion_ids) for o in outcomes for c in o.calls
    )


def test_a_row_without_a_task_fails_its_episode_with_the_fix(game):
    program = VerifiersProgram("verifiers:guess_vf.py", str(game))
    with pytest.raises(
        ValueError, match=r'extra_info.task is None.*source = "verifiers:guess_vf.py"'
    ):
        asyncio.run(program.episode("http://127.0.0.1:9/v1", "k", {"extra_info": {}}))


GRAPH = """
[run]
steps = 2
seed = 0
val_size = 2                  # of the 4 tasks: 2 to train on

[data]
source = "verifiers:guess_vf.py"
batch_size = 2

[models.policy]
path = "smollm2-135m-instruct"
trainable = true

[pools.main]
workers = 1

[nodes.generate]
uses = "agent_program"
model = "policy"
n = 4
max_new_tokens = 8
env = "verifiers:guess_vf.py"
returns = "reward"

[nodes.advantage]
uses = "advantage.grpo"

[nodes.update_policy]
uses = "update.policy"
model = "policy"
kl_loss_coef = 0.0
on_policy = true
"""


def test_a_graph_trains_on_a_verifiers_environment(game, tmp_path):
    (tmp_path / "guess_vf.py").write_text(GAME)
    run = run_tiny(write_graph(tmp_path, GRAPH), tmp_path / "runs", **{"run.val_size": 2})
    steps = [m for m in run.metrics if "generate/episodes/ok" in m]
    assert steps and all(m["generate/episodes/ok"] == 1.0 for m in steps)
    assert all(m["generate/calls_per_episode"] >= 1.0 for m in steps)
    assert any(m.get("update_policy/grad_norm", 0) > 0 for m in run.metrics)


def test_the_example_in_docs_agents_md_trains(tmp_path):
    """docs/agents.md's verifiers environment, copied as a user would, with the graph above."""
    page = (Path(__file__).resolve().parents[4] / "docs/agents.md").read_text()
    (code,) = re.findall(r"```python\n(# my_guess\.py\n.*?)```", page, flags=re.S)
    (tmp_path / "my_guess.py").write_text(code)
    graph = GRAPH.replace("guess_vf.py", "my_guess.py")
    run = run_tiny(write_graph(tmp_path, graph), tmp_path / "runs", **{"run.val_size": 2})
    steps = [m for m in run.metrics if "generate/episodes/ok" in m]
    assert steps and all(m["generate/episodes/ok"] == 1.0 for m in steps)
