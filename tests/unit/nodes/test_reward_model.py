"""reward.model against transformers' own forward: the token it reads, its own tokenizer and
chat template, the checkpoint formats it loads, and the tiny reward model."""

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForSequenceClassification,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    PreTrainedTokenizerFast,
)

from flowrl.engines import TrainEngine
from flowrl.models import load_model
from flowrl.models.tiny import tiny_model, tiny_tokenizer
from flowrl.nodes.reward import model as reward_model
from flowrl.protocol import DataProto

# a second tokenizer: other ids for the same characters, other special tokens, another template
OTHER_TEMPLATE = (
    "{% for m in messages %}<s>[{{ m['role'] | upper }}] {{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>[ASSISTANT] {% endif %}"
)


def other_tokenizer(template=OTHER_TEMPLATE):
    import string

    special = ["<s>", "</s>", "<unk>", "<pad>"]
    chars = sorted(set(string.printable), reverse=True)
    vocab = {token: i for i, token in enumerate(special + chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(special)
    out = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    out.chat_template = template
    return out


def templated(tokenizer, chat):
    """transformers' own tokenizing chat template: (1, s) ids."""
    out = tokenizer.apply_chat_template(chat, tokenize=True, return_dict=True)
    return torch.tensor([out["input_ids"]])


def classifier_dir(path, tokenizer, seed=0):
    """A tiny LlamaForSequenceClassification (num_labels 1, the tokenizer's pad id) and its
    tokenizer, written with save_pretrained."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    classifier = LlamaForSequenceClassification(config).eval()
    classifier.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return classifier


CHATS = [  # prompt messages, then what the policy wrote
    [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "5"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there!"}],
    [  # multi-turn: the last message is tool output
        {"role": "user", "content": "Add 7 and 8"},
        {"role": "assistant", "content": "calc(7+8)"},
        {"role": "tool", "content": "15"},
    ],
]


def policy_rows(tokenizer, chats=CHATS, eos=True):
    """Rows as generate / agent write them with the policy `tokenizer`: prompts (b, p)
    left-padded, responses (b, t) right-padded; a multi-turn row's tool output is attended
    (response_attention) but not trained (response_mask)."""
    prompts, responses = [], []
    for chat in chats:
        prompt = tokenizer.apply_chat_template(chat[:1], add_generation_prompt=True, tokenize=False)
        prompts.append(tokenizer(prompt, add_special_tokens=False)["input_ids"])
        ids, mask = [], []
        for m in chat[1:]:
            if m["role"] == "assistant":  # sampled, ending with eos
                part = tokenizer(m["content"], add_special_tokens=False)["input_ids"]
                part += [tokenizer.eos_token_id] if eos else []
                ids, mask = ids + part, mask + [1] * len(part)
            else:  # tool output, templated by the policy's template
                text = tokenizer.apply_chat_template([m], tokenize=False)
                part = tokenizer(text, add_special_tokens=False)["input_ids"]
                ids, mask = ids + part, mask + [0] * len(part)
        responses.append((ids, mask))
    p, t = max(map(len, prompts)), max(len(r) for r, _ in responses)
    pad = tokenizer.pad_token_id
    batch = {
        "prompts": torch.full((len(chats), p), pad),
        "prompt_mask": torch.zeros(len(chats), p, dtype=torch.long),
        "responses": torch.full((len(chats), t), pad),
        "response_mask": torch.zeros(len(chats), t, dtype=torch.long),
        "response_attention": torch.zeros(len(chats), t, dtype=torch.long),
    }
    for k, (prompt, (ids, mask)) in enumerate(zip(prompts, responses, strict=True)):
        batch["prompts"][k, p - len(prompt) :] = torch.tensor(prompt)
        batch["prompt_mask"][k, p - len(prompt) :] = 1
        batch["responses"][k, : len(ids)] = torch.tensor(ids)
        batch["response_mask"][k, : len(ids)] = torch.tensor(mask)
        batch["response_attention"][k, : len(ids)] = 1
    texts = np.empty(len(chats), dtype=object)
    texts[:] = [" ".join(m["content"] for m in c[1:] if m["role"] == "assistant") for c in chats]
    raw = np.empty(len(chats), dtype=object)
    raw[:] = [c[:1] for c in chats]
    infos = np.empty(len(chats), dtype=object)
    infos[:] = [{"messages": c[1:]} if len(c) > 2 else {} for c in chats]
    non_tensor = {"raw_prompt": raw, "response_text": texts, "rollout_info": infos}
    return DataProto.from_dict(batch, non_tensor)


def scores_of(path, batch, **params):
    module, tokenizer = load_model(str(path), head="value")
    engine = TrainEngine(module, tokenizer, trainable=False, micro_tokens=64)
    worker = reward_model.RewardModelWorker(engine, reward_model.Params(**params))
    return worker(batch)[0]["scores"]


def test_reads_the_last_real_token_as_transformers_does(tmp_path):
    # the policy's own tokenizer: ids pass through. Row 2 ends in tool output (attended, not
    # trained); rows 0-1 end with the sampled eos, which is not the pad token here, so it is
    # the token read (transformers reads the rightmost non-pad token)
    tokenizer = tiny_tokenizer()
    classifier = classifier_dir(tmp_path, tokenizer)
    batch = policy_rows(tokenizer)
    got = scores_of(tmp_path, batch, tokenizer="policy")
    ids = torch.cat([batch["prompts"], batch["responses"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["response_attention"]], 1)
    rows = [ids[k][mask[k].bool()] for k in range(len(ids))]
    with torch.no_grad():  # one row at a time, no padding at all
        alone = torch.stack([classifier(r[None]).logits[0, 0] for r in rows])
        # the same rows right-padded, then left-padded, in one transformers batch
        width, pad = max(map(len, rows)), tokenizer.pad_token_id
        right = torch.stack([torch.cat([r, r.new_full((width - len(r),), pad)]) for r in rows])
        left = torch.stack([torch.cat([r.new_full((width - len(r),), pad), r]) for r in rows])
        as_right = classifier(right, attention_mask=(right != pad).long()).logits[:, 0]
        as_left = classifier(left, attention_mask=(left != pad).long()).logits[:, 0]
    torch.testing.assert_close(got, alone, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got, as_right, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got, as_left, rtol=1e-4, atol=1e-5)
    # not the token before the last (the critic's alignment, the old reading)
    before = torch.stack([classifier(r[None, :-1]).logits[0, 0] for r in rows]).detach()
    assert not torch.allclose(got, before, atol=1e-3)


def test_skips_a_trailing_eos_that_is_the_pad_token_as_transformers_does(tmp_path):
    # pad = eos (SmolLM2's choice): transformers reads the rightmost token that is not the pad
    # id, so the sampled eos is skipped; flowrl reads the same token
    tokenizer = tiny_tokenizer()
    tokenizer.pad_token = tokenizer.eos_token
    classifier = classifier_dir(tmp_path, tokenizer)
    batch = policy_rows(tokenizer, CHATS[:2])
    got = scores_of(tmp_path, batch, tokenizer="policy")
    ids = torch.cat([batch["prompts"], batch["responses"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["response_attention"]], 1)
    with torch.no_grad():
        want = torch.stack(
            [classifier(ids[k][mask[k].bool()][None]).logits[0, 0] for k in range(2)]
        )
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_own_tokenizer_and_template_when_the_vocabularies_differ(tmp_path):
    # the reward model's tokenizer has other ids and another template: the conversation is
    # decoded and written again with its template; transformers on that text gives the same
    policy, own = tiny_tokenizer(), other_tokenizer()
    classifier = classifier_dir(tmp_path, own)
    batch = policy_rows(policy)
    batch.meta["policy_tokenizer"] = "tiny"
    got = scores_of(tmp_path, batch, rollout_info=True)
    with torch.no_grad():
        want = torch.stack([classifier(templated(own, c)).logits[0, 0] for c in CHATS])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    # reading the policy's ids as its own gives other numbers, and at run time is refused
    with pytest.raises(ValueError, match="vocabulary differs"):
        scores_of(tmp_path, batch, tokenizer="policy")


def test_same_vocabulary_passes_ids_through_unless_retemplate(tmp_path):
    tokenizer = tiny_tokenizer()
    classifier_dir(tmp_path, tokenizer)
    batch = policy_rows(tokenizer, CHATS[:2])
    batch.meta["policy_tokenizer"] = "tiny"
    through = scores_of(tmp_path, batch)
    torch.testing.assert_close(through, scores_of(tmp_path, batch, tokenizer="policy"))
    again = scores_of(tmp_path, batch, retemplate=True)  # the whole conversation, templated
    assert not torch.allclose(through, again)


def test_tiny_reward_model_scores_vary_with_the_input():
    engine = TrainEngine(tiny_model(head="value", seed=0), tiny_tokenizer(), trainable=False)
    batch = policy_rows(tiny_tokenizer())
    scores = reward_model.RewardModelWorker(engine, reward_model.Params(tokenizer="policy"))(batch)[
        0
    ]["scores"]
    assert scores.abs().min() > 0 and scores.unique().numel() == 3


def test_whitened_scores_and_the_raw_mean_as_metric():
    got = reward_model.whitened(torch.tensor([1.0, 2.0, 3.0]))
    torch.testing.assert_close(got, torch.tensor([-1.0, 0.0, 1.0]), atol=1e-5, rtol=0)
    assert reward_model.whitened(torch.tensor([4.0])).tolist() == [0.0]
    engine = TrainEngine(tiny_model(head="value", seed=0), tiny_tokenizer(), trainable=False)
    batch = policy_rows(tiny_tokenizer())
    params = reward_model.Params(tokenizer="policy", whiten=True, scale=2.0)
    out, metrics = reward_model.RewardModelWorker(engine, params)(batch)
    raw = reward_model.RewardModelWorker(engine, reward_model.Params(tokenizer="policy"))(batch)
    assert metrics["score"] == pytest.approx(float(raw[0]["scores"].mean()))
    torch.testing.assert_close(out["scores"], 2.0 * reward_model.whitened(raw[0]["scores"]))


# -- checkpoint formats ----------------------------------------------------------------------


def test_trl_value_head_checkpoint_loads_its_head(tmp_path):
    # TRL's AutoModelForCausalLMWithValueHead saves the LM's weights plus v_head.summary.*
    torch.manual_seed(0)
    lm = tiny_model(seed=3)
    weight, bias = torch.randn(1, 32), torch.tensor([0.25])
    state = {**lm.state_dict(), "v_head.summary.weight": weight, "v_head.summary.bias": bias}
    lm.save_pretrained(tmp_path, state_dict=state)
    tiny_tokenizer().save_pretrained(tmp_path)
    module, _ = load_model(str(tmp_path), head="value")
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        hidden = lm.model(ids).last_hidden_state  # (1, 4, 32)
        torch.testing.assert_close(module(ids), (hidden @ weight.T + bias).squeeze(-1))


@pytest.mark.parametrize("bias", [0.0, 0.5])
def test_saved_value_model_loads_back(tmp_path, bias):
    # bias 0 (a Bradley-Terry reward model): a *ForSequenceClassification directory that
    # transformers loads; bias 0.5 (a critic): the LM plus value_head.safetensors
    from flowrl.models.value_checkpoints import save_value_model

    module = tiny_model(head="value", seed=4)
    torch.nn.init.constant_(module.value_head.bias, bias)
    save_value_model(module, tmp_path, pad_token_id=0)
    tiny_tokenizer().save_pretrained(tmp_path)
    loaded, _ = load_model(str(tmp_path), head="value")
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), module(ids))
        if bias == 0.0:
            hf = AutoModelForSequenceClassification.from_pretrained(tmp_path)
            torch.testing.assert_close(hf(ids).logits[0, 0], module(ids)[0, -1])
    assert (tmp_path / "value_head.safetensors").exists() == (bias != 0.0)


def test_classifier_with_several_labels_is_refused(tmp_path):
    config = tiny_model().config
    config.num_labels = 2
    LlamaForSequenceClassification(config).save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="num_labels = 1"):
        load_model(str(tmp_path), head="value")


def test_causal_lm_without_a_head_gets_a_zero_one(tmp_path):
    tiny_model(seed=1).save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    module, _ = load_model(str(tmp_path), head="value")
    assert float(module.value_head.weight.detach().abs().sum()) == 0.0
    assert isinstance(tiny_model(seed=1), LlamaForCausalLM)
