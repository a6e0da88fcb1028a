"""A corpus of malformed graph files and overrides, run through the CLI as a user would.

Every case must exit non-zero, print no traceback, and name the file (or the override), the
table and the key; enumerations list their allowed values; nothing wrong is accepted.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from flowrl.cli import main

ROOT = Path(__file__).resolve().parents[3]
GRPO = (ROOT / "graphs/grpo.toml").read_text()
RAW_REPRS = ("'in_'", "must be in ('", "Attribute(", "<function", "(got ")


def with_line(table: str, line: str, text: str = GRPO) -> str:
    """The graph with `line` added at the top of `table` (a header such as "[models.policy]")."""
    assert table in text
    return text.replace(table, f"{table}\n{line}", 1)


def check(tmp_path, capsys, text, args=(), data: bytes | None = None):
    """(exit code, stderr, path) of `flowrl check` on `text` (or raw bytes) plus `args`."""
    path = tmp_path / "g.toml"
    path.write_bytes(data if data is not None else text.encode())
    code = main(["check", str(path), *args])  # an uncaught exception fails the test
    err = capsys.readouterr().err
    return code, err, str(path)


# (id, graph text, overrides, substrings the message must hold besides the file)
CASES = [
    (
        "steps-zero",
        with_line("[run]", "steps = 0", GRPO.replace("steps = 20\n", "")),
        [],
        ["[run]", '"steps"', "from 1 to"],
    ),
    (
        "steps-absurd",
        GRPO.replace("steps = 20", "steps = 1_000_000_000_000"),
        [],
        ["[run]", '"steps"', "1_000_000_000"],
    ),
    ("seed-negative", GRPO.replace("seed = 0", "seed = -1"), [], ["[run]", '"seed"', "from 0"]),
    (
        "backend-unknown",
        with_line("[run]", 'backend = "slurm"'),
        [],
        ["[run]", '"backend"', 'one of "ray", "local"'],
    ),
    (
        "batch-absurd",
        GRPO.replace("batch_size = 4", "batch_size = 1_000_000_000_000"),
        [],
        ["[data]", '"batch_size"', "10_000_000"],
    ),
    (
        "source-empty",
        GRPO.replace('source = "arithmetic"', 'source = ""'),
        [],
        ["[data]", '"source"', "non-empty"],
    ),
    (
        "lr-nan",
        GRPO.replace("lr = 2e-5", "lr = nan"),
        [],
        ["[models.policy]", '"lr"', "not a finite number"],
    ),
    (
        "lr-inf",
        GRPO.replace("lr = 2e-5", "lr = inf"),
        [],
        ["[models.policy]", '"lr"', "not a finite number"],
    ),
    (
        "lr-negative",
        GRPO.replace("lr = 2e-5", "lr = -2e-5"),
        [],
        ["[models.policy]", '"lr"', "> 0"],
    ),
    (
        "betas-one",
        with_line("[models.policy]", "betas = [0.9, 1.0]"),
        [],
        ["[models.policy]", '"betas"', "each in [0, 1)"],
    ),
    (
        "betas-short",
        with_line("[models.policy]", "betas = [0.9]"),
        [],
        ["[models.policy]", '"betas"', "a list of 2 numbers"],
    ),
    (
        "betas-nan",
        with_line("[models.policy]", "betas = [nan, 0.9]"),
        [],
        ["[models.policy]", '"betas"', "not a finite number"],
    ),
    (
        "grad-clip-negative",
        with_line("[models.policy]", "grad_clip = -1.0"),
        [],
        ["[models.policy]", '"grad_clip"', ">= 0"],
    ),
    (
        "dtype-unknown",
        with_line("[models.policy]", 'dtype = "fp32"'),
        [],
        ["[models.policy]", '"dtype"', 'one of "float32", "bfloat16", "float16"'],
    ),
    (
        "head-unknown",
        with_line("[models.ref]", 'head = "critic"'),
        [],
        ["[models.ref]", '"head"', 'one of "lm", "value"'],
    ),
    (
        "workers-absurd",
        GRPO.replace("workers = 1", "workers = 1_000_000_000_000"),
        [],
        ["[pools.main]", '"workers"', "65_536"],
    ),
    (
        "cpus-zero",
        GRPO.replace("cpus_per_worker = 2", "cpus_per_worker = 0"),
        [],
        ["[pools.main]", '"cpus_per_worker"', "from 1"],
    ),
    (
        "device-unknown",
        with_line("[pools.main]", 'device = "tpu"'),
        [],
        ["[pools.main]", '"device"', 'one of "cpu", "cuda"'],
    ),
    (
        "placement-lowercase",
        with_line("[pools.main]", 'placement = "pack"'),
        [],
        ["[pools.main]", '"placement"', '"STRICT_SPREAD"'],
    ),
    (
        "top-p-zero",
        with_line("[nodes.generate]", "top_p = 0.0"),
        [],
        ["[nodes.generate]", '"top_p"', "in (0, 1]"],
    ),
    (
        "top-p-above-one",
        with_line("[nodes.generate]", "top_p = 1.5"),
        [],
        ["[nodes.generate]", '"top_p"', "in (0, 1]"],
    ),
    (
        "temperature-zero",
        with_line("[nodes.generate]", "temperature = 0.0"),
        [],
        ["[nodes.generate]", '"temperature"', "> 0"],
    ),
    ("n-zero", GRPO.replace("n = 8", "n = 0"), [], ["[nodes.generate]", '"n"', "from 1"]),
    (
        "top-k-negative",
        with_line("[nodes.generate]", "top_k = -1"),
        [],
        ["[nodes.generate]", '"top_k"', "from 0"],
    ),
    (
        "kl-kind-unknown",
        with_line("[nodes.update_policy]", 'kl_loss_kind = "k9"'),
        [],
        ["[nodes.update_policy]", '"kl_loss_kind"', 'one of "k1", "k2", "k3", "abs"'],
    ),
    (
        "agg-unknown",
        with_line("[nodes.update_policy]", 'agg = "sum"'),
        [],
        ["[nodes.update_policy]", '"agg"', '"seq-mean-token-mean"'],
    ),
    (
        "epochs-zero",
        with_line("[nodes.update_policy]", "epochs = 0"),
        [],
        ["[nodes.update_policy]", '"epochs"', "from 1"],
    ),
    (
        "clip-negative",
        with_line("[nodes.update_policy]", "clip_low = -0.1"),
        [],
        ["[nodes.update_policy]", '"clip_low"', ">= 0"],
    ),
    (
        "dual-clip-below-one",
        with_line("[nodes.update_policy]", "dual_clip = 0.5"),
        [],
        ["[nodes.update_policy]", '"dual_clip"', "0 (off) or > 1"],
    ),
    (
        "grpo-eps-zero",
        with_line("[nodes.advantage]", "eps = 0.0"),
        [],
        ["[nodes.advantage]", '"eps"', "> 0"],
    ),
    (
        "uses-not-string",
        GRPO.replace('uses = "advantage.grpo"', "uses = 3"),
        [],
        ["[nodes.advantage]", '"uses"', "should be a string"],
    ),
    (
        "model-not-string",
        GRPO.replace('model = "ref"', "model = 3"),
        [],
        ["[nodes.ref_logprob]", '"model"', "should be a string"],
    ),
    (
        "node-id-with-dot",
        GRPO.replace("[nodes.reward]", '[nodes."reward.rule"]'),
        [],
        ['[nodes."reward.rule"]', '"reward.rule"', "letters, digits, _ and -", '"reward_rule"'],
    ),
    (
        "model-id-with-dot",
        GRPO.replace("[models.ref]", '[models."ref.v1"]').replace(
            'model = "ref"', 'model = "ref.v1"'
        ),
        [],
        ['[models."ref.v1"]', '"ref.v1"', "letters, digits, _ and -"],
    ),
    (
        "node-table-array",
        GRPO.replace("[nodes.reward]", "[[nodes.reward]]"),
        [],
        ["[nodes]", '"nodes.reward"', "must be a table"],
    ),
    (
        "override-lr",
        GRPO,
        ["models.policy.lr=-1"],
        ['override "models.policy.lr=-1"', "[models.policy]", '"lr"', "(from the command line)"],
    ),
    (
        "override-nan",
        GRPO,
        ["nodes.generate.temperature=nan"],
        ['override "nodes.generate.temperature=nan"', "[nodes.generate]", "not a finite"],
    ),
    (
        "override-unknown-key",
        GRPO,
        ["run.stepz=5"],
        ['override "run.stepz=5"', "[run]", '"stepz"', 'did you mean "steps"'],
    ),
    (
        "override-unknown-node",
        GRPO,
        ["nodes.update.epochs=2"],
        ['override "nodes.update.epochs=2"', "[nodes.update]", 'did you mean "update_policy"'],
    ),
    (
        "override-enum",
        GRPO,
        ["nodes.update_policy.agg=sum"],
        [
            'override "nodes.update_policy.agg=sum"',
            "[nodes.update_policy]",
            '"agg"',
            '"token-mean"',
        ],
    ),
    ("override-no-value", GRPO, ["run.steps"], ['override "run.steps"', "table.key=value"]),
    (
        "override-pool",
        GRPO,
        ["models.policy.pool=gpu"],
        ['override "models.policy.pool=gpu"', "[models.policy]", 'pool "gpu" is not defined'],
    ),
    (
        "verifiers-env-on-the-agent-node",
        GRPO.replace('uses = "generate"', 'uses = "agent"\nenv = "verifiers:game.py"'),
        [],
        ["[nodes.generate]", "a verifiers environment is not an interaction", "agent_program"],
    ),
    (
        "verifiers-env-answering",
        GRPO.replace('uses = "generate"', 'uses = "agent_program"\nenv = "verifiers:game.py"'),
        [],
        ["[nodes.generate]", "no file", "game.py", 'returns = "reward"'],
    ),
    (
        "verifiers-source-missing",
        GRPO.replace('source = "arithmetic"', 'source = "verifiers:tasks.py"'),
        [],
        ["[data] source", '"verifiers:tasks.py": no file', "tasks.py"],
    ),
    (
        "override-model",
        GRPO,
        ["nodes.generate.model=polcy"],
        ['override "nodes.generate.model=polcy"', "[nodes.generate]", 'did you mean "policy"'],
    ),
    (
        "override-uses",
        GRPO,
        ["nodes.advantage.uses=advantage.grp"],
        ['override "nodes.advantage.uses=advantage.grp"', "[nodes.advantage]", '"advantage.grpo"'],
    ),
    (
        "override-into-value",
        GRPO,
        ["nodes.generate.n.x=1"],
        ['override "nodes.generate.n.x=1"', '"nodes.generate.n" is a value'],
    ),
    (
        "override-whole-table",
        GRPO,
        ["models.policy=3"],
        ['override "models.policy=3"', "[models.policy] is a table"],
    ),
]


@pytest.mark.parametrize(
    ("text", "overrides", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_bad_graph_is_refused_with_a_message_that_says_where(
    tmp_path, capsys, text, overrides, expected
):
    code, err, path = check(tmp_path, capsys, text, overrides)
    assert code != 0 and "Traceback" not in err
    assert path in err
    for part in expected:
        assert part in err, f"{part!r} missing from:\n{err}"
    assert not any(raw in err for raw in RAW_REPRS), err


def test_every_bad_value_of_a_table_is_reported_once(tmp_path, capsys):
    lines = 'lr = nan\nbetas = [0.9, 1.0]\ndtype = "fp32"\ngrad_clip = -1.0'
    text = with_line("[models.policy]", lines, GRPO.replace("lr = 2e-5\n", ""))
    code, err, _ = check(tmp_path, capsys, text)
    assert code == 2 and err.startswith("4 errors:")
    for key in ("lr", "betas", "dtype", "grad_clip"):
        assert err.count(f'"{key}" = ') == 1
    assert "unknown model" not in err  # the nodes using the policy are not told it is unknown


FILE_CASES = [
    (
        "not-utf8",
        GRPO.encode().replace(b'"arithmetic"', b'"arithm\xffetic"'),
        ["line 12, column 17", "not UTF-8", "byte 0xff"],
    ),
    (
        "table-then-array",
        (GRPO + "\n[[run]]\nsteps = 3\n").encode(),
        ["line 52, column", "[[run]]", "defines again a table"],
    ),
    (
        "table-twice",
        (GRPO + "\n[data]\nshuffle = false\n").encode(),
        ["line 52", "table [data] is declared twice", "merge the two [data] tables"],
    ),
    (
        "syntax",
        GRPO.replace("steps = 20", "steps = = 20").encode(),
        ["line 6, column", "not valid TOML", "steps = = 20"],
    ),
    (  # tomllib notices it at the next table; the message names where the array opened
        "unclosed-array",
        GRPO.replace("[nodes.reward]", 'stop = ["\\n", "]"\n\n[nodes.reward]').encode(),
        [
            f"line {GRPO[: GRPO.index('[nodes.reward]')].count(chr(10)) + 1}: not valid TOML",
            "the array nodes.generate.stop = [ opened on this line is not closed",
            'close it with "]" after its last element: stop = ["\\n", "]"',
        ],
    ),
]


@pytest.mark.parametrize(
    ("data", "expected"), [c[1:] for c in FILE_CASES], ids=[c[0] for c in FILE_CASES]
)
def test_unreadable_file_is_named_with_line_and_column(tmp_path, capsys, data, expected):
    code, err, path = check(tmp_path, capsys, "", data=data)
    assert code == 2 and "Traceback" not in err and path in err
    for part in expected:
        assert part in err, f"{part!r} missing from:\n{err}"


def test_byte_order_mark_is_accepted(tmp_path, capsys):
    code, err, _ = check(tmp_path, capsys, "", data=b"\xef\xbb\xbf" + GRPO.encode())
    assert code == 0, err


def test_directory_as_graph_file_names_its_graphs(tmp_path, capsys):
    (tmp_path / "mine.toml").write_text(GRPO)
    assert main(["check", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "is a directory" in err and "mine.toml" in err


def test_missing_path_is_not_replaced_by_the_shipped_graph(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["check", "some/dir/grpo.toml"]) == 2
    err = capsys.readouterr().err
    assert "some/dir/grpo.toml: file: no such file" in err and 'write "grpo"' in err
    assert main(["check", "grpo.toml"]) == 2  # ends in .toml: a path, here missing
    assert main(["check", "grpoo"]) == 2
    assert 'no shipped graph named "grpoo" (did you mean "grpo"?)' in capsys.readouterr().err


def test_bare_name_is_the_shipped_graph_and_says_so(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["check", "grpo"]) == 0
    out = capsys.readouterr().out
    shipped = str(ROOT / "graphs" / "grpo.toml")
    assert out.startswith(f"{shipped} (the shipped graph grpo): ok")
    assert main(["plan", "grpo"]) == 0
    captured = capsys.readouterr()
    assert f"grpo is the shipped graph {shipped}" in captured.err
    assert captured.out.startswith("plan for")  # stdout stays the plan alone


def test_check_applies_overrides_given_after_or_before_the_file(tmp_path, capsys):
    path = tmp_path / "g.toml"
    path.write_text(GRPO)
    assert main(["check", str(path), "run.steps=3"]) == 0
    capsys.readouterr()
    # n = 1 leaves GRPO one sample per group: only an applied override can cause this error
    assert main(["check", "nodes.generate.n=1", str(path)]) == 2
    assert "each prompt has 1 sample" in capsys.readouterr().err
    assert main(["check", str(path), "--set", "run.steps=0"]) == 2
    assert 'override "run.steps=0"' in capsys.readouterr().err


def test_check_with_overrides_and_no_file_is_an_error(capsys):
    assert main(["check", "run.steps=3"]) == 2
    assert "no graph file given" in capsys.readouterr().err


def test_suggestions_are_only_ids_an_override_can_name(tmp_path, capsys):
    text = GRPO.replace("[models.ref]", '[models."ref.v1"]')  # ref.v1 is not a valid id
    code, err, _ = check(tmp_path, capsys, text.replace('model = "ref"', 'model = "ref.v"'))
    assert code == 2 and 'unknown model "ref.v"' in err
    assert 'did you mean "ref.v1"' not in err


def test_closed_output_pipe_gives_no_traceback():
    read, write = os.pipe()
    os.close(read)  # a reader that is already gone, like `head -1` after its line
    try:
        result = subprocess.run(
            [sys.executable, "-m", "flowrl.cli", "nodes"],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    finally:
        os.close(write)
    assert "Traceback" not in result.stderr and "BrokenPipeError" not in result.stderr
    assert result.returncode == 141


def test_unwritable_render_output_is_a_message(tmp_path, capsys):
    (tmp_path / "file").write_text("")  # a file where a directory is expected
    out = tmp_path / "file" / "g.dot"
    assert main(["render", str(ROOT / "graphs/grpo.toml"), "-o", str(out)]) == 1
    assert f"flowrl: cannot write {out}" in capsys.readouterr().err


def test_missing_or_unknown_data_file_is_named(tmp_path):
    from flowrl.errors import GraphErrors
    from flowrl.front import dsl

    graph = ROOT / "graphs" / "grpo.toml"
    for value, words in (
        ('"nowhere/train.parquet"', "no such data file"),
        ('"train.csv"', "neither a built-in source nor a data file"),
    ):
        with pytest.raises(GraphErrors) as info:
            dsl.load(graph, [f"data.source={value}"])
        (problem,) = info.value.problems
        assert problem.where == "[data] source" and words in problem.message
        assert "data.source=" in problem.message  # quotes the override


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has CUDA")
def test_cuda_pool_without_cuda_is_named_before_anything_loads(monkeypatch):
    from flowrl import compile
    from flowrl.runtime.guards import DeviceError, check_devices

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    plan = compile(ROOT / "graphs" / "grpo.toml", ['pools.main.device="cuda"'])
    with pytest.raises(DeviceError, match=r'\[pools.main\] device = "cuda".*device = "cpu"'):
        check_devices(plan)
