"""A critic / reward model: a causal LM's backbone with a scalar head.

The head starts at zero, so a new critic predicts 0 for every token (the mean of a 0/1 reward
is closer to that than to a random projection of 576 features), and it learns from there.
"""

import torch
from torch import nn


class ValueModel(nn.Module):
    """backbone (b, s) -> hidden (b, s, h) -> value_head -> (b, s)."""

    def __init__(self, causal_lm: nn.Module):
        super().__init__()
        self.model = causal_lm.model  # the transformer without its LM head
        self.config = causal_lm.config
        self.value_head = nn.Linear(self.config.hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids, attention_mask=None, position_ids=None) -> torch.Tensor:
        hidden = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids
        ).last_hidden_state
        return self.value_head(hidden).squeeze(-1)  # (b, s)
