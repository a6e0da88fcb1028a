"""The rollout-backend contract: what a rollout engine offers, and the table of backends by name.

A rollout backend samples responses for the generate node and answers the pool worker's
residency transitions. A graph picks one per model with `rollout = "<name>"` in
`[models.<name>]`; the pool worker builds it with `make_rollout`. Adding a backend is one module
with one class that has the shape of `RolloutBackend`, plus one line in `ROLLOUT_BACKENDS`
(docs/extending.md).

The table holds import strings, so a backend's module (and the packages it needs) loads only
when a graph picks it. This module imports no torch at module level: schema.py validates the
name from the table, and `flowrl check` runs where torch is not installed.

Memory: the compiler tracks a rollout model's `weights` and `kv_cache` parts. When a plan moves
`kv_cache` off or back on the device, the pool worker calls `offload()` or `reload()`; after an
update it calls `sync_weights(module)`, so the next step samples from the trained weights. A
backend that holds more of those parts itself (a server with its own copy of the weights)
says which in a class attribute, `parts = ("weights", "kv_cache")`, and then gets the moving
ones as an argument, `offload(parts)` / `reload(parts)`, whenever one of them moves.

Some backends need a GPU pool or a package flowrl does not install: `DEVICE` and `PACKAGE`
say which, and `flowrl check` reports them (never importing the package).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

# name -> "module:Class", imported only when a graph picks the name
ROLLOUT_BACKENDS = {
    "hf": "flowrl.engines.hf_rollout:HFRollout",  # flowrl's own KV-cache decode loop (CPU/CUDA)
    "sglang": "flowrl.engines.sglang_backend:SGLangRollout",  # in-process SGLang engine (GPU)
}
DEVICE = {"sglang": "cuda"}  # backend -> the only pool device it runs on
PACKAGE = {"sglang": "sglang"}  # backend -> the package it imports, an optional extra
INSTALL = {"sglang": 'pip install -e ".[sglang]" in a checkout, or pip install "flowrl[sglang]"'}


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

    def offload(self) -> None:
        """Free the device memory of the kv_cache part. A backend with `parts` is called as
        `offload(moving)`, those of its parts that leave (a server: release their memory)."""
        ...

    def reload(self) -> None:
        """Make the kv_cache part usable again; with `parts`, `reload(moving)` (a server:
        resume their memory)."""
        ...

    def sync_weights(self, source: torch.nn.Module) -> None:
        """Take the weights of `source` (the train engine's module, maybe the same object; for
        a model sharded by fsdp, the pool's unsharded rollout copy, refreshed just before)."""
        ...


def missing_package(name: str) -> str:
    """The package backend `name` needs when it is not installed here, else "". Looked up with
    importlib.util.find_spec, which finds a package without importing it."""
    package = PACKAGE.get(name, "")
    return package if package and importlib.util.find_spec(package) is None else ""


def rollout_class(name: str) -> type:
    """The backend class named `name` in ROLLOUT_BACKENDS, imported now."""
    if name not in ROLLOUT_BACKENDS:
        choices = ", ".join(f'"{n}"' for n in sorted(ROLLOUT_BACKENDS))
        raise ValueError(f'unknown rollout backend "{name}"; the backends are: {choices}')
    module, _, attr = ROLLOUT_BACKENDS[name].partition(":")
    return getattr(importlib.import_module(module), attr)


def make_rollout(
    name: str, module, tokenizer, device: str = "cpu", where: str = ""
) -> RolloutBackend:
    """A rollout engine of backend `name` over `module` (shared with the train engine when
    colocated, so a weight sync costs nothing) and `tokenizer`, on `device`. `where` ("pool p,
    rank r, model m") goes to a backend whose constructor takes it, for its error messages."""
    cls = rollout_class(name)
    takes_where = "where" in inspect.signature(cls).parameters
    return cls(module, tokenizer, device, **({"where": where} if takes_where else {}))
