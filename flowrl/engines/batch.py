"""A batch of prompts through the request contract: what the generate node and validation
call. Each (prompt, sample) is one request, all issued at once, so a batching backend starts
them in one batch (and prefills a prompt once for its n samples); the results come back as
right-padded tensors."""

from __future__ import annotations

import asyncio

import torch

from flowrl.engines.rollout import Request, Sampling, request_seed


def generate_batch(
    backend,
    prompts: torch.Tensor,
    prompt_mask: torch.Tensor,
    *,
    n: int = 1,
    max_new_tokens: int = 32,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    do_sample: bool = True,
    seed: int = 0,
    logprobs: bool = False,
) -> dict[str, torch.Tensor]:
    """Sample n responses per prompt on `backend` (a `RolloutBackend`).

    Args:
        prompts: (b, p) int64 token ids, left-padded; prompt_mask: (b, p) 1 on real tokens.
        n: samples per prompt; rows come back interleaved (prompt 0's n samples first).
        max_new_tokens, temperature, top_p, top_k, do_sample: see `Sampling` and `Request`.
        seed: the batch's seed; row r samples from the stream of `request_seed(seed, r)`,
            so a row's tokens do not depend on the other rows.
        logprobs: also return "logprobs".

    Returns:
        {"responses": (b*n, t) int64 right-padded with the pad id, "response_mask": (b*n, t)
        int64, 1 on each response up to and including its stop token}, t the longest
        response; with `logprobs`, "logprobs": (b*n, t) float32, each sampled token's log-prob
        (see `Result`), 0 past each response. CPU tensors made outside inference mode, so a
        train engine may use them directly.

    Raises:
        RuntimeError: a request came back aborted (its short response is not used as if it
            were complete).
    """
    sampling = Sampling(temperature, top_p, top_k, do_sample)
    pairs = zip(prompts.cpu(), prompt_mask.cpu(), strict=True)
    rows = [row[mask.bool()].tolist() for row, mask in pairs]  # each prompt's real ids
    requests = [
        Request(ids, max_new_tokens, sampling, seed=request_seed(seed, k), logprobs=logprobs)
        for k, ids in enumerate(ids for ids in rows for _ in range(n))
    ]
    results = backend.run(_all(backend, requests)) if requests else []
    for k, result in enumerate(results):
        if result.finish_reason == "abort":
            raise RuntimeError(
                f"request {k} of {len(results)} was aborted after {len(result.ids)} tokens; "
                "its short response is not used as if it were complete"
            )
    return padded(results, len(requests), backend.pad, logprobs)


async def _all(backend, requests: list[Request]) -> list:
    return list(await asyncio.gather(*(backend.generate(r) for r in requests)))


def padded(results: list, rows: int, pad: int, logprobs: bool) -> dict[str, torch.Tensor]:
    """Results -> the right-padded tensors of `generate_batch` (rows without a result: empty)."""
    t = max((len(r.ids) for r in results), default=0)
    responses = torch.full((rows, t), pad, dtype=torch.long)
    mask = torch.zeros((rows, t), dtype=torch.long)
    values = torch.zeros((rows, t), dtype=torch.float32)
    for k, result in enumerate(results):
        length = len(result.ids)
        responses[k, :length] = torch.tensor(result.ids, dtype=torch.long)
        mask[k, :length] = 1
        values[k, :length] = torch.tensor(result.logprobs, dtype=torch.float32)
    out = {"responses": responses, "response_mask": mask}
    return {**out, "logprobs": values} if logprobs else out
