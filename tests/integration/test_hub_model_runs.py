"""A graph whose models are hub names trains from the local Hugging Face cache; one that is not
cached stops `flowrl run` with the documented message, before any step."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from flowrl.models import hub
from flowrl.runtime.controller import Trainer
from flowrl.testing import tiny_model, tiny_tokenizer

pytestmark = pytest.mark.slow  # the integration tier: trains, starts Ray or loads models

ROOT = Path(__file__).resolve().parents[2]
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def cache_tiny_model(hub_dir: Path, name: str) -> None:
    snapshot = hub_dir / f"models--{name.replace('/', '--')}" / "snapshots" / COMMIT
    tiny_model(seed=5).save_pretrained(snapshot)
    tiny_tokenizer().save_pretrained(snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text(COMMIT)


def test_graph_trains_with_models_from_the_hub_cache(tiny_plan, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    cache_tiny_model(tmp_path / "hub", "acme/tiny-llama")
    paths = {f"models.{m}.path": '"acme/tiny-llama"' for m in ("policy", "ref")}
    plan = tiny_plan("grpo.toml", **paths)
    trainer = Trainer(plan, tmp_path / "run", "local")
    try:
        trainer.fit()
    finally:
        trainer.close()
    rows = [json.loads(x) for x in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[-1]["update_policy/grad_norm"] > 0


def test_run_with_an_uncached_model_prints_how_to_download_it(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(name, raising=False)
    result = subprocess.run(
        [sys.executable, "-m", "flowrl.cli", "run", str(ROOT / "graphs/grpo.toml"), "--tiny"]
        + ["--backend", "local", 'models.policy.path="acme/not-downloaded"'],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 1
    assert f"flowrl: {hub.not_found('acme/not-downloaded')}" in result.stderr
    assert str(tmp_path / "hf" / "hub") in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "runs").exists()
