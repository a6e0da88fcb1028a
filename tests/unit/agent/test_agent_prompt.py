"""Tools in the prompt: an agent prompt is templated with the schemas of the row's tools
(`tools=`), on the embedded SmolLM2 tokenizer with Qwen2.5's published template
(tests/data/qwen2_5_tools.jinja) and with its own; the appended conversation still equals the
template of the whole conversation token for token; the data loader counts the tool block."""

import json
from pathlib import Path

import pytest

from flowrl.agent.chat import ChatTokens, template_problems
from flowrl.agent.driver import run_requests
from flowrl.agent.episode import Episode, Limits
from flowrl.agent.parsers import make_parser
from flowrl.agent.prompt import AgentPrompt, template_shows_tools, with_system_prompt
from flowrl.agent.tools.toolbox import Toolbox
from flowrl.data.loader import PromptDataset
from flowrl.engines.threads import run_sync
from flowrl.testing import ScriptedTurns, tiny_tokenizer

QWEN = (Path(__file__).parents[2] / "data" / "qwen2_5_tools.jinja").read_text()
SYSTEM = "You are a math expert. Use the `calc_gsm8k_reward` tool. Put the answer after `####`."


def smollm2():
    from flowrl.models.loading import load_tokenizer

    return load_tokenizer("smollm2-135m-instruct")


def verl_row(truth="72", agent="tool_agent"):
    return {
        "prompt": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Natalia sold 48 clips in April and half as many in May."},
        ],
        "extra_info": {
            "agent_name": agent,
            "tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": truth}}},
        },
    }


@pytest.fixture(scope="module")
def tokenizer():
    return smollm2()


def test_qwen_template_shows_the_rows_tools_and_smollm2s_own_does_not(tokenizer):
    box = Toolbox(["answer_check", "calculator"])
    hermes = AgentPrompt(tokenizer, box, QWEN)
    text = hermes(verl_row())
    assert "# Tools" in text and "<tool_call>" in text
    # the row's tools_kwargs name calc_gsm8k_reward: it sees that tool only (verl's SGLang rule)
    assert '"name": "calc_gsm8k_reward"' in text and '"name": "calc"' not in text
    plain = AgentPrompt(tokenizer, box)(verl_row())
    with_tools = len(tokenizer(text)["input_ids"])
    without = len(tokenizer(plain)["input_ids"])
    assert with_tools > without + 150  # the tool block: signature, format, instructions
    assert template_shows_tools(tokenizer, QWEN) and not template_shows_tools(tokenizer)
    single = hermes(verl_row(agent="single_turn_agent"))
    assert "# Tools" not in single  # a single-turn row gets no tools


def test_a_system_prompt_describes_the_tools_where_the_template_cannot(tokenizer):
    box = Toolbox(["calculator"])
    text = AgentPrompt(tokenizer, box, None, "Tools:\n{tools}")(verl_row())
    assert "Tools:\n" + json.dumps(box.schemas[0]) in text and SYSTEM in text
    messages = with_system_prompt([{"role": "user", "content": "q"}], "S", [])
    assert messages[0] == {"role": "system", "content": "S"}


@pytest.mark.parametrize("which", ["smollm2_qwen_template", "tiny_qwen_template"])
def test_prompt_with_tools_plus_turns_equals_the_template_of_the_conversation(tokenizer, which):
    tok = tokenizer if which.startswith("smollm2") else tiny_tokenizer()
    box = Toolbox(["answer_check"])
    assert template_problems(tok, "tool", QWEN, box.schemas) == []
    chat = ChatTokens(tok, QWEN)
    row = verl_row()
    prompt_ids = tok(AgentPrompt(tok, box, QWEN)(row), add_special_tokens=False)["input_ids"]
    call = '<tool_call>\n{"name": "calc_gsm8k_reward", "arguments": {"answer": "72"}}\n</tool_call>'
    texts = [call, "#### 72"]
    turns = [tok(t, add_special_tokens=False)["input_ids"] + [chat.eos] for t in texts]
    episode = Episode(
        prompt_ids,
        chat,
        make_parser("hermes", box.names),
        box.open(row["extra_info"]),
        Limits(max_new_tokens=2000, max_turn_tokens=500),
        messages=row["prompt"],
    )
    run_sync(run_requests([episode], ScriptedTurns({0: turns})))
    assert episode.reason == "stop" and episode.info()["rollout_reward_scores"] == {
        "AnswerCheck": 1.0
    }
    tool_text = episode.messages[len(row["prompt"]) + 1]["content"]
    conversation = [
        *row["prompt"],
        {"role": "assistant", "content": texts[0]},
        {"role": "tool", "content": tool_text},
        {"role": "assistant", "content": texts[1]},
    ]
    full = chat.encode(conversation, generation_prompt=False, tools=box.schemas)
    assembled = episode.prompt_ids + episode.ids
    assert assembled == full[: len(assembled)]
    assert tok.decode(full[len(assembled) :]).strip() == ""  # the template's trailing newline
    assert "<tool_response>" in tok.decode(episode.ids)  # Qwen's tool role, as a user turn


def test_the_loader_templates_agent_prompts_with_their_tools_and_counts_the_block(tokenizer):
    box = Toolbox(["answer_check"])
    render = AgentPrompt(tokenizer, box, QWEN)
    rows = [{**verl_row(), "data_source": "gsm8k", "reward_model": {"ground_truth": "72"}}]
    plain = PromptDataset(rows, tokenizer, 1024)
    shown = PromptDataset(rows, tokenizer, 1024, render)
    assert "# Tools" in shown.collate([0])["prompt_text"][0]
    width = shown.collate([0])["prompts"].shape[1]
    assert width > plain.collate([0])["prompts"].shape[1] + 150
    assert len(PromptDataset(rows, tokenizer, width - 1, render)) == 0  # over max_prompt_len
