"""Built-in tools, by name in an agent node's `tools`:

- "calculator": `calc(expression)`, arithmetic on an AST walk (no `eval`), with bounded sizes;
- "python": `python(code)`, a program run in a child process under limits, confined to a
  read-only view of the interpreter (sandbox.py; the agent node's `sandbox` setting);
- "answer_check": `AnswerCheck`, a per-request tool in the style of verl's GSM8K tool: the
  model submits an answer through `calc_gsm8k_reward(answer)` and learns whether it is right;
  the request's reward is the last answer's score;
- "sandbox_fusion": `code_interpreter(code)`, run by a sandbox service (sandbox_service.py;
  its URL in a tool YAML's config).
"""

from __future__ import annotations

import ast
import math
import operator

from flowrl.agent.tools.sandbox import SandboxLimits, run_python
from flowrl.rewards import gsm8k

MAX_EXPRESSION = 200  # characters
MAX_DIGITS = 100  # results stay below 10**100 in magnitude
OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
PYTHON_LIMITS = SandboxLimits(cpu_s=5, wall_s=10.0, memory_mb=512, output_bytes=8192)


def calc(expression: str) -> str:
    """Evaluate an arithmetic expression and return its value.

    Args:
        expression: numbers with + - * / // % ** and parentheses, for example "347*28".
    """
    if len(expression) > MAX_EXPRESSION:
        raise ValueError(f"the expression is longer than {MAX_EXPRESSION} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from e
    value = _evaluate(tree.body)
    if isinstance(value, float):
        if value.is_integer() and abs(value) < 1e15:
            return str(int(value))
        return f"{value:.10g}"
    return str(value)


def _evaluate(node):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.UAdd | ast.USub):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        _check_size(node.op, left, right)
        return _bounded(OPERATORS[type(node.op)](left, right))
    raise ValueError(f"unsupported in an arithmetic expression: {ast.unparse(node)!r}")


def _digits(x) -> float:
    return math.log10(abs(x)) if x else 0.0


def _check_size(op, left, right) -> None:
    """Refuse an operation whose result would pass MAX_DIGITS, before computing it (an
    integer power or product could otherwise take unbounded time and memory)."""
    if isinstance(op, ast.Pow):
        if abs(right) > 1000 or (abs(left) > 1 and right * _digits(left) > MAX_DIGITS):
            raise ValueError(f"the result would have more than {MAX_DIGITS} digits")
    elif isinstance(op, ast.Mult) and _digits(left) + _digits(right) > MAX_DIGITS + 1:
        raise ValueError(f"the result would have more than {MAX_DIGITS} digits")


def _bounded(value):
    if isinstance(value, complex):
        raise ValueError("the result is not a real number")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("the result is not finite")
    if abs(value) >= 10**MAX_DIGITS:
        raise ValueError(f"the result has more than {MAX_DIGITS} digits")
    return value


def python_tool(sandbox: str = "auto"):
    """The `python` tool, confining its code as the agent node's `sandbox` says ("auto":
    where the machine can; "required": refuse where it cannot)."""

    async def python(code: str) -> str:
        """Run a Python program and return what it prints (stdout, then stderr).

        Args:
            code: the program; print the values you want to see.
        """
        result = await run_python(code, PYTHON_LIMITS, sandbox)
        return result.message(PYTHON_LIMITS)

    return python


python = python_tool()  # "flowrl.agent.tools.builtin:python", with the default setting


class AnswerCheck:
    """Checks a submitted answer against the row's ground truth (verl's `Gsm8kTool`): create
    with `ground_truth`; each call scores the answer, with a step reward of -0.05 when the
    score did not improve; the request's reward is the last answer's score."""

    def __init__(self, ground_truth: str = ""):
        self.ground_truth, self.score = str(ground_truth), 0.0

    def calc_gsm8k_reward(self, answer: str) -> tuple[str, float]:
        """Submit your final answer and learn whether it is correct.

        Args:
            answer: the final answer, a number.
        """
        text = answer if answer.startswith("#### ") else "#### " + answer
        score = gsm8k.compute_score("", text, self.ground_truth, method="flexible")
        step = 0.0 if score > self.score else -0.05
        self.score = score
        return f"Current parsed answer={answer!r} reward={score}", step

    def reward(self) -> float:
        return self.score
