"""Fixtures for node tests: the character-level tokenizer and tiny random Llama behind
`path = "tiny"`. They live in flowrl/models/tiny.py, since library code loads them too; tests
import them from here. Library code must not import this module (tests/unit/test_layout.py)."""

from flowrl.models.tiny import CHAT_TEMPLATE, SPECIAL, tiny_model, tiny_tokenizer

__all__ = ["CHAT_TEMPLATE", "SPECIAL", "tiny_model", "tiny_tokenizer"]
