"""The rollout-backend contract: what a rollout engine offers, and how a pool builds one.

A rollout backend samples responses for the generate node and answers the pool worker's
residency transitions. A graph picks one per model with `rollout = "<name>"` in
`[models.<name>]`; its record (import path, device, package, multi-turn) is a line of the
torch-free table `flowrl.backends.ROLLOUT_BACKENDS`, and the pool worker builds it with
`make_rollout`. Adding a backend is one module with one class that has the shape of
`RolloutBackend`, plus one line in that table (docs/extending.md).

Memory: the compiler tracks a rollout model's `weights` and `kv_cache` parts. When a plan moves
parts off or back on the device, the pool worker calls `offload(parts)` or `reload(parts)` with
the parts that move; each backend acts on those it holds (flowrl's own loop: the KV cache; a
server with its own copy of the weights: both). After an update it calls
`sync_weights(module)`, so the next step samples from the trained weights.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from flowrl import refs
from flowrl.backends import backend

if TYPE_CHECKING:
    import torch


@runtime_checkable
class RolloutBackend(Protocol):
    """A rollout engine, built as `Backend(module, tokenizer, device)` with the model's
    (possibly shared) torch module, its tokenizer and a device string ("cpu", "cuda:0")."""

    device: torch.device  # where its tensors live; the generate node seeds a generator there
    tokenizer: Any  # the model's tokenizer; the generate node decodes responses with it

    def generate(
        self,
        prompts: torch.Tensor,
        prompt_mask: torch.Tensor,
        *,
        n: int = 1,
        max_new_tokens: int = 32,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        do_sample: bool = True,
        generator: torch.Generator | None = None,
        logprobs: bool = False,
    ) -> dict[str, torch.Tensor]:
        """Sample n responses per prompt.

        Args:
            prompts: (b, p) int64 token ids, left-padded.
            prompt_mask: (b, p) 1 for real tokens, 0 for padding.
            n: samples per prompt; rows come back interleaved (prompt 0's n samples first).
            max_new_tokens: the most tokens a response may have; 0 gives empty responses.
            temperature, top_p, top_k: sampling filters, applied in `generate`'s order
                (top_k = 0 and top_p = 1.0 are off).
            do_sample: False (or temperature 0) picks the most likely token: greedy.
            generator: the random source of sampling, on `device`; None = torch's global one.
            logprobs: also return "logprobs", each sampled token's log-prob under the
                distribution it was drawn from (after temperature, top-k, top-p; greedy: the
                model's at temperature 1), for truncated importance sampling.

        Returns:
            {"responses": (b*n, t) int64 right-padded with the pad id, "response_mask":
            (b*n, t) int64, 1 on each response up to and including its first EOS}, t the
            longest response; with `logprobs`, "logprobs": (b*n, t) float32, 0 past each
            response; CPU tensors made outside inference mode, so a train engine may use them
            directly.
        """
        ...

    def offload(self, parts: tuple[str, ...]) -> None:
        """Free the device memory of those of `parts` ("weights", "kv_cache") it holds."""
        ...

    def reload(self, parts: tuple[str, ...]) -> None:
        """Make those of `parts` it holds usable again (before a generate: "kv_cache")."""
        ...

    def sync_weights(self, source: torch.nn.Module) -> None:
        """Take the weights of `source` (the train engine's module, maybe the same object; for
        a model sharded by fsdp, the pool's unsharded rollout copy, refreshed just before)."""
        ...


def rollout_class(name: str) -> type:
    """The class of backend `name` in flowrl.backends.ROLLOUT_BACKENDS, imported now."""
    return refs.load(backend(name).ref, what=f'rollout backend "{name}"')


def make_rollout(
    name: str, module, tokenizer, device: str = "cpu", where: str = ""
) -> RolloutBackend:
    """A rollout engine of backend `name` over `module` (shared with the train engine when
    colocated, so a weight sync costs nothing) and `tokenizer`, on `device`. `where` ("pool p,
    rank r, model m") goes to a backend whose constructor takes it, for its error messages."""
    cls = rollout_class(name)
    takes_where = "where" in inspect.signature(cls).parameters
    return cls(module, tokenizer, device, **({"where": where} if takes_where else {}))
