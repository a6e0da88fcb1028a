"""What surrounds a graph, broken as a user would break it: data files, model directories,
values scorers and tools return, run directories, checkpoints, the graph given to --resume,
signals. One case per way a class of input can be wrong; each must be refused (or handled and
counted) with a message naming what and where."""

import bz2
import concurrent.futures
import gzip
import json
import os
import signal
import struct
import threading
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from flowrl.data import DataError, PromptDataset, PromptLoader, load_rows
from flowrl.models.tiny import tiny_tokenizer


def row(i: int, **changes) -> dict:
    out = {
        "prompt": [{"role": "user", "content": f"what is {i} + 1?"}],
        "data_source": "arithmetic",
        "reward_model": {"ground_truth": str(i + 1)},
    }
    return {**out, **changes}


def jsonl(rows) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


GOOD = jsonl(row(i) for i in range(4))


def _parquet_bytes(rows) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pylist(rows), sink)
    return sink.getvalue().to_pybytes()


# -- data files ------------------------------------------------------------------------------
# (id, file name, how to make it, words the message must hold besides the file's path)
DATA_CASES = [
    ("empty", "d.jsonl", lambda p: p.write_bytes(b""), ["empty", "0 bytes"]),
    ("blank-lines", "d.jsonl", lambda p: p.write_text("\n \n"), ["no rows"]),
    ("gzip", "d.jsonl", lambda p: p.write_bytes(gzip.compress(GOOD.encode())), ["gzip", "gunzip"]),
    ("bzip2", "d.parquet", lambda p: p.write_bytes(bz2.compress(b"x" * 100)), ["bzip2"]),
    ("directory", "d.jsonl", lambda p: p.mkdir(), ["a directory"]),
    (
        "link-loop",
        "d.jsonl",
        lambda p: (os.symlink(p.with_name("e.jsonl"), p), os.symlink(p, p.with_name("e.jsonl"))),
        ["loop of symbolic links"],
    ),
    ("broken-link", "d.jsonl", lambda p: os.symlink(p.with_name("gone.jsonl"), p), ["does not"]),
    ("not-parquet", "d.parquet", lambda p: p.write_text(GOOD), ["not a parquet file", "PAR1"]),
    (
        "truncated-parquet",
        "d.parquet",
        lambda p: p.write_bytes(_parquet_bytes([row(0), row(1)])[:-40]),
        ["truncated parquet"],
    ),
    (
        "header-only-parquet",
        "d.parquet",
        lambda p: pq.write_table(pa.Table.from_pylist([row(0)]).slice(0, 0), p),
        ["no rows"],
    ),
    (
        "parquet-named-jsonl",
        "d.jsonl",
        lambda p: p.write_bytes(_parquet_bytes([row(0)])),
        ["parquet file named", "rename"],
    ),
    ("json-array", "d.json", lambda p: p.write_text("[1, 2]\n"), ["line 1", "JSON array"]),
    (
        "empty-messages",
        "d.jsonl",
        lambda p: p.write_text(GOOD + jsonl([row(9, prompt=[])])),
        ["line 5", 'column "prompt"', "empty message list"],
    ),
    (
        "prompt-number",
        "d.jsonl",
        lambda p: p.write_text(jsonl([row(0, prompt=7)])),
        ["line 1", 'column "prompt"', "a int"],
    ),
    (
        "message-without-content",
        "d.jsonl",
        lambda p: p.write_text(jsonl([row(0, prompt=[{"role": "user"}])])),
        ['column "prompt", message 0'],
    ),
    (
        "extra-info-list",
        "d.jsonl",
        lambda p: p.write_text(GOOD + jsonl([row(9, extra_info=[1, 2])])),
        ["line 5", 'column "extra_info"', "a list"],
    ),
    (
        "extra-info-list-parquet",
        "d.parquet",
        lambda p: pq.write_table(pa.Table.from_pylist([row(0, extra_info=[1, 2])]), p),
        ["row 0", 'column "extra_info"'],
    ),
    (
        "no-ground-truth",
        "d.jsonl",
        lambda p: p.write_text(jsonl([row(0, reward_model={})])),
        ['column "reward_model"', "ground_truth"],
    ),
    (
        "data-source-number",
        "d.jsonl",
        lambda p: p.write_text(jsonl([row(0, data_source=3)])),
        ['column "data_source"'],
    ),
]


@pytest.mark.parametrize(
    "make, name, words", [(c[2], c[1], c[3]) for c in DATA_CASES], ids=[c[0] for c in DATA_CASES]
)
def test_bad_data_file_names_file_row_and_column(tmp_path, make, name, words):
    path = tmp_path / name
    make(path)
    with pytest.raises(DataError) as info:
        load_rows(path)
    message = str(info.value)
    assert str(path) in message
    for word in words:
        assert word in message, message


def test_dropped_and_repeated_prompts_are_counted_and_the_loader_names_the_file():
    rows = load_rows_of([row(1)] * 3 + [row(2, prompt="x" * 500)])
    data = PromptDataset(rows, tiny_tokenizer(), max_prompt_len=64, source="d.jsonl")
    assert (len(data), data.filtered, data.duplicates) == (3, 1, 2)
    summary = data.summary()
    assert "3 of 4 prompts kept" in summary and "1 dropped" in summary
    assert "2 rows repeat" in summary
    with pytest.raises(DataError, match=r"d\.jsonl: data.batch_size = 8, but only 3 prompts"):
        PromptLoader(data, 8, seed=0)
    everything_long = PromptDataset(rows, tiny_tokenizer(), max_prompt_len=2, source="d.jsonl")
    with pytest.raises(DataError, match=r"all 4 prompts are longer than .*raise data.max_prompt"):
        PromptLoader(everything_long, 1, seed=0)


def load_rows_of(rows) -> list[dict]:
    from flowrl.data.verl_format import _check

    return [_check(r, "d.jsonl", f"line {i + 1}") for i, r in enumerate(rows)]


# -- model directories -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """Directories written by save_pretrained (the tiny Llama and its tokenizer), then broken."""
    from flowrl.models.tiny import tiny_model

    root = tmp_path_factory.mktemp("models")

    def save(name, **kw):
        directory = root / name
        tiny_model(**kw).save_pretrained(directory)
        tiny_tokenizer().save_pretrained(directory)
        return directory

    good = save("good")
    (save("no-config") / "config.json").unlink()
    weights = save("truncated") / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    (save("no-weights") / "model.safetensors").unlink()
    weights = save("header-cut") / "model.safetensors"
    (length,) = struct.unpack("<Q", weights.read_bytes()[:8])
    weights.write_bytes(weights.read_bytes()[: 8 + length // 2])
    for f in save("no-tokenizer").glob("tokenizer*"):
        f.unlink()
    other = save("other-shapes", hidden=64)
    (other / "config.json").write_text((good / "config.json").read_text())
    save("small-vocab", vocab=50)
    return root


MODEL_CASES = [
    ("no-config", "no-config/config.json", ["is missing"]),
    ("truncated", "truncated/model.safetensors", ["truncated or damaged", "bytes"]),
    ("header-cut", "header-cut/model.safetensors", ["not a readable safetensors"]),
    ("no-weights", "no-weights", ["no weight file", "save_pretrained"]),
    ("no-tokenizer", "no-tokenizer", ["no tokenizer file"]),
    ("other-shapes", "other-shapes", ["other shapes than its config.json"]),
    ("small-vocab", "small-vocab", ["embedding has 50 rows", "tokenizer has 103 tokens"]),
    ("good/config.json", "good/config.json", ["a file, not a model directory"]),
]


@pytest.mark.parametrize("given, named, words", MODEL_CASES, ids=[c[0] for c in MODEL_CASES])
def test_bad_model_directory_names_directory_and_file(model_dirs, given, named, words):
    from flowrl.models import load_model
    from flowrl.models.embedded import ModelNotFound

    with pytest.raises(ModelNotFound) as info:
        load_model(str(model_dirs / given))
    message = str(info.value)
    assert str(model_dirs / named) in message, message
    for word in words:
        assert word in message, message


def test_partial_snapshot_in_the_hub_cache_names_the_file_and_the_download(
    model_dirs, tmp_path, monkeypatch
):
    """The hub cache's layout: snapshots/<rev>/<file> are links into blobs/; an interrupted
    download leaves a link whose blob never arrived."""
    from flowrl.models.embedded import ModelNotFound
    from flowrl.models.loading import resolve_path

    repo = tmp_path / "hub" / "models--someone--tiny"
    snapshot = repo / "snapshots" / ("a" * 40)
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    for f in (model_dirs / "good").iterdir():
        (repo / "blobs" / f.name).write_bytes(f.read_bytes())
        os.symlink(repo / "blobs" / f.name, snapshot / f.name)
    (repo / "blobs" / "model.safetensors").unlink()  # the download stopped before this blob
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ModelNotFound) as info:
        resolve_path("someone/tiny")
    message = str(info.value)
    assert str(snapshot / "model.safetensors") in message
    assert "hf download someone/tiny" in message


def test_tokenizers_differ_by_vocabulary_and_special_tokens():
    from flowrl.models.loading import tokenizer_differences

    same, other = tiny_tokenizer(), tiny_tokenizer()
    assert tokenizer_differences(same, tiny_tokenizer()) == []
    other.add_tokens(["<extra>"])
    assert tokenizer_differences(same, other) == ["103 tokens vs 104"]


# -- values from user code -------------------------------------------------------------------

BAD_VALUES = [
    (None, "returned None"),
    ("high", "returned str 'high', not a number"),
    (float("nan"), "returned nan"),
    (float("inf"), "returned inf"),
    (float("-inf"), "returned -inf"),
    ({"value": 1.0}, 'returned a dict without "score"'),
    ({"score": "1"}, '("score") returned str'),
    ([1.0], "returned list"),
]


@pytest.mark.parametrize("value, words", BAD_VALUES, ids=[repr(v[0]) for v in BAD_VALUES])
def test_every_bad_score_names_the_scorer_and_the_value(value, words):
    from flowrl.rewards import BadValue, score_value

    with pytest.raises(BadValue) as info:
        score_value(value, "scorer my.py:score")
    assert str(info.value).startswith("scorer my.py:score") and words in str(info.value)


def test_numbers_of_any_kind_are_scores():
    import numpy as np
    import torch

    from flowrl.rewards import score_value

    for value in (1, True, np.float32(0.5), torch.tensor(0.25), {"score": 2, "acc": float("nan")}):
        score, extra = score_value(value)
        assert isinstance(score, float) and extra == {}  # a non-finite extra is left out


def test_bad_values_get_the_fallback_are_counted_and_named(tmp_path, capsys):
    """In-process (workers = 0) and in scoring processes alike; no flowrl traceback."""
    from flowrl.nodes.reward.rule import Params, run
    from flowrl.protocol import DataProto
    from flowrl.rewards.pool import close_all

    (tmp_path / "s.py").write_text(
        "def score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return {'1': None, '2': float('nan'), '3': 'x'}.get(solution_str, 1.0)\n"
    )
    batch = DataProto.from_dict(
        {},
        {
            "response_text": ["0", "1", "2", "3"],
            "ground_truth": ["0"] * 4,
            "data_source": ["a"] * 4,
            "extra_info": [{}] * 4,
        },
        meta={"base_dir": str(tmp_path)},
    )
    try:
        for workers in (0, 1):
            params = Params(scorer="s.py:score", workers=workers, fallback_score=-1.0)
            writes, metrics = run(batch, params)
            assert writes["scores"].tolist() == [1.0, -1.0, -1.0, -1.0]
            assert metrics["errors"] == 3
            err = capsys.readouterr().err
            assert "scorer s.py:score returned None" in err and "row 1" in err
            assert "Traceback" not in err
    finally:
        close_all()


def test_bad_tool_rewards_add_nothing_and_are_counted():
    from flowrl.nodes.reward.tools import tool_scores

    infos = [
        {"calls": [{"status": "bad_value", "error": "tool calc returned nan"}], "tool_rewards": []},
        {"calls": [], "tool_rewards": [], "rollout_reward_scores": {"calc": "high"}},
    ]
    shaped, bad = tool_scores([1.0, 1.0], infos, coef=1.0, final_coef=1.0, call_bonus=0.0)
    assert shaped == [1.0, 1.0]
    assert bad == [
        "tool calc returned nan on row 0",
        "tool calc (end-of-request reward) returned str 'high', not a number on row 1",
    ]


def test_a_tool_returning_a_bad_reward_is_recorded_not_raised():
    import asyncio

    from flowrl.agent.parsers import ToolCall
    from flowrl.agent.tools.session import Session

    session = Session([], {})
    session.functions = {"calc": lambda: ("7", float("nan"))}
    result = asyncio.run(session.call(ToolCall(name="calc", arguments={}), timeout=5))
    assert result.status == "bad_value" and result.reward is None  # as any failed call's
    assert result.error == "tool calc returned nan (not a finite number)"


def test_check_warns_on_a_learning_rate_far_outside_any_sane_range():
    from pathlib import Path

    from flowrl import compile

    graph = Path(__file__).resolve().parents[3] / "graphs" / "grpo.toml"
    assert not any("lr" in w for w in compile(graph).warnings)
    (warning,) = [w for w in compile(graph, ["models.policy.lr=1e6"]).warnings if " lr " in w]
    assert "[models.policy] lr = 1e+06 is far outside" in warning


# -- run directories -------------------------------------------------------------------------


class FrozenClock:
    """datetime.now() that always gives the same second: every start is a same-second start."""

    @staticmethod
    def now():
        import datetime

        return datetime.datetime(2025, 1, 2, 3, 4, 5)


def test_same_second_starts_get_directories_of_their_own(tmp_path, monkeypatch):
    import flowrl.runtime.run_dir as run_dirs

    monkeypatch.setattr(run_dirs, "datetime", FrozenClock)
    first, made = run_dirs.create(tmp_path / "runs" / "deep", "grpo")
    second, _ = run_dirs.create(tmp_path / "runs" / "deep", "grpo")
    assert (first.name, second.name) == ("grpo-20250102-030405", "grpo-20250102-030405-1")
    assert made == [tmp_path / "runs" / "deep", tmp_path / "runs"]
    # and four starts racing for one name, released together by a barrier. Threads, not
    # forked processes: a fork of this torch-loaded process can deadlock in the child; the
    # exclusive mkdir they race on is the same system call either way, and
    # tests/integration/test_run_dirs.py races two real `flowrl run` processes.
    barrier = threading.Barrier(4)

    def create_after():
        barrier.wait()
        return str(run_dirs.create(tmp_path / "race", "grpo")[0])

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        names = [f.result(timeout=60) for f in [pool.submit(create_after) for _ in range(4)]]
    assert len(set(names)) == 4 and all(os.path.isdir(n) for n in names)


def test_a_refused_start_leaves_nothing(tmp_path):
    import flowrl.runtime.run_dir as run_dirs

    run_dir, made = run_dirs.create(tmp_path / "a" / "b", "grpo")
    run_dirs.remove(run_dir, made)
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "file").write_text("x")
    with pytest.raises(run_dirs.RunDirError, match="run.out_dir .*file/runs cannot be made"):
        run_dirs.create(tmp_path / "file" / "runs", "grpo")


def test_a_locked_run_directory_is_refused_naming_the_holder(tmp_path):
    from flowrl.runtime.run_dir import Lock, RunDirError

    held = Lock(tmp_path).acquire()
    try:
        with pytest.raises(
            RunDirError, match=rf"in use by another flowrl process \(pid {os.getpid()}"
        ):
            Lock(tmp_path).acquire()
    finally:
        held.release()
    (tmp_path / "run.lock").write_text("pid 4194304 on elsewhere\n")  # its holder died
    taken = Lock(tmp_path).acquire()
    assert taken.stale == "pid 4194304"
    assert (tmp_path / "run.lock").read_text().startswith(f"pid {os.getpid()} on ")
    taken.release()


@pytest.mark.parametrize(
    "given, words",
    [
        ("missing", "no such directory"),
        ("file", "this is a file, not a run directory"),
        ("empty_dir", r"not a run directory \(it has no graph.toml\)"),
    ],
)
def test_resume_of_what_is_no_run_directory_creates_nothing(tmp_path, given, words):
    from flowrl.runtime.run_dir import RunDirError, resume_target

    (tmp_path / "file").write_text("x")
    (tmp_path / "empty_dir").mkdir()
    before = sorted(tmp_path.iterdir())
    with pytest.raises(RunDirError, match=words):
        resume_target(str(tmp_path / given))
    assert sorted(tmp_path.iterdir()) == before


# -- checkpoints and the graph given to --resume ---------------------------------------------


def _checkpoint(run_dir, step):
    from flowrl.runtime import checkpoint

    with checkpoint.writing(run_dir, step, keep=10, graph={"run": {"seed": 0}}) as out:
        (out / "controller.json").write_text(json.dumps({"step": step}))
        (out / "pool-main.pt").write_bytes(os.urandom(1000))
    return run_dir / "checkpoints" / f"step_{step:06d}"


@pytest.mark.parametrize(
    "damage, words",
    [
        (lambda c: (c / "pool-main.pt").unlink(), "pool-main.pt is missing"),
        (lambda c: (c / "controller.json").write_text('{"st'), "controller.json has 4 bytes"),
        (lambda c: (c / "pool-main.pt").write_bytes(os.urandom(1000)), "pool-main.pt differs"),
        (lambda c: (c / "manifest.json").unlink(), "manifest.json is missing"),
        (lambda c: (c / "manifest.json").write_text("{"), "manifest.json is unreadable"),
    ],
    ids=["weights-missing", "truncated", "altered", "no-manifest", "bad-manifest"],
)
def test_a_damaged_checkpoint_is_refused_naming_the_newest_complete_one(tmp_path, damage, words):
    from flowrl.runtime import checkpoint
    from flowrl.runtime.resume import choose
    from flowrl.runtime.run_dir import RunDirError

    good = _checkpoint(tmp_path, 2)
    damage(_checkpoint(tmp_path, 4))
    manifest = checkpoint.manifest(good)
    assert manifest["graph"] == {"run": {"seed": 0}} and manifest["flowrl_version"]
    with pytest.raises(RunDirError) as info:
        choose(tmp_path, None, "flowrl run g.toml")
    message = str(info.value)
    assert "step_000004 is incomplete or corrupted" in message and words in message
    assert f"flowrl run g.toml --resume {good}" in message
    assert choose(tmp_path, good, "flowrl run g.toml") == good  # the offered one resumes


def _run_dir_of(tmp_path, overrides=()):
    """A run directory as a run of graphs/grpo.toml with `overrides` leaves it."""
    import toml

    from flowrl.front import dsl

    graph = Path(__file__).resolve().parents[3] / "graphs" / "grpo.toml"
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "graph.toml").write_text(toml.dumps(dsl.load(graph, list(overrides)).raw))
    (run_dir / "run.json").write_text(
        json.dumps({"base_dir": str(graph.parent), "command": "flowrl run grpo"})
    )
    return run_dir, graph


def test_graph_differences_are_listed_unsafe_ones_refused_harmless_ones_allowed(tmp_path):
    from flowrl.front import dsl
    from flowrl.runtime.resume import compare_graph
    from flowrl.runtime.run_dir import RunDirError

    run_dir, graph = _run_dir_of(tmp_path, ["run.seed=1"])
    same = dsl.load(graph, ["run.seed=1", "run.steps=20"])  # the default written out: no change
    assert compare_graph(run_dir, same, False, "flowrl run grpo") == []
    harmless = dsl.load(graph, ["run.seed=1", "run.steps=40", "run.val_every=5"])
    assert compare_graph(run_dir, harmless, False, "c") == [
        "run.steps: 20 -> 40",
        "run.val_every: 10 -> 5",
    ]
    unsafe = dsl.load(graph, ["data.batch_size=8", "nodes.generate.n=4", "run.steps=40"])
    with pytest.raises(RunDirError) as info:
        compare_graph(run_dir, unsafe, False, "c")
    message = str(info.value)
    for line in ("data.batch_size: 4 -> 8", "nodes.generate.n: 8 -> 4", "run.seed: 1 -> 0"):
        assert line in message
    assert "run.steps" not in message  # harmless: not among the refused
    assert "flowrl run grpo" in message and "--allow-graph-change" in message
    assert len(compare_graph(run_dir, unsafe, True, "c")) == 4  # accepted knowingly


def test_another_algorithm_is_refused(tmp_path):
    from flowrl.front import dsl
    from flowrl.runtime.resume import compare_graph
    from flowrl.runtime.run_dir import RunDirError

    run_dir, graph = _run_dir_of(tmp_path)
    ppo = dsl.load(graph.with_name("ppo.toml"))
    with pytest.raises(RunDirError) as info:
        compare_graph(run_dir, ppo, False, "c")
    message = str(info.value)
    assert 'nodes.advantage.uses: "advantage.grpo" -> "advantage.gae"' in message
    assert "models.critic: added" in message and "nodes.values: added (uses values)" in message
    assert len(message.splitlines()) < 30


def test_a_read_only_file_refuses_the_resume_before_anything_changes(tmp_path):
    from flowrl.runtime.resume import check_writable
    from flowrl.runtime.run_dir import RunDirError

    (tmp_path / "metrics.jsonl").write_text("{}\n")
    (tmp_path / "metrics.jsonl").chmod(0o444)  # read-only even for root, by its mode
    with pytest.raises(RunDirError, match=r"metrics.jsonl is read-only.*chmod u\+w"):
        check_writable(tmp_path)


# -- signals ---------------------------------------------------------------------------------


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_is_no_failure_of_the_code_it_interrupts(sig):
    from flowrl.runtime.stop import Stopped, stopped_by_signals

    caught = []
    with pytest.raises(Stopped, match=f"stopped by {sig.name}"), stopped_by_signals():
        try:  # a node call wraps Exception into a failure of its own: a signal passes through
            os.kill(os.getpid(), sig)
        except Exception as e:
            caught.append(e)
    assert caught == []
