"""The sglang rollout backend on a real GPU and a real SGLang (skipped elsewhere): greedy output
agrees with flowrl's decode loop on the same weights, and after a 2-step GRPO run SGLang
serves exactly the trainer's weights. The model is Qwen2-0.5B-shaped with random weights
(bench/colocation.py builds it from a config, no download), in bfloat16.

Written without a GPU machine (none was available to the task): not yet run.

    pip install -e ".[sglang]" && pytest tests/gpu -q
"""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from flowrl.engines.batch import generate_batch
from flowrl.engines.sglang.smoke import chosen_logprobs, forced, prompts  # the smoke's own

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(
        importlib.util.find_spec("sglang") is None,
        reason='needs SGLang: pip install -e ".[sglang]"',
    ),
]
# greedy near-ties: bf16 kernels of two engines may order two logits closer than this
# differently (random weights give flat logits, std ~0.6, top-2 gaps ~0.1)
TIE = 0.05
STACKED = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")


@pytest.fixture(scope="module")
def qwen_dir() -> Path:
    sys.path.insert(0, str(ROOT / "bench"))
    from colocation import model_dir

    return model_dir("qwen2-0.5b")


def test_greedy_sglang_picks_flowrls_argmax_at_every_token(qwen_dir):
    from flowrl.engines.hf.engine import HFRollout
    from flowrl.engines.sglang.backend import SGLangRollout
    from flowrl.models import load_model

    module, tokenizer = load_model(str(qwen_dir), dtype="bfloat16")
    module.to("cuda:0")
    ids, mask = prompts(tokenizer, 8)
    ours = HFRollout(module, tokenizer, "cuda:0")
    theirs = SGLangRollout(module, tokenizer, "cuda:0")
    try:
        kwargs = dict(max_new_tokens=32, do_sample=False)
        expected = generate_batch(ours, ids, mask, **kwargs)
        got = generate_batch(theirs, ids, mask, logprobs=True, **kwargs)
    finally:
        theirs.shutdown()
    # every token SGLang chose is flowrl's argmax there, up to a near-tie, and the log-probs
    # it reports are the module's
    logits = forced(module, ids, mask, got)  # (b, t, v)
    chosen = logits.gather(-1, got["responses"][..., None]).squeeze(-1)  # (b, t)
    gap = (logits.max(-1).values - chosen) * got["response_mask"]
    assert float(gap.max()) < TIE, f"SGLang chose a token {float(gap.max()):.3f} below argmax"
    delta = (chosen_logprobs(logits, got) - got["logprobs"]).abs()
    assert float(delta.max()) < 0.1  # bf16, two engines' kernels
    same = [
        torch.equal(a[a_m.bool()], b[b_m.bool()])
        for a, a_m, b, b_m in zip(
            expected["responses"],
            expected["response_mask"],
            got["responses"],
            got["response_mask"],
            strict=True,
        )
    ]
    print(f"rows identical token for token: {sum(same)} of {len(same)}")


@pytest.mark.parametrize("offload", ["never", "always"])
def test_two_grpo_steps_leave_sglang_with_the_trainers_weights(qwen_dir, tmp_path, offload):
    import copy

    from flowrl.cli import load_plan
    from flowrl.runtime.controller import Trainer

    scorer = ROOT / "tests/integration/varied_scorer.py"  # nonzero advantages: the policy moves
    overrides = [
        f'models.policy.path="{qwen_dir}"',
        f'models.ref.path="{qwen_dir}"',
        f'pools.main.offload="{offload}"',
        f'nodes.reward.scorer="{scorer}:compute_score"',
        "run.steps=2",
        "run.val_size=0",
        "data.batch_size=2",
        "nodes.generate.n=4",
        "nodes.generate.max_new_tokens=32",
        "models.policy.lr=1e-2",  # random weights: let two steps move them far
        f'run.out_dir="{tmp_path}"',
    ]
    plan = load_plan(str(ROOT / "graphs/grpo_sglang.toml"), overrides)
    trainer = Trainer(plan, tmp_path / "run", "local")
    worker = trainer.executor.workers["main"][0]
    rollout, module = worker.rollout["policy"], worker.train["policy"].module
    try:
        initial = copy.deepcopy(module).to("cpu")
        trainer.fit()
        worker.transition("reload", "policy", ("weights", "kv_cache"))  # as before a generate
        ids, mask = prompts(worker.tokenizers["policy"], 4)
        got = generate_batch(rollout, ids, mask, max_new_tokens=16, do_sample=False, logprobs=True)
        now = (chosen_logprobs(forced(module, ids, mask, got), got) - got["logprobs"]).abs()
        old = chosen_logprobs(forced(initial.to("cuda:0"), ids, mask, got), got) - got["logprobs"]
        # SGLang's log-probs are the trained module's, not the initial one's
        assert float(now.max()) < 0.1 < float(old.abs().max())
        for name, param in module.named_parameters():  # exactly, where SGLang shows them
            if any(part in name for part in STACKED):
                continue  # SGLang holds these fused (qkv_proj, gate_up_proj)
            served = rollout.engine.get_weights_by_name(name, truncate_size=100)
            if served is not None:  # None where the model class has no get_weights_by_name
                served = torch.tensor(served).float()  # the first rows, as SGLang's tests
                want = param.detach().float().cpu()
                want = want[: len(served)] if served.dim() == want.dim() else want.flatten()
                assert torch.equal(served, want[: len(served)].reshape(served.shape)), name
    finally:
        trainer.close()
        rollout.shutdown()
