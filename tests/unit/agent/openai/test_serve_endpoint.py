"""The OpenAI-compatible endpoint (flowrl/serve/), called through the `openai` SDK: the tiny
model on flowrl's own engine, or scripted turns where a test needs a given text (tool calls,
stop strings). Fidelity: the ids answered and recorded are the engine's own samples, and their
log-probs equal the train engine's."""

import asyncio
import json

import httpx
import pytest
import torch

openai = pytest.importorskip("openai")

from flowrl.agent.chat import ChatTokens  # noqa: E402
from flowrl.agent.scripted import ScriptedTurns  # noqa: E402
from flowrl.engines import HFRollout, TrainEngine  # noqa: E402
from flowrl.engines.rollout import Request, Sampling, mix  # noqa: E402
from flowrl.protocol import DataProto  # noqa: E402
from flowrl.serve.app import Keys  # noqa: E402
from flowrl.serve.endpoint import Endpoint  # noqa: E402
from flowrl.serve.record import Recorder  # noqa: E402
from flowrl.serve.server import Server  # noqa: E402
from flowrl.testing import tiny_model, tiny_tokenizer  # noqa: E402

pytestmark = pytest.mark.slow  # starts a server (uvicorn on a thread)

KEY = "test-key"
HI = [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture(scope="module")
def model():
    return tiny_model().eval()


@pytest.fixture(scope="module")
def served(model):
    backend = HFRollout(model, tiny_tokenizer())
    endpoint = Endpoint(backend, model_name="tiny", context=256, max_n=4, recorder=Recorder())
    keys = Keys(KEY)
    with Server(endpoint, keys) as server:
        yield server


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served.base_url, api_key=KEY, max_retries=0)


def ask(client, **kwargs):
    """A chat completion of HI (unless `messages` is given), with the token ids."""
    kwargs = {"model": "tiny", "messages": HI, **kwargs}
    return client.chat.completions.create(extra_body={"return_token_ids": True}, **kwargs)


def test_chat_answer_carries_the_templates_prompt_ids_and_the_sampled_ids(served, client):
    r = ask(client, max_tokens=12, seed=5, logprobs=True)
    tokenizer = tiny_tokenizer()
    expected = ChatTokens(tokenizer).encode(HI, generation_prompt=True)
    assert r.prompt_token_ids == expected  # the chat template, applied on the server
    choice = r.choices[0]
    assert 0 < len(choice.token_ids) <= 12
    assert choice.message.content == tokenizer.decode(choice.token_ids, skip_special_tokens=True)
    assert [t.token for t in choice.logprobs.content] == [
        tokenizer.decode([i]) for i in choice.token_ids
    ]
    assert r.usage.prompt_tokens == len(expected)
    assert r.usage.completion_tokens == len(choice.token_ids)
    ended = choice.token_ids[-1] == tokenizer.eos_token_id  # the eos is kept, as vLLM's ids
    assert choice.finish_reason == ("stop" if ended else "length")
    plain = client.chat.completions.create(model="tiny", messages=HI, max_tokens=12, seed=5)
    assert plain.choices[0].model_extra.get("token_ids") is None  # only when asked
    assert plain.choices[0].message.content == choice.message.content  # same seed, same text


def test_ids_are_the_engines_samples_and_logprobs_the_trainers(served, client, model):
    """Fidelity: the ids equal a direct generate of the same request; the returned log-probs
    equal the train engine's recomputation (fp32, CPU) within 1e-4."""
    for temperature, top_p in ((1.0, 1.0), (0.7, 0.9)):
        r = ask(
            client, max_tokens=16, n=2, seed=11, temperature=temperature, top_p=top_p, logprobs=True
        )
        prompt = r.prompt_token_ids
        sampling = Sampling(temperature=temperature, top_p=top_p)
        direct = HFRollout(model, tiny_tokenizer())
        for i, choice in enumerate(r.choices):
            alone = direct.run(direct.generate(Request(prompt, 16, sampling, seed=mix(11, i))))
            assert choice.token_ids == alone.ids
            returned = [t.logprob for t in choice.logprobs.content]
            torch.testing.assert_close(
                torch.tensor(returned), torch.tensor(alone.logprobs), atol=1e-6, rtol=0
            )
        assert r.choices[0].token_ids != r.choices[1].token_ids  # n samples: own streams
    # at temperature 1 and no top-p the sampler's distribution is the model's: the trainer's
    r = ask(client, max_tokens=16, n=3, seed=2, logprobs=True)
    t = max(len(c.token_ids) for c in r.choices)
    responses = torch.zeros(3, t, dtype=torch.long)
    mask, returned = torch.zeros(3, t, dtype=torch.long), torch.zeros(3, t)
    for k, c in enumerate(r.choices):
        responses[k, : len(c.token_ids)] = torch.tensor(c.token_ids)
        mask[k, : len(c.token_ids)] = 1
        returned[k, : len(c.token_ids)] = torch.tensor([x.logprob for x in c.logprobs.content])
    prompts = torch.tensor([r.prompt_token_ids] * 3)
    batch = DataProto.from_dict(
        {
            "prompts": prompts,
            "prompt_mask": torch.ones_like(prompts),
            "responses": responses,
            "response_mask": mask,
            "response_attention": mask,
        }
    )
    recomputed = TrainEngine(model, tiny_tokenizer(), trainable=False).forward(batch, grad=False)[
        "logprobs"
    ]
    assert (recomputed[mask.bool()] - returned[mask.bool()]).abs().max() < 1e-4


def test_top_logprobs_rank_the_models_distribution(client, model):
    r = ask(client, max_tokens=6, seed=1, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    ids = r.prompt_token_ids + r.choices[0].token_ids
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    p = len(r.prompt_token_ids)
    for j, entry in enumerate(content):
        expected = torch.log_softmax(logits[p + j - 1], -1).topk(3)
        assert [x.logprob for x in entry.top_logprobs] == pytest.approx(
            expected.values.tolist(), abs=1e-5
        )
        # at temperature 1 the sampled token's log-prob is the model's
        assert entry.logprob == pytest.approx(
            float(torch.log_softmax(logits[p + j - 1], -1)[ids[p + j]]), abs=1e-5
        )


def test_streamed_chunks_add_up_to_the_answer(client):
    args = dict(
        model="tiny", messages=HI, max_tokens=10, seed=7, extra_body={"return_token_ids": True}
    )
    whole = client.chat.completions.create(**args)
    chunks = list(
        client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[0].prompt_token_ids == whole.prompt_token_ids
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    ids = [
        i for c in chunks if c.choices for i in (c.choices[0].model_extra.get("token_ids") or [])
    ]
    assert text == whole.choices[0].message.content and ids == whole.choices[0].token_ids
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[
        0
    ].finish_reason
    assert chunks[-1].usage.completion_tokens == len(ids)


def test_completions_take_text_and_token_id_prompts(client):
    tokenizer = tiny_tokenizer()
    ids = tokenizer("2 + 2 =", add_special_tokens=False)["input_ids"]
    by_text = client.completions.create(
        model="tiny", prompt="2 + 2 =", max_tokens=5, seed=3, extra_body={"return_token_ids": True}
    )
    by_ids = client.completions.create(
        model="tiny", prompt=ids, max_tokens=5, seed=3, extra_body={"return_token_ids": True}
    )
    assert by_text.choices[0].prompt_token_ids == ids == by_ids.choices[0].prompt_token_ids
    assert by_text.choices[0].token_ids == by_ids.choices[0].token_ids
    two = client.completions.create(
        model="tiny",
        prompt=[ids, ids[:3]],
        n=2,
        max_tokens=4,
        logprobs=2,
        extra_body={"return_token_ids": True},
    )
    assert [c.index for c in two.choices] == [0, 1, 2, 3]
    assert [c.prompt_token_ids for c in two.choices] == [ids, ids, ids[:3], ids[:3]]
    assert all(len(c.logprobs.token_logprobs) == len(c.token_ids) for c in two.choices)
    assert all(len(c.logprobs.top_logprobs) == len(c.token_ids) for c in two.choices)


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list()] == ["tiny"]


def _error(call) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as caught:
        call()
    return caught.value


def test_bad_requests_get_openais_error_shape_and_are_counted(served, client):
    stats = served.endpoint.stats
    before = dict(stats)
    unknown = _error(
        lambda: client.chat.completions.create(model="tiny", messages=HI, extra_body={"colour": 1})
    )
    assert (
        unknown.status_code == 400
        and "colour" in unknown.body["message"]
        and unknown.body["type"] == "invalid_request_error"
    )
    wrong = _error(
        lambda: openai.OpenAI(base_url=served.base_url, api_key="nope", max_retries=0).models.list()
    )
    assert wrong.status_code == 401 and wrong.body["code"] == "invalid_api_key"
    long = [{"role": "user", "content": "x" * 300}]
    over = _error(lambda: client.chat.completions.create(model="tiny", messages=long, max_tokens=4))
    assert over.status_code == 400 and over.body["code"] == "context_length_exceeded"
    room = _error(
        lambda: client.chat.completions.create(model="tiny", messages=HI, max_tokens=1000)
    )
    assert room.body["code"] == "context_length_exceeded"
    many = _error(
        lambda: client.chat.completions.create(model="tiny", messages=HI, n=5, max_tokens=2)
    )
    assert many.status_code == 400 and many.body["param"] == "n"
    bad_call = [
        *HI,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": "{2+2"}}
            ],
        },
    ]
    call = _error(
        lambda: client.chat.completions.create(model="tiny", messages=bad_call, max_tokens=2)
    )
    assert call.status_code == 400 and call.body["code"] == "invalid_tool_call"
    model = _error(lambda: client.chat.completions.create(model="gpt-9", messages=HI, max_tokens=2))
    assert model.status_code == 404 and model.body["code"] == "model_not_found"
    raw = httpx.post(
        f"{served.base_url}/chat/completions",
        content=b"{not json",
        headers={"Authorization": f"Bearer {KEY}"},
    )
    assert raw.status_code == 400 and raw.json()["error"]["code"] == "invalid_json"
    route = httpx.get(f"{served.base_url}/embeddings", headers={"Authorization": f"Bearer {KEY}"})
    assert route.status_code == 404 and "error" in route.json()
    counted = {k: stats[k] - before.get(k, 0) for k in stats if k.startswith("errors/")}
    assert counted["errors/context_length_exceeded"] == 2 and counted["errors/invalid_api_key"] == 1
    assert counted["errors/invalid_json"] == 1 and counted["errors/invalid_tool_call"] == 1
    # the endpoint is unharmed
    assert client.chat.completions.create(model="tiny", messages=HI, max_tokens=3).choices


# -- scripted turns: a given text -----------------------------------------------------------


@pytest.fixture
def scripted():
    """An endpoint whose model says texts[k] to a request of seed k."""
    tokenizer = tiny_tokenizer()
    servers = []

    def start(*texts, parser="hermes"):
        script = {
            mix(k, 0): [
                tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            ]
            for k, t in enumerate(texts)
        }
        backend = ScriptedTurns(script)
        backend.tokenizer = tokenizer
        endpoint = Endpoint(backend, model_name="tiny", parser=parser, recorder=Recorder())
        server = Server(endpoint, Keys(KEY)).start()
        servers.append(server)
        return openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0), endpoint

    yield start
    for server in servers:
        server.stop()


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calc",
            "description": "arithmetic",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]


def test_tool_calls_parsed_by_the_models_parser(scripted):
    text = (
        'Let me compute.<tool_call>{"name": "calc", "arguments": {"expression": "2+2"}}</tool_call>'
    )
    client, _ = scripted(text)
    r = ask(client, tools=TOOLS, seed=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me compute."
    (call,) = choice.message.tool_calls
    assert call.function.name == "calc" and json.loads(call.function.arguments) == {
        "expression": "2+2"
    }
    assert (
        tiny_tokenizer().decode(choice.token_ids, skip_special_tokens=True) == text
    )  # ids untouched


def test_tag_parser_names_the_tools_one_parameter(scripted):
    client, _ = scripted("<calc>3*4</calc>", parser="tag")
    r = client.chat.completions.create(model="tiny", messages=HI, tools=TOOLS, seed=0)
    (call,) = r.choices[0].message.tool_calls
    assert json.loads(call.function.arguments) == {"expression": "3*4"}


def test_malformed_call_from_the_model_is_content_and_counted(scripted):
    text = '<tool_call>{"name": "calc", "arguments": {2+2}</tool_call>'
    client, endpoint = scripted(text, text)
    r = client.chat.completions.create(model="tiny", messages=HI, tools=TOOLS, seed=0)
    assert r.choices[0].message.content == text and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop" and endpoint.stats["malformed_tool_calls"] == 1
    # tool_choice "none": the text is not parsed
    plain = client.chat.completions.create(
        model="tiny", messages=HI, tools=TOOLS, tool_choice="none", seed=1
    )
    assert plain.choices[0].message.content == text and endpoint.stats["malformed_tool_calls"] == 1


def test_stop_string_cuts_text_and_ids_together(scripted):
    client, endpoint = scripted("The answer is 4. STOP and more")
    r = client.chat.completions.create(
        model="tiny", messages=HI, stop=["STOP"], seed=0, extra_body={"return_token_ids": True}
    )
    choice = r.choices[0]
    assert choice.message.content == "The answer is 4. " and choice.finish_reason == "stop"
    # ids up to the token completing the stop string (one character a token here)
    assert tiny_tokenizer().decode(choice.token_ids) == "The answer is 4. STOP"
    (call,) = endpoint.recorder.take("")
    assert list(call.completion_ids) == choice.token_ids


def test_concurrent_episodes_never_mix(model):
    """32 episodes at once, each with its own key: each one's recorded calls are its own
    prompt and the ids a direct generate of its request samples."""
    recorder = Recorder()
    endpoint = Endpoint(HFRollout(model, tiny_tokenizer()), model_name="tiny", recorder=recorder)
    keys = Keys()
    episode_keys = {f"ep{k}": keys.open(f"ep{k}") for k in range(32)}
    with Server(endpoint, keys) as server:

        async def one(k, key):
            client = openai.AsyncOpenAI(base_url=server.base_url, api_key=key, max_retries=0)
            messages = [{"role": "user", "content": f"episode {k}: " + "ab" * k}]
            r = await client.chat.completions.create(
                model="tiny",
                messages=messages,
                max_tokens=8 + k % 5,
                seed=k,
                extra_body={"return_token_ids": True},
            )
            return r

        async def run_all():
            return await asyncio.gather(
                *(one(k, key) for k, key in enumerate(episode_keys.values()))
            )

        answers = asyncio.run(run_all())
        wrong = _error(
            lambda: openai.OpenAI(
                base_url=server.base_url, api_key="ep-forged", max_retries=0
            ).models.list()
        )
        assert wrong.status_code == 401  # with episode keys open, only they are taken
    direct = HFRollout(model, tiny_tokenizer())
    for k, (episode, answer) in enumerate(zip(episode_keys, answers, strict=True)):
        (call,) = recorder.take(episode)
        assert list(call.prompt_ids) == answer.prompt_token_ids
        assert tiny_tokenizer().decode(call.prompt_ids).count(f"episode {k}:") == 1
        alone = direct.run(
            direct.generate(Request(call.prompt_ids, 8 + k % 5, Sampling(), seed=mix(k, 0)))
        )
        assert list(call.completion_ids) == alone.ids == answer.choices[0].token_ids
        torch.testing.assert_close(
            torch.tensor(call.logprobs), torch.tensor(alone.logprobs), atol=1e-5, rtol=0
        )


def test_an_agents_conversation_becomes_one_row_the_trainer_agrees_with(served, model):
    """Three calls of one episode (named by header), each sending the history back: one
    row whose trained tokens are the sampled ones with their log-probs (the trainer's within
    1e-4), the user turns between them attended to; a weight sync between calls stamps the
    next call's version."""
    from flowrl.serve.record import segments

    client = openai.OpenAI(
        base_url=served.base_url,
        api_key=KEY,
        max_retries=0,
        default_headers={"X-Episode-Id": "conversation"},
    )
    messages = list(HI)
    # seeds under which the random model samples no special token (its text drops them, so
    # the template's history would differ from the sampled ids: a break, tested below)
    served.endpoint.version = 3
    for turn in range(3):
        r = ask(client, messages=messages, max_tokens=8, seed=10 + turn, logprobs=True)
        messages += [
            {"role": "assistant", "content": r.choices[0].message.content},
            {"role": "user", "content": f"And then {turn}?"},
        ]
        served.endpoint.version += 1 + turn  # versions 3, 4, 6
    calls = served.endpoint.recorder.take("conversation")
    assert [c.version for c in calls] == [3, 4, 6]
    (row,) = segments(calls)
    assert row.versions == [3, 4, 6] and row.calls == 3
    assert sum(row.mask) == sum(len(c.completion_ids) for c in calls)
    ids = torch.tensor([row.ids])
    batch = DataProto.from_dict(
        {
            "prompts": torch.tensor([row.prompt_ids]),
            "prompt_mask": torch.ones(1, len(row.prompt_ids), dtype=torch.long),
            "responses": ids,
            "response_mask": torch.tensor([row.mask]),
            "response_attention": torch.ones_like(ids),
        }
    )
    engine = TrainEngine(model, tiny_tokenizer(), trainable=False)
    recomputed = engine.forward(batch, grad=False)["logprobs"][0]
    trained = torch.tensor(row.mask).bool()
    assert (recomputed[trained] - torch.tensor(row.logprobs)[trained]).abs().max() < 1e-4
    # an edited history (the first answer rewritten) starts a second row
    messages[1] = {"role": "assistant", "content": "edited"}
    ask(client, messages=messages, max_tokens=4, seed=1)
    assert len(segments(calls + served.endpoint.recorder.take("conversation"))) == 2


def test_a_weight_update_in_the_middle_of_an_episode_stamps_both_versions(served, model):
    """A real weight sync between two calls of one episode (what run.staleness can do while
    a program runs): the second call is stamped with the next version and sampled by the new
    weights (its log-probs are the new model's, within 1e-4, not the old one's); the row keeps
    both versions and the node's metrics count the episode as spanning two."""
    import copy

    from flowrl.serve.program_rows import program_metrics
    from flowrl.serve.programs import Outcome

    def recompute(module, call):
        ids = torch.tensor([call.completion_ids])
        batch = DataProto.from_dict(
            {
                "prompts": torch.tensor([call.prompt_ids]),
                "prompt_mask": torch.ones(1, len(call.prompt_ids), dtype=torch.long),
                "responses": ids,
                "response_mask": torch.ones_like(ids),
                "response_attention": torch.ones_like(ids),
            }
        )
        engine = TrainEngine(module, tiny_tokenizer(), trainable=False)
        return engine.forward(batch, grad=False)["logprobs"][0]

    backend, endpoint = served.endpoint.backend, served.endpoint
    old = copy.deepcopy(model)
    new = copy.deepcopy(model)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    client = openai.OpenAI(
        base_url=served.base_url,
        api_key=KEY,
        max_retries=0,
        default_headers={"X-Episode-Id": "across-a-sync"},
    )
    endpoint.set_version(5)
    try:
        r = ask(client, max_tokens=8, seed=10)
        backend.sync_weights(new)  # the trainer's sync, while the episode runs
        messages = [*HI, {"role": "assistant", "content": r.choices[0].message.content}]
        ask(
            client,
            messages=[*messages, {"role": "user", "content": "Sure?"}],
            max_tokens=8,
            seed=11,
        )
    finally:
        backend.sync_weights(old)  # the module-scoped model as it was
        endpoint.set_version(0)
    first, second = endpoint.recorder.take("across-a-sync")
    assert (first.version, second.version) == (5, 6)
    for call, module in ((first, old), (second, new)):
        got = torch.tensor(call.logprobs)
        assert (recompute(module, call) - got).abs().max() < 1e-4
    assert (recompute(old, second) - torch.tensor(second.logprobs)).abs().max() > 1e-3
    outcome = Outcome(reward=1.0, calls=[first, second])
    metrics = program_metrics([outcome, Outcome(reward=0.0, calls=[first])], refused=0)
    assert metrics["episodes_across_versions"] == 0.5 and metrics["version_span_max"] == 1.0
