"""Model paths that name a hub model resolve from the local Hugging Face cache and never from
the network; a model that is not there is an error that says how to download it."""

import socket
from pathlib import Path

import pytest
import torch

from flowrl.front import compiler
from flowrl.models import ModelNotFound, hub, load_model, load_tokenizer
from flowrl.testing import tiny_model, tiny_tokenizer

ROOT = Path(__file__).resolve().parents[3]
NAME = "acme/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def save_to_cache(hub_dir: Path, name: str = NAME):
    """A tiny model laid out as huggingface_hub caches a download: models--<owner>--<name>/
    refs/main holding a commit hash, snapshots/<commit>/ holding the files."""
    repo = hub_dir / f"models--{name.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    model = tiny_model(seed=3)
    model.save_pretrained(snapshot)
    tiny_tokenizer().save_pretrained(snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return model


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """Any attempt to reach the network fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError("flowrl tried to reach the network")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("variable", ["HF_HOME", "HF_HUB_CACHE"])
def test_hub_name_loads_the_cached_snapshot(tmp_path, monkeypatch, variable):
    monkeypatch.setenv(variable, str(tmp_path))
    hub_dir = tmp_path / "hub" if variable == "HF_HOME" else tmp_path
    saved = save_to_cache(hub_dir)
    module, tokenizer = load_model(NAME)
    for key, value in saved.state_dict().items():
        torch.testing.assert_close(module.state_dict()[key], value, rtol=0, atol=0)
    text = "What is 2 + 3?"
    assert tokenizer(text)["input_ids"] == tiny_tokenizer()(text)["input_ids"]
    assert load_tokenizer(NAME).eos_token == "<|im_end|>"


def test_local_directory_loads_as_itself(tmp_path):
    saved = tiny_model(seed=4)
    saved.save_pretrained(tmp_path / "mine")
    tiny_tokenizer().save_pretrained(tmp_path / "mine")
    module, _ = load_model(str(tmp_path / "mine"))
    torch.testing.assert_close(module.model.embed_tokens.weight, saved.model.embed_tokens.weight)


def test_a_model_not_in_the_cache_says_how_to_download_it(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    save_to_cache(tmp_path / "hub")  # another model is there
    with pytest.raises(ModelNotFound) as caught:
        load_model("acme/not-downloaded")
    assert str(caught.value) == hub.not_found("acme/not-downloaded")
    message = str(caught.value)
    assert f"({tmp_path / 'hub'})" in message
    assert "`hf download acme/not-downloaded`" in message and "does not download" in message


def test_plan_sizes_a_cached_hub_model_from_its_config(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    saved = save_to_cache(tmp_path)
    overrides = [f'models.{m}.path="{NAME}"' for m in ("policy", "ref")]
    plan = compiler.compile_file(ROOT / "graphs/grpo.toml", overrides)
    weights = plan.pools["main"].memory_bytes["ref"]["weights"]
    n_params = sum(p.numel() for p in saved.parameters())  # the estimate leaves out the norms
    assert weights == pytest.approx(4 * n_params, rel=0.01)  # fp32
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))  # not in this cache
    plan = compiler.compile_file(ROOT / "graphs/grpo.toml", overrides)
    assert plan.pools["main"].memory_bytes["ref"] == {}


def test_graph_file_doc_shows_the_exact_error(monkeypatch):
    monkeypatch.setattr(hub, "hub_cache", lambda: Path("/root/.cache/huggingface/hub"))
    doc = (ROOT / "docs/graph-file.md").read_text()
    assert f"flowrl: {hub.not_found('HuggingFaceTB/SmolLM2-360M-Instruct')}\n" in doc
