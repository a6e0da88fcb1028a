"""Models named the Hugging Face hub's way ("HuggingFaceTB/SmolLM2-360M-Instruct"), found in the
local Hugging Face cache only, as with HF_HUB_OFFLINE=1: flowrl never downloads at run time.
A user downloads a model once, on purpose, with `hf download NAME`.

The cache is where huggingface_hub puts it: $HF_HUB_CACHE, else $HF_HOME/hub, else
~/.cache/huggingface/hub, read when a model is looked up (so a test or a job script may set
them late). huggingface_hub is imported only for such a name; no torch here.
"""

import json
import os
from pathlib import Path


def hub_cache() -> Path:
    """The Hugging Face hub cache directory, from the environment as it is now."""
    env = os.environ
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if env.get(name):
            return Path(env[name]).expanduser()
    home = env.get("HF_HOME") or Path(env.get("XDG_CACHE_HOME", "~/.cache")) / "huggingface"
    return Path(home).expanduser() / "hub"


def cached_snapshot(name: str) -> Path | None:
    """The directory of `name`'s snapshot (revision "main") in the cache; None when the cache
    does not hold it. Never touches the network."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(name, cache_dir=hub_cache(), local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError, OSError):
        return None


def cached_config(name: str) -> dict | None:
    """`name`'s config.json from the cache (for memory estimates), or None."""
    from huggingface_hub import try_to_load_from_cache

    try:
        path = try_to_load_from_cache(name, "config.json", cache_dir=hub_cache())
    except ValueError:  # not a valid hub name
        return None
    return json.loads(Path(path).read_text()) if isinstance(path, str) else None


def not_found(path: str) -> str:
    """The error for a model path that is neither a directory nor in the cache."""
    return (
        f'model "{path}" is not in the local cache of Hugging Face models ({hub_cache()}) '
        "and is not a directory; flowrl does not download models at run time. Download it "
        f"once with `hf download {path}` (huggingface_hub's CLI; HF_HOME or HF_HUB_CACHE "
        "choose where), "
        'or set path to a local directory, "smollm2-135m-instruct" (the embedded model) or '
        '"tiny" (a tiny random model)'
    )
