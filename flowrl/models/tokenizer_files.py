"""What a tokenizer directory holds, read from its files without transformers or torch, so
`flowrl check` can compare a reward model's vocabulary with the policy's in well under a second.

A vocabulary is the token -> id map of `tokenizer.json` (the model's vocab plus its added
tokens) or of `vocab.json`; a chat template is `chat_template.jinja`, `chat_template.json` or
the `chat_template` entry of `tokenizer_config.json` (where transformers looks for one).
"""

from __future__ import annotations

import json
from pathlib import Path

from flowrl.models import embedded

TINY = "tiny"


def local_dir(path: str, base_dir: str = ".") -> Path | None:
    """The directory behind a model or tokenizer path, if it is on this machine already: the
    embedded model's cache, a directory (as given, else relative to `base_dir`), or a hub
    name's cached
    snapshot. None for "tiny" and for what is not here (the run reports that)."""
    if path == embedded.ALIAS:
        cached = embedded.cache_root() / "models" / embedded.ALIAS
        return cached if (cached / "config.json").is_file() else None
    if path in ("", TINY):
        return None
    for local in (Path(path), Path(base_dir) / path):  # as the loader, then the graph's folder
        if local.is_dir():
            return local
    if "/" in path and not path.startswith((".", "/")) and not Path(path).exists():
        from flowrl.models import hub

        return hub.cached_snapshot(path)
    return None


def vocabulary(path: str, base_dir: str = ".") -> dict | None:
    """token -> id of a model path's tokenizer, or None when it cannot be read from files."""
    if path == TINY:
        from flowrl.models.tiny import _tokenizer_json

        return _vocab_of(json.loads(_tokenizer_json()))
    directory = local_dir(path, base_dir)
    if directory is None:
        return None
    if (directory / "tokenizer.json").is_file():
        return _vocab_of(json.loads((directory / "tokenizer.json").read_text()))
    if (directory / "vocab.json").is_file():
        return json.loads((directory / "vocab.json").read_text())
    return None


def _vocab_of(tokenizer: dict) -> dict:
    vocab = tokenizer.get("model", {}).get("vocab") or {}
    if isinstance(vocab, list):  # a Unigram model: [[piece, score], ...] in id order
        vocab = {piece: i for i, (piece, _) in enumerate(vocab)}
    vocab = dict(vocab)
    for added in tokenizer.get("added_tokens") or []:
        vocab[added["content"]] = added["id"]
    return vocab


def has_chat_template(path: str, base_dir: str = ".") -> bool | None:
    """Whether a model path's tokenizer has a chat template; None when that cannot be read."""
    if path == TINY:
        return True
    directory = local_dir(path, base_dir)
    if directory is None:
        return None
    if (directory / "chat_template.jinja").is_file() or (
        directory / "chat_template.json"
    ).is_file():
        return True
    config = directory / "tokenizer_config.json"
    if config.is_file():
        return bool(json.loads(config.read_text()).get("chat_template"))
    return False
