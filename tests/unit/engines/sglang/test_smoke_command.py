"""The SGLang smoke test lives beside its engine (flowrl/engines/sglang/smoke.py); the command
of the previous layout, `python -m flowrl.smoke --gpu`, still runs it, with a warning naming
the new one."""

import sys
import warnings

import pytest
import torch

from flowrl import compat


def test_python_m_of_the_old_module_warns_and_runs_the_new_one(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", ["flowrl.smoke", "--gpu"])
    code = compat._MovedFinder().get_code("flowrl.smoke")  # what runpy runs for `-m`
    with warnings.catch_warnings(record=True) as caught, pytest.raises(SystemExit) as done:
        warnings.simplefilter("always")
        exec(code, {"__name__": "__main__"})
    assert done.value.code == 0
    assert capsys.readouterr().out.startswith("skip gpu-smoke: no CUDA device")
    (warning,) = [w for w in caught if issubclass(w.category, compat.FlowrlDeprecationWarning)]
    assert str(warning.message).startswith(
        "python -m flowrl.smoke is deprecated and goes in flowrl 0.3.0: use python -m "
        "flowrl.engines.sglang.smoke"
    )
