"""A Gymnasium environment of text: guess a number from 1 to 8 in at most 4 tries, told
"higher" or "lower" after each wrong one. graphs/grpo_guess_env.toml trains on it (the agent
node's `env`); docs/agents.md "Environments".

reward: 1 for the right number, -0.1 for a guess that is wrong or missing. `terminated` when it
is guessed, `truncated` when the tries run out. The number comes from reset's seed (the
request's), or `options["target"]` (a row's `extra_info.interaction_kwargs`).
"""

import re

import gymnasium
from gymnasium import spaces

LOW, HIGH, TRIES = 1, 8, 4


class GuessNumber(gymnasium.Env):
    observation_space = spaces.Text(max_length=200)
    action_space = spaces.Text(max_length=200)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.target = int(self.np_random.integers(LOW, HIGH + 1))
        if options and "target" in options:
            self.target = int(options["target"])
        self.tries = 0
        return f"I picked a number from {LOW} to {HIGH}. Your guess?", {}

    def step(self, action: str):
        self.tries += 1
        numbers = re.findall(r"-?\d+", action)
        guess = int(numbers[-1]) if numbers else None
        if guess == self.target:
            return "Right!", 1.0, True, False, {"tries": self.tries}
        out_of_tries = self.tries >= TRIES
        if guess is None:
            hint = f"Answer with one number from {LOW} to {HIGH}."
        else:
            hint = "Higher." if guess < self.target else "Lower."
        return hint, -0.1, False, out_of_tries, {"tries": self.tries}
