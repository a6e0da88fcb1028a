"""A tokenizer's ids and chat template read through `tokenizers` and `jinja2` alone, for the
template check of `flowrl check` (flowrl/agent/checks.py): importing transformers costs about
a second and, where torch is installed, imports torch too.

`FileTokenizer` has the few members `flowrl.agent.chat` uses (`apply_chat_template`,
`__call__(text, add_special_tokens=False)`, `decode`, `eos_token`, `eos_token_id`) and
renders and encodes as transformers' fast tokenizers do: the template in a sandboxed jinja2
environment with `trim_blocks`, `lstrip_blocks`, the loop controls, transformers' `tojson`,
`raise_exception`, `strftime_now` and `namespace`, and the named special tokens as variables
(tests/unit/agent/test_file_tokenizer.py compares it with transformers token for token). A model
directory without a tokenizer.json (a slow tokenizer only) gets None: the caller falls back
to transformers.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token")


class FileTokenizer:
    """A `tokenizers.Tokenizer`, its chat template and its named special tokens.

    Args:
        tokenizer_json: the text of tokenizer.json.
        chat_template: the jinja2 source of the chat template.
        special: named special tokens as text, e.g. {"eos_token": "<|im_end|>"}.
    """

    def __init__(self, tokenizer_json: str, chat_template: str, special: dict[str, str]):
        from tokenizers import Tokenizer

        self.backend = Tokenizer.from_str(tokenizer_json)
        self.chat_template = chat_template
        self.special = {k: v for k, v in special.items() if v is not None}
        self.eos_token = self.special.get("eos_token")
        self.eos_token_id = self.backend.token_to_id(self.eos_token) if self.eos_token else None
        self._template = None

    @classmethod
    def from_dir(cls, path: str | Path) -> FileTokenizer | None:
        """The tokenizer of a model directory (tokenizer.json, tokenizer_config.json and the
        template there or in chat_template.jinja); None when it has no tokenizer.json or no
        chat template."""
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            return None
        config_file = path / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        template = config.get("chat_template")
        if (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text()
        if not isinstance(template, str):  # none, or named templates: leave it to transformers
            return None
        special = {key: _content(config.get(key)) for key in SPECIAL}
        return cls((path / "tokenizer.json").read_text(), template, special)

    def apply_chat_template(
        self,
        messages: list[dict],
        tokenize: bool = False,
        add_generation_prompt: bool = False,
        tools: list[dict] | None = None,
        chat_template: str | None = None,
    ):
        if chat_template:  # an agent node's own template (tools in the prompt)
            template = _compile(chat_template)
        else:
            if self._template is None:
                self._template = _compile(self.chat_template)
            template = self._template
        text = template.render(
            messages=messages, tools=tools or None, documents=None,
            add_generation_prompt=add_generation_prompt, **self.special,
        )  # fmt: skip
        return self(text)["input_ids"] if tokenize else text

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        return {"input_ids": self.backend.encode(text, add_special_tokens=add_special_tokens).ids}

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)


def _content(value):
    """A special token as tokenizer_config.json writes it: text, or {"content": text, ...}."""
    return value.get("content") if isinstance(value, dict) else value


def _compile(source: str):
    """The template in a sandbox set up as transformers sets its own up."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja's own tojson escapes HTML characters, which a prompt must keep
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["namespace"] = jinja2.utils.Namespace
    return env.from_string(source)
