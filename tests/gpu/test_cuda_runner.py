"""The CUDA runner (flowrl/engines/hf/static.py) with its decode steps as CUDA graphs, on a GPU
(skipped elsewhere): greedy fp32 tokens equal the eager runner's, with and without the compiled
step; bf16 log-probs equal the train engine's on the same weights; a multi-turn rollout (held
slots, cache extension, padding rows in held slots) gives the log-probs of the whole
conversation; graphs are captured again after the weights move, and after an offload and a
reload of a bf16 view; a capture on a thread whose current device is another GPU replays.
Every engine compared with fp32 results runs in fp32 (`dtype="float32"`: "auto" is a bf16
view on CUDA). tests/unit/engines/hf/test_static_runner.py and tests/unit/engines/hf/
test_capturable_step.py check everything but the capture on the CPU.

Written without a GPU machine (none was lent to the task): not yet run.

    pytest tests/gpu/test_cuda_runner.py -q
"""

import asyncio
import threading

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
# fp32, as the results they are compared with; uncompiled unless a test says (a compile
# takes its seconds out of the GPU machine's few minutes)
GRAPHS = HFOptions(runner="cuda_graph", memory_fraction=0.05, dtype="float32", compile="off")
EAGER = HFOptions(runner="eager", dtype="float32")
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


@pytest.mark.parametrize("compile", ["off", "on"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_graph_replays_give_the_eager_runners_greedy_tokens_in_fp32(family, compile):
    model = tiny_model(seed=3).cuda().eval() if family == "llama" else qwen2()
    prompts, mask = batch(11)  # 11 rows pad to 16
    eager = HFRollout(model, tiny_tokenizer(), "cuda", options=EAGER)
    options = HFOptions(runner="cuda_graph", memory_fraction=0.05, dtype="float32", compile=compile)
    graphs = HFRollout(model, tiny_tokenizer(), "cuda", options=options)
    assert graphs.view is None  # the fp32 module itself
    kwargs = dict(max_new_tokens=40, do_sample=False, logprobs=True)
    a = generate_batch(eager, prompts, mask, **kwargs)
    b = generate_batch(graphs, prompts, mask, **kwargs)
    runner = graphs.runner
    assert runner.graphs and runner.warnings == []  # replays, not the eager fallback
    assert (runner.compiled is not None) == (compile == "on")
    # the ladder at width 128 in one pass: 16 rows and every size below
    assert {(b, 128) for b in (16, 8, 4, 2, 1)} <= set(runner.captured)
    assert torch.equal(a["responses"], b["responses"])
    torch.testing.assert_close(a["logprobs"], b["logprobs"], atol=1e-4, rtol=0)


def test_bf16_logprobs_equal_the_train_engines():
    model = tiny_model(seed=5).cuda().eval()
    options = HFOptions(runner="cuda_graph", memory_fraction=0.05, dtype="bfloat16", compile="off")
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
    assert engine.view is None

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
    assert engine.view is None  # the runner reads `model`: what moves and changes below
    prompts, mask = batch(4)
    before = generate_batch(engine, prompts, mask, max_new_tokens=20, do_sample=False)
    graphs = {id(g) for g in engine.runner.captured.values()}
    assert graphs
    for p in model.parameters():  # an offload and a reload: new storage, same values
        p.data = p.data.cpu().cuda()
    after = generate_batch(engine, prompts, mask, max_new_tokens=20, do_sample=False)
    assert torch.equal(before["responses"], after["responses"])
    assert not graphs & {id(g) for g in engine.runner.captured.values()}  # captured again
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p * 0.5)  # an update in place: the same graphs read the new values
    changed = generate_batch(engine, prompts, mask, max_new_tokens=20, do_sample=False)
    expected = generate_batch(
        HFRollout(model, tiny_tokenizer(), "cuda", options=EAGER),
        prompts,
        mask,
        max_new_tokens=20,
        do_sample=False,
    )
    assert torch.equal(changed["responses"], expected["responses"])


def test_a_bf16_view_offloaded_and_reloaded_decodes_as_before():
    model = tiny_model(seed=3).cuda().eval()
    options = HFOptions(runner="cuda_graph", memory_fraction=0.05, dtype="bfloat16", compile="off")
    engine = HFRollout(model, tiny_tokenizer(), "cuda", options=options)
    prompts, mask = batch(6)
    before = generate_batch(engine, prompts, mask, max_new_tokens=20, do_sample=False)
    kept = engine.runner.keeps_cache()  # a tiny cache on a big card: kept
    engine.offload(("kv_cache", "weights"))
    assert next(engine.view.parameters()).device.type == "cpu"
    assert (engine.runner.cache is not None) == kept
    engine.reload(("kv_cache", "weights"))
    after = generate_batch(engine, prompts, mask, max_new_tokens=20, do_sample=False)
    assert torch.equal(before["responses"], after["responses"])
    assert engine.runner.graphs and engine.runner.warnings == []


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_a_capture_on_a_thread_whose_device_is_another_replays():
    model = tiny_model(seed=3).to("cuda:1").eval()
    prompts, mask = batch(4)
    expected = generate_batch(
        HFRollout(model, tiny_tokenizer(), "cuda:1", options=EAGER),
        prompts, mask, max_new_tokens=20, do_sample=False,
    )  # fmt: skip
    engine = HFRollout(model, tiny_tokenizer(), "cuda:1", options=GRAPHS)
    out = {}

    def run():  # a thread's current device is cuda:0
        out["responses"] = generate_batch(
            engine, prompts, mask, max_new_tokens=20, do_sample=False
        )["responses"]

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert torch.equal(out["responses"], expected["responses"])
