"""The calculator task's agent, written for OpenAI's API alone: it asks the model, runs the
calculator on each call the endpoint returns as `tool_calls`, sends the result back as a tool
message, and answers with the model's last text. graphs/grpo_openai_agent.toml trains it; the
same function runs against any OpenAI-compatible server (`flowrl serve`, vLLM)."""

import json

import openai

from flowrl.agent.tools.builtin import calc  # arithmetic only: never eval what a model wrote

CALC = {
    "type": "function",
    "function": {
        "name": "calc",
        "description": "Evaluate an arithmetic expression, e.g. 347*28.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}
TURNS = 3  # assistant turns, as grpo_tools.toml's max_assistant_turns


def solve(base_url: str, api_key: str, row: dict) -> str:
    """The model's final answer to the row's question, after at most TURNS turns."""
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = list(row["prompt"])
    answer = ""
    for _ in range(TURNS):
        reply = client.chat.completions.create(
            model="policy", messages=messages, tools=[CALC], max_tokens=24
        )
        message = reply.choices[0].message
        answer = message.content or ""
        if not message.tool_calls:
            break
        # send the turn back as the model wrote it (its text holds the <calc> call)
        messages.append({"role": "assistant", "content": answer})
        call = message.tool_calls[0]
        try:
            result = calc(json.loads(call.function.arguments)["expression"])
        except (ValueError, KeyError, ZeroDivisionError) as e:
            result = f"error: {e}"
        messages.append({"role": "tool", "content": result})
    return answer
