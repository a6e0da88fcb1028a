"""Load a model and tokenizer by path: an alias, a local HF directory, a hub name found in the
local Hugging Face cache (flowrl/models/hub.py), or "tiny" (a small random model built
in-process, for tests). Nothing is downloaded.

Every directory is checked before transformers reads it (`check_dir`): a problem names the
directory and the file at fault (a missing config.json, a weight file missing, truncated or
left as a link to a blob the cache never got), not transformers' own trace. After loading,
a vocabulary smaller than the tokenizer is refused, and `tokenizer_differences` compares the
tokenizers of two models (a frozen model fed the policy's token ids must share its tokenizer).
"""

import json
import struct
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from flowrl.models import embedded, hub, value_checkpoints
from flowrl.nodespec import HEADS

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_path(path: str) -> str:
    """The local directory behind a model path: the embedded model's cache, the directory
    itself, or a hub name's snapshot in the local Hugging Face cache (flowrl/models/hub.py); raises
    ModelNotFound, saying how to download it, when it is none of these."""
    if path == embedded.ALIAS:
        return str(embedded.ensure_cached())
    if path == "tiny":
        return path
    if Path(path).exists():
        return str(check_dir(Path(path)))
    snapshot = hub.cached_snapshot(path)
    if snapshot is None:
        raise embedded.ModelNotFound(hub.not_found(path))
    return str(check_dir(Path(snapshot), hub_name=path))


WEIGHTS = ("model.safetensors", "pytorch_model.bin")  # or their .index.json, listing shards


def check_dir(directory: Path, hub_name: str | None = None) -> Path:
    """`directory` if it holds a loadable model; else ModelNotFound naming it and the file."""
    again = f" (an incomplete download: run `hf download {hub_name}` again)" if hub_name else ""
    if not directory.is_dir():
        raise embedded.ModelNotFound(
            f"model path {directory} is a file, not a model directory: give the folder that "
            "holds config.json and the weights (the one save_pretrained wrote)"
        )
    config = directory / "config.json"
    _present(config, "the model's configuration", again)
    try:
        json.loads(config.read_text())
    except (OSError, ValueError) as e:
        raise embedded.ModelNotFound(f"{config}: not valid JSON ({e}){again}") from None
    found = [
        directory / n for n in WEIGHTS if (directory / n).exists() or (directory / n).is_symlink()
    ]
    indexes = [directory / f"{n}.index.json" for n in WEIGHTS]
    for index in indexes:
        if index.exists():
            shards = json.loads(index.read_text()).get("weight_map", {}).values()
            found += [directory / shard for shard in sorted(set(shards))]
    if not found:
        raise embedded.ModelNotFound(
            f"{directory}: no weight file (model.safetensors, pytorch_model.bin or a sharded "
            f"index){again}; save the model with save_pretrained"
        )
    for weights in found:
        _present(weights, "a weight file", again)
        if weights.suffix == ".safetensors":
            _check_safetensors(weights, again)
    return directory


def _present(path: Path, what: str, again: str) -> None:
    if path.is_file():
        return
    if path.is_symlink():
        raise embedded.ModelNotFound(
            f"{path}: {what} is a link to a file that is not there{again or ' (a broken link)'}"
        )
    raise embedded.ModelNotFound(f"{path}: {what} is missing{again}")


def _check_safetensors(path: Path, again: str) -> None:
    """A safetensors file whose header or data is cut short (an interrupted copy): the header
    says where each tensor ends; the file must be that long."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length)) if 8 + length <= size else None
    except (OSError, ValueError, struct.error):
        header = None
    if header is None:
        raise embedded.ModelNotFound(f"{path}: not a readable safetensors file (truncated?){again}")
    end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    if 8 + length + end != size:
        raise embedded.ModelNotFound(
            f"{path}: truncated or damaged: {size} bytes, its header describes "
            f"{8 + length + end}{again}; write or copy it again"
        )


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def load_tokenizer(path: str):
    """The tokenizer of a model path; pad falls back to eos."""
    if path == "tiny":
        from flowrl.models.tiny import tiny_tokenizer

        return tiny_tokenizer()
    directory = resolve_path(path)
    if not any((Path(directory) / n).exists() for n in TOKENIZER_FILES):
        raise embedded.ModelNotFound(
            f"{directory}: no tokenizer file ({', '.join(TOKENIZER_FILES)}): save the tokenizer "
            "into the model's folder (tokenizer.save_pretrained)"
        )
    tokenizer = _pretrained(AutoTokenizer, directory)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(path: str, *, head: str = "lm", dtype: str = "float32", seed: int = 0):
    """(module, tokenizer) for a model path.

    Args:
        path: "smollm2-135m-instruct" (embedded), a local HF directory, a hub id already in
            the local HF cache, or "tiny".
        head: "lm" gives the causal LM; "value" a ValueModel: the backbone with a scalar head,
            the `score` layer of a *ForSequenceClassification directory, a value head saved
            beside a causal LM (TRL, OpenRLHF, flowrl), or a new one, zero-initialised
            (flowrl/models/value_checkpoints.py).
        dtype: "float32", "bfloat16" or "float16".
        seed: seeds whatever is initialised at random (the tiny model), without touching the
            global random state.
    """
    if head not in HEADS:
        raise ValueError(f"head must be one of {HEADS}, got {head!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if path == "tiny":
            from flowrl.models.tiny import tiny_model

            module = tiny_model(head=head, seed=seed)
        else:
            module = _load_module(resolve_path(path), head, DTYPES[dtype])
    tokenizer = load_tokenizer(path)
    if path == embedded.ALIAS:
        embedded.check(module, tokenizer)
    _check_vocab(module, tokenizer, path)
    return module.to(DTYPES[dtype]), tokenizer


def context_length(path: str) -> int | None:
    """The most tokens a model attends to (config max_position_embeddings), None if unknown."""
    if path == "tiny":
        from flowrl.models.tiny import CONTEXT

        return CONTEXT
    try:
        config = json.loads((Path(resolve_path(path)) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    value = config.get("max_position_embeddings") or config.get("n_positions")
    return int(value) if isinstance(value, int) else None


def _check_vocab(module, tokenizer, path: str) -> None:
    """Token ids the tokenizer gives must have an embedding row: else generate fails deep
    inside with an IndexError."""
    embeddings = module.get_input_embeddings() if hasattr(module, "get_input_embeddings") else None
    rows = getattr(embeddings, "num_embeddings", None)
    if rows is not None and len(tokenizer) > rows:
        raise embedded.ModelNotFound(
            f'model "{path}": its embedding has {rows} rows (config.json vocab_size) but its '
            f"tokenizer has {len(tokenizer)} tokens, so ids from {rows} on have no embedding: "
            "use the tokenizer saved with this model, or resize the embeddings "
            "(model.resize_token_embeddings(len(tokenizer))) and save it again"
        )


def tokenizer_differences(a, b) -> list[str]:
    """How two tokenizers differ in what they map text to ([] when the same ids come out):
    the vocabulary and the special tokens. A model fed another's ids needs []."""
    out = []
    if len(a) != len(b):
        out.append(f"{len(a)} tokens vs {len(b)}")
    elif a.get_vocab() != b.get_vocab():
        out.append("the same number of tokens, but different ids")
    for name in ("eos_token_id", "bos_token_id", "pad_token_id"):
        if getattr(a, name, None) != getattr(b, name, None):
            out.append(f"{name} {getattr(a, name, None)} vs {getattr(b, name, None)}")
    return out


def _load_module(path: str, head: str, dtype: torch.dtype):
    if head == "value":  # every reward-model and critic format: flowrl/models/value_checkpoints.py
        return value_checkpoints.load_value_model(path, dtype, _pretrained)
    return _pretrained(AutoModelForCausalLM, path, dtype=dtype)


def _pretrained(cls, path: str, **kwargs):
    """cls.from_pretrained, every failure (and weights the config does not match, which
    transformers would fill at random with a warning) named by directory."""
    loads_weights = cls is not AutoTokenizer
    try:
        out = cls.from_pretrained(
            path,
            local_files_only=True,
            **kwargs,
            **({"output_loading_info": True} if loads_weights else {}),
        )
    except Exception as e:  # transformers' or safetensors' own error: the file is in there
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if "mismatched_sizes" in first:  # transformers printed its table of tensors above
            first = "its weight files hold tensors of other shapes than its config.json gives"
        raise embedded.ModelNotFound(
            f"cannot load {'the tokenizer' if not loads_weights else 'the model'} in {path}: "
            f"{first}. Use a directory written by save_pretrained, a hub name in the local "
            f'Hugging Face cache, "{embedded.ALIAS}" (the embedded default), or "tiny" for '
            "tests; nothing is downloaded at run time"
        ) from None
    if not loads_weights:
        return out
    module, info = out
    missing = [k for k in info.get("missing_keys", ()) if not k.endswith("lm_head.weight")]
    wrong = info.get("mismatched_keys", ())
    if missing or wrong:
        names = ", ".join(
            [*missing[:3], *(str(w[0]) if isinstance(w, tuple) else str(w) for w in wrong[:3])]
        )
        raise embedded.ModelNotFound(
            f"{path}: its weight files do not match its config.json ({len(missing)} tensors "
            f"missing, {len(wrong)} of another shape: {names}); save the model again with "
            "save_pretrained"
        )
    return module
