"""A length bonus on the scores.

reads: scores, response_mask -> writes: bonus_scores

Written against the docs of flowrl 0.1 (docs/extending.md, "A node"), kept as it was: the
test of old spellings (tests/unit/test_api.py) loads it unchanged.
"""

import attrs

from flowrl.nodespec import NodeSpec
from flowrl.validators import at_least, checked


@attrs.frozen
class Params:
    scale: float = checked(0.01, at_least(0))  # bonus per response token


def run(batch, params):
    lengths = batch["response_mask"].sum(-1).float()  # (b,)
    return {"bonus_scores": batch["scores"] + params.scale * lengths}


SPEC = NodeSpec(reads=("scores", "response_mask"), writes=("bonus_scores",), params=Params, fn=run)
