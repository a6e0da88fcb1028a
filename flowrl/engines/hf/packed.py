"""One model call that decodes some requests and prefills others (scheduler.py): every row's
tokens packed into one sequence, so the weights are read once for all of them.

A model call on CPU costs a read of all the weights plus a share per token (SmolLM2-135M, one
torch thread on the 2-core machine: ~70 ms a call and ~6 ms a token). A request back from its
tools brings a few new tokens (its last sampled token and the tool's answer); prefilled in a
call of its own, it costs a whole weight read while the decoding requests wait for it. Packed,
the projections and MLPs run over [each decoding row's token, then each joining row's new
tokens] as one sequence (batch 1, each token at its own position), and attention runs per
group on the slot cache (kv_cache.py): the decoding rows as one batch of one query each over
their slots, a joining row's tokens over its own slot with a causal mask. So a packed call
computes what the two calls compute, up to the order of floating-point sums.

The attention is this module's own function, registered with transformers'
`AttentionInterface` and selected for the packed call only (the model's own implementation,
sdpa, runs every other call, and computes each group here). It needs a model whose attention
layers call the registered functions: transformers marks those `_supports_attention_backend`
(Llama, Qwen2/3, Mistral, Gemma and most other decoders of transformers 5). For any other
model the scheduler makes the two calls; a model marked so whose layers do not call it is
caught after the call (every layer must have come through here): the engine computes that
call again unpacked, warns, and packs no more.

The implementation is swapped on the model's config for the duration of the call, which other
threads see: a forward of the same module on another thread meanwhile (a shared module) gets
plain sdpa from this function, and overlapping packed calls restore the implementation once
the last one ends (a count per config, under a lock).
"""

from __future__ import annotations

import contextlib
import threading

import attrs
import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from flowrl.engines.hf.kv_cache import attention_mask

NAME = "flowrl_packed"
_current = threading.local()  # the packed call running on this thread
_lock = threading.Lock()
_swapped: dict[int, list] = {}  # id(config) -> [packed calls running, implementation before]


@attrs.frozen
class Group:
    """Rows lo..hi-1 of the call (= cache slots), each with `width` tokens, starting at token
    `start` of the packed sequence; `mask` (rows, 1, width, columns) over their slots."""

    start: int
    lo: int
    hi: int
    width: int
    mask: torch.Tensor


@attrs.define
class PackedCall:
    """A packed call's groups over the slot cache; `attend` is the attention of its layers."""

    cache: object
    groups: list[Group]
    layers_seen: int = 0

    def attend(self, module, query, key, value, scaling, mask=None, **kwargs):
        """query (1, heads, t, d) of the packed sequence -> (1, t, heads, d), each group
        attending over its slots' cached keys and values (this call's already written by the
        cache; `key`, `value` and the call's `mask` are not read)."""
        kwargs.pop("is_causal", None)  # each group's mask says it
        layer = self.cache.layers[module.layer_idx]
        self.layers_seen += 1
        out = []
        for g in self.groups:
            rows = g.hi - g.lo
            q = query[0, :, g.start : g.start + rows * g.width]  # (heads, rows * w, d)
            q = q.unflatten(1, (rows, g.width)).transpose(0, 1)  # (rows, heads, w, d)
            columns = g.mask.shape[-1]
            keys = layer.key_buffer[g.lo : g.hi, :, :columns]
            values = layer.value_buffer[g.lo : g.hi, :, :columns]
            o, _ = sdpa_attention_forward(
                module, q, keys, values, g.mask, scaling=scaling, is_causal=False, **kwargs
            )  # (rows, w, heads, d); sdpa's refusals (softcap) stand
            out.append(o.flatten(0, 1))
        return torch.cat(out)[None], None


def groups_of(
    lengths: list[int], offsets: list[int], lo: int, device, runs: bool = False
) -> list[Group]:
    """Rows of one token next to each other form one group; a longer row is a group alone,
    or with `runs` one group with the rows of its length next to it (slots lo.., row k
    feeding lengths[k] ids at columns offsets[k]..)."""
    out, start, k = [], 0, 0
    while k < len(lengths):
        end = k + 1
        if lengths[k] == 1 or runs:
            while end < len(lengths) and lengths[end] == lengths[k]:
                end += 1
        width = lengths[k]
        columns = max(offsets[k:end]) + width
        offs = torch.tensor(offsets[k:end], dtype=torch.long, device=device)
        mask = attention_mask(offs, width, columns, torch.float32, eager=False)
        out.append(Group(start, lo + k, lo + end, width, mask))
        start += (end - k) * width
        k = end
    return out


def packed_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """The attention of the call running on this thread (`packing`): a packed call's groups,
    or another call's own `attend` (the CUDA runner's decode, static.py); plain sdpa for
    another thread's forward of the module meanwhile."""
    call = getattr(_current, "call", None)
    if call is None:  # another thread's forward of the module while this one packs
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, **kwargs
        )
    return call.attend(module, query, key, value, scaling, mask=attention_mask, **kwargs)


AttentionInterface.register(NAME, packed_attention)
AttentionMaskInterface.register(NAME, sdpa_mask)  # masks of other threads' calls meanwhile


def can_pack(module) -> bool:
    """Whether `module` (a transformers causal LM, maybe wrapped) routes its attention through
    the registered functions and runs sdpa, whose per-group function this is."""
    from flowrl.models.calls import innermost

    inner = innermost(module)
    config = getattr(inner, "config", None)
    return bool(
        getattr(type(inner), "_supports_attention_backend", False)
        and getattr(config, "_attn_implementation", None) == "sdpa"
    )


@contextlib.contextmanager
def packing(module, call):
    """`call.attend` (a `PackedCall`, or another call with an `attend` of the same shape)
    selected as the attention of the model calls inside, on this thread."""
    from flowrl.models.calls import innermost

    config = innermost(module).config
    with _lock:
        entry = _swapped.get(id(config))
        if entry is None:
            entry = _swapped[id(config)] = [0, config._attn_implementation]
            config._attn_implementation = NAME
        entry[0] += 1
    _current.call = call
    try:
        yield
    finally:
        _current.call = None
        with _lock:
            entry[0] -= 1
            if entry[0] == 0:
                config._attn_implementation = entry[1]
                del _swapped[id(config)]
