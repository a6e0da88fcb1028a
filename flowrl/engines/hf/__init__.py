"""The `hf` rollout backend: flowrl's own continuous-batching engine over a transformers causal
LM. engine.py serves the request contract; scheduler.py is its loop, slots.py the continuous
batch in the cache slots (its decode steps in decoding.py), runner.py the model runner that
makes every model call, static.py its CUDA version (a static cache, CUDA graphs), kv_cache.py
the slot cache, packed.py calls that pack rows of different lengths, sampling.py the
per-request draws."""
