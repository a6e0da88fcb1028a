"""The server backend of docs/extending.md ("A server backend"), taken from the page, against a
small OpenAI-compatible completions server in this process: stdlib http.server on 127.0.0.1,
sampling with flowrl's own engine on a tiny model of its own, whose weights change only when
the backend loads a folder into it."""

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from flowrl.engines import make_rollout
from flowrl.engines.batch import generate_batch
from flowrl.engines.rollout import Request, Sampling
from flowrl.testing import run_tiny, tiny_model, tiny_tokenizer

ROOT = Path(__file__).resolve().parents[3]
PAGE = (ROOT / "docs/extending.md").read_text()
REF = "openai_rollout.py:OpenAIRollout"


def block(kind: str, first_line: str) -> str:
    blocks = re.findall(rf"```{kind}\n(.*?)```", PAGE, flags=re.S)
    return next(b for b in blocks if first_line in b)


class FakeServer:
    """/v1/completions (token ids in, "token_id:<id>" out, the stop token kept) and
    /update_weights_from_disk ({"model_path"}: loads its model.safetensors), one request at a
    time; `calls` lists ("load", path) and ("complete", n) in order."""

    def __init__(self):
        from safetensors.torch import load_file

        self.model, self.calls, self.lock = tiny_model(seed=12345), [], threading.Lock()
        self.engine = make_rollout("hf", self.model, tiny_tokenizer())
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    if self.path == "/update_weights_from_disk":
                        path = Path(body["model_path"])
                        state = load_file(path / "model.safetensors")
                        missing, _ = server.model.load_state_dict(state, strict=False)
                        assert set(missing) <= {"lm_head.weight"}  # tied to the embeddings
                        server.calls.append(("load", path))
                        out = {"success": True}
                    else:
                        out = server.complete(body)
                data = json.dumps(out).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def complete(self, body: dict) -> dict:
        temperature = body["temperature"]
        sampling = Sampling(
            temperature or 1.0, body["top_p"], max(body["top_k"], 0), temperature > 0
        )
        request = Request(body["prompt"], body["max_tokens"], sampling, seed=body["seed"])
        result = self.engine.run(self.engine.generate(request))
        self.calls.append(("complete", len(result.ids)))
        tokens = [f"token_id:{i}" for i in result.ids]
        logprobs = {"tokens": tokens, "token_logprobs": result.logprobs}
        return {"choices": [{"logprobs": logprobs, "finish_reason": result.finish_reason}]}

    def close(self):
        self.http.shutdown()
        self.http.server_close()


@pytest.fixture
def server():
    fake = FakeServer()
    yield fake
    fake.close()


def backend(tmp_path, server, policy, text=None):
    from flowrl.front.sections import rollout_options  # noqa: F401 (as the pool builds it)

    (tmp_path / "openai_rollout.py").write_text(text or block("python", "# openai_rollout.py"))
    from flowrl import refs

    options = refs.load(REF, tmp_path).Options(url=server.url)
    return make_rollout(REF, policy, tiny_tokenizer(), options=options, base_dir=tmp_path)


def samples(engine, seed=0):
    prompts = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    return generate_batch(
        engine, prompts, torch.ones_like(prompts), n=2, max_new_tokens=6, seed=seed, logprobs=True
    )


def test_once_synced_it_samples_what_hf_samples_on_the_policy(tmp_path, server):
    policy = tiny_model(seed=0)
    remote = backend(tmp_path, server, policy)
    unsynced = samples(remote)
    remote.sync_weights(policy)  # as the pool does before the first generate
    ((kind, folder),) = server.calls[-1:]
    assert kind == "load" and (folder / "config.json").is_file()
    expected = samples(make_rollout("hf", policy, tiny_tokenizer()))
    got = samples(remote)
    assert torch.equal(got["responses"], expected["responses"])
    torch.testing.assert_close(got["logprobs"], expected["logprobs"])
    assert not torch.equal(unsynced["responses"], expected["responses"])  # other weights before
    remote.sync_weights(policy)
    assert not folder.exists()  # the server loaded the next folder: the older one is gone
    remote.close()
    assert not server.calls[-1][1].exists()


def graph_with_backend(tmp_path, server, text=None) -> Path:
    (tmp_path / "openai_rollout.py").write_text(text or block("python", "# openai_rollout.py"))
    graph = (ROOT / "graphs/ppo.toml").read_text()
    graph = graph.replace("[nodes.generate]\n", "[nodes.generate]\nreturn_logprobs = true\n", 1)
    table = block("toml", f'rollout = "{REF}"')  # the page's, with this server's address
    (line,) = [x for x in table.splitlines() if x.startswith("rollout = ")]
    graph = graph.replace("[models.policy]\n", f"[models.policy]\n{line}\n", 1)
    options = table[table.index("[models.policy.rollout_options]") :]
    graph += "\n" + options.replace("http://127.0.0.1:8000", server.url)
    (tmp_path / "g.toml").write_text(graph)
    return tmp_path / "g.toml"


def test_a_tiny_run_loads_weights_before_the_first_completion_and_after_each_update(
    tmp_path, server, capsys
):
    graph = graph_with_backend(tmp_path, server)
    run = run_tiny(graph, tmp_path / "runs", **{"run.critic_warmup": 0})
    kinds = [kind for kind, _ in server.calls]
    assert kinds[0] == "load"  # before any completion
    updates = len([m for m in run.metrics if "update_policy/grad_norm" in m])
    assert updates == 2 and kinds.count("load") == 1 + updates
    assert all(kind == "load" or kinds[:k].count("load") for k, kind in enumerate(kinds))
    assert not any(path.exists() for kind, path in server.calls if kind == "load")  # close()
    gaps = [m["rollout/logprob_gap"] for m in run.metrics if "rollout/logprob_gap" in m]
    assert len(gaps) == 2 and max(gaps) < 1e-4  # the same engine on the same weights
    assert "stale weights" not in capsys.readouterr().err


def test_a_backend_that_never_loads_the_weights_makes_the_run_warn_once(tmp_path, server, capsys):
    page = block("python", "# openai_rollout.py")
    deaf = page.replace(
        '        self.post("/update_weights_from_disk", {"model_path": str(directory)})',
        "        pass  # forgot to send them",
    )
    assert deaf != page
    run_tiny(
        graph_with_backend(tmp_path, server, deaf), tmp_path / "runs", **{"run.critic_warmup": 0}
    )
    err = capsys.readouterr().err
    assert err.count("likely sampling with stale weights") == 1
    assert f'rollout backend "{REF}" of model policy' in err


@pytest.mark.parametrize(
    "returned, said",
    [
        ("Result(ids, choice['logprobs']['token_logprobs'][:-1], reason)", "ids with"),
        ("Result(ids + ids + ids, [0.0] * 3 * len(ids), reason)", "for max_new_tokens = "),
        ("Result(ids, [float('nan')] * len(ids), reason)", "the log-prob nan"),
        ("Result(ids, choice['logprobs']['token_logprobs'], 'eos')", 'finish reason "eos"'),
        ("Result([-1] + ids[1:], choice['logprobs']['token_logprobs'], reason)", "the id -1"),
        ("(ids, reason)", "a tuple, not a Result"),
    ],
)
def test_a_result_that_breaks_the_contract_stops_naming_the_backend(
    tmp_path, server, returned, said
):
    from flowrl.engines.rollout import RolloutResultError

    page = block("python", "# openai_rollout.py")
    line = '        return Result(ids, choice["logprobs"]["token_logprobs"], reason)'
    assert line in page
    remote = backend(
        tmp_path, server, tiny_model(seed=0), page.replace(line, f"        return {returned}")
    )
    with pytest.raises(RolloutResultError) as caught:
        samples(remote)
    message = str(caught.value)
    assert said in message and "OpenAIRollout (openai_rollout.py:" in message.replace(
        str(tmp_path) + "/", ""
    )
