"""OpenEnv environments of text as an agent node's rollout source (`env = "file.py:Cls"` naming
an `openenv.core.env_server.Environment`), against the real `openenv-core` package: the class
served by OpenEnv's own app on loopback, each request one session of OpenEnv's client, its
reset observation opening the conversation, each step's reward a turn reward and `done`
ending it, the request's seed and the row's kwargs given to reset, many requests at once,
and what the environment returns checked where it comes back."""

import asyncio
import random
import re
from pathlib import Path

import pytest

pytest.importorskip("openenv.core")

from openenv.core.env_server import Action, Environment, Observation, State  # noqa: E402

from flowrl.agent.interactions import as_interaction, load_interactions  # noqa: E402
from flowrl.agent.openenv_envs import OpenEnvInteraction, is_openenv  # noqa: E402
from flowrl.agent.tools import ToolError  # noqa: E402
from flowrl.testing import scripted_request  # noqa: E402

pytestmark = pytest.mark.slow  # importing openenv imports gradio (seconds); servers start


class Guess(Action):
    text: str


class Hint(Observation):
    message: str = ""


class GuessState(State):
    target: int = 0


class GuessGame(Environment[Guess, Hint, GuessState]):
    """Guess a number from 1 to 8 in at most 3 tries, told 'higher' or 'lower'."""

    SUPPORTS_CONCURRENT_SESSIONS = True
    resets: list = []

    def __init__(self):
        super().__init__()
        self._state = GuessState()

    def reset(self, seed=None, episode_id=None, target=None, **kwargs):
        GuessGame.resets.append((seed, target))
        number = target if target is not None else random.Random(seed).randint(1, 8)
        self._state = GuessState(episode_id=episode_id, target=number)
        return Hint(message="Guess my number, 1 to 8.")

    def step(self, action, timeout_s=None, **kwargs):
        self._state.step_count += 1
        found = re.findall(r"\d", action.text)
        guess = int(found[-1]) if found else 0
        if guess == self._state.target:
            return Hint(message="Right!", reward=1.0, done=True)
        hint = "higher" if guess < self._state.target else "lower"
        return Hint(message=hint, reward=-0.1, done=self._state.step_count >= 3)

    @property
    def state(self):
        return self._state


class OneAtATime(GuessGame):
    SUPPORTS_CONCURRENT_SESSIONS = False  # OpenEnv's default: one session per server


@pytest.fixture
def close():
    opened = []
    yield opened.append
    for interaction in opened:
        interaction.close()


def run(interaction, close, turns, **kwargs):
    close(interaction)
    return scripted_request(turns, interaction=interaction, **kwargs).info()


def test_an_episode_runs_the_served_environment_turn_by_turn(close):
    interaction = as_interaction(GuessGame)
    assert isinstance(interaction, OpenEnvInteraction) and is_openenv(GuessGame)
    info = run(interaction, close, ["I guess 4", "then 6", "7"], interaction_kwargs={"target": 7})
    users = [m["content"] for m in info["messages"] if m["role"] == "user"]
    assert users == ["Guess my number, 1 to 8.", "higher", "higher", "Right!"]
    assert info["turn_rewards"] == [-0.1, -0.1, 1.0]
    assert info["termination"] == "interaction_done"
    assert (info["env_terminated"], info["env_truncated"]) == (True, False)
    assert interaction.all_servers[0].url.startswith("http://127.0.0.1:")


def test_done_after_the_tries_ends_the_request_and_seed_and_kwargs_reach_reset(close):
    GuessGame.resets = []
    info = run(
        as_interaction(GuessGame), close, ["1", "1", "1", "1"], interaction_kwargs={"target": 8}
    )
    assert info["turn_rewards"] == [-0.1, -0.1, -0.1] and info["env_terminated"]
    assert GuessGame.resets == [(0, 8)]  # the request's seed (0 here) and the row's kwargs


def test_many_requests_at_once_each_their_own_session(close):
    """8 requests on one server at once (the class takes concurrent sessions) and on a pool of
    one-session servers (it does not): each request's game is its own."""
    for cls, servers in ((GuessGame, 1), (OneAtATime, 8)):
        interaction = OpenEnvInteraction(cls)
        close(interaction)

        async def episode(k, interaction=interaction):
            request, number = f"r{k}", k % 8 + 1
            await interaction.start(request, seed=k, target=number)
            said = [{"role": "assistant", "content": str(number)}]
            hints = [await interaction.reply(request, said)]
            await interaction.finish(request)
            return hints

        async def all_of_them():
            return await asyncio.gather(*(episode(k) for k in range(8)))

        out = asyncio.run(all_of_them())
        assert all(hints == [(True, "Right!", 1.0)] for hints in out)
        assert len(interaction.all_servers) == servers
        if servers > 1:  # a later request reuses a free server of the pool
            asyncio.run(episode(3))
            assert len(interaction.all_servers) == servers


class TwoFields(Action):
    text: str
    other: str


class Nothing(Observation):
    pass


class BadAction(Environment[TwoFields, Hint, State]):
    def reset(self, seed=None, episode_id=None, **kwargs):
        return Hint(message="")

    def step(self, action, timeout_s=None, **kwargs):
        return Hint(message="")

    @property
    def state(self):
        return State()


class BadObservation(Environment[Guess, Nothing, State]):
    reset, step, state = BadAction.reset, BadAction.step, BadAction.state


def test_models_that_are_not_text_are_refused_with_the_class_and_the_fix():
    with pytest.raises(ToolError, match=r"TwoFields \(text: str, other: str\) cannot be made"):
        OpenEnvInteraction(BadAction, label="envs.py:BadAction")
    with pytest.raises(ToolError, match=r"test_openenv_envs.py:\d+\): its observation model "):
        OpenEnvInteraction(BadObservation, label="envs.py:BadObservation")


class Run(Action):
    code: str
    timeout_s: int = 5  # a field with a default: the model's text goes to `code`


class Ran(Observation):
    stdout: str = ""
    stderr: str = ""
    exit_code: int = 0


class Runner(Environment[Run, Ran, State]):
    """Observations of several fields (a coding environment's): the model reads them as lines."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def reset(self, seed=None, episode_id=None, **kwargs):
        return Ran(stdout="ready")

    def step(self, action, timeout_s=None, **kwargs):
        ok = action.code.strip() == "print(2 + 2)"
        return Ran(stdout="4" if ok else "", stderr="" if ok else "SyntaxError", exit_code=1 - ok,
                   reward=float(ok), done=ok)  # fmt: skip

    @property
    def state(self):
        return State()


def test_an_observation_of_several_fields_is_read_as_lines(close):
    interaction = as_interaction(Runner)
    assert interaction.action_field == "code"
    info = run(interaction, close, ["print(2 +", "print(2 + 2)"])
    users = [m["content"] for m in info["messages"] if m["role"] == "user"]
    assert users == ["stdout: ready\nexit_code: 0", "stderr: SyntaxError\nexit_code: 1",
                     "stdout: 4\nexit_code: 0"]  # fmt: skip
    assert info["turn_rewards"] == [0.0, 1.0]


class Broken(GuessGame):
    def step(self, action, timeout_s=None, **kwargs):
        raise ValueError("the board is on fire")


def test_an_environment_that_raises_fails_its_request_with_the_error(close):
    """OpenEnv's server sends the exception back as an error frame; the request fails with it
    (scripted_request raises what failed a request)."""
    with pytest.raises(RuntimeError, match="the board is on fire"):
        run(as_interaction(Broken), close, ["3", "4"], interaction_kwargs={"target": 7})


def test_the_agent_node_takes_an_openenv_class_by_file_reference(tmp_path, close):
    source = tmp_path / "game.py"
    source.write_text(
        "from openenv.core.env_server import Action, Environment, Observation, State\n"
        "class Say(Action):\n    words: str\n"
        "class Heard(Observation):\n    reply: str = ''\n"
        "class Echo(Environment[Say, Heard, State]):\n"
        "    SUPPORTS_CONCURRENT_SESSIONS = True\n"
        "    def reset(self, seed=None, episode_id=None, **kw):\n"
        "        return Heard(reply='say something')\n"
        "    def step(self, action, timeout_s=None, **kw):\n"
        "        return Heard(reply=action.words.upper(), reward=0.5, done=True)\n"
        "    @property\n    def state(self):\n        return State()\n"
    )
    (interaction,) = load_interactions("", "", str(tmp_path), env="game.py:Echo").values()
    info = run(interaction, close, ["hello"])
    users = [m["content"] for m in info["messages"] if m["role"] == "user"]
    assert users == ["say something", "HELLO"] and info["turn_rewards"] == [0.5]


def test_the_example_in_docs_agents_md_runs(tmp_path, close):
    """docs/agents.md's OpenEnv example, copied as a user would, plays a game to its end."""
    text = (Path(__file__).parents[3] / "docs" / "agents.md").read_text()
    section = text[text.index("## Environments (OpenEnv)") :]
    code = section[
        section.index("```python\n") + 10 : section.index("```\n", section.index("```python"))
    ]
    (tmp_path / "guess_openenv.py").write_text(code)
    (interaction,) = load_interactions(
        "", "", str(tmp_path), env="guess_openenv.py:GuessGame"
    ).values()
    info = run(interaction, close, ["1", "2", "3", "4"])
    assert info["termination"] in ("interaction_done", "max_turns")
    assert len(info["turn_rewards"]) >= 1 and info["env_terminated"] == (
        info["termination"] == "interaction_done"
    )
