"""When most of a step's requests fail, the step says so with the first error and where it came
from, and its update is passed over: no later node meets rows without responses. A walk that
trains nothing (validation) scores what it got; the pools' transitions stay in order."""

import sys
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch

from flowrl import testing
from flowrl.errors import described, where_raised
from flowrl.protocol import DataProto
from flowrl.runtime import step_log
from flowrl.runtime.node_call import CallResult

sys.path.insert(0, str(Path(__file__).parent))
from test_row_order import GOOD, TOY, Recording, prompts  # noqa: E402

compile_text = partial(testing.compile_text, toy=TOY)


def infos(errors: list[str | None]) -> np.ndarray:
    out = np.empty(len(errors), dtype=object)
    for i, error in enumerate(errors):
        out[i] = {"termination": "error" if error else "stop", "error": error}
    return out


def rollout_rows(errors) -> DataProto:
    rows = DataProto.from_dict({"response_mask": torch.ones(len(errors), 2, dtype=torch.long)})
    rows["rollout_info"] = infos(errors)
    return rows


@pytest.mark.parametrize(
    ("errors", "said"),
    [
        (["E: a (x.py:3)"] * 4, "4 of 4 requests failed; first: E: a (x.py:3)"),
        ([None, "E: b", "E: c", "E: d"], "3 of 4 requests failed; first: E: b"),
        ([None, None, "E: c", "E: d"], ""),  # half: the step trains on the other half
        ([None] * 4, ""),
    ],
)
def test_a_step_fails_when_more_than_half_its_requests_did(errors, said):
    assert step_log.failed_step(rollout_rows(errors)) == said


def test_a_request_out_of_time_counts_as_failed():
    rows = rollout_rows([None, None])
    rows["rollout_info"] = infos([None, None])
    for info in rows["rollout_info"]:
        info["termination"] = "timeout"
    assert step_log.failed_step(rows).endswith("first: ran out of time (request_timeout_s)")


class FailingRollout(Recording):
    """The toy graph's walk, whose generate call answers with `errors` as its requests'
    outcome (one per row it returns)."""

    def __init__(self, plan, errors):
        super().__init__(plan)
        self.errors = errors

    def submit(self, pool, method, per_rank_args):
        out = super().submit(pool, method, per_rank_args)
        if method == "call" and per_rank_args[0][0] == "generate":
            writes = out[0].writes
            writes["rollout_info"] = infos(self.errors)
            out = [CallResult(writes, {}, 0.0, 0.0)]
        return out


def test_a_step_whose_requests_mostly_failed_passes_over_every_node_after_them(tmp_path):
    plan = compile_text(tmp_path, GOOD)  # 2 prompts x 4 samples; offload = "always"
    executor = FailingRollout(plan, [None] + ["TypeError: no (tutor.py:5)"] * 7)
    result = executor.run_step(prompts([0, 1]))
    calls = [e[1] for e in executor.log if e[0] == "call"]
    assert calls == ["generate"]  # score, log-probs, advantage and the update never ran
    assert "advantages" not in result.batch and "scores" not in result.batch
    said = "7 of 8 requests failed; first: TypeError: no (tutor.py:5)"
    assert result.batch.meta[step_log.FAILED_STEP] == said
    assert step_log.trained_nothing(result.batch)  # it counts toward run.max_failed_steps
    # the pools' moves still pair up: every reload of a model is followed by its offload
    moves = [(kind, model) for kind, model, _ in (e for e in executor.log if e[0] != "call")]
    for model in ("policy", "ref"):
        kinds = [kind for kind, m in moves if m == model and kind in ("reload", "offload")]
        assert kinds and kinds[-1] == "offload", (model, kinds)
    report = step_log.failure_report(1, result.batch, list(range(1, 8)), ["  request 1 ..."])
    assert report == f"step 1: {said}; the step's update was skipped\n  request 1 ..."


def test_a_step_with_most_requests_answered_trains_on_them(tmp_path):
    plan = compile_text(tmp_path, GOOD)
    executor = FailingRollout(plan, [None] * 6 + ["TypeError: no"] * 2)
    result = executor.run_step(prompts([0, 1]))
    assert [e[1] for e in executor.log if e[0] == "call"][-1] == "update"
    assert step_log.FAILED_STEP not in result.batch.meta
    assert not step_log.trained_nothing(result.batch)


def test_a_walk_that_trains_nothing_goes_on_after_failed_requests(tmp_path):
    # validation: it scores what the requests gave, failed or not
    plan = compile_text(tmp_path, GOOD)
    executor = FailingRollout(plan, ["TypeError: no"] * 8)
    result = executor.run_step(prompts([0, 1]), only={"generate", "score"})
    assert [e[1] for e in executor.log if e[0] == "call"] == ["generate"]
    assert "scores" in result.batch and step_log.FAILED_STEP not in result.batch.meta


USER_CODE = """
class Tutor:
    def __init__(self, config):
        raise ConnectionError("sandbox unreachable")

    def generate_response(self, instance_id, messages):
        return True, "", 0.0, {}
"""


def test_an_error_is_described_at_the_users_line(tmp_path):
    from flowrl import refs
    from flowrl.agent.tools import ToolError
    from flowrl.agent.verl import make_interaction

    (tmp_path / "tutor.py").write_text(USER_CODE)
    with pytest.raises(ToolError) as raised:  # flowrl's wrapper, raised from the user's error
        make_interaction(refs.load("tutor.py:Tutor", tmp_path), "tutor")
    assert where_raised(raised.value).endswith("tutor.py:4")  # the user's line, not flowrl's
    said = described(raised.value)
    assert said.startswith("ToolError: interaction Tutor(config={...}) raised ConnectionError")
    assert said.endswith("tutor.py:4)")
    # a message that names its place already gets no second one
    assert described(TypeError("start (tutor.py:2): no **kwargs")).endswith("no **kwargs")


def test_a_verl_interaction_without_kwargs_fails_naming_its_method(tmp_path):
    import asyncio

    from flowrl.agent.verl import make_interaction

    class Tutor:
        def __init__(self, config):
            pass

        async def start_interaction(self, instance_id=None):
            return None

        async def generate_response(self, instance_id, messages, **kwargs):
            return True, "ok", 0.0, {}

    interaction = make_interaction(Tutor, "tutor")
    with pytest.raises(TypeError, match=r"Tutor.start_interaction \(.*test_failed_requests.py:"):
        asyncio.run(interaction.start("id", ground_truth="3"))
    with pytest.raises(TypeError, match=r"'ground_truth': give it \*\*kwargs"):
        asyncio.run(interaction.start("id", ground_truth="3"))
    asyncio.run(interaction.start("id"))  # no kwargs: fine


def test_requests_whose_infrastructure_failed_leave_their_group_and_the_loss(tmp_path):
    """An engine that died or a service that is down is not the model's failure: those rows
    are never scored, a group they leave with one row goes whole, the rest trains."""
    plan = compile_text(tmp_path, GOOD)  # 2 prompts x 4 samples: rows 0-3 and 4-7
    executor = FailingRollout(plan, [None] * 8)
    outcome = ["stop", "infra", "infra", "infra", "stop", "infra", "stop", "stop"]

    def submit(pool, method, per_rank_args, inner=executor.submit):
        out = inner(pool, method, per_rank_args)
        if method == "call" and per_rank_args[0][0] == "generate":
            for info, reason in zip(out[0].writes["rollout_info"], outcome, strict=True):
                info["termination"] = reason
                info["error"] = "InfraError: engine gone" if reason == "infra" else None
        return out

    executor.submit = submit
    result = executor.run_step(prompts([0, 1]))
    assert [e[1] for e in executor.log if e[0] == "call"][-1] == "update"  # it trained
    uids = result.batch["uid"].tolist()
    assert len(result.batch) == 3 and len(set(uids)) == 1  # rows 4, 6, 7: the second group
    assert [i["termination"] for i in result.batch["rollout_info"]] == ["stop"] * 3
    assert result.metrics["infra_failed"] == 4.0 and result.metrics["infra_groups_dropped"] == 1.0
    assert step_log.FAILED_STEP not in result.batch.meta


def test_an_infra_error_ends_a_request_as_infra_and_a_code_error_as_error():
    from flowrl.errors import InfraError, is_infra

    class ConnectError(Exception):  # named as httpx names its own
        pass

    assert is_infra(InfraError("engine gone")) and is_infra(ConnectionRefusedError())
    assert is_infra(ConnectError()) and not is_infra(ValueError("bad answer"))
    from flowrl.agent.tools.sandbox_service import SandboxServiceError

    assert is_infra(SandboxServiceError("the service answered HTTP 500"))


def test_a_tool_whose_service_is_down_ends_its_request_as_infra(tmp_path):
    from flowrl.testing import scripted_request

    (tmp_path / "remote.py").write_text(
        "from flowrl.api import InfraError\n\n"
        "def lookup(q: str) -> str:\n"
        '    """Look it up.\n\n    Args:\n        q: the query.\n    """\n'
        '    raise InfraError("the search service answered 503")\n\n'
        "def local(q: str) -> str:\n"
        '    """Look it up here.\n\n    Args:\n        q: the query.\n    """\n'
        '    raise ValueError("no such word")\n'
    )
    call = '<tool_call>{"name": "%s", "arguments": {"q": "x"}}</tool_call>'
    tools = ["remote.py:lookup", "remote.py:local"]
    down = scripted_request([call % "lookup", "done"], tools, base_dir=tmp_path, raise_errors=False)
    assert down.info()["termination"] == "infra"
    assert "the search service answered 503" in down.info()["error"]
    # the tool's own error is an answer the model reads; the request goes on
    own = scripted_request([call % "local", "done"], tools, base_dir=tmp_path)
    assert own.info()["termination"] == "stop" and own.info()["tool_errors"] == 1
