"""Fixtures for node tests: the character-level tokenizer and tiny random Llama behind
`path = "tiny"`. They live in flowrl/models/tiny.py, since library code loads them too; tests
import them from here. Library code must not import this module (tests/unit/test_layout.py)."""

from flowrl.models.tiny import CHAT_TEMPLATE, SPECIAL, tiny_model, tiny_tokenizer

__all__ = ["CHAT_TEMPLATE", "SPECIAL", "ScriptedTurns", "tiny_model", "tiny_tokenizer"]


class ScriptedTurns:
    """A turn backend (flowrl.agent.driver.TurnBackend) that samples nothing: request i's
    k-th turn is `script[i][k]` (a list of ids), cut to the turn's limit. It records what the
    driver appended before each turn (`appended[i]`) and the limits it asked for."""

    def __init__(self, script: dict, logprob: float = -0.5):
        self.script, self.logprob = script, logprob
        self.count = {i: 0 for i in script}
        self.appended = {i: [] for i in script}
        self.limits = {i: [] for i in script}

    def turn(self, rows, append, limits):
        out = []
        for i, extra, limit in zip(rows, append, limits, strict=True):
            self.appended[i].append(list(extra))
            self.limits[i].append(limit)
            ids = list(self.script[i][self.count[i]])[:limit]
            self.count[i] += 1
            out.append((ids, [self.logprob] * len(ids)))
        return out
