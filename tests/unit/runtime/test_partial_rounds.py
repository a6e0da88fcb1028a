"""run.partial_rollout: the compiler's checks and plan text, and the rounds of
flowrl/runtime/partial.py on a scripted rollout stage (each prompt says how long its response
is): groups streamed into batches in a fixed order, unfinished responses continued across
weight versions with every token stamped, and a checkpoint's state resuming the rounds exactly.
The same on the tiny model: tests/integration/test_partial_rollouts.py."""

import json
from pathlib import Path

import attrs
import pytest
import torch

from flowrl.errors import GraphErrors
from flowrl.front.compiler import compile_file
from flowrl.front.pipeline import PipelinePlan
from flowrl.nodes import generate
from flowrl.protocol import DataProto
from flowrl.runtime.executor import StepResult
from flowrl.runtime.partial import TOKEN_VERSION, PartialPipeline
from flowrl.runtime.pipeline import VERSION_KEY, entries, load_queue, save_queue
from flowrl.testing import load_node

GRAPHS = Path(__file__).resolve().parents[3] / "graphs"
DISAGGREGATED = str(GRAPHS / "grpo_disaggregated.toml")
ASYNC = ("run.staleness=1", "nodes.generate.return_logprobs=true", "nodes.update_policy.tis_cap=2")


def problems(graph, *overrides) -> str:
    with pytest.raises(GraphErrors) as e:
        compile_file(str(graph), list(overrides))
    return str(e.value)


def test_the_plan_splits_the_rollout_stage_at_generate():
    plan = compile_file(DISAGGREGATED, [*ASYNC, "run.partial_rollout=8"])
    p, names = plan.pipeline, {i.id: i.name for i in plan.items}
    assert [names[i] for i in p.generate_items] == [
        "dispatch:generate",
        "generate",
        "collect:generate",
    ]
    assert [names[i] for i in p.after_items] == ["reward", "advantage"]
    assert (p.partial, p.samples, p.max_new_tokens, p.logprobs) == (8, 8, 20, True)
    text = plan.text()
    assert (
        "async: run.staleness = 1, run.partial_rollout = 8: the rollout stage runs in rounds"
        in (text)
    )
    assert "each round generate samples at most 8 tokens of every response in flight" in text
    assert "rollout stage (pool gen): items 1, 2, 3 every round; 4, 8 on each batch" in text
    assert compile_file(DISAGGREGATED, list(ASYNC)).pipeline.partial == 0


def test_the_rounds_move_only_the_generating_model():
    """With the reference on the rollout pool too and offloading on, the round's walk reloads
    and offloads the policy alone; the reference moves with its own node, on each batch."""
    overrides = ["run.partial_rollout=8", 'models.ref.pool="gen"', 'pools.gen.offload="always"']
    plan = compile_file(DISAGGREGATED, [*ASYNC, *overrides])
    p, names = plan.pipeline, {i.id: i.name for i in plan.items}
    assert [names[i] for i in p.generate_items] == [
        "reload:policy:1",
        "dispatch:generate",
        "generate",
        "collect:generate",
        "offload:policy:5",
    ]
    assert "reload:ref:7" in [names[i] for i in p.after_items]


def test_refuses_partial_rollouts_without_the_pipeline():
    text = problems(DISAGGREGATED, "run.partial_rollout=8")
    assert "[run]: partial_rollout = 8 continues unfinished responses" in text
    assert "fix: set run.staleness = 1" in text


def test_refuses_a_segment_as_long_as_the_response_cap():
    text = problems(DISAGGREGATED, *ASYNC, "run.partial_rollout=20")
    assert "partial_rollout = 20 is not below nodes.generate.max_new_tokens = 20" in text


def test_refuses_an_agent(tmp_path):
    text = (GRAPHS / "grpo_tools.toml").read_text()
    graph = tmp_path / "tools.toml"
    graph.write_text(text + '\n[pools.gen]\ncpus_per_worker = 1\noffload = "never"\n')
    pools = ('models.policy.rollout_pool="gen"', 'models.policy.pool="main"', "run.staleness=1")
    pools += ("run.partial_rollout=8",)
    assert 'this graph generates with [nodes.generate] (uses = "agent")' in problems(graph, *pools)


# -- the rounds, on a scripted rollout stage ----------------------------------------------
EOS, PAD, CAP, SEGMENT, N, PROMPTS = 2, 0, 12, 4, 2, 2
TOKEN = 7  # what a scripted response repeats before its stop token


class Tokenizer:
    eos_token_id, pad_token_id = EOS, PAD

    def batch_decode(self, rows, skip_special_tokens=True):
        return [" ".join(map(str, r)) for r in rows]


class Timed:
    start = end = 0.0
    value = (0.0, 0.0)  # an import's answer: when its weights were exported


class Executor:
    """The calls PartialPipeline makes: weight export and import (recorded), and the two walks
    of a round. A prompt's first id is the length its response wants (at most CAP); the walk
    of generate samples up to the round's limit of it, ending with EOS when it gets there."""

    concurrent = False

    def __init__(self, first=0, node_spec=generate.SPEC):
        self.loads, self.limits, self.exported = [], [], first - 1  # the versions exported
        models = {"policy": type("M", (), {"pool": "train"})}
        nodes = {"generate": type("Decl", (), {"spec": node_spec})}  # its Continuation
        self.spec = type("Spec", (), {"models": models, "nodes": nodes})

    def ranks(self, pool):
        return 1

    def submit(self, pool, method, args):
        if method == "import_weights":
            self.loads.append(args[0][1])
        return (method, args)

    def results(self, handle):
        return [Timed()]

    def rank0_output(self, handle):  # the weights of the next version: its number
        self.exported += 1
        return self.exported

    def run_stage(self, batch, ids, record=None, track="", param_changes=None):
        if ids == (1,):
            return self._generate(batch, param_changes["generate"])
        scores = torch.ones(len(batch))
        out = batch.union(DataProto.from_dict({"scores": scores}))
        return StepResult(out, {"reward/score": 1.0}, [])

    def _generate(self, batch, changes):
        assert changes["n"] == 1
        limit = changes["max_new_tokens"]
        self.limits.append(limit)
        rows = []
        for prompt, mask in zip(batch["prompts"], batch["prompt_mask"], strict=True):
            ids = prompt[mask.bool()].tolist()
            want, so_far = ids[0], len(ids) - 3  # the prompts are 3 ids long
            n = min(limit, want - so_far)
            rows.append([TOKEN] * (n - 1) + [EOS] if so_far + n == want else [TOKEN] * n)
        width = max(len(r) for r in rows)
        responses = torch.full((len(rows), width), PAD)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            responses[i, : len(r)], mask[i, : len(r)] = torch.tensor(r), 1
        logprobs = -mask.float()
        out = {"responses": responses, "response_mask": mask, "rollout_logprobs": logprobs}
        return StepResult(batch.union(DataProto.from_dict(out)), {}, [])


def stages(staleness=1, cap=CAP):
    return PipelinePlan(
        staleness=staleness,
        model="policy",
        rollout_pool="gen",
        train_pools=("train",),
        rollout_nodes=("generate", "reward"),
        train_nodes=("update_policy",),
        rollout_items=(1, 2),
        train_items=(3,),
        sync_item=4,
        rows=PROMPTS * N,
        correction="truncated importance sampling",
        partial=SEGMENT,
        generate_items=(1,),
        after_items=(2,),
        generate_node="generate",
        samples=N,
        max_new_tokens=cap,
        logprobs=True,
    )


WANTS = [3, 10, 2, 12, 5, 9, 4, 4, 11, 3, 6, 8, 2, 2, 12, 7]  # the responses' lengths


def prompts(r: int, version: int):
    """Round r's prompts: two, each asking for the next length of WANTS (cycling)."""
    wants = [WANTS[(2 * (r - 1) + i) % len(WANTS)] for i in range(PROMPTS)]
    ids = torch.tensor([[w, 5, 6] for w in wants])
    uid = torch.tensor([2 * (r - 1) + i for i in range(PROMPTS)])
    batch = DataProto.from_dict({"prompts": ids, "prompt_mask": torch.ones_like(ids), "uid": uid})
    return batch, {"read": 2 * r}, None


def train(pipeline, steps, start=0) -> list:
    """The train stage's side: take each step's batch, then export its update."""
    out = []
    for step in range(start + 1, steps + 1):
        rollout, metrics = pipeline.take(step)
        out.append((step, rollout, metrics))
        pipeline.export(step)
    return out


def test_groups_stream_into_batches_and_responses_continue_across_versions():
    executor = Executor()
    pipeline = PartialPipeline(executor, stages(), prompts, Tokenizer(), 0, 6, None)
    taken = train(pipeline, 6)
    assert set(executor.limits) == {SEGMENT}  # every round samples at most 4 tokens a row
    for step, rollout, metrics in taken:
        batch = rollout.result.batch
        assert len(batch) == PROMPTS * N and rollout.step == step
        lengths = batch["response_mask"].sum(-1)
        for row in range(len(batch)):  # a whole response: the length its prompt asked for
            want = int(batch["prompts"][row, -3])
            assert int(lengths[row]) == want
            ids = batch["responses"][row, :want].tolist()
            assert ids == [TOKEN] * (want - 1) + [EOS]
            versions = batch[TOKEN_VERSION][row, :want].tolist()
            assert versions == sorted(versions)  # older tokens first
            assert int(batch[VERSION_KEY][row]) == versions[0]
            # a segment of 4 tokens is sampled by one version
            assert all(len(set(versions[i : i + SEGMENT])) == 1 for i in range(0, want, SEGMENT))
        assert batch["scores"].shape == (len(batch),)  # the rest of the stage ran on the batch
        groups = batch["group"].tolist()
        assert all(groups.count(g) == N for g in groups)  # whole groups only
        assert metrics["async/staleness"] == step - 1 - rollout.version
        assert metrics["async/token_staleness_max"] == metrics["async/staleness"]
    # groups in the order they finish: step 1 the short ones of rounds 1-2 (3 and 2 tokens),
    # step 2 the 10-token group of round 1 (ended in round 3) and the 12 of round 2 (round 4)
    assert [r.result.batch["group"].tolist() for _, r, _ in taken[:2]] == [
        [0, 0, 2, 2],
        [1, 1, 3, 3],
    ]
    # at least one response was sampled by two versions of the weights
    mixed = [
        row
        for _, r, _ in taken
        for row, mask in zip(
            r.result.batch[TOKEN_VERSION], r.result.batch["response_mask"], strict=True
        )
        if len(set(row[mask.bool()].tolist())) > 1
    ]
    assert mixed
    assert executor.loads == sorted(executor.loads)  # versions only go forward


class Concurrent(Executor):
    concurrent = True  # the rounds in the rollout thread, as on Ray


def test_the_rounds_in_their_own_thread_equal_the_rounds_in_turn():
    """The version of a round reads counts, never timing: with the rounds in a thread racing
    the train stage, every batch is the one of the rounds run in turn."""
    inline = train(PartialPipeline(Executor(), stages(), prompts, Tokenizer(), 0, 6, None), 6)
    for _ in range(5):
        pipeline = PartialPipeline(Concurrent(), stages(), prompts, Tokenizer(), 0, 6, None)
        try:
            threaded = train(pipeline, 6)
        finally:
            pipeline.close()
        for (_, a, _), (_, b, _) in zip(inline, threaded, strict=True):
            assert a.version == b.version
            for key in a.result.batch.batch.keys():
                assert torch.equal(a.result.batch[key], b.result.batch[key]), key
            assert list(a.result.batch["response_text"]) == list(b.result.batch["response_text"])


@pytest.mark.parametrize("saved", [1, 2, 3])
def test_a_checkpoint_resumes_the_rounds_exactly(tmp_path, saved):
    """The state of a checkpoint after step `saved`, through save_queue / load_queue: a new
    pipeline from it (the rollout pool holding update `saved`) trains the remaining steps on
    the same batches as the uninterrupted run."""
    steps = 6
    whole = train(PartialPipeline(Executor(), stages(), prompts, Tokenizer(), 0, steps, None), 6)
    pipeline = PartialPipeline(Executor(), stages(), prompts, Tokenizer(), 0, steps, None)
    train(pipeline, saved)
    queued = pipeline.queued(saved)
    assert all(b.step > saved for b in queued.batches)
    assert queued.loader == {"read": 2 * queued.rounds["done"]}  # the loader of its round
    save_queue(tmp_path, queued)
    state = {"loader": queued.loader, **entries(queued)}  # as controller.json keeps it
    state = json.loads(json.dumps(state))
    restored = load_queue(tmp_path, state)
    assert restored.rounds["done"] == queued.rounds["done"]
    assert restored.loader == queued.loader
    executor = Executor(first=saved)
    resumed = PartialPipeline(executor, stages(), prompts, Tokenizer(), saved, steps, restored)
    rest = train(resumed, steps, start=saved)
    assert min(executor.loads or [saved]) >= saved  # nothing older than the checkpoint's
    for (s, a, _), (t, b, _) in zip(whole[saved:], rest, strict=True):
        assert s == t and a.version == b.version
        for key in ("responses", "response_mask", TOKEN_VERSION, "group", "prompts"):
            assert torch.equal(a.result.batch[key], b.result.batch[key]), (s, key)


def test_a_response_is_cut_at_max_new_tokens_within_a_round():
    """max_new_tokens = 10 with rounds of 4: a response that would go on is cut to 10 tokens in
    its third round (2 of the 4 sampled kept) and ends there, without a stop token."""

    def long_and_short(r: int, version: int):
        ids = torch.tensor([[14, 5, 6], [3, 5, 6]])
        batch = DataProto.from_dict({"prompts": ids, "prompt_mask": torch.ones_like(ids)})
        return batch, {"read": r}, None

    pipeline = PartialPipeline(Executor(), stages(cap=10), long_and_short, Tokenizer(), 0, 3, None)
    taken = train(pipeline, 3)
    long_rows = 0
    for _, rollout, _ in taken:
        batch = rollout.result.batch
        for row in range(len(batch)):
            length = int(batch["response_mask"][row].sum())
            ids = batch["responses"][row, :length].tolist()
            if int(batch["prompts"][row, -3]) == 14:
                long_rows += 1
                assert ids == [TOKEN] * 10 and int(batch["segments"][row]) == 3
            else:
                assert ids == [TOKEN, TOKEN, EOS]
    assert long_rows


def test_a_users_rollout_node_gets_its_own_columns_rebuilt():
    """The rounds ask the generating node's `Continuation` for its columns of a whole
    response: a user's node (tests/support/toy/sampler.py) gets its `answer`, not generate's
    response_text and response_attention."""
    sampler = load_node(Path(__file__).resolve().parents[2] / "support" / "toy" / "sampler.py").SPEC
    pipeline = PartialPipeline(
        Executor(node_spec=sampler), stages(), prompts, Tokenizer(), 0, 3, None
    )
    for _, rollout, _ in train(pipeline, 3):
        batch = rollout.result.batch
        assert "answer" in batch.keys() and "response_text" not in batch.keys()
        assert "response_attention" not in batch.keys()
        for row in range(len(batch)):
            want = int(batch["prompts"][row, -3])  # the whole response, over its rounds
            ids = " ".join(map(str, [TOKEN] * (want - 1) + [EOS]))
            assert batch["answer"][row] == "sampler: " + ids


def test_a_continuation_that_returns_other_columns_is_named():
    sampler = load_node(Path(__file__).resolve().parents[2] / "support" / "toy" / "sampler.py").SPEC
    wrong = attrs.evolve(sampler.continues, finish=lambda rows, tokenizer: {"text": []})
    spec = attrs.evolve(sampler, continues=wrong)
    pipeline = PartialPipeline(Executor(node_spec=spec), stages(), prompts, Tokenizer(), 0, 3, None)
    with pytest.raises(ValueError, match=r"\[nodes.generate\]: its Continuation.finish returned"):
        train(pipeline, 3)


def test_a_queue_of_the_other_kind_is_refused():
    """A checkpoint's queue resumes only with the setting that wrote it."""
    from flowrl.runtime.pipeline import Pipeline, Queued, Rollout

    whole = Queued([Rollout(2, 0, StepResult(DataProto.from_dict({}), {}, []))], {"read": 4})
    with pytest.raises(ValueError, match="resume it with run.partial_rollout = 0"):
        PartialPipeline(Executor(), stages(), prompts, Tokenizer(), 1, 6, whole)
    rounds = Queued([], {"read": 4}, {"done": 2, "complete": 1, "groups": 4}, {})
    plain = attrs.evolve(stages(), partial=0)
    with pytest.raises(ValueError, match="resume it with the same run.partial_rollout"):
        Pipeline(Executor(), plain, lambda r: None, 1, 6, rounds)
