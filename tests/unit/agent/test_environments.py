"""Gymnasium environments of text as an agent node's rollout source (`env = "file.py:Cls"`),
against the real `gymnasium` package: the reset observation opens the conversation, each
turn's action is the model's turn and its reward a turn reward, terminated and truncated kept
apart, the request's seed given to reset, and what an environment returns checked where it
comes back."""

import asyncio

import pytest

gymnasium = pytest.importorskip("gymnasium")

from flowrl.agent.environments import EnvironmentInteraction  # noqa: E402
from flowrl.testing import scripted_request  # noqa: E402


class Guess(gymnasium.Env):
    """Guess a number from 1 to 8 in at most 3 tries: 'higher' / 'lower' after each."""

    observation_space = gymnasium.spaces.Text(200)
    action_space = gymnasium.spaces.Text(200)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.target = int(self.np_random.integers(1, 9))
        if options and "target" in options:
            self.target = int(options["target"])
        self.tries = 0
        return "Guess my number, 1 to 8.", {}

    def step(self, action):
        self.tries += 1
        digits = [int(c) for c in action if c.isdigit()]
        guess = digits[-1] if digits else 0
        if guess == self.target:
            return "Right!", 1.0, True, False, {}
        hint = "higher" if guess < self.target else "lower"
        return hint, -0.1, False, self.tries >= 3, {}


def test_an_episode_runs_the_environment_turn_by_turn():
    episode = scripted_request(
        ["I guess 4", "then 6", "7"], interaction=Guess, interaction_kwargs={"target": 7}
    )
    info = episode.info()
    users = [m["content"] for m in info["messages"] if m["role"] == "user"]
    assert users == ["Guess my number, 1 to 8.", "higher", "higher", "Right!"]
    assert info["turn_rewards"] == [-0.1, -0.1, 1.0]
    assert info["termination"] == "interaction_done"
    assert (info["env_terminated"], info["env_truncated"]) == (True, False)
    assert info["policy_tokens"] > 0 and info["tool_tokens"] > 0  # observations: mask 0


def test_truncated_is_kept_apart_from_terminated():
    episode = scripted_request(["1", "1", "1"], interaction=Guess, interaction_kwargs={"target": 8})
    info = episode.info()
    assert (info["env_terminated"], info["env_truncated"]) == (False, True)
    assert info["turn_rewards"] == [-0.1, -0.1, -0.1]


class Seeded(Guess):
    seeds: list = []

    def reset(self, *, seed=None, options=None):
        Seeded.seeds.append(seed)
        return super().reset(seed=seed, options=options)


def test_the_request_seed_reaches_reset():
    """run_requests gives each episode its request's seed (index 0 here, as the agent node's
    seeds by step and row); reset gets it, so the same seed draws the same episode."""
    Seeded.seeds = []
    scripted_request(["1"], interaction=Seeded, max_assistant_turns=1)
    assert Seeded.seeds == [0]
    interaction = EnvironmentInteraction(Guess)
    for request, seed in (("a", 3), ("b", 3)):
        asyncio.run(interaction.start(request, seed=seed))
    assert interaction.envs["a"].target == interaction.envs["b"].target


class Broken(Guess):
    def step(self, action):
        return 3, float("nan"), False, False, {}


class NaNReward(Guess):
    def step(self, action):
        return "ok", float("nan"), False, False, {}


class FourValues(Guess):
    def step(self, action):
        return "ok", 0.0, False, {}  # gym's old API


@pytest.mark.parametrize(
    ("env", "said"),
    [
        (Broken, "returned int 3; it must return text (a str, or a dict of fields) as its obs"),
        (NaNReward, "returned float nan; it must return a finite number as its reward"),
        (FourValues, "it must return (observation, reward, terminated, truncated, info)"),
    ],
)
def test_what_an_environment_returns_is_checked_naming_its_line(env, said):
    episode = scripted_request(["5"], interaction=env, raise_errors=False)
    info = episode.info()
    assert info["termination"] == "error" and said in info["error"]
    assert "test_environments.py:" in info["error"]  # the class's file:line


def test_the_node_metrics_count_the_environments_own_ends():
    """env_terminated / env_truncated: shares of the step's requests (a game won, lost)."""
    from types import SimpleNamespace

    from flowrl.agent.rows import agent_metrics

    won = scripted_request(["7"], interaction=Guess, interaction_kwargs={"target": 7})
    lost = scripted_request(["1", "1", "1"], interaction=Guess, interaction_kwargs={"target": 8})
    stats = SimpleNamespace(seconds=lambda part: 1.0, overlap_s=0.0, turns=4)
    metrics = agent_metrics([won, lost, lost], stats)
    assert metrics["env_terminated"] == pytest.approx(1 / 3)
    assert metrics["env_truncated"] == pytest.approx(2 / 3)
    plain = scripted_request(["hi"], max_assistant_turns=1)
    assert "env_terminated" not in agent_metrics([plain], stats)


class Board(Guess):
    """Observations as a dict of fields (a `spaces.Dict`): read as "name: value" lines."""

    def reset(self, *, seed=None, options=None):
        text, info = super().reset(seed=seed, options=options)
        return {"board": text, "tries_left": 3, "note": ""}, info

    def step(self, action):
        text, reward, terminated, truncated, info = super().step(action)
        return {"board": text, "tries_left": 3 - self.tries}, reward, terminated, truncated, info


def test_an_observation_of_fields_is_read_as_lines():
    info = scripted_request(["4", "7"], interaction=Board, interaction_kwargs={"target": 7}).info()
    users = [m["content"] for m in info["messages"] if m["role"] == "user"]
    assert users == [
        "board: Guess my number, 1 to 8.\ntries_left: 3",  # the empty note left out
        "board: higher\ntries_left: 2",
        "board: Right!\ntries_left: 1",
    ]
