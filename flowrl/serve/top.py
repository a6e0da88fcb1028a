"""`top_logprobs`: the k likeliest tokens at each sampled position, from one forward pass of
the backend's module over the prompt and the completion (the engine returns only the sampled
token's log-prob). The distribution is the model's at the request's temperature, before top-k
and top-p, as vLLM reports it."""

from __future__ import annotations


def top_logprobs(module, prompt: list[int], ids: list[int], k: int, temperature: float):
    """[(token, log-prob), ...] (k of them, likeliest first) for each of `ids` after `prompt`."""
    import torch

    if not ids or k == 0:
        return [[] for _ in ids]
    device = next(module.parameters()).device
    with torch.inference_mode():
        x = torch.tensor([prompt + ids], device=device)
        logits = module(input_ids=x).logits[0, len(prompt) - 1 : len(prompt) + len(ids) - 1]
        logprobs = torch.log_softmax(logits.float() / (temperature or 1.0), -1)  # (t, v)
        values, indices = logprobs.topk(k, -1)
    return [
        list(zip(i.tolist(), v.tolist(), strict=True)) for i, v in zip(indices, values, strict=True)
    ]
