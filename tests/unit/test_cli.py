"""The CLI's error handling and choices: one error base, constants from one place."""

import attrs
import pytest
from flowrl.nodes.update import critic, policy

from flowrl import cli, nodespec
from flowrl.data import DataError
from flowrl.errors import FlowrlError, GraphErrors
from flowrl.front import schema
from flowrl.front.registry import UnknownNode
from flowrl.math import ops
from flowrl.models import ModelNotFound
from flowrl.rewards import ScorerError


@pytest.mark.parametrize("cls", [GraphErrors, DataError, ModelNotFound, ScorerError, UnknownNode])
def test_every_user_error_derives_from_the_base(cls):
    assert issubclass(cls, FlowrlError)


def test_cli_reports_any_flowrl_error_without_traceback(monkeypatch, capsys):
    class NewKindOfError(FlowrlError):  # a subclass the CLI has never heard of
        pass

    def fails(args):
        raise NewKindOfError("pool main, rank 1: it broke")

    monkeypatch.setattr(cli, "cmd_nodes", fails)
    assert cli.main(["nodes"]) == 1
    assert capsys.readouterr().err == "flowrl: pool main, rank 1: it broke\n"


def test_cli_lets_a_bug_through(monkeypatch):
    def fails(args):
        raise KeyError("a bug in flowrl, not a user's mistake")

    monkeypatch.setattr(cli, "cmd_nodes", fails)
    with pytest.raises(KeyError):
        cli.main(["nodes"])


def test_backend_choices_come_from_the_schema(capsys):
    with pytest.raises(SystemExit):
        cli.main(["run", "g.toml", "--backend", "slurm"])
    err = capsys.readouterr().err
    assert all(f"'{name}'" in err for name in schema.BACKENDS)


def test_heads_are_defined_once():
    from flowrl.models import loading

    assert schema.HEADS is nodespec.HEADS and loading.HEADS is nodespec.HEADS


def test_loss_aggregation_modes_are_defined_once():
    for params in (critic.Params, policy.Params):
        with pytest.raises(ValueError):
            params(agg="sum")
        for mode in ops.AGG_MODES:
            assert params(agg=mode).agg == mode
    assert not hasattr(critic, "AGG") and not hasattr(policy, "AGG")
    assert attrs.fields(policy.Params).agg.default in ops.AGG_MODES
