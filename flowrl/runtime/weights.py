"""The one path weights take from a train pool to a rollout pool of its own.

    export(executor, model, pool)          rank 0 of the train pool: Timed(Weights, ...)
    send(executor, model, pool, to_pool)   every rank of the rollout pool loads them
    slices(model, pool, to_pool, loads)    the export and each load, for the trace

Both users go through here: a step's `sync` item (`Executor`, at the end of a synchronous
step, and after a resume) and the asynchronous pipeline (flowrl/runtime/pipeline.py), which
exports after each update and loads a version just before the rollout stage generates with it.
On Ray, `export` answers a reference, so the weights go from worker to worker without passing
through the controller.
"""

import warnings

import torch

from flowrl.runtime.trace import Slice


class Weights(dict):
    """Exported weights, a state dict whose pickle carries each tensor's bytes as a buffer
    (`numpy`'s out-of-band pickle buffers) instead of torch's own pickling. Between Ray actors
    the bytes then go through the object store without a serialising copy and load on the
    other side as views of it: 135M fp32 parameters from one actor to another took 0.33 s this
    way against 4.06 s (bench/weight_transfer.py, medians). In one process it is the dict."""

    def __reduce__(self):
        raw = {k: (_bytes(v), str(v.dtype), tuple(v.shape)) for k, v in self.items()}
        return _weights, (raw,)


def _bytes(tensor: torch.Tensor):
    """A tensor's bytes as a flat numpy uint8 array (a view when it is contiguous on the CPU)."""
    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()


def _weights(raw: dict) -> Weights:
    with warnings.catch_warnings():  # read-only memory: loading into a module only reads it
        warnings.filterwarnings("ignore", "The given NumPy array is not writable")
        return Weights(
            {
                k: torch.from_numpy(a)
                .view(getattr(torch, dtype.removeprefix("torch.")))
                .reshape(shape)
                for k, (a, dtype, shape) in raw.items()
            }
        )


def export(executor, model: str, pool: str):
    """Start `export_weights` of `model` on every rank of `pool` (under fsdp they all gather
    the shards) and answer rank 0's result, in a form `send` passes on (on Ray a reference,
    not waited for)."""
    handle = executor.submit(pool, "export_weights", [(model,)] * executor.ranks(pool))
    return executor.rank0_output(handle)


def send(executor, model: str, pool: str, to_pool: str, weights=None):
    """Load `weights` (an `export`'s answer; None: export them from `pool` now) into every
    rank of `to_pool`. Returns the handle of the loading, not waited for: its results are each
    rank's `Timed`, for `slices`."""
    if weights is None:
        weights = export(executor, model, pool)
    args = [(model, weights)] * executor.ranks(to_pool)
    return executor.submit(to_pool, "import_weights", args)


def slices(model: str, pool: str, to_pool: str, loads: list) -> list[Slice]:
    """A sync to another pool as slices: the export on the train pool's rank 0 (its times come
    back with each load's `Timed.value`) and every rollout rank's load. The gap between them
    is the transfer."""
    exported = Slice(f"export:{model}", "sync", f"{pool}/rank0", *loads[0].value)
    return [exported] + [
        Slice(f"sync:{model}", "sync", f"{to_pool}/rank{rank}", t.start, t.end)
        for rank, t in enumerate(loads)
    ]


def sent(executor, model: str, pool: str, to_pool: str, weights=None) -> list[Slice]:
    """`send`, waited for: the transfer's slices."""
    handle = send(executor, model, pool, to_pool, weights)
    return slices(model, pool, to_pool, executor.results(handle))
