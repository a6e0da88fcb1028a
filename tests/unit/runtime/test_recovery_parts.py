"""The parts of recovery that need no cluster: when a lost rank may be recovered from (and the
backoff), fault points firing once, the loggers cut back and reopened, and SIGTERM's safe
point. The recoveries themselves: tests/integration/test_recovery.py."""

import json
import os
import signal
import time

import pytest

from flowrl.runtime import faults, stop
from flowrl.runtime.loggers import Loggers
from flowrl.runtime.recovery import LostWorker, Recovery, RecoveryStop


def lost(pool="gen", rank=0, what="died"):
    return LostWorker(f"call generate on pool {pool}, rank {rank}: gone", pool, rank, what, "pid 1")


def test_backoff_doubles_while_no_step_finishes_and_resets_after_one():
    recovery = Recovery(max_restarts=10, backoff_s=2.0)
    assert recovery.allow(lost(), 3) == 2.0
    assert recovery.allow(lost(pool="train"), 3) == 4.0  # another point, no step between
    recovery.finished(3)
    assert recovery.allow(lost(), 5) == 2.0
    assert recovery.restarts == 3


def test_the_same_point_twice_in_a_row_stops_with_the_cause():
    recovery = Recovery(max_restarts=10, backoff_s=0)
    recovery.allow(lost(), 3)
    recovery.finished(2)  # a step before the failing one: no progress past it
    with pytest.raises(RecoveryStop, match="gone; the same fault stopped step 3 again"):
        recovery.allow(lost(), 3)
    recovery = Recovery(max_restarts=10, backoff_s=0)
    recovery.allow(lost(), 3)
    recovery.finished(3)  # the step got past the fault: a later one there is a new fault
    assert recovery.allow(lost(), 3) == 0


def test_max_restarts_bounds_the_recoveries_and_zero_stops_at_the_first():
    with pytest.raises(RecoveryStop, match=r"run.max_restarts = 0"):
        Recovery(max_restarts=0, backoff_s=0).allow(lost(), 1)
    recovery = Recovery(max_restarts=2, backoff_s=0)
    for step in (1, 2):
        recovery.allow(lost(), step)
        recovery.finished(step)
    with pytest.raises(RecoveryStop, match=r"recovered 2 times already \(run.max_restarts = 2\)"):
        recovery.allow(lost(), 3)


def test_the_event_says_what_died_where_and_what_was_restored():
    recovery = Recovery(max_restarts=3, backoff_s=0)
    failure = lost(what="node lost")
    recovery.allow(failure, 4)
    row, said = recovery.event(failure, 4, 2, "checkpoint step_000002", 3.21, 1.5e9)
    assert row["event"] == "recovery" and row["step"] == 4 and row["restored_step"] == 2
    assert (row["lost"], row["what"], row["where"]) == ("pool gen, rank 0", "node lost", "pid 1")
    assert row["seconds"] == 3.21 and row["cause"] == str(failure) and row["time"] == 1.5e9
    assert "checkpoint step_000002 loaded in 3.2 s; going on from step 2" in said
    assert "recovery 1 of at most 3" in said


def test_a_fault_fires_once_per_mark_folder(tmp_path, monkeypatch):
    fired = []
    monkeypatch.setattr(faults, "_fire", fired.append)
    monkeypatch.setenv(faults.VARIABLE, "gen.0.generate:2:TERM,logged:3")
    faults.point("gen.0.generate", 1)
    faults.point("gen.0.generate", 12)  # not step 2
    faults.point("logged", 3)
    faults.point("gen.0.generate", 2)
    assert fired == ["KILL", "TERM"]
    faults.point("gen.0.generate", 2)  # without FLOWRL_FAULTS_ONCE: every time
    assert fired == ["KILL", "TERM", "TERM"]
    monkeypatch.setenv(faults.ONCE, str(tmp_path))
    faults.point("logged", 3)
    faults.point("logged", 3)
    assert fired == ["KILL", "TERM", "TERM", "KILL"]
    (mark,) = tmp_path.iterdir()
    assert f"logged:3 pid {os.getpid()}" in mark.read_text()


class Remote:  # a logger that cannot take a step back (TensorBoard, W&B)
    def __init__(self, run_dir, spec):
        self.rows = []

    def log(self, row):
        self.rows.append(row["step"])

    def close(self):
        pass


def test_loggers_rewind_cut_the_file_and_send_no_step_twice(tmp_path, monkeypatch):
    from flowrl.runtime import loggers as module
    from flowrl.runtime.step_log import truncate_log

    monkeypatch.setitem(module.LOGGERS, "remote", Remote)
    logs = Loggers(["remote"], tmp_path, spec=None)
    for step in range(4):
        logs.log({"step": step, "x": step})
    logs.rewind()
    truncate_log(tmp_path / "metrics.jsonl", 1)  # a recovery back to step 1
    logs.reopen()
    logs.log({"event": "recovery", "step": 3})
    for step in range(2, 6):
        logs.log({"step": step, "x": step})
    logs.close()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "event" not in r] == [0, 1, 2, 3, 4, 5]
    assert [r["step"] for r in rows if "event" in r] == [3]
    assert logs.loggers[1].rows == [0, 1, 2, 3, 4, 5]  # 2 and 3 were not sent again


def test_sigterm_asks_for_the_safe_point_and_a_second_one_stops_at_once():
    with stop.preemptible(30) as preemption:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        assert preemption.requested
        with pytest.raises(stop.Stopped, match="stopped by SIGTERM"):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)  # the grace timer went too


def test_no_safe_point_within_the_grace_period_stops_there():
    with pytest.raises(stop.Stopped, match=r"no safe point within run.term_grace_s = 0.2 s"):
        with stop.preemptible(0.2):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)


def test_grace_zero_leaves_sigterm_to_the_run_s_own_handler():
    before = signal.getsignal(signal.SIGTERM)
    with stop.preemptible(0):
        assert signal.getsignal(signal.SIGTERM) is before
