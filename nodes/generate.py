"""Sample responses from the policy: n per prompt, stopping at EOS.

reads: prompts, prompt_mask -> writes: responses, response_mask, response_text
Rows come back interleaved (all samples of prompt 0, then prompt 1, ...); the runtime repeats
the batch's other columns to match, so `uid` groups the samples of a prompt.
"""

from __future__ import annotations

import time

import attrs

from flowrl.lazy import np, torch
from flowrl.nodespec import NodeSpec
from flowrl.validators import MAX_SAMPLES, MAX_TOKENS, checked, count, interval, positive


@attrs.frozen
class Params:
    n: int = checked(1, count(1, MAX_SAMPLES))  # samples per prompt
    max_new_tokens: int = checked(32, count(1, MAX_TOKENS))  # response length cap
    temperature: float = checked(1.0, positive())  # sampling temperature
    top_p: float = checked(1.0, interval(0, 1, low_open=True))  # nucleus sampling; 1.0 = off
    top_k: int = checked(0, count(0, MAX_TOKENS))  # top-k sampling; 0 = off
    do_sample: bool = True  # False = greedy (validation uses greedy)


def step_generator(meta: dict, device="cpu") -> torch.Generator:
    """A generator seeded by (seed, step, rank): a resumed run samples what the first did."""
    seed = int(meta.get("seed", 0)) * 1_000_003 + int(meta.get("step", 0)) * 9_973
    return torch.Generator(device=device).manual_seed(seed + int(meta.get("rank", 0)))


def generation_metrics(response_mask, seconds: float) -> dict:
    """response_mask (b, t) -> response_length mean / max and new tokens per second."""
    lengths = response_mask.sum(-1).float()  # (b,)
    return {
        "response_length": float(lengths.mean()) if len(lengths) else 0.0,
        "response_length_max": float(lengths.max()) if len(lengths) else 0.0,
        "gen_tokens_per_s": float(lengths.sum()) / max(seconds, 1e-9),
    }


class GenerateWorker:
    def __init__(self, engine, params: Params):
        self.engine, self.params = engine, params

    def __call__(self, batch):
        p, start = self.params, time.perf_counter()
        out = self.engine.generate(
            batch["prompts"],
            batch["prompt_mask"],
            n=p.n,
            max_new_tokens=p.max_new_tokens,
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k,
            do_sample=p.do_sample,
            generator=step_generator(batch.meta, self.engine.device),
        )
        texts = np.empty(len(out["responses"]), dtype=object)  # (b * n,) strings
        texts[:] = self.engine.tokenizer.batch_decode(out["responses"], skip_special_tokens=True)
        metrics = generation_metrics(out["response_mask"], time.perf_counter() - start)
        return {**out, "response_text": texts}, metrics


SPEC = NodeSpec(
    reads=("prompts", "prompt_mask"),
    writes=("responses", "response_mask", "response_text"),
    params=Params,
    worker=GenerateWorker,
    mode="rollout",
    head="lm",
    rows="repeat",
)
