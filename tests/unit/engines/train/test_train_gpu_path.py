"""The train engine's GPU-minded paths, checked on the CPU (flowrl/engines/train/): log-probs
and entropy over chunks of tokens (no whole (rows, tokens, vocabulary) logits), with gradients
and with activation checkpointing; micro-batches of rows sorted by length (what it does on
CUDA) giving the same numbers with less padding; param_dtype's autocast only on cuda."""

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from flowrl.engines import TrainEngine
from flowrl.engines.train.forward import ResponseForward, chunked_logprobs, token_logprobs
from flowrl.engines.train.sharding import make_sharding
from flowrl.protocol import DataProto
from flowrl.testing import tiny_model, tiny_tokenizer


class LargestTensor(TorchDispatchMode):
    """The most elements of any tensor an op makes while the mode is on, views of `weight`
    (its transpose for the head's matmul) aside."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.most, self.weight = 0, weight.untyped_storage().data_ptr()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() != self.weight:
                self.most = max(self.most, t.numel())
        return out


def saved_bytes(fn):
    """fn() under autograd: its value, and the bytes of the tensors saved for its backward."""
    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, total[0]


def rows(seed=0, b=6, p=5, t=9):
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, 100, (b, p), generator=g)
    responses = torch.randint(3, 100, (b, t), generator=g)
    prompt_mask = torch.ones_like(prompts)
    prompt_mask[::2, :2] = 0  # left padding
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    response_mask = (torch.arange(t)[None] < lengths[:, None]).long()
    return DataProto.from_dict(
        {
            "prompts": prompts,
            "prompt_mask": prompt_mask,
            "responses": responses,
            "response_mask": response_mask,
        }
    )


def test_chunked_logprobs_equal_the_whole_pass_without_its_logits():
    model = tiny_model(seed=1, vocab=2000)  # a vocabulary much wider than the hidden states
    head = model.get_output_embeddings()
    hidden = torch.randn(4, 10, 32, requires_grad=True)  # (b, t, h)
    tokens = torch.randint(0, head.weight.shape[0], (4, 10))
    v = head.weight.shape[0]

    def whole():
        return token_logprobs(head(hidden).float() / 0.7, tokens, entropy=True)

    def chunked():
        return chunked_logprobs(hidden, head, tokens, True, 0.7, chunk=8)

    (full, full_saved), (part, part_saved) = saved_bytes(whole), saved_bytes(chunked)
    for key in ("logprobs", "entropy"):
        torch.testing.assert_close(part[key], full[key])
    # the gradients agree
    grads = []
    for out in (full, part):
        hidden.grad = None
        (out["logprobs"].sum() + out["entropy"].sum()).backward()
        grads.append(hidden.grad.clone())
    torch.testing.assert_close(grads[0], grads[1])
    # no tensor of the chunked pass holds the (b, t, v) logits: at most 8 tokens' worth
    with LargestTensor(head.weight) as largest:
        chunked()
    assert largest.most <= 8 * v < 4 * 10 * v
    with LargestTensor(head.weight) as largest:
        whole()
    assert largest.most == 4 * 10 * v  # the check bites: the whole pass makes (b, t, v)
    # and the backward keeps each chunk's hidden states, not its logits
    assert part_saved < full_saved / 4


def test_the_engine_chunks_the_head_past_max_logits_and_trains_the_same():
    plain, chunked = tiny_model(seed=2), tiny_model(seed=2)
    batch = rows()
    engines = [TrainEngine(m, tiny_tokenizer(), lr=1e-3) for m in (plain, chunked)]
    engines[1].forward_module.max_logits = 5 * plain.config.vocab_size  # 5 tokens a chunk
    outs = []
    for engine in engines:
        out = engine.forward(batch, grad=True, entropy=True)
        engine.backward((out["logprobs"] * batch["response_mask"]).sum() + out["entropy"].sum())
        engine.step()
        outs.append(out)
    torch.testing.assert_close(outs[0]["logprobs"], outs[1]["logprobs"])
    torch.testing.assert_close(outs[0]["entropy"], outs[1]["entropy"])
    for a, b in zip(plain.parameters(), chunked.parameters(), strict=True):
        torch.testing.assert_close(a, b)


def test_chunking_works_with_activation_checkpointing():
    models = [tiny_model(seed=3) for _ in range(2)]
    batch = rows(seed=1)
    engines = [
        TrainEngine(models[0], tiny_tokenizer()),
        TrainEngine(models[1], tiny_tokenizer(), activation_checkpointing=True),
    ]
    engines[1].forward_module.max_logits = 4 * models[1].config.vocab_size
    grads = []
    for engine in engines:
        out = engine.forward(batch, grad=True)
        engine.backward((out["logprobs"] * batch["response_mask"]).sum())
        grads.append([p.grad.clone() for p in engine.module.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b)


def test_micro_batches_sorted_by_length_pad_less_and_change_nothing():
    model = tiny_model(seed=4)
    batch = rows(seed=2, b=12, t=16)
    lengths = torch.tensor([1, 16, 2, 15, 1, 16, 3, 14, 2, 16, 1, 15])  # alternating
    batch["response_mask"] = (torch.arange(16)[None] < lengths[:, None]).long()
    in_order = TrainEngine(model, tiny_tokenizer(), micro_tokens=60)
    by_length = TrainEngine(copy.deepcopy(model), tiny_tokenizer(), micro_tokens=60)
    by_length.by_length = True  # what a CUDA engine does

    def padded(engine):  # tokens the micro-batches compute, padding included
        return sum(
            len(m) * (int(m["prompt_mask"].sum(-1).max()) + int(m["response_mask"].sum(-1).max()))
            for m in engine._split(batch)
        )

    assert padded(by_length) < padded(in_order)
    a = in_order.infer(batch, entropy=True)
    b = by_length.infer(batch, entropy=True)
    for key in ("logprobs", "entropy"):
        torch.testing.assert_close(a[key], b[key])  # in the rows' order
    for engine in (in_order, by_length):  # one optimizer step, a token-mean loss

        def loss(micro, counts, engine=engine):
            logprobs = engine.forward(micro, grad=True)["logprobs"]
            return (logprobs * micro["response_mask"]).sum() / counts.num_tokens, {}

        engine.update(batch, loss)
    for x, y in zip(in_order.module.parameters(), by_length.module.parameters(), strict=True):
        torch.testing.assert_close(x, y)


def test_param_dtype_autocasts_only_on_cuda():
    assert make_sharding("ddp", device="cpu", compute=torch.bfloat16).autocast_to is None
    assert make_sharding("ddp", device="cuda", compute=torch.bfloat16).autocast_to is torch.bfloat16
    forward = ResponseForward(tiny_model())
    assert forward.max_logits == 1 << 28


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_engine_computes_in_bf16_over_fp32_master_weights_with_fused_adamw():
    model = tiny_model(seed=6).cuda()
    engine = TrainEngine(model, tiny_tokenizer(), device="cuda", param_dtype="bfloat16")
    seen = []
    hook = model.model.layers[0].mlp.down_proj.register_forward_hook(
        lambda m, args, out: seen.append(out.dtype)
    )
    out = engine.forward(rows(), grad=True)
    hook.remove()
    engine.backward(out["logprobs"].sum())
    engine.step()
    assert seen == [torch.bfloat16]
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert engine.optimizer.defaults["fused"] and engine.by_length
