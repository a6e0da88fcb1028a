"""The KV cache is passed under the name the installed transformers uses, so no worker prints
transformers' "`past_key_values`/`cache_params` are deprecated" warning."""

import inspect
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import LlamaForCausalLM

from flowrl.models.calls import cache_argument
from flowrl.testing import tiny_model

ROOT = Path(__file__).resolve().parents[3]


def test_the_name_follows_the_models_forward():
    model = tiny_model()
    expected = (
        "cache"
        if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters
        else ("past_key_values")
    )
    assert list(cache_argument(model, None)) == [expected]
    assert list(cache_argument(model.model, None)) == [expected]


@pytest.mark.slow  # a child process: a Python start-up with torch
def test_a_rollout_and_a_shared_prompt_forward_print_no_deprecation():
    """In a fresh process (transformers warns once per process): sample with the cache, and
    score rows that share prompts (the forward that reuses the prompts' cache)."""
    code = """
import torch
from flowrl.engines import TrainEngine
from flowrl.engines.hf.engine import HFRollout
from flowrl.engines.batch import generate_batch
from flowrl.testing import tiny_model, tiny_tokenizer, update_batch

model, tokenizer = tiny_model(), tiny_tokenizer()
prompts = torch.randint(3, 90, (2, 5))
generate_batch(
    HFRollout(model, tokenizer), prompts, torch.ones_like(prompts), n=2, max_new_tokens=4,
    temperature=1.0, top_p=1.0, top_k=0, do_sample=True, seed=0,
)
rows = update_batch(b=4)
for key in ("prompts", "prompt_mask"):
    rows[key] = rows[key][torch.tensor([0, 0, 1, 1])]
TrainEngine(model, tokenizer, trainable=False).forward(rows, grad=False)
print("ran")
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert "ran" in result.stdout
    assert "deprecated" not in result.stderr, result.stderr
