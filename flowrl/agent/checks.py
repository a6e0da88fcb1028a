"""`flowrl check` for an agent node: its limits, tools, parser and interaction, and whether the
model's chat template can append tool messages without changing earlier tokens. Loads the
tokenizer (never the weights), once per model path and observation role."""

from __future__ import annotations

import json
import os
from pathlib import Path

from flowrl.hooks import CheckContext, Finding

PARSERS = ("hermes", "tag")
_TEMPLATE: dict = {}  # (model path, obs_role, template and tools) -> problems


def agent_findings(p, context: CheckContext) -> list[Finding]:
    out = _limit_findings(p)
    toolbox, interactions = None, {}
    try:
        from flowrl.agent.tools.toolbox import Toolbox

        toolbox = Toolbox(p.tools, context.base_dir, p.tool_config)
    except Exception as e:
        fix = 'tools = ["calculator", "file.py:name"] or tool_config = "tools.yaml" (verl\'s)'
        out.append(Finding(f"tools: {e}", fix))
    out += _parser_findings(p, context, toolbox)
    out += _sandbox_findings(p)
    if sum(map(bool, (p.interaction, p.interaction_config, p.env))) > 1:
        out.append(Finding("interaction, interaction_config and env: several are set", "keep one"))
    interactions = {}
    if p.env.startswith("verifiers:"):  # verifiers runs its own loop: the program node's door
        fix = f'uses = "agent_program" with env = "{p.env}" (docs/agents.md, verifiers)'
        out.append(Finding(f'env = "{p.env}": a verifiers environment is not an interaction', fix))
    else:
        try:  # instantiates verl interaction classes as verl's registry does
            from flowrl.agent.interactions import load_interactions

            interactions = load_interactions(
                p.interaction, p.interaction_config, context.base_dir, p.env
            )
        except Exception as e:
            fix = 'interaction = "file.py:reply" or interaction_config = "interaction.yaml"'
            if p.env:
                fix = "env = \"file.py:Cls\", an environment of text (Gymnasium's or OpenEnv's)"
            out.append(Finding(f"{'env' if p.env else 'interaction'}: {e}", fix))
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
    if p.interact_on_cut and not (p.interaction or p.interaction_config or p.env):
        fix = 'interaction = "file.py:reply" or interaction_config = "interaction.yaml"'
        out.append(Finding("interact_on_cut = true without an interaction does nothing", fix, True))
    if p.obs_role not in ("tool", "user"):
        out.append(Finding(f'obs_role = "{p.obs_role}" must be "tool" or "user"'))
    if p.solution not in ("assistant", "full"):
        out.append(Finding(f'solution = "{p.solution}" must be "assistant" or "full"'))
    return out


def _sandbox_findings(p) -> list[Finding]:
    """Where the python tool's code cannot be confined: an error under sandbox = "required",
    else a warning saying what the code can reach (given once: the run does not repeat it)."""
    if "python" not in p.tools:
        return []
    from flowrl.agent.tools import sandbox

    state = sandbox.confinement()
    if state.available:
        return []
    notice = sandbox.unconfined_notice(state.reason)
    if p.sandbox == "required":
        return [Finding(f'sandbox = "required", but {notice}', sandbox.REQUIRED_FIX)]
    sandbox.say_unconfined_once(state.reason)
    return [Finding(f'{notice} (sandbox = "required" refuses to run instead)', warning=True)]


def _parser_findings(p, context, toolbox) -> list[Finding]:
    if p.parser not in PARSERS and ":" not in p.parser:
        return [Finding(f'parser = "{p.parser}"', 'parser = "hermes", "tag" or "file.py:parse"')]
    if p.parser not in PARSERS:
        try:
            from flowrl.agent.tools import load_object

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


def _template(path: str, obs_role: str, template: str | None = None, tools=()) -> list[str]:
    """Problems of appending turns with this tokenizer (and `template`, `tools` in the
    prompt), kept per model directory, role, template and tools."""
    tools = list(tools)
    variant = _variant(template, tools)
    key = (path, obs_role, variant)
    if key not in _TEMPLATE:
        stored = _stored(path, f"{obs_role}|{variant}")
        _TEMPLATE[key] = stored.get() if stored else None
        if _TEMPLATE[key] is None:
            _TEMPLATE[key] = _template_problems(path, obs_role, template, tools)
            loaded = not any(p.startswith("cannot load") for p in _TEMPLATE[key])
            if stored and loaded:  # a tokenizer that failed to load is tried again next time
                stored.put(_TEMPLATE[key])
    return _TEMPLATE[key]


def _variant(template: str | None, tools: list) -> str:
    """A short key of the template override and the tools the prompt carries."""
    import hashlib

    text = json.dumps([template, tools], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _template_problems(path: str, obs_role: str, template=None, tools=()) -> list[str]:
    from flowrl.agent.chat import template_problems
    from flowrl.agent.file_tokenizer import FileTokenizer

    tools = list(tools)
    try:
        tokenizer = tokenizer_of(path)
        problems = template_problems(tokenizer, obs_role, template, tools) if tokenizer else []
        if problems and isinstance(tokenizer, FileTokenizer):
            # found through tokenizers + jinja2: transformers, the authority, confirms
            tokenizer = tokenizer_of(path, fast=False)
            problems = template_problems(tokenizer, obs_role, template, tools) if tokenizer else []
    except Exception as e:
        return [f"cannot load the tokenizer of {path!r}: {e}"]
    return problems


def _shows_tools(path: str, template: str | None) -> bool | None:
    """Whether the (override) template renders tools=; None when the tokenizer is not at
    hand (the embedded model before its first conversion). Kept like the template check."""
    from flowrl.agent.prompt import template_shows_tools

    key = ("shows_tools", path, _variant(template, []))
    if key not in _TEMPLATE:
        stored = _stored(path, "|".join(key[::2]))
        _TEMPLATE[key] = stored.get() if stored else None
        if _TEMPLATE[key] is None:
            try:
                tokenizer = tokenizer_of(path)
            except Exception:
                return None
            if tokenizer is None:
                return None
            _TEMPLATE[key] = template_shows_tools(tokenizer, template)
            if stored:
                stored.put(_TEMPLATE[key])
    return _TEMPLATE[key]


class _Stored:
    """The template check's result for one model directory, kept in FLOWRL_CACHE
    (~/.cache/flowrl/chat_template_checks.json) under the directory, the observation role and
    the size and mtime of its tokenizer files: loading a real tokenizer costs about 0.1-0.4 s
    of the under-a-second `flowrl check`, and its files seldom change."""

    VERSION = 1  # bump when template_problems finds other things

    def __init__(self, directory: Path, obs_role: str):
        from flowrl.models import embedded

        self.file = embedded.cache_root() / "chat_template_checks.json"
        stats = []
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            info = (directory / name).stat() if (directory / name).is_file() else None
            stats.append(f"{name}:{info.st_size}:{info.st_mtime_ns}" if info else f"{name}:-")
        self.key = "|".join([f"v{self.VERSION}", str(directory.resolve()), obs_role, *stats])

    def _read(self) -> dict:
        try:
            return json.loads(self.file.read_text())
        except (OSError, ValueError):
            return {}

    def get(self) -> list[str] | bool | None:
        return self._read().get(self.key)

    def put(self, problems: list[str] | bool) -> None:
        try:
            data = {**self._read(), self.key: problems}
            self.file.parent.mkdir(parents=True, exist_ok=True)
            temp = self.file.with_suffix(f".tmp{os.getpid()}")
            temp.write_text(json.dumps(data, indent=1, sort_keys=True))
            temp.replace(self.file)  # atomic: a concurrent check reads the old or the new
        except OSError:  # a read-only cache only costs the next check its time
            pass


def _stored(path: str, obs_role: str) -> _Stored | None:
    """Where a model path's template check is kept; None for the tiny model (built in code,
    cheap) and for paths that are not directories here."""
    from flowrl.models import embedded

    if path == embedded.ALIAS:
        directory = embedded.cache_root() / "models" / embedded.ALIAS
        return _Stored(directory, obs_role) if (directory / "config.json").is_file() else None
    if path != "tiny" and Path(path).is_dir():
        return _Stored(Path(path), obs_role)
    return None


def tokenizer_of(path: str, fast: bool = True):
    """The tokenizer of a model path, without torch (`flowrl check` runs where torch is not
    installed); None for the embedded model before its one-off conversion, which needs torch
    (the first `flowrl run` converts it, and checks the template then). `fast`: read the
    tokenizer's files through `tokenizers` and `jinja2` (flowrl/agent/file_tokenizer.py), not
    transformers, whose import takes a second, where the files allow."""
    from flowrl.agent.file_tokenizer import FileTokenizer
    from flowrl.models import embedded

    if path == "tiny":
        from flowrl.models import tiny

        if fast:
            special = {"eos_token": "<|im_end|>", "pad_token": "<pad>"}
            return FileTokenizer(tiny._tokenizer_json(), tiny.CHAT_TEMPLATE, special)
        return tiny.tiny_tokenizer()
    if path == embedded.ALIAS:
        directory = embedded.cache_root() / "models" / embedded.ALIAS
        if not (directory / "config.json").is_file():
            return None
        path = str(directory)
    if fast and Path(path).is_dir():
        tokenizer = FileTokenizer.from_dir(path)
        if tokenizer is not None:
            return tokenizer
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)
