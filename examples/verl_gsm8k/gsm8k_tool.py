"""A GSM8K answer-checking tool written against verl's `BaseTool` interface
(verl/tools/base_tool.py, verl/tools/gsm8k_tool.py): flowrl runs it as it is, from
tools.yaml. It does not import verl (not installed here); where verl is installed, subclass
`verl.tools.base_tool.BaseTool` instead, nothing else changes."""

from typing import Any
from uuid import uuid4

from flowrl.rewards import gsm8k


class ToolResponse:
    """verl's `verl.tools.schemas.ToolResponse`, text only."""

    def __init__(self, text: str | None = None):
        self.text = text


class Gsm8kTool:
    """create(ground_truth) -> execute(answer) scores it, -0.05 when it did not improve ->
    calc_reward -> release, one instance per request (verl's lifecycle)."""

    def __init__(self, config: dict, tool_schema):
        self.config = config
        self.tool_schema = tool_schema
        self.name = tool_schema.function.name
        self._instance_dict = {}

    def get_openai_tool_schema(self):
        return self.tool_schema

    async def create(
        self, instance_id: str | None = None, ground_truth: str | None = None, **kwargs
    ):
        if instance_id is None:
            instance_id = str(uuid4())
        if ground_truth is None:
            ground_truth = kwargs.get("create_kwargs", {}).get("ground_truth", None)
        self._instance_dict[instance_id] = {
            "response": "",
            "ground_truth": ground_truth,
            "reward": 0.0,
        }
        return instance_id, ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs):
        answer = parameters.get("answer", "")
        if not isinstance(answer, str):
            answer = str(answer)
        state = self._instance_dict[instance_id]
        state["response"] = answer if answer.startswith("#### ") else "#### " + answer
        reward = await self.calc_reward(instance_id)
        tool_reward = 0.0 if reward > state["reward"] else -0.05  # no improvement: a penalty
        state["reward"] = reward
        return ToolResponse(text=f"Current parsed {answer=} {reward=}"), tool_reward, {}

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        state = self._instance_dict[instance_id]
        return gsm8k.compute_score("", state["response"], state["ground_truth"], method="flexible")

    async def release(self, instance_id: str, **kwargs) -> None:
        del self._instance_dict[instance_id]
