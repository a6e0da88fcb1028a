"""The `sglang` rollout backend: an in-process SGLang engine on the rank's GPU.

Chosen per model with `rollout = "sglang"` in `[models.<m>]`; this module loads only then, and
imports sglang only when the engine is built (`pip install -e ".[sglang]"`, which pins
sglang==0.5.21, the release whose torch pin is the project's torch 2.13.0). The engine runs
token ids in, token ids out (tokenizer init skipped) with the memory saver on, so the plan's
offload / reload of the model's `weights` and `kv_cache` parts release and resume SGLang's
memory regions of the same names. It keeps its own copy of the weights: it starts with dummy
weights and receives the train engine's module's parameters (no second copy on this side: the
tensors are handed over as they are, in buckets), after every update and after every resume of
its weights, whose values a release drops.

A push (`_push`) is one weight-update session: `begin_weight_update()`, the buckets, then
`end_weight_update()` (closed on any error), then a prefix-cache flush, so no cached prefix
computed with old weights is reused. Since 0.5.21 SGLang refuses `update_weights_from_tensor`
outside a session, and every refusal comes back as a `(success, message)` return value, never
an exception: each one is read, and a refusal raises `PushRefused` with SGLang's message and
the pool, rank and model. With `verify` (on in the tests and the GPU smoke command; in a run:
`[models.<m>.rollout_options] verify = true`) a few pushed parameters are read back
(`get_weights_by_name`) and compared with the trainer's. A LoRA model's adapters are folded into
the pushed weights, under the base model's names (SGLang skips names it does not know with a
hidden warning). The model's dtype must be 16-bit (SGLang's attention kernels are; `flowrl
check` refuses float32 first). SGLang's signal handlers and its shutdown (which kill the whole
process tree) are replaced: process.py; the tensors crossing over: io.py.

When what happens (the order tests/unit/engines/sglang/test_sglang_backend.py checks around a
plan's steps):
- build: engine up, weights pushed, cache flushed;
- offload(parts): release_memory_occupation(tags) of the parts still held;
- reload(parts) with the kv_cache part (before a generate): resume "weights" if released, push
  the weights, flush, then resume "kv_cache" (verl's order: the KV cache comes back after the
  push, so weights and trainer copy are the peak, not weights and KV cache). The weights part
  alone (before an update or a log-prob pass) resumes nothing: those calls use the train
  engine's module, and SGLang's copy stays off the device until the next generate needs it;
- sync_weights(module): push and flush now if the weights are held, else at the next resume.

Differences from `hf` (docs/scaling.md): sampling is SGLang's, so a request's seed is not used
and a run is not reproducible sample for sample (SGLang's per-request `sampling_seed` needs
`--enable-deterministic-inference` and is refused by its flashinfer sampler); log-probs are
SGLang's (after temperature, before top-k / top-p; greedy: the model's at temperature 1),
which differ slightly from the trainer's: truncated importance sampling (update.policy's
tis_cap) corrects for that.

SGLang API relied on, read in the sglang 0.5.21 wheel (python/sglang/srt/entrypoints/engine.py,
managers/tokenizer_control_mixin.py, managers/scheduler_components/weight_updater.py,
arg_groups/fields/, managers/schedule_batch.py, models/llama.py). Not yet run against a real
SGLang: this task had no GPU machine (`make gpu-smoke` is the check).
- `sglang.Engine(**server_args)`, ServerArgs fields used: model_path, skip_tokenizer_init,
  enable_memory_saver, load_format ("dummy": random weights, replaced by the first push),
  dtype, mem_fraction_static, tp_size, base_gpu_id, random_seed, port, log_level,
  custom_sigquit_handler (unknown names raise TypeError: ServerArgs is a msgspec Struct).
- `await Engine.async_generate(input_ids=list[int], sampling_params=dict,
  return_logprob=bool)` (engine.py:523; stream False: the first item of
  `tokenizer_manager.generate_request`, awaited on the engine's `loop`, where the tokenizer
  manager's handle loop runs) -> one dict: "output_ids" (list[int], a matched stop token
  included) and "meta_info": {"output_token_logprobs": [(logprob, token_id, text|None)],
  "finish_reason": {"type": "stop" | "length" | "abort", ...}}; an abort's "message" says
  why. Many such calls awaited together are batched by SGLang's scheduler (continuous
  batching), and its radix cache reuses any cached prefix of `input_ids` (earlier turns).
- `begin_weight_update(selector="all")`, `end_weight_update()`,
  `update_weights_from_tensor(named_tensors, load_format=None, flush_cache=True)`: each
  returns `(success: bool, message: str)`; `flush_cache()` returns an object with `success`
  and `message`; `get_weights_by_name(name, truncate_size=100)` returns the parameter's first
  `truncate_size` rows as nested float lists, or None (a model class without it: Qwen2).
- `release_memory_occupation(tags)`, `resume_memory_occupation(tags)` (tags "weights",
  "kv_cache"; return None) and the tokenizer manager's `auto_create_handle_loop()`,
  `event_loop`, `_subprocess_watchdog` (process.py).
- `mem_fraction_static = f`: SGLang keeps (1 - f) of the GPU memory that is free when the
  engine starts as headroom (model_runner_components/kv_pool_runtime.py:65-67) and fills the
  rest with its weights and KV cache: a fraction of the free memory at start, after the
  trainer's models are on the GPU and before their optimizer state exists, not of the GPU.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch

from flowrl import compat
from flowrl.backends import ROLLOUT_BACKENDS, SGLangOptions
from flowrl.engines.rollout import Request, Result, RolloutBase
from flowrl.engines.served_weights import rollout_weights, weight_buckets
from flowrl.engines.sglang.io import (
    free_port,
    request_result,
    sampling_params,
    verify_names,
    write_model_dir,
)
from flowrl.engines.sglang.process import EngineGuard

DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}  # SGLang's kernels
VERIFY_ROWS = 4  # rows of each checked parameter read back in verify mode


class PushRefused(RuntimeError):
    """SGLang refused a weight push, or serves other weights than the ones pushed."""


def sglang_engine(**server_args):
    """The real engine, `sglang.Engine(**server_args)`; sglang is imported here, on first use."""
    try:
        import sglang
    except ImportError as e:
        raise ImportError(
            f'rollout = "sglang" needs SGLang: {ROLLOUT_BACKENDS["sglang"].install}'
        ) from e
    return sglang.Engine(**server_args)


class SGLangRollout(RolloutBase):
    """Generates with an SGLang engine; implements `flowrl.engines.rollout.RolloutBackend`, and
    holds the `weights` and `kv_cache` parts itself (`parts`): `offload` / `reload` act on
    those of the moving parts.

    Args:
        module: the train engine's module (its parameters are what SGLang serves), 16-bit.
        tokenizer: the model's tokenizer (eos and pad ids; the generate node decodes with it).
        device: "cuda:<k>": the engine runs on GPU k.
        options: `flowrl.backends.SGLangOptions` (`[models.<m>.rollout_options]`):
            mem_fraction_static (of the GPU memory free at its start), verify (read a few
            parameters back after each push and compare them with the module's), bucket_mb.
        seed: SGLang's random seed (the pool worker passes one from `run.seed` and the rank).
        where: "pool <p>, rank <r>, model <m>", for error messages.
        engine_factory: builds the engine from server args; default the real `sglang.Engine`
            (tests pass a fake that behaves as the pinned SGLang does).
    """

    parts = ("weights", "kv_cache")
    Options = SGLangOptions  # its record in flowrl/backends.py says where it runs and what

    def __init__(
        self,
        module: torch.nn.Module,
        tokenizer,
        device: str = "cuda",
        *,
        options: SGLangOptions | None = None,
        seed: int = 0,
        where: str = "",
        engine_factory: Callable | None = None,
    ):
        super().__init__(module, tokenizer, device, options=options, seed=seed, where=where)
        self.eos = tokenizer.eos_token_id
        self.bucket_bytes = int(self.options.bucket_mb * 1024**2)
        self.verify = self.options.verify
        if os.environ.get("FLOWRL_SGLANG_VERIFY") == "1":
            compat.warn("FLOWRL_SGLANG_VERIFY=1", "[models.<m>.rollout_options] verify = true")
            self.verify = True
        self.released: set[str] = set()  # memory tags released and not yet resumed
        dtype = _served_dtype(module, self.where)
        self.guard = EngineGuard(self.where)
        self.model_dir = Path(tempfile.mkdtemp(prefix="flowrl-sglang-"))
        # removed by shutdown, or when this object goes or the process exits
        self._remove_dir = weakref.finalize(self, shutil.rmtree, self.model_dir, True)
        write_model_dir(module, tokenizer, self.model_dir)
        try:
            factory = engine_factory or sglang_engine
            self.engine = self._start(factory, dtype, self.options.mem_fraction_static, seed)
        except BaseException:
            self._remove_dir()
            raise
        try:
            self._push()
        except BaseException:
            self.shutdown()
            raise

    @property
    def loop(self):
        """The engine's event loop: SGLang's tokenizer manager answers requests on it, so the
        rollout's requests run there (`run`), as verl's rollout does."""
        return self.engine.loop

    def run(self, coroutine):
        """Run a coroutine of requests to this engine on its loop, to its end (the batch
        helper and the agent node call this)."""
        self._ready()
        with self._calling():
            return self.loop.run_until_complete(coroutine)

    async def generate(self, request: Request) -> Result:
        """One turn (see `RolloutBackend.generate`): `async_generate` with the whole
        conversation's ids; SGLang's radix cache finds the prefix an earlier turn (or another
        sample of the prompt) computed, so only the new tokens are prefilled. SGLang samples
        with its own random state: the request's seed and turn are not used, and a run is not
        reproducible sample for sample. Log-probs are SGLang's (after temperature, before
        top-k / top-p; greedy: the model's at temperature 1). An aborted request comes back
        with finish reason "abort"."""
        if request.max_new_tokens <= 0:
            return Result([], [], "length")
        if request.forced:
            raise ValueError(
                f"{self.where}: forced first-turn ids (the agent node's script_first_turn) "
                'need rollout = "hf"; SGLang samples every token itself'
            )
        if self.guard.find_dead():
            raise self.guard.error()
        s = request.sampling
        params = sampling_params(
            request.max_new_tokens, s.temperature, s.top_p, s.top_k, s.do_sample, self.eos
        )
        out = await self.engine.async_generate(
            input_ids=list(request.ids), sampling_params=params, return_logprob=request.logprobs
        )
        return request_result(out, self.eos, request.logprobs, self.where)

    def release(self, request_id: str) -> None:
        """Nothing is held by id: SGLang's radix cache keeps finished prefixes by content and
        evicts them (least recently used) when it needs the room."""

    def offload(self, parts: tuple[str, ...]) -> None:
        """Release the memory of `parts` ("weights", "kv_cache") still held on the GPU."""
        tags = [p for p in self.parts if p in parts and p not in self.released]
        if tags:
            with self._calling():
                self.engine.release_memory_occupation(tags=tags)  # returns None (0.5.21)
            self.released.update(tags)

    def reload(self, parts: tuple[str, ...]) -> None:
        """Before a generate (the kv_cache part is reloaded): resume what was released, pushing
        the weights again. The weights part alone comes back with the next KV cache."""
        if "kv_cache" in parts:
            self._ready()

    def sync_weights(self, source: torch.nn.Module) -> None:
        """Take the trained weights of `source`: pushed now if SGLang holds its weights, else
        when they are resumed (a resume pushes them anyway)."""
        self.module, self.weights_version = source, self.weights_version + 1
        if "weights" not in self.released:
            self._push()

    def shutdown(self) -> None:
        """Stop the engine's own processes (not `Engine.shutdown()`, which kills every child
        of the process, flowrl's scorers included) and remove its model directory."""
        self.guard.stop(self.engine)
        self._remove_dir()

    def _start(self, factory: Callable, dtype: str, mem_fraction: float, seed: int):
        """The engine on this rank's GPU, with dummy weights (the module's are pushed next)."""
        engine = factory(
            model_path=str(self.model_dir),
            skip_tokenizer_init=True,  # token ids in and out
            enable_memory_saver=True,  # release / resume by tag
            load_format="dummy",  # the weights come from the module, pushed next
            dtype=dtype,
            mem_fraction_static=mem_fraction,
            tp_size=1,
            base_gpu_id=self.device.index or 0,
            random_seed=seed,
            port=free_port(),  # ranks sharing a machine each get their own
            log_level="error",
            **self.guard.server_args(),  # flowrl's SIGQUIT handler
        )
        self.guard.started(engine)
        return engine

    @contextmanager
    def _calling(self):
        """Around every engine call: a dead engine raises at once, and a child dying during
        the call raises inside it (process.on_sigquit)."""
        if self.guard.find_dead():
            raise self.guard.error()
        self.guard.busy = True
        try:
            yield
        finally:
            self.guard.busy = False

    def _ready(self) -> None:
        """Resume released memory: the weights first, then push them (a release dropped their
        values) and flush, then the KV cache."""
        if "weights" in self.released:
            with self._calling():
                self.engine.resume_memory_occupation(tags=["weights"])
            self.released.discard("weights")
            self._push()
        if "kv_cache" in self.released:
            with self._calling():
                self.engine.resume_memory_occupation(tags=["kv_cache"])
            self.released.discard("kv_cache")

    def _push(self) -> None:
        """The module's weights into SGLang in one weight-update session, bucket by bucket,
        then a prefix-cache flush, every answer checked; in verify mode, a read-back."""
        session = hasattr(self.engine, "begin_weight_update")  # SGLang >= 0.5.21
        wanted, checked = verify_names(self.module) if self.verify else (), []
        with torch.no_grad():
            if session:
                self._check("begin_weight_update", self._call("begin_weight_update"))
            try:
                for bucket in weight_buckets(rollout_weights(self.module), self.bucket_bytes):
                    answer = self._call(
                        "update_weights_from_tensor", named_tensors=bucket, flush_cache=False
                    )
                    self._check("update_weights_from_tensor", answer, bucket)
                    checked += [(n, t[:VERIFY_ROWS].clone()) for n, t in bucket if n in wanted]
            except BaseException:
                if session:  # close the session; the first error is the one to report
                    try:
                        self._call("end_weight_update")
                    except Exception:
                        pass
                raise
            if session:
                self._check("end_weight_update", self._call("end_weight_update"))
        flushed = self._call("flush_cache")
        if not getattr(flushed, "success", True):
            self._refused("flush_cache", getattr(flushed, "message", repr(flushed)))
        if self.verify:
            self._verify(checked)

    def _call(self, method: str, **kwargs):
        with self._calling():
            return getattr(self.engine, method)(**kwargs)

    def _check(self, method: str, answer, bucket=()) -> None:
        """SGLang answers (success, message): a refusal raises."""
        if not isinstance(answer, tuple | list) or len(answer) < 2:
            self._refused(method, f"an answer that is not (success, message): {answer!r}")
        if not answer[0]:
            names = [name for name, _ in bucket]
            what = f" (a bucket of {len(names)}: {', '.join(names[:3])}...)" if names else ""
            self._refused(method, f"{answer[1]}{what}")

    def _refused(self, method: str, message: str):
        raise PushRefused(
            f"SGLang refused {method} on {self.where}: {message}. Its weights are not the "
            "trainer's, so every rollout would come from other weights: stopping"
        )

    def _verify(self, checked: list[tuple[str, torch.Tensor]]) -> None:
        """Read the checked parameters back from SGLang: their first rows must be exactly the
        pushed ones (SGLang returns them as float32 lists)."""
        for name, tensor in checked:
            served = self._call("get_weights_by_name", name=name, truncate_size=VERIFY_ROWS)
            if served is None:
                self._refused(
                    "get_weights_by_name",
                    f"nothing read back for {name} (verify needs a model class with "
                    "get_weights_by_name: Llama has it, Qwen2 not in 0.5.21)",
                )
            got, want = torch.tensor(served, dtype=torch.float32), tensor[:VERIFY_ROWS].float()
            if got.shape != want.shape or not torch.equal(got, want.cpu()):
                self._refused(
                    "the pushed weights",
                    f"verify read back {name} and it differs from the trainer's "
                    f"(first values {got.flatten()[:3].tolist()} vs "
                    f"{want.flatten()[:3].tolist()})",
                )


def _served_dtype(module: torch.nn.Module, where: str) -> str:
    dtype = next(module.parameters()).dtype
    if dtype not in DTYPE_NAMES:
        raise ValueError(
            f"{where}: SGLang serves 16-bit weights (its attention kernels are bf16/fp16), but "
            f'the model is {dtype}: set dtype = "bfloat16" in the model\'s table'
        )
    return DTYPE_NAMES[dtype]
