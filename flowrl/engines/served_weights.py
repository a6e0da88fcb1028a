"""The weights a server rollout backend serves, as any such backend sends them: the module's
tensors under the base model's names with a LoRA adapter folded in (`rollout_weights`), in
groups of bounded size (`weight_buckets`). SGLang's backend pushes them this way
(engines/sglang/backend.py); a vLLM or other server backend reuses them. A rollout copy of
the module in its own dtype (flowrl's own engine on CUDA) takes them in place
(`refresh_in_place`)."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator

import torch


def rollout_weights(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of what SGLang serves: the module's parameters under the base model's
    names; with a LoRA adapter (peft) each adapted layer's base weight with its update folded
    in (W + scale * B @ A, a new tensor; the module is not changed) and the adapter's own
    tensors left out, as `flowrl export` folds them."""
    adapted = {
        name: layer
        for name, layer in module.named_modules()
        if hasattr(layer, "get_delta_weight") and hasattr(layer, "base_layer")
    }
    for name, tensor in module.named_parameters():
        if "lora_" in name:
            continue
        owner, marker, rest = name.rpartition(".base_layer.")
        if marker:
            layer = adapted[owner]
            if rest == "weight" and not (layer.merged or layer.disable_adapters):
                for adapter in layer.active_adapters:
                    tensor = tensor + layer.get_delta_weight(adapter).to(tensor.dtype)
            name = f"{owner}.{rest}"
        yield name, tensor.detach()


def weight_buckets(
    named: Iterable[tuple[str, torch.Tensor]], limit: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive (name, tensor) groups of at most `limit` bytes each (a larger tensor alone).
    The tensors are the module's own, detached, not copies: the engine copies them into its
    weights (over CUDA IPC when they are on the GPU)."""
    bucket, size = [], 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > limit:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor.detach()))
        size += nbytes
    if bucket:
        yield bucket


@torch.no_grad()
def refresh_in_place(target: torch.nn.Module, source: torch.nn.Module) -> None:
    """Copy `source`'s parameters and buffers into `target`'s of the same names, cast to
    their dtype, in place: `target`'s tensors keep their storage (what a CUDA graph captured
    over them reads), and nothing the size of the model is allocated."""
    mine = dict(itertools.chain(target.named_parameters(), target.named_buffers()))
    for name, tensor in itertools.chain(source.named_parameters(), source.named_buffers()):
        mine[name].copy_(tensor)
