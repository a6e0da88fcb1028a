"""Multi-turn tool rollouts: the per-request state machine (episode.py), token assembly
(chat.py), call parsers (parsers.py), tools (tools.py, builtin.py, sandbox.py) and the wave
driver (driver.py). Plain Python: the engine side is flowrl/engines/wave_rollout.py and the
node nodes/agent.py. See docs/multi-turn.md."""
