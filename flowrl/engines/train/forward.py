"""The train engine's forward pass as a module: per-response-token log-probs (or values).

`ResponseForward` wraps the model (a causal LM or a ValueModel) so that a whole forward is one
module call (the engine's `forward_module`). That is what FSDP2 needs: `fully_shard` hooks a
module's `__call__`, and the root module's hooks gather the parameters outside the decoder
layers (embeddings, final norm, head), so the engine must call the root, not the backbone and
the head one after the other.

The forward does only the work the outputs need: padding columns are trimmed by the caller, the
head runs only at the positions that predict response tokens (logsumexp minus the gathered
logit, no log-softmax over the vocabulary kept), and a prompt repeated over its n samples runs
once when the engine asks for it (`share_prompts`; never under fsdp, see `hidden`).

The logits of a micro-batch are (tokens, vocabulary) floats: 4096 tokens of Qwen's 151,936
entries are 2.5 GB in fp32, and the entropy needs a softmax of the same size. Past
`max_logits` elements the head runs over chunks of tokens instead (`chunked_logprobs`), each
chunk recomputed in the backward (torch's checkpoint), so no more than one chunk's logits
exist at a time; below it (every CPU default: SmolLM2's 49,152 entries x 4096 tokens is under
it) the pass is the plain one, unchanged.
"""

import contextlib
import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import DynamicCache

from flowrl.models.calls import cache_argument

# logits elements (tokens x vocabulary) above which the head runs in chunks of tokens: 1 GiB of
# fp32 logits at a time
MAX_LOGITS = 1 << 28


class ResponseForward(nn.Module):
    """model: a causal LM or a ValueModel (anything with `base_model` and an output head)."""

    def __init__(self, model: nn.Module, max_logits: int = MAX_LOGITS):
        super().__init__()
        self.model = model
        self.is_value = hasattr(model, "value_head")
        self.max_logits = max_logits  # see the module's docstring

    def forward(
        self,
        prompts: torch.Tensor,
        prompt_mask: torch.Tensor,
        responses: torch.Tensor,
        attention: torch.Tensor,
        entropy: bool = False,
        temperature: float = 1.0,
        share_prompts: bool = False,
        read_at=None,
    ) -> dict:
        """prompts, prompt_mask (b, p) left-padded; responses, attention (b, t) right-padded ->
        {"logprobs" (b, t)[, "entropy" (b, t)]} for an LM, {"values" (b, t)} for a value model
        (not masked: the engine zeroes the padding).

        With `read_at` (b,) positions in the joined prompt + response sequence, a value model
        returns {"scores" (b,)}: its head at the hidden state *of* that token, as a sequence
        classifier reads a reward (train/sequence_scores.py), not of the token before.
        """
        if read_at is not None:
            ids = torch.cat([prompts, responses], dim=1)  # (b, s)
            mask = torch.cat([prompt_mask, attention], dim=1)
            hidden = self.model.base_model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                use_cache=False,
            ).last_hidden_state  # (b, s, h)
            picked = hidden[torch.arange(len(ids), device=ids.device), read_at]  # (b, h)
            return {"scores": self.model.value_head(picked).squeeze(-1).float()}
        hidden = self.hidden(prompts, prompt_mask, responses, attention, share_prompts)
        if self.is_value:
            values = self.model.value_head(hidden).squeeze(-1).float()  # (b, t), a view
            return {"values": values.clone()}  # FSDP2 warns of views leaving its root module
        head = self.model.get_output_embeddings()
        chunk = max(1, self.max_logits // head.weight.shape[0])  # tokens per chunk
        if hidden.shape[0] * hidden.shape[1] > chunk:
            return chunked_logprobs(hidden, head, responses, entropy, temperature, chunk)
        logits = head(hidden).float() / temperature  # (b, t, v)
        return token_logprobs(logits, responses, entropy)

    def hidden(self, prompts, prompt_mask, responses, attention, share_prompts) -> torch.Tensor:
        """The backbone's last hidden states at the positions predicting each response token:
        (b, t, h), from prompts (b, p) and responses (b, t) with their attention mask (b, t).

        With `share_prompts`, rows that repeat a prompt (the n samples of one prompt) share it:
        each distinct prompt runs once, its keys and values are repeated for its rows, and only
        response tokens run per row. Gradients flow back through the shared keys and values, so
        this is the same function as the whole-sequence pass; for 4 prompts x 8 samples it
        computes 4 x 46 prompt tokens instead of 32 x 46. It calls each layer twice, which
        FSDP2's backward does not support (a layer's gathered weights are freed after its first
        backward), and it keeps a cache that recomputed layers would fill twice, so the engine
        turns it off under fsdp and under activation checkpointing.
        """
        backbone, p = self.model.base_model, prompts.shape[1]
        mask = torch.cat([prompt_mask, attention], dim=1)  # (b, p + t)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # left padding: count real tokens
        if not share_prompts:
            ids = torch.cat([prompts, responses], dim=1)
            hidden = backbone(
                input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False
            )
            return hidden.last_hidden_state[:, p - 1 : -1]
        distinct, group = torch.unique(
            torch.cat([prompts, prompt_mask], dim=1), dim=0, return_inverse=True
        )  # (g, 2p), and each row's prompt (b,)
        cache = DynamicCache(config=backbone.config)
        prompt_hidden = backbone(
            input_ids=distinct[:, :p],
            attention_mask=distinct[:, p:],
            position_ids=(distinct[:, p:].cumsum(-1) - 1).clamp(min=0),
            **cache_argument(backbone, cache),
            use_cache=True,
        ).last_hidden_state  # (g, p, h)
        cache.batch_select_indices(group)  # (g, ...) -> (b, ...), differentiable
        response_hidden = backbone(
            input_ids=responses,
            attention_mask=mask,
            position_ids=positions[:, p:],
            **cache_argument(backbone, cache),
            use_cache=True,
        ).last_hidden_state  # (b, t, h)
        # the last prompt state predicts the first response token, response state k the k+1st
        return torch.cat([prompt_hidden[group, -1:], response_hidden[:, :-1]], dim=1)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, entropy: bool | str = False):
    """logits (b, t, v), tokens (b, t) -> {"logprobs" (b, t)[, "entropy" (b, t)]}.

    log p(x) = z_x - logsumexp(z): one gather, no (b, t, v) log-softmax kept.
    Entropy H = logsumexp(z) - sum_x softmax(z)_x z_x; with entropy = "metric" computed
    without gradients (no autograd graph over the vocabulary, and a checkpointed chunk's
    backward stops recomputing before it), the same values.
    """
    normaliser = logits.logsumexp(-1)  # (b, t)
    out = {"logprobs": logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - normaliser}
    if entropy:
        with torch.no_grad() if entropy == "metric" else contextlib.nullcontext():
            out["entropy"] = normaliser - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    return out


def chunked_logprobs(hidden, head, tokens, entropy: bool, temperature: float, chunk: int) -> dict:
    """`token_logprobs` of head(hidden) / temperature, over `chunk` tokens at a time: hidden
    (b, t, h), tokens (b, t) -> {"logprobs" (b, t)[, "entropy" (b, t)]}. With gradients, each
    chunk keeps only its hidden states and recomputes its logits in the backward."""
    b, t, _ = hidden.shape

    def one(states, ids):  # (n, h), (n,) -> {"logprobs" (n,)[, "entropy" (n,)]}
        return token_logprobs(head(states).float() / temperature, ids, entropy)

    flat, ids = hidden.reshape(b * t, -1), tokens.reshape(b * t)
    parts = []
    for start in range(0, b * t, chunk):
        args = (flat[start : start + chunk], ids[start : start + chunk])
        grad = torch.is_grad_enabled() and flat.requires_grad
        parts.append(checkpoint(one, *args, use_reentrant=False) if grad else one(*args))
    return {k: torch.cat([p[k] for p in parts]).reshape(b, t) for k in parts[0]}


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The transformer blocks of a model: `base_model.layers` (Llama, Qwen, Mistral, ...) or
    `base_model.h` (GPT-2 style)."""
    backbone = model.base_model
    for name in ("layers", "h"):
        layers = getattr(backbone, name, None)
        if isinstance(layers, nn.ModuleList):
            return layers
    raise ValueError(f"cannot find the decoder layers of {type(backbone).__name__}")


def checkpoint_layers(layers: nn.ModuleList) -> None:
    """Activation checkpointing per layer: each layer keeps only its inputs in the forward and
    recomputes the rest in the backward (torch's non-reentrant checkpoint). Done by replacing
    each layer's `forward`, so parameter names (and checkpoints) do not change. Only with
    gradients on: a rollout of the same module under no_grad calls the layer as it is
    (torch's checkpoint reads the RNG states even then, which a CUDA graph capture refuses)."""
    for layer in layers:
        layer.forward = functools.partial(checkpointed, layer.forward)


def checkpointed(forward, *args, **kwargs):
    """`forward(*args, **kwargs)`, under torch's non-reentrant checkpoint when gradients are
    on."""
    if torch.is_grad_enabled():
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return forward(*args, **kwargs)
