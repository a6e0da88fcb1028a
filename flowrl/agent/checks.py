"""`flowrl check` for an agent node: its limits, tools, parser and interaction, and whether the
model's chat template can append tool messages without changing earlier tokens. Loads the
tokenizer (never the weights), once per model path and observation role."""

from __future__ import annotations

from flowrl.nodespec import CheckContext, Finding

PARSERS = ("hermes", "tag")
_TEMPLATE: dict = {}  # (model path, obs_role) -> problems


def agent_findings(p, context: CheckContext) -> list[Finding]:
    out = _limit_findings(p)
    toolbox, interactions = None, {}
    try:
        from flowrl.agent.tools import Toolbox

        toolbox = Toolbox(p.tools, context.base_dir, p.tool_config)
    except Exception as e:
        fix = 'tools = ["calculator", "file.py:name"] or tool_config = "tools.yaml" (verl\'s)'
        out.append(Finding(f"tools: {e}", fix))
    out += _parser_findings(p, context, toolbox)
    if p.interaction and p.interaction_config:
        out.append(Finding("interaction and interaction_config are both set", "keep one"))
    try:  # instantiates verl interaction classes as verl's registry does
        from flowrl.agent.interactions import load_interactions

        interactions = load_interactions(p.interaction, p.interaction_config, context.base_dir)
    except Exception as e:
        fix = 'interaction = "file.py:reply" or interaction_config = "interaction.yaml"'
        out.append(Finding(f"interaction: {e}", fix))
    template = None
    try:
        from flowrl.agent.prompt import read_template

        template = read_template(p.chat_template, context.base_dir)
    except Exception as e:
        out.append(Finding(str(e), 'chat_template = "file.jinja" (relative to the graph)'))
    if toolbox is not None:
        from flowrl.agent.data_checks import row_findings

        out += row_findings(toolbox, interactions, context)
    if context.model_path:
        tools = toolbox.schemas if toolbox is not None else []
        out += [
            Finding(f"chat template: {problem}", _TEMPLATE_FIX)
            for problem in _template(context.model_path, p.obs_role, template, tools)
        ]
        if tools and not p.system_prompt and _shows_tools(context.model_path, template) is False:
            out.append(Finding(_NO_TOOLS.format(context.model_path), warning=True))
    return out


_NO_TOOLS = (
    "chat template of {} ignores tools=: the model is never shown its tools' schemas. "
    'Set chat_template = "file.jinja" to a template with a tool block (Qwen2.5\'s: '
    'graphs/chat_templates/qwen2_5_tools.jinja), or system_prompt = "... {{tools}} ..." '
    "to describe them in text"
)


_TEMPLATE_FIX = (
    "use a model whose chat template only appends (ChatML and most others do), or set "
    'obs_role = "user"'
)


def _limit_findings(p) -> list[Finding]:
    out = []
    positive = ("max_new_tokens", "max_assistant_turns", "max_parallel_calls", "max_obs_tokens")
    for name in positive:
        if getattr(p, name) < 1:
            out.append(Finding(f"{name} = {getattr(p, name)} must be at least 1"))
    for name in ("max_turn_tokens", "max_invalid_calls", "max_user_turns"):
        if getattr(p, name) < 0:
            out.append(Finding(f"{name} = {getattr(p, name)} must be 0 or more"))
    for name in ("tool_timeout_s", "request_timeout_s"):
        if getattr(p, name) <= 0:
            out.append(Finding(f"{name} = {getattr(p, name)} must be positive"))
    if p.max_turn_tokens > p.max_new_tokens:
        out.append(
            Finding(
                f"max_turn_tokens = {p.max_turn_tokens} exceeds max_new_tokens = "
                f"{p.max_new_tokens} (the whole response), which caps every turn",
                warning=True,
            )
        )
    if p.request_timeout_s < p.tool_timeout_s:
        out.append(Finding("request_timeout_s is shorter than tool_timeout_s", warning=True))
    if p.obs_role not in ("tool", "user"):
        out.append(Finding(f'obs_role = "{p.obs_role}" must be "tool" or "user"'))
    if p.solution not in ("assistant", "full"):
        out.append(Finding(f'solution = "{p.solution}" must be "assistant" or "full"'))
    return out


def _parser_findings(p, context, toolbox) -> list[Finding]:
    if p.parser not in PARSERS and ":" not in p.parser:
        return [Finding(f'parser = "{p.parser}"', 'parser = "hermes", "tag" or "file.py:parse"')]
    if p.parser not in PARSERS:
        try:
            from flowrl.agent.objects import load_object

            load_object(p.parser, context.base_dir, "parser")
        except Exception as e:
            return [Finding(str(e), 'parser = "file.py:parse"')]
    if p.parser == "tag" and toolbox is not None:
        out = []
        for tool in toolbox.tools:
            for schema in tool.schemas:
                function = schema["function"]
                required = function.get("parameters", {}).get("required", [])
                if len(required) != 1:
                    out.append(
                        Finding(
                            f'parser = "tag" passes one argument, but tool '
                            f"{function['name']} requires {len(required)}",
                            'use parser = "hermes" for tools of several arguments',
                        )
                    )
        return out
    return []


def _template(path: str, obs_role: str, template: str | None, tools: list) -> list[str]:
    key = (path, obs_role, template, repr(tools))
    if key not in _TEMPLATE:
        from flowrl.agent.chat import template_problems

        try:
            tokenizer = tokenizer_of(path)
        except Exception as e:
            _TEMPLATE[key] = [f"cannot load the tokenizer of {path!r}: {e}"]
        else:
            _TEMPLATE[key] = (
                template_problems(tokenizer, obs_role, template, tools) if tokenizer else []
            )
    return _TEMPLATE[key]


def _shows_tools(path: str, template: str | None) -> bool | None:
    """Whether the (override) template renders tools=; None when the tokenizer is not at
    hand (the embedded model before its first conversion)."""
    from flowrl.agent.prompt import template_shows_tools

    try:
        tokenizer = tokenizer_of(path)
    except Exception:
        return None
    return None if tokenizer is None else template_shows_tools(tokenizer, template)


def tokenizer_of(path: str):
    """The tokenizer of a model path, without torch (`flowrl check` runs where torch is not
    installed); None for the embedded model before its one-off conversion, which needs torch
    (the first `flowrl run` converts it, and checks the template then)."""
    from flowrl.models import embedded

    if path == "tiny":
        from flowrl.models.tiny import tiny_tokenizer

        return tiny_tokenizer()
    if path == embedded.ALIAS:
        directory = embedded.cache_root() / "models" / embedded.ALIAS
        if not (directory / "config.json").is_file():
            return None
        path = str(directory)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)
