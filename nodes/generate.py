"""Sample responses from the policy: n per prompt, stopping at EOS.

reads: prompts, prompt_mask -> writes: responses, response_mask, response_attention, response_text
(+ rollout_logprobs when return_logprobs: each sampled token's log-prob under the distribution
it was drawn from, for update.policy's truncated importance sampling, tis_cap)
Every response token is sampled, so response_attention (the tokens a forward attends to) equals
response_mask (the tokens trained on); a multi-turn rollout makes them differ.
Every row is one request of the rollout contract (flowrl/engines/rollout.py, batch.py), from
its own random stream. Rows come back interleaved (all samples of prompt 0, then prompt 1,
...); the runtime repeats the batch's other columns to match, so `uid` groups the samples of a
prompt. Its responses can be continued over rounds (run.partial_rollout): `finished`.
"""

from __future__ import annotations

import time

import attrs

from flowrl.hooks import Continuation
from flowrl.lazy import np
from flowrl.nodespec import NodeSpec, RolloutParams


@attrs.frozen
class Params(RolloutParams):
    """n, max_new_tokens, temperature, top_p, top_k, do_sample: see RolloutParams."""

    return_logprobs: bool = False  # also write rollout_logprobs (the sampler's log-probs)


def step_seed(meta: dict) -> int:
    """The seed of a step's rollout, from (seed, step, round, rank); row r of the batch samples
    from the stream of (this, r) (flowrl.engines.rollout.request_seed), so a resumed run
    samples what the first did."""
    seed = int(meta.get("seed", 0)) * 1_000_003 + int(meta.get("step", 0)) * 9_973
    seed += int(meta.get("round", 0)) * 7_919  # a refilling step's further prompt batches
    return seed + int(meta.get("rank", 0))


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
        from flowrl.engines.batch import generate_batch

        p, start = self.params, time.perf_counter()
        out = generate_batch(
            self.engine,
            batch["prompts"],
            batch["prompt_mask"],
            n=p.n,
            max_new_tokens=p.max_new_tokens,
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k,
            do_sample=p.do_sample,
            seed=step_seed(batch.meta),
            logprobs=p.return_logprobs,
        )
        if p.return_logprobs:
            out["rollout_logprobs"] = out.pop("logprobs")  # (b * n, t)
        texts = np.empty(len(out["responses"]), dtype=object)  # (b * n,) strings
        texts[:] = self.engine.tokenizer.batch_decode(out["responses"], skip_special_tokens=True)
        metrics = generation_metrics(out["response_mask"], time.perf_counter() - start)
        attention = out["response_mask"].clone()  # (b * n, t)
        return {**out, "response_attention": attention, "response_text": texts}, metrics


def finished(rows, tokenizer) -> dict:
    """Whole responses continued over rounds -> the columns the worker writes besides the
    tokens: response_attention (b, t) = response_mask, response_text (b,) decoded."""
    mask = rows["response_mask"]  # (b, t)
    texts = np.empty(len(rows), dtype=object)
    texts[:] = tokenizer.batch_decode(
        [ids[m.bool()].tolist() for ids, m in zip(rows["responses"], mask, strict=True)],
        skip_special_tokens=True,
    )
    return {"response_attention": mask.clone(), "response_text": texts}


SPEC = NodeSpec(
    reads=("prompts", "prompt_mask"),
    writes=("responses", "response_mask", "response_attention", "response_text"),
    params=Params,
    worker=GenerateWorker,
    mode="rollout",
    head="lm",
    rows="repeat",
    optional_writes={"rollout_logprobs": lambda p: p.return_logprobs},
    continues=Continuation(("response_attention", "response_text"), finished),
)
