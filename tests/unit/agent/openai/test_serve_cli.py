"""`flowrl serve`: the endpoint alone, over a model path, in a child process."""

import os
import subprocess
import sys
import time

import pytest

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow  # a Python child process


def test_flowrl_serve_answers_openai_clients(tmp_path):
    env = {**os.environ, "FLOWRL_API_KEY": "k1"}
    child = subprocess.Popen(
        [sys.executable, "-m", "flowrl.cli", "serve", "tiny", "--port", "0", "--name", "tiny"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        line = child.stdout.readline()
        assert "at http://127.0.0.1:" in line and "(key required)" in line, line
        base_url = line.split(" at ")[1].split()[0]
        client = openai.OpenAI(base_url=base_url, api_key="k1", max_retries=0)
        deadline = time.monotonic() + 60
        while True:  # the banner comes just before uvicorn listens
            try:
                assert [m.id for m in client.models.list()] == ["tiny"]
                break
            except openai.APIConnectionError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        r = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4, seed=0
        )
        assert len(r.choices) == 1 and r.usage.completion_tokens <= 4
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base_url, api_key="k2", max_retries=0).models.list()
    finally:
        child.terminate()
        child.wait(timeout=30)


def test_flowrl_serve_refuses_an_open_host_without_a_key():
    env = {k: v for k, v in os.environ.items() if k != "FLOWRL_API_KEY"}
    done = subprocess.run(
        [sys.executable, "-m", "flowrl.cli", "serve", "tiny", "--host", "0.0.0.0"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 2 and "--api-key" in done.stderr
