"""docs/agents.md's worked example runs: its program and graph, written as the page lays them
out, train two steps on the tiny model; the endpoint example's fields are the SDK's."""

import re
from pathlib import Path

import pytest

pytest.importorskip("openai")

import flowrl.nodes  # noqa: E402
from flowrl.testing import run_tiny  # noqa: E402

pytestmark = pytest.mark.slow  # trains

ROOT = Path(__file__).resolve().parents[4]
PAGE = (ROOT / "docs/agents.md").read_text()
if str(ROOT / "nodes") not in flowrl.nodes.__path__:  # an editable install of another checkout
    flowrl.nodes.__path__.insert(0, str(ROOT / "nodes"))


def block(path: str) -> str:
    """The ```python / ```toml block of the page whose first line is `# path`."""
    (text,) = re.findall(rf"```(?:python|toml)\n(# {re.escape(path)}\n.*?)```", PAGE, flags=re.S)
    return text


def test_the_pages_agent_program_trains(tmp_path):
    (tmp_path / "my_agent.py").write_text(block("my_agent.py"))
    (tmp_path / "agent_graph.toml").write_text(block("agent_graph.toml"))
    run = run_tiny(tmp_path / "agent_graph.toml", tmp_path / "runs")
    steps = [m for m in run.metrics if "generate/episodes/ok" in m]
    assert steps and all(m["generate/episodes/ok"] == 1.0 for m in steps)
    assert all(m["generate/calls_per_episode"] == 2.0 for m in steps)
    assert any(m.get("update_policy/grad_norm", 0) > 0 for m in run.metrics)


def test_the_pages_endpoint_example_runs(capsys):
    """The client example against the endpoint (the tiny model under the embedded one's name,
    on a free port instead of 8000)."""
    from flowrl.engines import HFRollout
    from flowrl.serve.app import Keys
    from flowrl.serve.endpoint import Endpoint
    from flowrl.serve.server import Server
    from flowrl.testing import tiny_model, tiny_tokenizer

    backend = HFRollout(tiny_model().eval(), tiny_tokenizer())
    endpoint = Endpoint(backend, model_name="smollm2-135m-instruct")
    with Server(endpoint, Keys()) as server:
        code = block("try_endpoint.py").replace("http://127.0.0.1:8000/v1", server.base_url)
        exec(compile(code, "try_endpoint.py", "exec"), {})
    printed = capsys.readouterr().out
    assert "[" in printed and endpoint.stats["calls"] == 1
