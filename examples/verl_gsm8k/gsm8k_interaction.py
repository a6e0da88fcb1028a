"""A GSM8K interaction written against verl's `BaseInteraction` interface
(verl/interactions/base.py, gsm8k_interaction.py): it reads the last assistant message and
either ends the request (right) or asks the model to try again."""

from typing import Any
from uuid import uuid4

from flowrl.rewards import gsm8k


class Gsm8kInteraction:
    def __init__(self, config: dict[str, Any]):
        self.config = config
        self.name = config.get("name", "interaction_agent")
        self._instance_dict = {}

    async def start_interaction(
        self, instance_id: str | None = None, ground_truth: str | None = None, **kwargs
    ) -> str:
        if instance_id is None:
            instance_id = str(uuid4())
        self._instance_dict[instance_id] = {
            "response": "",
            "ground_truth": ground_truth,
            "reward": 0.0,
        }
        return instance_id

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]], **kwargs):
        content = ""
        for item in reversed(messages):
            if item.get("role") == "assistant":
                content = item.get("content")
                break
        self._instance_dict[instance_id]["response"] = content
        reward = await self.calculate_score(instance_id)
        if reward == 1.0:
            return True, "Your response is correct!", reward, {}
        return (
            False,
            "Your response is incorrect! You need to reflect on your answer and try again.",
            reward,
            {},
        )

    async def calculate_score(self, instance_id: str, **kwargs) -> float:
        state = self._instance_dict[instance_id]
        return gsm8k.compute_score("", state["response"], state["ground_truth"], method="strict")

    async def finalize_interaction(self, instance_id: str, **kwargs) -> None:
        del self._instance_dict[instance_id]
