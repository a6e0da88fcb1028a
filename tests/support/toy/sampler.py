"""A user's rollout node, with its params named its own way, that asks for what the built-in
nodes get through hooks: partial rollouts (`continues`: its `answer` column rebuilt when a
response ends; `keep_logprobs` where generate says `return_logprobs`) and its own prompts
(`prompt`: `banner` before each row's question, where the agent node shows its tools).

reads: prompts, prompt_mask -> writes: responses, response_mask, answer (+ rollout_logprobs)
"""

import attrs
import numpy as np

from flowrl.hooks import Continuation
from flowrl.nodespec import NodeSpec, RolloutParams


@attrs.frozen
class Params(RolloutParams):
    max_new_tokens: int = 8
    keep_logprobs: bool = False  # also write rollout_logprobs
    banner: str = "Q: "  # put before every prompt's question


class SamplerWorker:
    def __init__(self, engine, params):
        self.params = params


def answer(rows, tokenizer) -> dict:
    """Whole responses -> `answer` (b,): the decoded tokens, marked as this node's."""
    pairs = zip(rows["responses"], rows["response_mask"], strict=True)
    texts = tokenizer.batch_decode([ids[m.bool()].tolist() for ids, m in pairs])
    out = np.empty(len(texts), dtype=object)  # (b,) strings
    out[:] = ["sampler: " + t for t in texts]
    return {"answer": out}


def prompt(params: Params, base_dir: str, tokenizer):
    """Each row's last message after the banner, as plain text (no chat template)."""
    return lambda row: params.banner + row["prompt"][-1]["content"]


SPEC = NodeSpec(
    reads=("prompts", "prompt_mask"),
    writes=("responses", "response_mask", "answer"),
    params=Params,
    worker=SamplerWorker,
    mode="rollout",
    head="lm",
    rows="repeat",
    optional_writes={"rollout_logprobs": lambda p: p.keep_logprobs},
    continues=Continuation(("answer",), answer),
    prompt=prompt,
)
