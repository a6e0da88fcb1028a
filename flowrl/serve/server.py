"""Running the endpoint: uvicorn on a thread of its own, bound to a free port of 127.0.0.1
by default (`Server`), and `flowrl serve`'s loading of a model or a run's checkpoint.

    with Server(endpoint, keys) as server:       # started; stopped on leaving
        client = openai.OpenAI(base_url=server.base_url, api_key=key)
"""

from __future__ import annotations

import socket
import threading
import time

import uvicorn

from flowrl.serve.app import Keys, make_app
from flowrl.serve.endpoint import Endpoint


class Threaded:
    """An ASGI app under uvicorn on a thread of this process, on a socket bound before it
    starts (port 0: a free one, with no race for it)."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, name: str = "flowrl-serve"):
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind((host, port))
        self.host, self.port, self.name = host, self.socket.getsockname()[1], name
        config = uvicorn.Config(app, log_level="warning", access_log=False)
        self.server = uvicorn.Server(config)
        self.thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}"

    def start(self, timeout_s: float = 30.0):
        self.thread = threading.Thread(
            target=self.server.run,
            kwargs={"sockets": [self.socket]},
            name=self.name,
            daemon=True,
        )
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} did not start on {self.host}:{self.port}")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(timeout=10)
            if self.thread.is_alive():
                self.server.force_exit = True
                self.thread.join(timeout=10)
        self.socket.close()


class Server(Threaded):
    """The endpoint served by uvicorn on a thread of this process.

    Args:
        endpoint: what answers requests (endpoint.py).
        keys: which keys it takes (app.Keys).
        host: the address to bind; "127.0.0.1" keeps it on this machine ("0.0.0.0" for a
            cluster, with a fixed key).
        port: the port; 0 picks a free one.
    """

    def __init__(self, endpoint: Endpoint, keys: Keys, host: str = "127.0.0.1", port: int = 0):
        self.endpoint, self.keys = endpoint, keys
        super().__init__(make_app(endpoint, keys), host, port, name="the endpoint")

    @property
    def base_url(self) -> str:
        """What an OpenAI client takes as `base_url` (ends in /v1)."""
        return f"{self.url}/v1"

    def start(self, timeout_s: float = 30.0) -> Server:
        return super().start(timeout_s)

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def load_served(
    path: str, step: int | None = None, model: str | None = None, dtype: str = "float32"
):
    """(module, tokenizer, context, name) for `flowrl serve PATH`: a model path (as a graph's
    `path`: the embedded alias, a Hugging Face directory, a cached hub id, "tiny") or a run
    directory (it holds graph.toml), whose checkpoint `step` (default: the latest) of model
    `model` is exported to a temporary directory first (flowrl export)."""
    import tempfile
    from pathlib import Path

    from flowrl.models import load_model
    from flowrl.models.loading import context_length

    if (Path(path) / "graph.toml").exists():
        from flowrl.runtime.export import export

        out = Path(tempfile.mkdtemp(prefix="flowrl-serve-"))
        export(path, out, step=step, model=model)
        name = f"{Path(path).name}" + (f"@{step}" if step is not None else "")
        path, shown = str(out), name
    else:
        shown = Path(path).name or path
    module, tokenizer = load_model(path, dtype=dtype)
    return module.eval(), tokenizer, context_length(path) or 8192, shown


def serve(args) -> int:
    """`flowrl serve`: the endpoint over one model until interrupted."""
    import os

    from flowrl.engines.hf.engine import HFRollout
    from flowrl.serve.app import Keys

    key = args.api_key or os.environ.get("FLOWRL_API_KEY")
    module, tokenizer, context, name = load_served(
        args.model, args.step, args.model_name, args.dtype
    )
    endpoint = Endpoint(
        HFRollout(module, tokenizer),
        model_name=args.name or name,
        context=context,
        parser=args.parser,
        max_n=args.max_n,
        seed=args.seed,
    )
    server = Server(endpoint, Keys(key), args.host, args.port)
    print(
        f"flowrl serve: {endpoint.model_name} at {server.base_url}"
        + (" (key required)" if key else " (any key)"),
        flush=True,
    )
    try:
        server.server.run(sockets=[server.socket])
    finally:
        server.socket.close()
    return 0
