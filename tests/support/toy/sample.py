"""Toy controller sampler for refill tests: n rows per prompt, token values from the uid.

Even uids give n identical rows (a group the dynamic-sampling filter drops), odd uids rows that
differ; the response width is 2 + the batch's refill round, so rounds differ in width.
"""

import attrs
import torch

from flowrl.nodespec import NodeSpec


@attrs.frozen
class Params:
    n: int = 2


def run(batch, params):
    uid = batch["uid"].repeat_interleave(params.n)  # (b * n,)
    sample = torch.arange(len(uid)) % params.n
    width = 2 + int(batch.meta.get("round", 0))
    varied = (uid % 2 == 1).long() * sample  # 0 for every row of an even uid
    responses = (uid + varied)[:, None].repeat(1, width)  # (b * n, width)
    return {"responses": responses, "response_mask": torch.ones_like(responses)}


SPEC = NodeSpec(
    reads=("prompts", "uid"),
    writes=("responses", "response_mask"),
    params=Params,
    fn=run,
    rows="repeat",
)
