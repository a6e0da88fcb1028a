"""The `hf` rollout backend: flowrl's own continuous-batching engine over a transformers causal
LM. engine.py serves the request contract; scheduler.py is its loop, slots.py the continuous
batch in the cache slots, kv_cache.py the slot cache, packed.py calls that pack rows of
different lengths, sampling.py the per-request draws."""
