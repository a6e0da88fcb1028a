"""Collecting the ranks' outputs of a node whose per-token outputs differ in width."""

import numpy as np
import torch

from flowrl.protocol import DataProto
from flowrl.runtime.executor import LEFT_PADDED


def test_ranks_that_generated_different_lengths_are_right_padded_to_the_widest():
    # rank 0's longest response has 3 tokens, rank 1's 1 token
    rank0 = DataProto.from_dict(
        {
            "responses": torch.tensor([[5, 6, 2], [7, 2, 0]]),
            "response_mask": torch.tensor([[1, 1, 1], [1, 1, 0]]),
            "scores": torch.tensor([1.0, 0.0]),
        },
        non_tensor={"response_text": np.array(["ab", "c"], dtype=object)},
    )
    rank1 = DataProto.from_dict(
        {
            "responses": torch.tensor([[2]]),
            "response_mask": torch.tensor([[1]]),
            "scores": torch.tensor([0.5]),
        },
        non_tensor={"response_text": np.array([""], dtype=object)},
    )
    rows = DataProto.concat_padded([rank0, rank1], LEFT_PADDED)
    assert torch.equal(rows["responses"], torch.tensor([[5, 6, 2], [7, 2, 0], [2, 0, 0]]))
    assert torch.equal(rows["response_mask"], torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0]]))
    assert torch.equal(rows["scores"], torch.tensor([1.0, 0.0, 0.5]))
    assert list(rows["response_text"]) == ["ab", "c", ""]
    assert rank1["responses"].shape == (1, 1)  # the rank's own output is left as it was
