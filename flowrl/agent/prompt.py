"""An agent prompt as the model sees it: the row's messages templated with the schemas of the
tools the row may use, as verl templates them (`apply_chat_template(messages, tools=...)`).

The data loader renders every prompt of a graph with an agent node through `AgentPrompt` (the
node's `NodeSpec.prompt` hook, `agent_prompt`), so
the tool block counts toward `data.max_prompt_len`, the `prompts` ids every node reads are the
ones the policy sampled from, and samples.jsonl's `prompt_text` is what the model saw. Which
tools a row sees is `Toolbox.select` (verl's SGLang rollout: the tools its `tools_kwargs` name,
none for `agent_name = "single_turn_agent"`).

A template without tool support (SmolLM2's, the tiny model's) drops `tools=` silently;
`template_shows_tools` finds that, `flowrl check` reports it, and the node's fixes are a
`chat_template` file (e.g. Qwen2.5's, whose `# Tools` block works with any ChatML vocabulary)
or a `system_prompt` that describes the tools in text (`{tools}` is replaced by their JSON
schemas, one a line).

No torch.
"""

from __future__ import annotations

import json
from pathlib import Path

PROBE = {
    "type": "function",
    "function": {
        "name": "flowrl_probe_tool",
        "description": "A tool that only tests the chat template.",
        "parameters": {"type": "object", "properties": {}, "required": []},
    },
}


def read_template(path: str, base_dir: str | Path = ".") -> str | None:
    """The text of a chat-template file (relative to the graph's folder), or None for ""."""
    if not path:
        return None
    file = Path(path) if Path(path).is_absolute() else Path(base_dir) / path
    if not file.is_file():
        raise FileNotFoundError(f"chat_template: no file {file}")
    return file.read_text()


def with_system_prompt(messages: list, system_prompt: str, schemas: list) -> list:
    """`messages` with `system_prompt` (its `{tools}` replaced by the schemas, one JSON a
    line) before the row's own system message, or as a new first message."""
    if not system_prompt:
        return list(messages)
    tools = "\n".join(json.dumps(schema) for schema in schemas)
    text = system_prompt.replace("{tools}", tools)
    messages = list(messages)
    if messages and messages[0].get("role") == "system":
        first = dict(messages[0], content=text + "\n\n" + str(messages[0]["content"]))
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def render(tokenizer, messages: list, schemas: list, chat_template: str | None = None) -> str:
    """The prompt text with the generation prompt; `tools=` only when there are tools (a
    template may change its system block for an empty list)."""
    kwargs = {"tools": schemas} if schemas else {}
    if chat_template:
        kwargs["chat_template"] = chat_template
    return tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False, **kwargs
    )


def template_shows_tools(tokenizer, chat_template: str | None = None) -> bool:
    """Whether the template renders the `tools=` it is given (a probe tool's name appears)."""
    messages = [{"role": "user", "content": "Hi"}]
    try:
        text = render(tokenizer, messages, [PROBE], chat_template)
    except Exception:
        return False
    return PROBE["function"]["name"] in text


class AgentPrompt:
    """`row -> prompt text` for the data loader: the row's messages, with the node's
    `system_prompt`, templated with the tools the row may use.

    Args:
        tokenizer: the policy's tokenizer.
        toolbox: the agent node's tools (tools.Toolbox).
        chat_template: a template text that replaces the tokenizer's, or None.
        system_prompt: text put before the row's system message ("" = none).
    """

    def __init__(self, tokenizer, toolbox, chat_template=None, system_prompt: str = ""):
        self.tokenizer, self.toolbox = tokenizer, toolbox
        self.chat_template, self.system_prompt = chat_template, system_prompt

    def schemas(self, extra) -> list[dict]:
        return [s for tool in self.toolbox.select(extra) for s in tool.schemas]

    def __call__(self, row: dict) -> str:
        schemas = self.schemas(row.get("extra_info"))
        messages = with_system_prompt(row["prompt"], self.system_prompt, schemas)
        return render(self.tokenizer, messages, schemas, self.chat_template)


def agent_prompt(params, base_dir, tokenizer) -> AgentPrompt:
    """The agent node's `NodeSpec.prompt` hook: its prompts' renderer, from its `tools`,
    `tool_config`, `chat_template` and `system_prompt` params (relative paths from
    `base_dir`, the graph's folder)."""
    from flowrl.agent.tools.toolbox import Toolbox

    toolbox = Toolbox(params.tools, base_dir, params.tool_config)
    template = read_template(params.chat_template, base_dir)
    return AgentPrompt(tokenizer, toolbox, template, params.system_prompt)
