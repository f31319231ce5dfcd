"""The `calculator` tool: exact rational arithmetic on an expression, parsed safely.

The expression is parsed into a syntax tree (`ast.parse(mode="eval")`, which only parses, never
runs anything) and evaluated by walking a whitelist of node kinds: numbers, + - * / // % **,
unary +/-, parentheses. Anything else (names, calls, attributes, strings) is rejected with the
offending construct named. Numbers become `fractions.Fraction`s built from their source text, so
`0.1 + 0.2` is exactly `3/10`. Exponents are bounded (|exponent| <= 1000, result <= 10,000 digits)
so that `9**9**9` fails fast instead of occupying the server's loop.

Runs inline on the server's loop thread: a call costs ~10 us to parse and evaluate.
"""

from __future__ import annotations

import ast
import decimal
import operator
from fractions import Fraction

from agentrl.toolservers.server import Tool, ToolFailure, ToolSpec

MAX_EXPRESSION_CHARS = 2000
MAX_EXPONENT = 1000
MAX_RESULT_DIGITS = 10_000

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_DECIMAL_CONTEXT = decimal.Context(prec=30)


def evaluate(expression: str) -> Fraction:
    """Exact value of `expression`; raises ToolFailure saying what is wrong with it."""
    try:
        tree = ast.parse(expression.strip().replace("\n", " "), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise ToolFailure(f"cannot parse expression: {exc}") from None
    try:
        return _eval(tree.body, expression.strip().replace("\n", " "))
    except RecursionError:
        raise ToolFailure("expression is nested too deeply") from None


def _eval(node: ast.AST, source: str) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return Fraction(node.value)
    if isinstance(node, ast.Constant) and type(node.value) is float:
        # From the literal's text, not the float: "0.1" is exactly 1/10. One line, so offsets index it.
        return Fraction(source[node.col_offset : node.end_col_offset].replace("_", ""))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _eval(node.operand, source)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp):
        left, right = _eval(node.left, source), _eval(node.right, source)
        if isinstance(node.op, ast.Pow):
            return _power(left, right)
        op = _BINARY.get(type(node.op))
        if op is None:
            raise ToolFailure(f"operator {type(node.op).__name__} is not supported; use + - * / // % **")
        if right == 0 and op in (operator.truediv, operator.floordiv, operator.mod):
            raise ToolFailure("division by zero")
        return Fraction(op(left, right))
    what = ast.get_source_segment(source, node) or type(node).__name__
    raise ToolFailure(f"unsupported element {what!r}: only numbers, + - * / // % ** and parentheses")


def _power(base: Fraction, exponent: Fraction) -> Fraction:
    if exponent.denominator != 1:
        raise ToolFailure(f"exponent {exponent} is not an integer; the result would not be exact")
    if abs(exponent) > MAX_EXPONENT:
        raise ToolFailure(f"exponent {exponent} is larger than {MAX_EXPONENT} in magnitude")
    if base == 0 and exponent < 0:
        raise ToolFailure("division by zero (zero to a negative power)")
    digits = abs(int(exponent)) * max(len(str(base.numerator)), len(str(base.denominator)))
    if digits > MAX_RESULT_DIGITS:
        raise ToolFailure(f"result would have about {digits} digits (limit {MAX_RESULT_DIGITS})")
    return base ** int(exponent)


def format_result(value: Fraction) -> dict:
    """`value`: exact ("7/2" or "12"); `decimal`: 30 significant digits for reading."""
    exact = str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"
    if value.denominator == 1:
        return {"value": exact, "decimal": exact if len(exact) <= 30 else str(_DECIMAL_CONTEXT.plus(value.numerator))}
    approx = _DECIMAL_CONTEXT.divide(decimal.Decimal(value.numerator), decimal.Decimal(value.denominator))
    text = format(approx.normalize(_DECIMAL_CONTEXT), "f") if abs(approx.adjusted()) < 30 else str(approx)
    return {"value": exact, "decimal": text}


class CalculatorTool(Tool):
    spec = ToolSpec(
        name="calculator",
        description=(
            "Evaluate an arithmetic expression exactly. Supports numbers, + - * / // % ** and "
            "parentheses. Returns the exact value (an integer or a fraction p/q) and a decimal."
        ),
        parameters={
            "type": "object",
            "properties": {
                "expression": {
                    "type": "string",
                    "description": "The expression, e.g. '(3 + 4) * 2 / 5'.",
                    "minLength": 1,
                    "maxLength": MAX_EXPRESSION_CHARS,
                }
            },
            "required": ["expression"],
            "additionalProperties": False,
        },
        idempotent=True,
    )

    def run(self, args: dict) -> dict:
        return format_result(evaluate(args["expression"]))
