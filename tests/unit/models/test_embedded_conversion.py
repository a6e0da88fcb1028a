"""The embedded model's conversion (flowrl/models/embedded.py) does not depend on what a
transformers release's GGUF conversion guesses for the special tokens: transformers 5.17 made
<|im_start|> the eos of SmolLM2's file. Here that guess is simulated (gguf_guess.py), and the
conversion still gives SmolLM2's eos <|im_end|>, id 2, on the tokenizer and the config. The
refusal of a wrong model says what helps. Reads the GGUF file's metadata and tokenizer, not its
weights (~10 s)."""

from types import SimpleNamespace

import pytest
from gguf_guess import wrong_eos  # tests/support, on the path (tests/conftest.py)
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from flowrl.models import embedded
from flowrl.testing import tiny_model


@pytest.fixture(scope="module")
def source():
    try:
        return embedded.gguf_file()
    except embedded.ModelNotFound as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def guessed(source):
    """Under the wrong guess (gguf_guess.py): what transformers alone converts (tokenizer,
    config), and flowrl's tokenizer."""
    with pytest.MonkeyPatch.context() as patch:
        wrong_eos(patch)
        return SimpleNamespace(
            tokenizer=AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name),
            config=AutoConfig.from_pretrained(source.parent, gguf_file=source.name),
            converted=embedded.converted_tokenizer(source),
        )


def test_the_conversion_sets_smollm2s_special_tokens_whatever_the_guess(guessed):
    # the simulation bites: transformers alone gives the wrong eos
    assert guessed.tokenizer.eos_token == "<|im_start|>" and guessed.config.eos_token_id == 1
    tokenizer, config = guessed.converted, guessed.config
    model = SimpleNamespace(config=config, generation_config=GenerationConfig())
    embedded.set_special_tokens(model, tokenizer)
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 2)
    assert (tokenizer.pad_token, tokenizer.bos_token) == ("<|im_end|>", "<|im_start|>")
    assert config.eos_token_id == model.generation_config.eos_token_id == 2
    assert config.pad_token_id == 2 and config.bos_token_id == 1
    assert "<|im_start|>" in tokenizer.chat_template


def test_a_wrong_model_is_refused_with_what_helps(source, guessed):
    module = tiny_model()
    module.config.eos_token_id = 1
    with pytest.raises(RuntimeError) as cached:
        embedded.check(module, guessed.tokenizer)  # a cache converted by an earlier flowrl
    assert "eos token is '<|im_start|>'" in str(cached.value)
    assert "config eos id is 1, expected 2" in str(cached.value)
    assert "delete" in str(cached.value) and "converts it again" in str(cached.value)
    with pytest.raises(RuntimeError) as fresh:  # just converted: no cache to blame
        embedded.check(module, guessed.tokenizer, where=str(source))
    assert "deleting the cache cannot help" in str(fresh.value)
    assert "pyproject.toml" in str(fresh.value)
