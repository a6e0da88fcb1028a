"""flowrl's harness for `verifiers` environments: the chat program an environment's seat runs,
in this process (verifiers' `null` harness runs a Python child per turn, built by `uv` from
PyPI). Each launch sends the conversation so far to verifiers' interception endpoint (which
forwards it to flowrl's endpoint and records it in the trace) and takes one reply: a plain
chat model, no tools. verifiers finds it by its module name (`HARNESS_ID` in
flowrl/serve/verifiers_envs.py); it imports verifiers, so only verifiers imports it.
"""

from __future__ import annotations

import verifiers.v1 as vf
from openai import AsyncOpenAI
from verifiers.v1.dialects.chat import message_to_wire


class FlowrlChatConfig(vf.HarnessConfig):
    pass


class FlowrlChatHarness(vf.Harness[FlowrlChatConfig]):
    APPENDS_SYSTEM_PROMPT = True  # the task's system prompt is the first message, as the row's
    SUPPORTS_RESUME = True  # each turn relaunches on the whole conversation
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(
        self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, tool_interception_url=None
    ):
        system, prompt = self.resolve_prompt(data)
        messages = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        elif prompt:
            messages += [message_to_wire(m) for m in prompt]
        async with AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0) as client:
            await client.chat.completions.create(model=ctx.model, messages=messages)
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")


__all__ = ["FlowrlChatHarness"]
