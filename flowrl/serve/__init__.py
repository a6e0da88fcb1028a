"""An OpenAI-compatible endpoint in front of a rollout backend (docs/agents.md): an agent
program written for OpenAI's API samples from the policy, and each call's tokens are recorded
for training. Here rather than under flowrl/agent/: `flowrl serve` runs it with no agent."""
