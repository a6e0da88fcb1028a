"""Token assembly for multi-turn rollouts, without drift.

A conversation's token ids are built by appending, never by re-templating the whole history:

    prompt ids       = chat template of the prompt messages, with the generation prompt
    + turn ids       = the ids the policy sampled, verbatim (never decoded and re-encoded)
    + observation    = the template of the tool (or user) messages as a *delta*: templated
                       after a fixed base conversation whose ids are cut after its last
                       end-of-turn token, minus those base ids
    + turn ids ...

Cutting the base after its last end-of-turn token puts whatever the template writes between
one turn's `<|im_end|>` and the next `<|im_start|>` (SmolLM2 and Qwen: a newline) into the
observation; templating the tool message alone drops it (verl #6501). For a template that only
appends (ChatML and most others) the concatenation equals the template of the whole
conversation token for token; `template_problems` checks that on a canned conversation, which
`flowrl check` runs for an agent node's tokenizer.

Plain Python over a transformers tokenizer: no torch.
"""

from __future__ import annotations

BASE = (
    {"role": "system", "content": "S"},
    {"role": "user", "content": "U"},
    {"role": "assistant", "content": "A"},
)
MARKER = "\n...[{} tokens cut]...\n"  # what replaces the middle of an over-long tool output


class TemplateError(ValueError):
    """The chat template cannot append messages without changing earlier tokens."""


class ChatTokens:
    """A tokenizer's chat template as appendable token ids.

    Args:
        tokenizer: a transformers tokenizer with a chat template; its eos token ends a turn.
        chat_template: a template text used instead of the tokenizer's (the node's
            `chat_template` file), or None.
    """

    def __init__(self, tokenizer, chat_template: str | None = None):
        self.tokenizer, self.chat_template = tokenizer, chat_template
        self.eos = tokenizer.eos_token_id
        base = self.encode(list(BASE), generation_prompt=False)
        if self.eos not in base:
            raise TemplateError(
                f"the chat template does not end an assistant turn with the eos token "
                f"{tokenizer.eos_token!r}: turns cannot be cut there"
            )
        self.base = base[: len(base) - base[::-1].index(self.eos)]  # up to the last eos

    def encode(self, messages: list[dict], generation_prompt: bool, tools=None) -> list[int]:
        """The chat template's ids of `messages` (as the data loader tokenizes prompts)."""
        kwargs = {"tools": tools} if tools else {}
        if self.chat_template:
            kwargs["chat_template"] = self.chat_template
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt, **kwargs
        )
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def delta(self, messages: list[dict]) -> list[int]:
        """The ids that append `messages` (tool results, a user reply) to a conversation
        whose last turn ended with eos, through the next assistant generation prompt."""
        full = self.encode([*BASE, *messages], generation_prompt=True)
        if full[: len(self.base)] != self.base:
            raise TemplateError(
                "the chat template changes earlier tokens when messages are appended; "
                f"first difference at token {_first_difference(full, self.base)}"
            )
        return full[len(self.base) :]

    def decode(self, ids: list[int]) -> str:
        """Text of ids without special tokens: for parsing calls, rewards and logs only."""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def show(self, ids: list[int]) -> str:
        """Text of ids with special tokens, as the model sees them: for logs."""
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def truncate(self, text: str, max_tokens: int) -> tuple[str, bool]:
        """(text cut to about `max_tokens` tokens by dropping its middle, whether it was cut).
        The kept head and tail are decoded from the text's own ids, so the template may
        tokenize the joined text a token or two differently at the seams."""
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) <= max_tokens:
            return text, False
        head = max_tokens // 2
        tail = max_tokens - head
        dropped = len(ids) - max_tokens
        kept = self.tokenizer.decode(ids[:head]) + MARKER.format(dropped)
        return kept + (self.tokenizer.decode(ids[-tail:]) if tail else ""), True


def template_problems(
    tokenizer, obs_role: str = "tool", chat_template: str | None = None, tools=None
) -> list[str]:
    """What stops this tokenizer's template from appending turns token for token: [] when
    prompt (with `tools`) + sampled turns + observation deltas equals the template of a canned
    two-call conversation (with `obs_role` messages as the observations)."""
    try:
        chat = ChatTokens(tokenizer, chat_template)
        messages = [
            {"role": "system", "content": "Use the calculator."},
            {"role": "user", "content": "What is 12 * 34?"},
        ]
        ids = chat.encode(messages, generation_prompt=True, tools=tools)
        turns = ["<calc>12*34</calc>", "Check: <calc>408/34</calc>", "The answer is 408."]
        results = ["408", "12"]
        for k, turn in enumerate(turns):
            ids += tokenizer(turn, add_special_tokens=False)["input_ids"] + [chat.eos]
            messages.append({"role": "assistant", "content": turn})
            if k < len(results):
                observation = [{"role": obs_role, "content": results[k]}]
                ids += chat.delta(observation)
                messages += observation
        full = chat.encode(messages, generation_prompt=False, tools=tools)
    except Exception as e:  # a template that raises on these messages is unusable too
        return [f"{type(e).__name__}: {e}"]
    full = full[: len(full) - full[::-1].index(chat.eos)] if chat.eos in full else full
    if ids == full:
        return []
    at = _first_difference(ids, full)
    return [
        "appending turns gives other tokens than templating the whole conversation: at "
        f"token {at}, appended {tokenizer.decode(ids[at : at + 8])!r} vs template "
        f"{tokenizer.decode(full[at : at + 8])!r}"
    ]


def _first_difference(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def truncate_chars(text: str, length: int, side: str) -> str:
    """verl's cut of a tool response longer than `length` characters (tool_agent_loop.py):
    "left" keeps the first characters, "right" the last, "middle" half of each."""
    if len(text) <= length:
        return text
    if side == "left":
        return text[:length] + "...(truncated)"
    if side == "right":
        return "(truncated)..." + text[-length:]
    half = length // 2
    return text[:half] + "...(truncated)..." + (text[-half:] if half else "")
