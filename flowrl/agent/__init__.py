"""Multi-turn tool rollouts: the per-request state machine (episode.py), token assembly
(chat.py), call parsers (parsers.py), tools (tools.py, builtin.py, sandbox.py) and the request
driver (driver.py: one asyncio task per request over the rollout contract). Plain Python: the
engine side is flowrl/engines/rollout.py's contract and its backends, the node nodes/agent.py.
See docs/multi-turn.md."""
