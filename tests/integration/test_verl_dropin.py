"""verl's GSM8K multi-turn recipe runs through `flowrl run --tiny` unchanged
(examples/verl_gsm8k): rows built as verl's gsm8k_multiturn_w_tool.py builds them, a
BaseTool-shaped class from verl's tool YAML, a BaseInteraction-shaped class from verl's
interaction YAML. A scripted policy emits Hermes calls (the tiny random model would not), so
every number below is what verl's rollout computes for the same turns."""

import json
import re
import shutil
from pathlib import Path

import pytest

from flowrl.agent import rows as agent_rows
from flowrl.api import RolloutBase
from flowrl.cli import main

pytestmark = pytest.mark.slow  # the integration tier: a tiny training run

EXAMPLE = Path(__file__).parents[2] / "examples" / "verl_gsm8k"
SCORER = """
import json
from flowrl.rewards import gsm8k

def compute_score(data_source, solution_str, ground_truth, extra_info):
    with open(__file__ + ".seen.jsonl", "a") as f:
        f.write(json.dumps({"extra_info": extra_info, "truth": ground_truth}) + "\\n")
    return gsm8k.compute_score(data_source, solution_str, ground_truth)
"""
QUESTION = re.compile(r"sells (\d+) boxes of (\d+) pencils and (\d+) loose")


class HermesPolicy(RolloutBase):
    """Stands in for the rollout engine (the request contract): a request reads its question
    from its conversation; turn 0 calls calc_gsm8k_reward, later turns write "#### answer".
    Greedy requests (validation) and requests of even seed answer right, the others one too
    many; `wrong` records the request ids that answered wrong."""

    wrong: set = set()

    async def generate(self, request):
        from flowrl.engines.rollout import Result

        text = self.tokenizer.decode(list(request.ids))
        a, b, c = map(int, QUESTION.findall(text)[-1])
        off = 0 if request.sampling.greedy or request.seed % 2 == 0 else 1
        if off:
            HermesPolicy.wrong.add(request.request_id)
        answer = a * b + c + off
        call = {"name": "calc_gsm8k_reward", "arguments": {"answer": str(answer)}}
        reply = f"<tool_call>{json.dumps(call)}</tool_call>" if request.turn == 0 else ""
        reply = reply or f"#### {answer}"
        ids = self.tokenizer(reply, add_special_tokens=False)["input_ids"]
        ids = (ids + [self.tokenizer.eos_token_id])[: request.max_new_tokens]
        return Result(ids, [-1.0] * len(ids), "stop")


def test_verls_gsm8k_recipe_runs_as_it_is(tmp_path, monkeypatch):
    example = tmp_path / "examples" / "verl_gsm8k"  # its chat_template: ../../graphs/...
    shutil.copytree(EXAMPLE, example, ignore=shutil.ignore_patterns("*.parquet"))
    shutil.copytree(
        EXAMPLE.parents[1] / "graphs" / "chat_templates", tmp_path / "graphs" / "chat_templates"
    )
    monkeypatch.syspath_prepend(str(example))
    import build_data

    monkeypatch.setattr("sys.argv", ["build_data.py", "--out", str(example)])
    build_data.main()
    (tmp_path / "scorer.py").write_text(SCORER)
    monkeypatch.setattr("flowrl.engines.hf.engine.HFRollout", HermesPolicy)
    monkeypatch.setattr(agent_rows, "_SETUPS", {})  # this run's setups only, not other tests'
    HermesPolicy.wrong.clear()
    overrides = [
        f'run.out_dir="{tmp_path / "runs"}"',
        f'nodes.reward.scorer="{tmp_path / "scorer.py"}:compute_score"',
        "nodes.generate.max_new_tokens=400",
        "nodes.generate.max_turn_tokens=0",  # the tiny run's script is replaced by ours
        "nodes.generate.script_first_turn=false",
        "nodes.generate.max_assistant_turns=3",
    ]
    graph = str(example / "graph.toml")
    assert main(["run", graph, "--tiny", "--backend", "local", *overrides]) in (0, None)

    seen = [json.loads(x) for x in (tmp_path / "scorer.py.seen.jsonl").read_text().splitlines()]
    infos = [s["extra_info"] for s in seen]
    right = [i for i in infos if i["rollout_reward_scores"]["calc_gsm8k_reward"] == 1.0]
    wrong = [i for i in infos if i not in right]
    # 2 training steps x 8 requests, the policy's wrong ones wrong; validation (4 rows, 1
    # sample, greedy: all right) x 2
    trained = 2 * 8
    assert 0 < len(HermesPolicy.wrong) < trained
    assert (len(right), len(wrong)) == (
        trained - len(HermesPolicy.wrong) + 8,
        len(HermesPolicy.wrong),
    )
    # right: call, tool round, "#### x", the interaction says correct and ends the request:
    # verl's num_turns = 2 assistant + 2 user (the tool round and the reply) + 1
    for info in right:
        assert info["num_turns"] == 5 and info["tool_rewards"] == [0.0]
        assert info["turn_scores"] == [1.0]
        assert info["rollout_reward_scores"] == {"calc_gsm8k_reward": 1.0}
        assert info["need_tools_kwargs"] is True and "tools_kwargs" in info
    # wrong: the tool scores 0 (-0.05: no improvement), the interaction asks again, the
    # third assistant turn reaches max_assistant_turns = 3: 3 + 2 + 1
    for info in wrong:
        assert info["num_turns"] == 6 and info["tool_rewards"] == [-0.05]
        assert info["turn_scores"] == [0.0]
        assert info["rollout_reward_scores"] == {"calc_gsm8k_reward": 0.0}
    run_dir = next((tmp_path / "runs").iterdir())
    steps = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [s for s in steps if "score/mean" in s]
    # the right ones score 1, end with the interaction's done; the wrong ones hit max_turns
    assert sum(s["score/mean"] for s in train) * 8 == trained - len(HermesPolicy.wrong)
    for s in train:
        assert s["generate/termination/interaction_done"] == s["score/mean"]
        assert s["generate/termination/max_turns"] == 1 - s["score/mean"]
    assert all(s["generate/requests_trained"] == 1.0 for s in train)
    assert [s["val/score"] for s in steps if "val/score" in s] == [1.0, 1.0]
    samples = [json.loads(x) for x in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert all("Current parsed answer=" in s["conversation"][1]["content"] for s in samples)
    ends = {s["termination"]: s["conversation"][-1] for s in samples}
    assert ends["interaction_done"] == {"role": "user", "content": "Your response is correct!"}
    # every tool instance and every interaction instance was released
    (setup,) = [s for s in agent_rows._SETUPS.values() if s.interactions.get("gsm8k")]
    assert setup.toolbox.tools[0].tool._instance_dict == {}
    assert setup.interactions["gsm8k"].instance._instance_dict == {}
