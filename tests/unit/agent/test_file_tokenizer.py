"""The template check's tokenizer (tokenizers + jinja2, no transformers) renders and encodes
as transformers does, and the check finds the same problems through it."""

import subprocess
import sys
from pathlib import Path

import pytest

from flowrl.agent import checks
from flowrl.agent.chat import template_problems
from flowrl.agent.file_tokenizer import FileTokenizer
from flowrl.models import embedded, tiny
from flowrl.testing import CHAT_TEMPLATE, tiny_tokenizer

ROOT = Path(__file__).resolve().parents[3]
EMBEDDED = embedded.cache_root() / "models" / embedded.ALIAS
MESSAGES = [
    {"role": "system", "content": "Use the calculator: <calc>a*b</calc>."},
    {"role": "user", "content": 'What is 12 * 34? "quotes" & <tags>'},
    {"role": "assistant", "content": "<calc>12*34</calc>"},
    {"role": "tool", "content": "408"},
]


def pair(template=CHAT_TEMPLATE):
    """(transformers' tiny tokenizer, the file tokenizer of the same files), both on `template`."""
    reference = tiny_tokenizer()
    reference.chat_template = template
    special = {"eos_token": "<|im_end|>", "pad_token": "<pad>"}
    return reference, FileTokenizer(tiny._tokenizer_json(), template, special)


def same_encoding(reference, fast):
    for generation_prompt in (False, True):
        text = reference.apply_chat_template(
            MESSAGES, tokenize=False, add_generation_prompt=generation_prompt
        )
        assert fast.apply_chat_template(MESSAGES, add_generation_prompt=generation_prompt) == text
        ids = reference(text, add_special_tokens=False)["input_ids"]
        assert fast(text)["input_ids"] == ids
        assert fast.decode(ids, skip_special_tokens=True) == reference.decode(
            ids, skip_special_tokens=True
        )
    assert fast.eos_token_id == reference.eos_token_id


def test_tiny_files_encode_as_transformers():
    same_encoding(*pair())


@pytest.mark.skipif(not (EMBEDDED / "tokenizer.json").is_file(), reason="no converted model")
def test_embedded_model_files_encode_as_transformers():
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(EMBEDDED), local_files_only=True)
    fast = FileTokenizer.from_dir(EMBEDDED)
    same_encoding(reference, fast)
    assert template_problems(fast) == template_problems(reference) == []


REWRITES = CHAT_TEMPLATE.replace(
    "{{ message['content'] }}",
    "{% if message['role'] != 'assistant' or loop.last %}{{ message['content'] }}{% endif %}",
)
NO_EOS = CHAT_TEMPLATE.replace("<|im_end|>", "<pad>")
BLANK_LINE = CHAT_TEMPLATE.replace(
    "<|im_start|>assistant\n{% endif %}", "<|im_start|>assistant\n\n{% endif %}"
)


@pytest.mark.parametrize("template", [CHAT_TEMPLATE, REWRITES, NO_EOS, BLANK_LINE])
def test_template_problems_are_the_same_through_either(template):
    reference, fast = pair(template)
    for role in ("tool", "user"):
        assert template_problems(fast, role) == template_problems(reference, role)


def test_a_model_directory_without_tokenizer_json_falls_back(tmp_path):
    assert FileTokenizer.from_dir(tmp_path) is None


def test_model_directory_read_through_files(tmp_path):
    reference = tiny_tokenizer()
    reference.save_pretrained(tmp_path)
    fast = checks.tokenizer_of(str(tmp_path))
    assert isinstance(fast, FileTokenizer)
    same_encoding(reference, fast)


def test_problem_found_fast_is_confirmed_by_transformers(tmp_path, monkeypatch):
    reference = tiny_tokenizer()
    reference.chat_template = REWRITES
    reference.save_pretrained(tmp_path)
    monkeypatch.setattr(checks, "_TEMPLATE", {})
    problems = checks._template(str(tmp_path), "tool")
    assert len(problems) == 1 and "changes earlier tokens" in problems[0]


def test_template_check_of_the_tiny_model_imports_no_transformers():
    code = (
        "import sys; sys.modules['torch'] = None; sys.modules['transformers'] = None\n"
        "from flowrl.agent import checks\n"
        "assert checks._template('tiny', 'tool') == []\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr


def test_the_template_check_of_a_directory_is_kept_until_its_files_change(tmp_path, monkeypatch):
    import os

    monkeypatch.setenv("FLOWRL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(checks, "_TEMPLATE", {})
    reference = tiny_tokenizer()
    reference.chat_template = REWRITES
    model = tmp_path / "model"
    reference.save_pretrained(model)
    first = checks._template(str(model), "tool")
    assert len(first) == 1 and "changes earlier tokens" in first[0]
    assert (tmp_path / "cache/chat_template_checks.json").is_file()

    def no_loading(*args, **kwargs):
        raise AssertionError("the tokenizer was loaded again")

    monkeypatch.setattr(checks, "tokenizer_of", no_loading)
    monkeypatch.setattr(checks, "_TEMPLATE", {})  # a new process: only the file remains
    assert checks._template(str(model), "tool") == first
    info = (model / "tokenizer.json").stat()  # the files change: checked again
    os.utime(model / "tokenizer.json", ns=(info.st_atime_ns, info.st_mtime_ns + 10**9))
    monkeypatch.setattr(checks, "_TEMPLATE", {})
    problems = checks._template(str(model), "tool")
    assert len(problems) == 1 and "the tokenizer was loaded again" in problems[0]
