"""A critic / reward model: a causal LM's backbone with a scalar head.

A new head starts at zero, so a new critic predicts 0 for every token. Why zero rather than a
small random init: the first advantages are then the plain returns (no noise from a random
projection of 576 features), the mean of a 0/1 reward is closer to 0 than to that noise, and
the backbone gets no gradient until the head has moved, so early critic updates cannot disturb
the pretrained features through a random head.
"""

import torch
from torch import nn


class ValueModel(nn.Module):
    """backbone: (b, s) ids -> hidden (b, s, h) -> value_head -> values (b, s).

    Args:
        lm: a transformers model with `.model` (its transformer) and `.config`: a causal LM,
            or a sequence classifier (whose `score` layer is then passed as `head`).
        head: a trained Linear(hidden, 1) to use; None builds a new one, zero-initialised.
    """

    def __init__(self, lm: nn.Module, head: nn.Linear | None = None):
        super().__init__()
        self.model = lm.model  # the transformer without its LM head
        self.config = lm.config
        if head is None:
            head = nn.Linear(self.config.hidden_size, 1)
            nn.init.zeros_(head.weight)
            nn.init.zeros_(head.bias)
        self.value_head = head

    @property
    def base_model(self) -> nn.Module:
        return self.model

    def forward(self, input_ids, attention_mask=None, position_ids=None) -> torch.Tensor:
        hidden = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids
        ).last_hidden_state  # (b, s, h)
        return self.value_head(hidden).squeeze(-1)  # (b, s)
