"""A stand-in for `sglang.Engine` at the pinned version (0.5.21) that does what it does where the
backend can go wrong, read in the 0.5.21 wheel:
- server arguments: only ServerArgs' field names (a msgspec Struct: others raise TypeError);
- weights: dummy (random) at start; `update_weights_from_tensor` outside a
  `begin_weight_update()` / `end_weight_update()` session is refused, and every weight call
  answers `(success, message)` and never raises (managers/scheduler_components/
  weight_updater.py:217-300); a name the model does not have is skipped with a warning
  (models/llama.py:739); pushed values are copied into its own dtype; `get_weights_by_name`
  returns the first rows as float lists, None for an unknown name; `flush_cache` answers an
  object with `success`; a released "weights" region comes back with other values;
  resuming a tag that is not released is a KeyError in the scheduler;
- generate: `finish_reason` per request ("stop", "length", or "abort" for requests listed in
  `abort`, cut short as SGLang returns them); `async_generate` (0.5.21's signature): one
  request per call, answered only on the loop the tokenizer manager's handle loop runs on
  (the engine's `loop`); the k-th request (from 0) is aborted when k is in `abort`;
- processes: it starts a child (its "scheduler") and, in the main thread, installs a SIGQUIT
  handler that kills the whole process tree (or `custom_sigquit_handler`, engine.py:1863-1881);
  its first request adds asyncio SIGTERM / SIGQUIT handlers (tokenizer_manager.py:2316-2324);
  when its child is dead, a call sends SIGQUIT to the process as SGLang's subprocess watchdog
  does (done inside the call, not from a thread every second: the tests do not depend on
  timing) and then waits, as a real call waits forever on a dead scheduler; with `failing`
  set, its live scheduler sends SIGQUIT as one that hit an exception does (scheduler.py:6093);
  `shutdown()` kills every child of the process (engine.py:1406).
`calls` records every call as (method, details).
"""

import asyncio
import logging
import os
import signal
import subprocess
import sys
import threading
import weakref
from pathlib import Path

import psutil
import torch

# the ServerArgs fields flowrl passes, each present in 0.5.21's arg_groups/fields/*.py
SERVER_ARGS = {
    "model_path", "skip_tokenizer_init", "enable_memory_saver", "load_format", "dtype",
    "mem_fraction_static", "tp_size", "base_gpu_id", "random_seed", "port", "log_level",
    "custom_sigquit_handler",
}  # fmt: skip
OUTSIDE = (
    "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()"
)
log = logging.getLogger("sglang.srt.models.llama")


def kill_process_tree(pid: int, include_parent: bool = True) -> None:
    """SGLang's utils.kill_process_tree: SIGKILL every descendant of pid, then pid itself."""
    parent = psutil.Process(pid)
    children = parent.children(recursive=True)
    for child in children:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(children, timeout=60)
    if include_parent:
        parent.kill()


class FlushOutput:
    def __init__(self, success: bool, message: str = ""):
        self.success, self.message = success, message


class TokenizerManager:
    """The parts of SGLang's TokenizerManager the backend touches. Its handle loop runs on
    the loop current where it is first needed (`get_or_create_event_loop`): the engine's."""

    def __init__(self, loop):
        self.event_loop, self.gracefully_exit = None, False
        self._subprocess_watchdog = Watchdog()
        self._loop = loop

    def auto_create_handle_loop(self):
        if self.event_loop is not None:
            return
        loop = self._loop
        if threading.current_thread() is threading.main_thread():
            loop.add_signal_handler(signal.SIGTERM, self._sigterm)
            loop.add_signal_handler(signal.SIGQUIT, lambda: kill_process_tree(os.getpid()))
        self.event_loop = loop

    def _sigterm(self):
        self.gracefully_exit = True


class Watchdog:
    def __init__(self):
        self.stopped = False

    def stop(self):
        self.stopped = True


class FakeEngine:
    def __init__(self, **server_args):
        unknown = sorted(set(server_args) - SERVER_ARGS)
        if unknown:
            raise TypeError(f"Unexpected keyword argument '{unknown[0]}'")
        self.server_args, self.calls, self.queued, self.pushed = server_args, [], [], []
        self.abort, self.skipped, self.refuse, self.failing = set(), [], "", False
        self.async_requests, self.batches, self._waiting, self.arrivals = [], [], 0, 0
        self.session, self.released = False, set()
        self.dtype = getattr(torch, server_args.get("dtype", "bfloat16"))
        shapes = _shapes(server_args["model_path"])
        self.weights = {name: torch.randn(shape).to(self.dtype) for name, shape in shapes.items()}
        # Engine._ensure_event_loop (engine.py:1326): the thread's loop, or a new one
        self.loop = asyncio.new_event_loop()
        self.tokenizer_manager = TokenizerManager(self.loop)
        if threading.current_thread() is threading.main_thread():
            handler = server_args.get("custom_sigquit_handler")
            signal.signal(signal.SIGQUIT, handler or (lambda s, f: kill_process_tree(os.getpid())))
        code = "import time; time.sleep(3600)"
        self.scheduler = subprocess.Popen([sys.executable, "-S", "-c", code])
        weakref.finalize(self, _end, self.scheduler)  # at the latest when the test process ends

    # -- requests (each runs through the tokenizer manager's loop, as SGLang's do) ------------
    def _request(self, name, details=None):
        self.calls.append((name, details))
        self.tokenizer_manager.auto_create_handle_loop()
        # a dead scheduler (the watchdog's SIGQUIT) or one that hit an exception (its own
        # SIGQUIT from its except block, still alive); then SGLang waits for the answer
        if self.scheduler.poll() is not None or self.failing:
            os.kill(os.getpid(), signal.SIGQUIT)
            self.tokenizer_manager.event_loop.run_until_complete(asyncio.sleep(2))
            raise AssertionError("a real engine would wait forever for its dead scheduler")

    def generate(self, input_ids, sampling_params, return_logprob=False):
        self._request("generate", len(input_ids))
        assert not self.released, f"generate with {sorted(self.released)} released"
        self.requests, self.sampling = input_ids, sampling_params
        outputs = self.queued.pop(0) if self.queued else _made_up(input_ids, sampling_params)
        for i in self.abort:  # cut short, as SGLang returns an aborted request
            outputs[i]["output_ids"] = outputs[i]["output_ids"][:1]
            outputs[i]["meta_info"]["output_token_logprobs"] = outputs[i]["meta_info"][
                "output_token_logprobs"
            ][:1]
            outputs[i]["meta_info"]["finish_reason"] = {"type": "abort", "message": "Aborted"}
        return outputs

    async def async_generate(
        self,
        prompt=None,
        sampling_params=None,
        input_ids=None,
        image_data=None,
        audio_data=None,
        video_data=None,
        mm_hashes=None,
        mm_content_hashes=None,
        return_logprob=False,
        logprob_start_len=None,
        top_logprobs_num=None,
        token_ids_logprob=None,
        lora_path=None,
        custom_logit_processor=None,
        require_reasoning=False,
        return_hidden_states=False,
        return_routed_experts=False,
        routed_experts_start_len=0,
        stream=False,
        bootstrap_host=None,
        bootstrap_port=None,
        bootstrap_room=None,
        routed_dp_rank=None,
        disagg_prefill_dp_rank=None,
        kv_hints=None,
        data_parallel_rank=None,
        external_trace_header=None,
        rid=None,
        session_params=None,
        priority=None,
        session_id=None,
        *,
        cache_salt=None,
    ):
        """0.5.21's signature (entrypoints/engine.py:523). One request (input_ids a list of
        ints) -> one output dict; a batch (a list of lists) -> a list of them. The answer comes
        from the tokenizer manager's handle loop: awaited on another event loop, a real engine
        never answers (here: an AssertionError). Requests awaited together are batched:
        `batches` records the size of each group that was waiting together."""
        assert not stream, "flowrl reads whole answers"
        self.calls.append(("async_generate", len(input_ids)))
        self.tokenizer_manager.auto_create_handle_loop()
        if asyncio.get_running_loop() is not self.tokenizer_manager.event_loop:
            raise AssertionError("awaited on a loop other than the tokenizer manager's: hangs")
        if self.scheduler.poll() is not None or self.failing:
            os.kill(os.getpid(), signal.SIGQUIT)
            await asyncio.sleep(2)
            raise AssertionError("a real engine would wait forever for its dead scheduler")
        assert not self.released, f"generate with {sorted(self.released)} released"
        single = not input_ids or not isinstance(input_ids[0], list)
        batch = [input_ids] if single else input_ids
        self.async_requests.append((batch, sampling_params, return_logprob))
        self._waiting += 1
        await asyncio.sleep(0)  # the scheduler takes every request waiting at its step
        if self._waiting:
            self.batches.append(self._waiting)
            self._waiting = 0
        outputs = _made_up(batch, sampling_params)
        if self.queued:  # scripted answers, one per request in the order they came
            outputs = [self.queued[0].pop(0) for _ in batch]
            self.queued = [q for q in self.queued if q]
        for out in outputs:
            self.arrivals += 1
            if self.arrivals - 1 in self.abort:
                out["output_ids"] = out["output_ids"][:1]
                meta = out["meta_info"]
                meta["output_token_logprobs"] = meta["output_token_logprobs"][:1]
                meta["finish_reason"] = {"type": "abort", "message": "Aborted"}
            if not return_logprob:
                del out["meta_info"]["output_token_logprobs"]
        return outputs[0] if single else outputs

    def begin_weight_update(self, selector="all"):
        self._request("begin", None)
        if self.session:
            return False, "a weight-update session is already open; call end_weight_update() first"
        self.session = True
        return True, "Success"

    def end_weight_update(self):
        self._request("end", None)
        if not self.session:
            return False, "no weight-update session is open; call begin_weight_update() first"
        self.session = False
        return True, "Success"

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        self._request("update", tuple(name for name, _ in named_tensors))
        assert not flush_cache  # one flush after the last bucket
        if not self.session:
            return False, OUTSIDE
        if self.refuse:
            return False, self.refuse
        self.pushed.append(list(named_tensors))
        for name, tensor in named_tensors:
            if name not in self.weights:
                log.warning(f"Parameter {name} not found in params_dict")
                self.skipped.append(name)
                continue
            self.weights[name] = tensor.detach().to("cpu", self.dtype, copy=True)
        return True, "Success"

    def get_weights_by_name(self, name, truncate_size=100):
        self._request("get_weights", name)
        if name not in self.weights:
            return None
        return self.weights[name].to(torch.float32).numpy().tolist()[:truncate_size]

    def flush_cache(self):
        self._request("flush", None)
        return FlushOutput(True)

    def release_memory_occupation(self, tags=None):
        self._request("release", tuple(tags))
        self.released.update(tags)

    def resume_memory_occupation(self, tags=None):
        self._request("resume", tuple(tags))
        for tag in tags:
            self.released.remove(tag)  # KeyError for a tag not released, as in the scheduler
            if tag == "weights":  # the memory saver restores the buffers, not their values
                self.weights = {n: torch.full_like(w, 7.0) for n, w in self.weights.items()}

    def shutdown(self):
        self.calls.append(("shutdown", None))
        kill_process_tree(os.getpid(), include_parent=False)


def _end(process) -> None:
    process.kill()
    process.wait()


def _shapes(model_path: str) -> dict:
    """The parameter names and shapes of the model config.json describes (what SGLang's
    model class loads), built on the meta device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(Path(model_path))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def _made_up(input_ids, sampling_params) -> list[dict]:
    """1..max tokens below the vocabulary's end per request, log-probs -0.1, -0.2, ..."""
    outputs = []
    for i, ids in enumerate(input_ids):
        length = 1 + (sum(ids) + i) % sampling_params["max_new_tokens"]
        tokens = [10 + (sum(ids) + i + k) % 50 for k in range(length)]
        logprobs = [(-0.1 * (k + 1), token, None) for k, token in enumerate(tokens)]
        finish = {"type": "length", "length": length}
        meta = {"output_token_logprobs": logprobs, "finish_reason": finish}
        outputs.append({"output_ids": tokens, "meta_info": meta})
    return outputs
