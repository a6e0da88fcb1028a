"""The `sglang` rollout backend: an in-process SGLang engine (GPU). backend.py serves the
request contract, io.py is what crosses to SGLang (sampling parameters, results), process.py
guards the engine's child processes, smoke.py is the GPU smoke test (`make gpu-smoke`).
Imported only when a graph picks `rollout = "sglang"`."""
