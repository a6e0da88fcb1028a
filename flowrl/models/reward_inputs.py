"""A reward model's input: the conversation written with the reward model's own tokenizer and
chat template, as verl's reward-model worker does when its tokenizer is not the policy's
(decode the response, append it to the prompt's messages, apply the reward model's template).

The token ids the policy sampled mean nothing to a tokenizer with another vocabulary, so they
pass through unchanged only when the two vocabularies are the same (`same_vocabulary`).
"""

from __future__ import annotations

import functools

import torch


def conversations(batch) -> list[list[dict]]:
    """Each row's conversation: its prompt messages (`raw_prompt`) and then what the policy
    wrote: a multi-turn row's messages (assistant turns and tool output, from `rollout_info`),
    else one assistant message with the decoded response (`response_text`, special tokens
    such as the end-of-sequence token already dropped)."""
    prompts, texts = batch["raw_prompt"], batch["response_text"]
    infos = batch["rollout_info"] if "rollout_info" in batch else [None] * len(prompts)
    out = []
    for prompt, text, info in zip(prompts, texts, infos, strict=True):
        turns = (info or {}).get("messages")
        reply = [dict(m) for m in turns] if turns else [{"role": "assistant", "content": text}]
        out.append([dict(m) for m in prompt] + reply)
    return out


def templated(tokenizer, chats: list[list[dict]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Conversations -> ids, mask (b, s), left-padded: each one as `tokenizer`'s chat template
    writes the whole conversation (no generation prompt), the text tokenized without adding
    special tokens again (the template already has them), as transformers' tokenizing
    `apply_chat_template` does."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"the reward model's tokenizer ({tokenizer.name_or_path or type(tokenizer).__name__})"
            " has no chat template, so the conversation cannot be written for it: give its "
            "directory a chat template, or score with the policy's tokenizer (same vocabulary)"
        )
    rows = []
    for chat in chats:
        text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=False)
        rows.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return left_padded(rows, pad_id(tokenizer))


def left_padded(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> ids, mask (b, s) with the padding on the left."""
    width = max((len(r) for r in rows), default=0)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for k, row in enumerate(rows):
        if row:
            ids[k, width - len(row) :] = torch.tensor(row)
            mask[k, width - len(row) :] = 1
    return ids, mask


def pad_id(tokenizer) -> int:
    for token_id in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if token_id is not None:
            return token_id
    return 0


def same_vocabulary(a, b) -> bool:
    """Whether two tokenizers map every token to the same id."""
    return a is b or a.get_vocab() == b.get_vocab()


@functools.cache
def policy_tokenizer(path: str):
    """The tokenizer of the policy's model path, loaded once per process."""
    from flowrl.models.loading import load_tokenizer

    return load_tokenizer(path)


def preference_chats(batch) -> list[list[dict]]:
    """Preference rows (flowrl/data/preferences.py) -> 2b conversations, interleaved: row k's
    prompt with its chosen response at 2k, with its rejected one at 2k + 1."""
    out = []
    for prompt, extra in zip(batch["raw_prompt"], batch["extra_info"], strict=True):
        if not isinstance(extra, dict) or "chosen" not in extra or "rejected" not in extra:
            raise ValueError(
                "a preference row needs extra_info.chosen and extra_info.rejected (or top-level "
                '"chosen" / "rejected" in the data file): data.source must hold preference '
                'pairs, e.g. "arithmetic_preferences"'
            )
        prompt = [dict(m) for m in prompt]
        out += [prompt + [dict(m) for m in extra[k]] for k in ("chosen", "rejected")]
    return out
