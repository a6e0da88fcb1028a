"""The base of a rollout backend whose server holds its own copy of the weights (vLLM, SGLang
or any OpenAI-compatible server started apart from flowrl): the public way such a backend gets
the trained weights, and its teardown.

    class MyServer(ServerRollout):
        weights_as = "directory"             # or "buckets"
        def load_weights(self, directory):   # a folder of safetensors + config.json
            post(f"{url}/update_weights_from_disk", {"model_path": str(directory)})
        async def generate(self, request): ...

`sync_weights(module)` is called before the first generate (when the pool builds the backend:
`own_weights = True`) and after every update of the model; `ServerRollout` turns the module
into what the server loads: with `weights_as = "directory"` a fresh folder of safetensors
(the base model's names, a LoRA adapter folded in, as `flowrl export` writes them, plus the
model's config.json) passed to `load_weights(directory)`, the previous folder deleted once the
next is loaded; with `"buckets"` groups of (name, tensor) of at most `bucket_mb` MB passed to
`load_weight_buckets(buckets)` (for a server that takes tensors over a call: SGLang's
`update_weights_from_tensor`). `close()` is called once when the pool shuts down (also after a
failed run): it deletes the folders; a subclass that started something stops it there too
and calls `super().close()`.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from flowrl.engines.rollout import RolloutBase
from flowrl.engines.served_weights import rollout_weights, weight_buckets

WEIGHTS_AS = ("directory", "buckets")


class ServerRollout(RolloutBase):
    """A rollout backend over a server with its own weights: write `generate` and
    `load_weights` (or `load_weight_buckets`); `sync_weights` and `close` are done here."""

    own_weights = True  # the pool syncs once before the first generate
    weights_as = "directory"  # "directory": load_weights(folder); "buckets": load_weight_buckets
    bucket_mb = 512.0  # the most MB of one bucket, with weights_as = "buckets"

    def __init__(self, module, tokenizer, device="cpu", *, options=None, seed=0, where=""):
        super().__init__(module, tokenizer, device, options=options, seed=seed, where=where)
        if self.weights_as not in WEIGHTS_AS:
            raise ValueError(
                f"{type(self).__name__}.weights_as = {self.weights_as!r}: use one of {WEIGHTS_AS}"
            )
        self.weights_version = 0  # syncs so far: 1 after the one before the first generate
        self._folder = None  # the temp folder the weight directories go in

    def sync_weights(self, source) -> None:
        self.weights_version += 1
        if self.weights_as == "buckets":
            limit = int(self.bucket_mb * (1 << 20))
            self.load_weight_buckets(weight_buckets(rollout_weights(source), limit))
            return
        from safetensors.torch import save_file

        if self._folder is None:
            self._folder = Path(tempfile.mkdtemp(prefix="flowrl-weights-"))
        directory = self._folder / f"v{self.weights_version:06d}"
        directory.mkdir()
        tensors = {name: t.detach().contiguous().cpu() for name, t in rollout_weights(source)}
        save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
        config = getattr(source, "config", None)
        if config is not None and hasattr(config, "to_json_file"):
            config.to_json_file(directory / "config.json")
        self.load_weights(directory)
        for older in self._folder.iterdir():  # the server has loaded the new one
            if older != directory:
                shutil.rmtree(older, ignore_errors=True)

    def load_weights(self, directory: Path) -> None:
        """Make the server serve the weights in `directory` (model.safetensors, config.json)
        before returning. Write it when `weights_as = "directory"`."""
        raise NotImplementedError(
            f'{type(self).__name__} has weights_as = "directory" but no load_weights(directory)'
        )

    def load_weight_buckets(self, buckets) -> None:
        """Send every bucket, a list of (name, tensor), to the server before returning. Write
        it when `weights_as = "buckets"`."""
        raise NotImplementedError(
            f'{type(self).__name__} has weights_as = "buckets" but no load_weight_buckets()'
        )

    def close(self) -> None:
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None
