"""CUDA graphs of the static runner's decode step (static.py `StaticRunner` inherits
`GraphCapture`): a width's ladder of batch sizes captured in one pass, largest first, with
garbage collection and cache emptying held off; capture and replay under the model's device;
graphs dropped when the parameters or buffers move; the step compiled by inductor before it
is captured (`compiled_step`); and a block of decode steps read back behind an event
(`Launched`), so that the next block can be queued first.
"""

from __future__ import annotations

import contextlib
import gc
import time
import warnings

import torch

from flowrl.engines.hf.sampling import sample_scan

# decode calls pad their rows to the next of these (vLLM captures 1, 2, 4 and multiples of 8)
LADDER = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512)


class Launched:
    """A block queued on the device (`StaticRunner.launch_block`): its (2, steps, d) tokens
    and log-probs on their way to the host (page-locked memory on CUDA, an event behind the
    copy), the rows finished after it (d,) and its last logits (d, v), on the device."""

    def __init__(self, result: torch.Tensor, done: torch.Tensor, logits: torch.Tensor):
        self.done, self.logits, self.event = done, logits, None
        if result.device.type == "cuda":
            self.host = torch.empty(result.shape, pin_memory=True)
            self.host.copy_(result, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream(result.device))  # behind the copy
        else:
            self.host = result

    def read(self) -> tuple[list, list]:
        """Wait for the block -> (tokens, logprobs), lists (steps, d): the block's one read
        back."""
        if self.event is not None:
            self.event.synchronize()
        return self.host[0].long().tolist(), self.host[1].tolist()


class GraphCapture:
    """The graph half of `StaticRunner`, for a class with `module`, `device`, `graphs`,
    `compiled`, `captured`, `pool`, `weights_at`, `warnings`, `capture_s`, the static
    inputs `ids`, `positions`, the `scratch` column and `_step`."""

    def _run(self, b: int, width: int) -> None:
        """The decode step over rows 0..b-1 from the static inputs into `out[:b]`: a graph
        replay, the width's ladder captured the first time this shape comes up; under the
        model's device (a capture on a thread whose current device is another one would
        record nothing, and a replay would launch on the wrong device's stream)."""
        if not self.graphs:
            self._step(b, width)
            return
        with torch.cuda.device(self.device):
            graph = self.captured.get((b, width))
            if graph is None:
                graph = self._capture_ladder(b, width)
                if graph is None:
                    self._step(b, width)
                    return
            graph.replay()

    def _check_weights(self) -> None:
        """Graphs read the parameters and buffers (RoPE's frequencies) where they were:
        after a move (an offload and a reload), capture again."""
        if self.graphs:
            tensors = [*self.module.parameters(), *self.module.buffers()]
            weights = tuple(t.data_ptr() for t in tensors)
            if weights != self.weights_at:
                self._forget_graphs()
                self.weights_at = weights

    def _forget_graphs(self) -> None:
        self.captured, self.pool, self.weights_at = {}, None, None

    def _turn_off(self, what: str, error: BaseException) -> None:
        """Graphs, the compiled step or the compiled sampler off for the rest of the process,
        warned and kept in `warnings` (a benchmark records them)."""
        if what == "compile":
            self.compiled = None
        elif what == "sampler":
            self.sampler = None
        else:
            self.graphs = False
        part = "the block's sampling" if what == "sampler" else "the rollout's decode step"
        message = (
            f"{part}: {'capturing' if what == 'graphs' else 'compiling'} "
            f"it failed ({type(error).__name__}: {str(error)[:500]}); it runs "
            f"{'eagerly' if what == 'graphs' else 'uncompiled'} from now on"
        )
        self.warnings.append(message)
        warnings.warn(message, stacklevel=3)

    def _capture_ladder(self, b: int, width: int):
        """Graphs of `_step` at `width` for b and every smaller size of the ladder not yet
        captured, largest first (the smaller reuse the pool's memory), with garbage
        collection and cache emptying held off (`capturing`) -> b's graph, or None (warned,
        graphs off) if it cannot be. Rows finishing at different times walk down the
        ladder: their shapes are then already captured, outside the timed decode."""
        start = time.perf_counter()
        sizes = sorted({s for s in LADDER if s < b} | {b}, reverse=True)
        real_ids, real_positions = self.ids[:b].clone(), self.positions[:b].clone()
        self.positions[:b] = self.scratch  # the warm-ups write nothing a row owns
        try:
            with capturing():
                for size in sizes:
                    if (size, width) not in self.captured:
                        self.captured[(size, width)] = self._capture(size, width)
        except RuntimeError as error:
            self._turn_off("graphs", error)
        finally:
            self.ids[:b], self.positions[:b] = real_ids, real_positions
            self.capture_s += time.perf_counter() - start
        return self.captured.get((b, width)) if self.graphs else None

    def _capture(self, b: int, width: int) -> torch.cuda.CUDAGraph:
        """A CUDA graph of `_step(b, width)` (raises RuntimeError if it cannot be)."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # kernels chosen, workspaces allocated, outside the graph
                self._step(b, width)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        self.pool = self.pool or torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            self._step(b, width)
        return graph


@contextlib.contextmanager
def capturing():
    """`gc.collect` and `torch.cuda.empty_cache` as no-ops while a ladder of graphs is
    captured (vLLM does the same): torch.cuda.graph runs both before every capture, ~0.1-0.4 s
    each in a process holding transformers and datasets, and emptying the cache hands a
    colocated train engine's cached blocks back to the driver. One collection first."""
    gc.collect()
    saved = gc.collect, torch.cuda.empty_cache, getattr(torch._C, "_host_emptyCache", None)
    gc.collect, torch.cuda.empty_cache = (lambda generation=2: 0), (lambda: None)
    if saved[2] is not None:
        torch._C._host_emptyCache = lambda: None
    try:
        yield
    finally:
        gc.collect, torch.cuda.empty_cache = saved[:2]
        if saved[2] is not None:
            torch._C._host_emptyCache = saved[2]


def compiled_sampler():
    """`sample_scan` compiled by inductor, shapes dynamic: the scaling, the max and the
    exponentials fused around the scan, so a sampled decode step reads its logits about twice
    (eager, each of sample_scan's element-wise ops is a pass over the vocabulary). Compiled
    at its first call, again for each new sampling setting (temperature, top-k, top-p are
    constants of the compiled code)."""
    return torch.compile(sample_scan, dynamic=True)


def compiled_step(forward):
    """`forward` (StaticRunner._forward) compiled by inductor, shapes dynamic: RMSNorm with
    its residual, rotary and SiLU-mul fused into a few kernels per layer (the eager step
    launches ~41 a layer); the CUDA graph then captures the compiled kernels. Compiled once
    at its first call (a graph's warm-up), again only for a new shape kind (1 row)."""
    compiled = torch.compile(forward, dynamic=True)

    def step(*args):
        # every layer runs the same code: its index (an int on the module) stays symbolic,
        # so the 24 layers of a Qwen2-0.5B are one compile, not 24 (dynamo's limit is 8)
        with torch._dynamo.config.patch(allow_unspec_int_on_nn_module=True):
            return compiled(*args)

    return step
