"""The CUDA runner (flowrl/engines/hf/static.py) with its decode steps as CUDA graphs, on a GPU
(skipped elsewhere): greedy fp32 tokens equal the eager runner's; bf16 log-probs equal the
train engine's on the same weights; a multi-turn rollout (held slots, cache extension, padding
rows in held slots) gives the log-probs of the whole conversation; graphs are captured again
after the weights move. tests/unit/engines/hf/test_static_runner.py checks everything but the
capture on the CPU.

Written without a GPU machine (none was lent to the task): not yet run.

    pytest tests/gpu/test_cuda_runner.py -q
"""

import asyncio

import pytest
import torch

from flowrl.backends import HFOptions
from flowrl.engines import HFRollout, TrainEngine
from flowrl.engines.batch import generate_batch
from flowrl.engines.rollout import Request, Sampling
from flowrl.engines.threads import run_sync
from flowrl.protocol import DataProto
from flowrl.testing import tiny_model, tiny_qwen2, tiny_tokenizer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
GRAPHS = HFOptions(runner="cuda_graph", memory_fraction=0.05)
GREEDY = Sampling(do_sample=False)


def qwen2(dtype=torch.float32):
    """A random Qwen2 on the GPU: 4 query heads sharing 2 KV heads, biased projections."""
    return tiny_qwen2(layers=3, hidden=64).to("cuda", dtype)


def batch(rows: int, width: int = 9):
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 100, (rows, width), generator=g)
    mask = torch.ones_like(prompts)
    for k in range(rows):
        mask[k, : k % 4] = 0
    return prompts, mask


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_graph_replays_give_the_eager_runners_greedy_tokens_in_fp32(family):
    model = tiny_model(seed=3).cuda().eval() if family == "llama" else qwen2()
    prompts, mask = batch(11)  # 11 rows pad to 16
    eager = HFRollout(model, tiny_tokenizer(), "cuda", options=HFOptions(runner="eager"))
    graphs = HFRollout(model, tiny_tokenizer(), "cuda", options=GRAPHS)
    kwargs = dict(max_new_tokens=40, do_sample=False, logprobs=True)
    a = generate_batch(eager, prompts, mask, **kwargs)
    b = generate_batch(graphs, prompts, mask, **kwargs)
    assert graphs.runner.graphs and graphs.runner.captured  # replays, not the eager fallback
    assert (16, 128) in graphs.runner.captured
    assert torch.equal(a["responses"], b["responses"])
    torch.testing.assert_close(a["logprobs"], b["logprobs"], atol=1e-4, rtol=0)


def test_bf16_logprobs_equal_the_train_engines():
    model = tiny_model(seed=5).cuda().eval()
    options = HFOptions(runner="cuda_graph", memory_fraction=0.05, dtype="bfloat16")
    engine = HFRollout(model, tiny_tokenizer(), "cuda", options=options)
    prompts, mask = batch(8)
    out = generate_batch(engine, prompts, mask, n=2, max_new_tokens=24, seed=3, logprobs=True)
    rows = DataProto.from_dict(
        {
            "prompts": prompts.repeat_interleave(2, 0),
            "prompt_mask": mask.repeat_interleave(2, 0),
            "responses": out["responses"],
            "response_mask": out["response_mask"],
        }
    )
    trainer = TrainEngine(engine.view, tiny_tokenizer(), trainable=False, device="cuda")
    logprobs = trainer.forward(rows, grad=False)["logprobs"]
    real = out["response_mask"].bool()
    assert (logprobs[real] - out["logprobs"][real]).abs().max() < 1e-3


def test_a_multi_turn_request_extends_its_held_slot_under_graph_replays():
    model = tiny_model(seed=3).cuda().eval()
    engine = HFRollout(model, tiny_tokenizer(), "cuda", options=GRAPHS)

    def together(requests):
        async def run():
            return await asyncio.gather(*(engine.generate(r) for r in requests))

        return run_sync(run())

    first = together([Request([5, 6, 7, 8], 2, GREEDY, request_id="a", keep=True)])[0]
    together([Request([10 + k, 11, 12], 20, GREEDY) for k in range(3)])  # pads into A's slot
    ids = [5, 6, 7, 8, *first.ids, 40, 41]
    second = together([Request(ids, 5, Sampling(), request_id="a", keep=True, seed=4)])[0]
    engine.release("a")
    with torch.no_grad():
        whole = model(input_ids=torch.tensor([ids + second.ids], device="cuda")).logits[0]
    expected = whole.float().log_softmax(-1)[len(ids) - 1 : -1]
    expected = expected.gather(-1, torch.tensor(second.ids, device="cuda")[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(second.logprobs), expected.cpu(), atol=1e-4, rtol=0)


def test_graphs_are_captured_again_after_the_weights_move():
    model = tiny_model(seed=3).cuda().eval()
    engine = HFRollout(model, tiny_tokenizer(), "cuda", options=GRAPHS)
    prompts, mask = batch(4)
    before = generate_batch(engine, prompts, mask, max_new_tokens=20, do_sample=False)
    for p in model.parameters():  # an offload and a reload: new storage, same values
        p.data = p.data.cpu().cuda()
    after = generate_batch(engine, prompts, mask, max_new_tokens=20, do_sample=False)
    assert torch.equal(before["responses"], after["responses"])
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p * 0.5)  # an update in place: the same graphs read the new values
    changed = generate_batch(engine, prompts, mask, max_new_tokens=20, do_sample=False)
    expected = generate_batch(
        HFRollout(model, tiny_tokenizer(), "cuda", options=HFOptions(runner="eager")),
        prompts,
        mask,
        max_new_tokens=20,
        do_sample=False,
    )
    assert torch.equal(changed["responses"], expected["responses"])
