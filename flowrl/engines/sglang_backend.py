"""The `sglang` rollout backend: an in-process SGLang engine on the rank's GPU.

Chosen per model with `rollout = "sglang"` in `[models.<m>]`; this module loads only then, and
imports sglang only when the engine is built (`pip install -e ".[sglang]"`). The engine runs
token ids in, token ids out (tokenizer init skipped) with the memory saver on, so the plan's
offload / reload of the model's `weights` and `kv_cache` parts release and resume SGLang's
memory regions of the same names. It keeps its own copy of the weights: it starts with dummy
weights and receives the train engine's module's parameters (no second copy on this side: the
tensors are handed over as they are, in buckets), after every update and after every resume of
its weights, whose values a release drops. Each push ends with a prefix-cache flush, so no
cached prefix computed with old weights is reused.

When what happens (the order tests/unit/test_sglang_backend.py checks around a plan's steps):
- build: engine up, weights pushed, cache flushed;
- offload(parts): release_memory_occupation(tags) of the parts still held;
- reload(parts) with the kv_cache part (before a generate): resume "weights" if released, push
  the weights, flush, then resume "kv_cache" (verl's order: the KV cache comes back after the
  push, so weights and trainer copy are the peak, not weights and KV cache). The weights part
  alone (before an update or a log-prob pass) resumes nothing: those calls use the train
  engine's module, and SGLang's copy stays off the device until the next generate needs it;
- sync_weights(module): push and flush now if the weights are held, else at the next resume.

Differences from `hf` (docs/scaling.md): sampling is SGLang's, so `generator` is not used and
a run is not reproducible sample for sample; log-probs are SGLang's (after temperature, before
top-k / top-p; greedy: the model's at temperature 1), which differ slightly from the trainer's:
truncated importance sampling (update.policy's tis_cap) corrects for that.

SGLang API relied on, read in sgl-project/sglang's main branch at commit
001067fffe33427bee0ed2f007fb7551a1d76b44 (python/sglang/srt/entrypoints/engine.py,
server_args.py, sampling/sampling_params.py, constants.py, managers/schedule_batch.py; the
newest release on PyPI is 0.5.23, pyproject asks for >= 0.5); verl v0.6.1's in-process rollout
(sglang_rollout.py) calls the same names. Nothing here has run against a real SGLang: this
task had no GPU machine.
- `sglang.Engine(**server_args)`, ServerArgs fields used: model_path, skip_tokenizer_init,
  enable_memory_saver, load_format ("dummy": random weights, replaced by the first push),
  dtype, mem_fraction_static, tp_size, base_gpu_id, random_seed, port, log_level.
- `Engine.generate(input_ids=list[list[int]], sampling_params=dict, return_logprob=bool)` ->
  one dict per request: "output_ids" (list[int], every sampled token, a matched stop token
  included: schedule_batch.py's Req finish check keeps it) and "meta_info":
  {"output_token_logprobs": [(logprob, token_id, text|None)], "finish_reason": {"type":
  "stop" | "length", ...}}. Sampling params: max_new_tokens, temperature (0 = greedy:
  SGLang sets top_k = 1), top_p, top_k (-1 = off), stop_token_ids.
- `Engine.update_weights_from_tensor(named_tensors: list[tuple[str, Tensor]],
  load_format: str | None = None, flush_cache: bool = True)`; names are the HF checkpoint's.
- `Engine.flush_cache()`, `Engine.release_memory_occupation(tags: list[str] | None)`,
  `Engine.resume_memory_occupation(tags: list[str] | None)` with tags "weights", "kv_cache"
  (GPU_MEMORY_TYPE_WEIGHTS / _KV_CACHE; "cuda_graph" is left in place), `Engine.shutdown()`.
"""

from __future__ import annotations

import copy
import shutil
import socket
import tempfile
import weakref
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch

from flowrl.backends import ROLLOUT_BACKENDS

BUCKET_BYTES = 512 * 1024**2  # weights pushed per update_weights_from_tensor call
MEM_FRACTION = 0.5  # of the GPU for SGLang's weights and KV cache; the trainer shares the rest
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def sglang_engine(**server_args):
    """The real engine, `sglang.Engine(**server_args)`; sglang is imported here, on first use."""
    try:
        import sglang
    except ImportError as e:
        raise ImportError(
            f'rollout = "sglang" needs SGLang: {ROLLOUT_BACKENDS["sglang"].install}'
        ) from e
    return sglang.Engine(**server_args)


class SGLangRollout:
    """Generates with an SGLang engine; implements `flowrl.engines.rollout.RolloutBackend`, and
    holds the `weights` and `kv_cache` parts itself (`parts`): `offload` / `reload` act on
    those of the moving parts.

    Args:
        module: the train engine's module (its parameters are what SGLang serves).
        tokenizer: the model's tokenizer (eos and pad ids; the generate node decodes with it).
        device: "cuda:<k>": the engine runs on GPU k.
        engine_factory: builds the engine from server args; default the real `sglang.Engine`
            (tests pass a fake that records calls).
        seed: SGLang's random seed.
    """

    parts = ("weights", "kv_cache")

    def __init__(
        self,
        module: torch.nn.Module,
        tokenizer,
        device: str = "cuda",
        *,
        engine_factory: Callable | None = None,
        seed: int = 0,
        mem_fraction: float = MEM_FRACTION,
        bucket_bytes: int = BUCKET_BYTES,
    ):
        self.module, self.tokenizer, self.device = module, tokenizer, torch.device(device)
        self.eos = tokenizer.eos_token_id
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos
        self.bucket_bytes = bucket_bytes
        self.released: set[str] = set()  # memory tags released and not yet resumed
        self.model_dir = Path(tempfile.mkdtemp(prefix="flowrl-sglang-"))
        # removed by shutdown, or when this object goes or the process exits
        self._remove_dir = weakref.finalize(self, shutil.rmtree, self.model_dir, True)
        write_model_dir(module, tokenizer, self.model_dir)
        factory = engine_factory or sglang_engine
        try:
            self.engine = self._start(factory, mem_fraction, seed)
        except BaseException:
            self._remove_dir()
            raise
        self._push()

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
    ) -> dict:
        """Sample n responses per prompt (see `RolloutBackend.generate`): each prompt's real
        tokens (its left padding stripped) are sent n times, so its samples come back next to
        each other and SGLang's prefix cache prefills the prompt once. `generator` is not used
        (SGLang samples on its own). With `logprobs`, also "logprobs": (b*n, t) float32, the
        sampled tokens' log-probs as SGLang reports them, 0 past each response."""
        rows = prompts.shape[0] * n
        if rows == 0 or max_new_tokens <= 0:
            return empty_responses(rows, logprobs)
        self._ready()
        requests = [ids for ids in prompt_ids(prompts, prompt_mask) for _ in range(n)]
        params = sampling_params(max_new_tokens, temperature, top_p, top_k, do_sample, self.eos)
        outputs = self.engine.generate(
            input_ids=requests, sampling_params=params, return_logprob=logprobs
        )
        return response_tensors(outputs, self.eos, self.pad, logprobs)

    def offload(self, parts: tuple[str, ...]) -> None:
        """Release the memory of `parts` ("weights", "kv_cache") still held on the GPU."""
        tags = [p for p in self.parts if p in parts and p not in self.released]
        if tags:
            self.engine.release_memory_occupation(tags=tags)
            self.released.update(tags)

    def reload(self, parts: tuple[str, ...]) -> None:
        """Before a generate (the kv_cache part is reloaded): resume what was released, pushing
        the weights again. The weights part alone comes back with the next KV cache."""
        if "kv_cache" in parts:
            self._ready()

    def sync_weights(self, source: torch.nn.Module) -> None:
        """Take the trained weights of `source`: pushed now if SGLang holds its weights, else
        when they are resumed (a resume pushes them anyway)."""
        self.module = source
        if "weights" not in self.released:
            self._push()

    def shutdown(self) -> None:
        """Stop the engine's processes and remove the model directory written for it."""
        self.engine.shutdown()
        self._remove_dir()

    def _start(self, factory: Callable, mem_fraction: float, seed: int):
        """The engine on this rank's GPU, with dummy weights (the module's are pushed next)."""
        return factory(
            model_path=str(self.model_dir),
            skip_tokenizer_init=True,  # token ids in and out
            enable_memory_saver=True,  # release / resume by tag
            load_format="dummy",  # the weights come from the module, pushed next
            dtype=DTYPE_NAMES[next(self.module.parameters()).dtype],
            mem_fraction_static=mem_fraction,
            tp_size=1,
            base_gpu_id=self.device.index or 0,
            random_seed=seed,
            port=_free_port(),  # ranks sharing a machine each get their own
            log_level="error",
        )

    def _ready(self) -> None:
        """Resume released memory: the weights first, then push them (a release dropped their
        values) and flush, then the KV cache."""
        if "weights" in self.released:
            self.engine.resume_memory_occupation(tags=["weights"])
            self.released.discard("weights")
            self._push()
        if "kv_cache" in self.released:
            self.engine.resume_memory_occupation(tags=["kv_cache"])
            self.released.discard("kv_cache")

    def _push(self) -> None:
        """The module's parameters into SGLang, bucket by bucket, then a prefix-cache flush."""
        with torch.no_grad():
            for bucket in weight_buckets(self.module.named_parameters(), self.bucket_bytes):
                self.engine.update_weights_from_tensor(named_tensors=bucket, flush_cache=False)
        self.engine.flush_cache()


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


def prompt_ids(prompts: torch.Tensor, prompt_mask: torch.Tensor) -> list[list[int]]:
    """(b, p) ids and mask -> each row's real tokens as a list (its padding removed)."""
    rows = zip(prompts.cpu(), prompt_mask.cpu(), strict=True)
    return [row[mask.bool()].tolist() for row, mask in rows]


def sampling_params(max_new_tokens, temperature, top_p, top_k, do_sample, eos) -> dict:
    """flowrl's sampling settings in SGLang's terms: greedy is temperature 0; top_k 0 (off) is
    -1; EOS is a stop token whatever the model config says, as in the `hf` backend."""
    greedy = not do_sample or temperature == 0
    return {
        "max_new_tokens": max_new_tokens,
        "temperature": 0.0 if greedy else float(temperature),
        "top_p": 1.0 if greedy else float(top_p),
        "top_k": top_k if top_k > 0 and not greedy else -1,
        "stop_token_ids": [eos],
    }


def response_tensors(outputs: list[dict], eos: int, pad: int, logprobs: bool) -> dict:
    """SGLang's per-request outputs -> {"responses": (r, t) int64 right-padded with `pad`,
    "response_mask": (r, t) int64, 1 up to and including the first EOS} (+ "logprobs" (r, t)
    float32, 0 past each response), t the longest response."""
    ids, values = [], []
    for out in outputs:
        tokens = [int(x) for x in out["output_ids"]]
        if logprobs:
            reported = out["meta_info"]["output_token_logprobs"]  # [(logprob, id, text)]
            if len(reported) != len(tokens):
                raise RuntimeError(
                    f"SGLang returned {len(tokens)} tokens but {len(reported)} log-probs"
                )
            values.append([float(entry[0]) for entry in reported])
        if eos in tokens:  # nothing after the first EOS is part of the response
            tokens = tokens[: tokens.index(eos) + 1]
        ids.append(tokens)
    t = max((len(x) for x in ids), default=0)
    responses = torch.full((len(ids), t), pad, dtype=torch.long)
    mask = torch.zeros(len(ids), t, dtype=torch.long)
    chosen = torch.zeros(len(ids), t, dtype=torch.float32)
    for row, tokens in enumerate(ids):
        responses[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        mask[row, : len(tokens)] = 1
        if logprobs:
            chosen[row, : len(tokens)] = torch.tensor(values[row][: len(tokens)])
    out = {"responses": responses, "response_mask": mask}
    return {**out, "logprobs": chosen} if logprobs else out


def empty_responses(rows: int, logprobs: bool) -> dict:
    empty = torch.zeros(rows, 0, dtype=torch.long)
    out = {"responses": empty, "response_mask": empty.clone()}
    return {**out, "logprobs": torch.zeros(rows, 0)} if logprobs else out


def write_model_dir(module: torch.nn.Module, tokenizer, path: Path) -> None:
    """What SGLang loads with dummy weights: the module's config.json (its architecture named,
    EOS the tokenizer's) and the tokenizer files."""
    config = copy.deepcopy(module.config)
    config.architectures = config.architectures or [type(module).__name__]
    config.eos_token_id = tokenizer.eos_token_id
    config.to_json_file(str(path / "config.json"))
    tokenizer.save_pretrained(str(path))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
