"""Token assembly without drift: prompt + sampled ids + observation deltas equal the chat
template of the whole conversation, token for token, on the embedded model's tokenizer
(SmolLM2's ChatML) and on the tiny character-level one; the masks are right token by token."""

import concurrent.futures

import pytest

from flowrl.agent.chat import ChatTokens, template_problems
from flowrl.agent.driver import run_requests
from flowrl.agent.episode import Episode, Limits
from flowrl.agent.parsers import make_parser
from flowrl.agent.tools.toolbox import FunctionTool, Toolbox
from flowrl.engines.threads import run_sync
from flowrl.testing import CHAT_TEMPLATE, ScriptedTurns, tiny_tokenizer


@pytest.fixture(scope="module")
def smol():
    from flowrl.models import embedded, load_tokenizer

    try:
        embedded.gguf_file()
    except embedded.ModelNotFound as e:
        pytest.skip(str(e))
    return load_tokenizer(embedded.ALIAS)


@pytest.fixture(params=["smol", "tiny"])
def tokenizer(request):
    return request.getfixturevalue("smol") if request.param == "smol" else tiny_tokenizer()


def calc(expression: str) -> str:
    """Multiply.

    Args:
        expression: "a*b".
    """
    a, b = expression.split("*")
    return str(int(a) * int(b))


def test_smollm2_observation_delta_keeps_the_newline_after_the_turn(smol):
    chat = ChatTokens(smol)
    delta = chat.delta([{"role": "tool", "content": "9716"}])
    assert smol.decode(delta) == "\n<|im_start|>tool\n9716<|im_end|>\n<|im_start|>assistant\n"
    assert smol.decode(chat.base).endswith("<|im_start|>assistant\nA<|im_end|>")


def test_template_check_passes_for_chatml(tokenizer):
    assert template_problems(tokenizer) == []
    assert template_problems(tokenizer, obs_role="user") == []


def test_template_that_rewrites_history_is_reported():
    tokenizer = tiny_tokenizer()
    # renders only the last assistant message's content (like templates that strip reasoning
    # from earlier turns): appending turns cannot reproduce it
    tokenizer.chat_template = CHAT_TEMPLATE.replace(
        "{{ message['content'] }}",
        "{% if message['role'] != 'assistant' or loop.last %}{{ message['content'] }}{% endif %}",
    )
    problems = template_problems(tokenizer)
    assert len(problems) == 1 and "changes earlier tokens" in problems[0]


def test_generation_prompt_unlike_the_assistant_header_is_reported():
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE.replace(
        "<|im_start|>assistant\n{% endif %}", "<|im_start|>assistant\n\n{% endif %}"
    )
    problems = template_problems(tokenizer)
    assert len(problems) == 1 and "other tokens than templating the whole" in problems[0]
    assert "'\\n<calc>" in problems[0]  # the diff shows where they part


def test_template_without_eos_at_turn_end_is_reported():
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE.replace("<|im_end|>", "<pad>")
    assert "does not end an assistant turn with the eos token" in template_problems(tokenizer)[0]


def test_episode_ids_equal_the_full_template_and_masks_mark_sampled_tokens(tokenizer):
    """Two calls then an answer, scripted with the canonical ids of each turn's text."""
    chat = ChatTokens(tokenizer)
    box = Toolbox.__new__(Toolbox)
    box.tools = [FunctionTool(calc)]
    box.names = ["calc"]
    prompt = [
        {"role": "system", "content": "Use <calc>a*b</calc> to multiply."},
        {"role": "user", "content": "What is 347 * 28?"},
    ]
    texts = ["<calc>347*28</calc>", "Let me check: <calc>28*347</calc>", "It is 9716."]
    turns = [tokenizer(t, add_special_tokens=False)["input_ids"] + [chat.eos] for t in texts]
    pool = concurrent.futures.ThreadPoolExecutor(2)
    episode = Episode(
        chat.encode(prompt, generation_prompt=True),
        chat,
        make_parser("tag", ["calc"]),
        box.open({}),
        Limits(max_new_tokens=500, max_turn_tokens=100),
        messages=prompt,
    )
    run_sync(run_requests([episode], ScriptedTurns({0: turns})))
    pool.shutdown()
    assert episode.reason == "stop"
    conversation = prompt + [
        {"role": "assistant", "content": texts[0]},
        {"role": "tool", "content": "9716"},
        {"role": "assistant", "content": texts[1]},
        {"role": "tool", "content": "9716"},
        {"role": "assistant", "content": texts[2]},
    ]
    full = chat.encode(conversation, generation_prompt=False)
    assembled = episode.prompt_ids + episode.ids
    assert assembled == full[: len(assembled)]
    assert tokenizer.decode(full[len(assembled) :]).strip() == ""  # only the trailing newline
    assert episode.messages[len(prompt) :] == conversation[len(prompt) :]
    # the mask, token by token: 1 exactly where the scripted turns' ids sit
    expected, position = [0] * len(episode.ids), 0
    for k, turn in enumerate(turns):
        start = episode.ids.index(turn[0], position)
        assert episode.ids[start : start + len(turn)] == turn
        expected[start : start + len(turn)] = [1] * len(turn)
        position = start + len(turn)
        if k == 0:
            assert start == 0
    assert episode.mask == expected and position == len(episode.ids)


def test_truncate_keeps_head_and_tail_with_a_marker():
    chat = ChatTokens(tiny_tokenizer())  # one token per character
    text, cut = chat.truncate("abcdefghijklmnopqrstuvwxyz", 6)
    assert cut and text.startswith("abc") and text.endswith("xyz") and "20 tokens cut" in text
    assert chat.truncate("short", 6) == ("short", False)
