"""The model behind `path = "tiny"`: a character-level tokenizer and a tiny random Llama, built
in-process in milliseconds, no download. Tests use it (through flowrl.testing) and so may a
graph, to try a run end to end without a real model."""

import string
from functools import cache

SPECIAL = ["<pad>", "<|im_start|>", "<|im_end|>"]
# max_position_embeddings: room for a --tiny run's prompts at one token a character (a tool
# block's template is thousands of characters); RoPE has no position table to grow
CONTEXT = 8192
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@cache
def _tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    chars = sorted(set(string.printable))
    vocab = {token: i for i, token in enumerate(SPECIAL + chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=" "))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIAL)
    return tok.to_str()


def tiny_tokenizer():
    """A character-level tokenizer (printable ASCII, one token per character, plus <pad>,
    <|im_start|> and <|im_end|> = eos) with a ChatML template like SmolLM2's."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json()),
        eos_token="<|im_end|>",
        pad_token="<pad>",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_model(
    head: str = "lm", seed: int = 0, vocab: int | None = None, layers: int = 2, hidden: int = 32
):
    """A random Llama (2 layers, hidden 32, 2 heads sharing 1 KV head, tied embeddings) over
    `vocab` tokens (default: tiny_tokenizer's); head "value" wraps it in a ValueModel whose
    head is a fixed random projection (seeded), not zero: a tiny reward model then scores
    each input differently, so a tiny run of a graph scored by it has a gradient (a real new
    value head starts at zero: flowrl/models/value_head.py says why). Seeded without touching
    the global random state."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=vocab or len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=CONTEXT,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.eos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
        if head == "value":
            from flowrl.models.value_head import ValueModel

            model = ValueModel(model)
            torch.nn.init.normal_(model.value_head.weight, std=hidden**-0.5)
    return model


def tiny_qwen2(seed: int = 1, layers: int = 2, hidden: int = 32):
    """A random Qwen2 over tiny_tokenizer's tokens: biased q/k/v projections and 4 query heads
    sharing 2 KV heads (the shape rollout engines must fold), seeded without touching the
    global random state; in eval mode, on the CPU."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=len(tiny_tokenizer()),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen2ForCausalLM(config).eval()
