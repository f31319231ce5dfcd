"""The `calculator` tool: exact rational arithmetic on an expression, parsed safely.

One regular expression splits the text into numbers, the operators + - * / // % ** and
parentheses (anything else is rejected with its position); an operator-precedence (shunting-yard)
loop evaluates them with Python's rules: ** binds tighter than a unary minus on its left and is
right-associative (`-2**2 == -4`, `2**3**2 == 512`, `2**-1 == 1/2`). Nothing of the user's text is
ever run. Integers stay Python ints; a division or a decimal literal makes a `fractions.Fraction`
built from the literal's text, so `0.1 + 0.2` is exactly `3/10`.

Bounds, so that no expression occupies the server's loop: |exponent| <= 1000, and every value,
literal or intermediate, has at most 10,000 digits (numerator and denominator each). The size of
each operation's result is bounded from its operands' sizes *before* it is computed (a product
has at most the sum of their bits), so `9**9**9` or a 2,000-character product of large powers
fails at the first operation that would pass the bound; before, such a product was computed in
full (0.6 to 1.3 s measured) and then failed to print (Python refuses int-to-text past 4,300
digits), which the server answered by running it a second time. Results over 4,300 digits are
printed through `decimal`, which has no such limit. A second bound caps the big-number work of one
expression (MAX_WORK_BITS2, products of operand sizes, the cost of multiplying and of the gcd a
fraction needs): a sum of 40 fractions of 3,400 digits each took 33 ms before it, about 10 ms at
most with it.

Runs inline on the server's loop thread, so its cost is the service's. Measured against the
previous `ast.parse` + tree-walk version in one process (load average ~10, so slow absolutes):
`(17 + 7) * 3 / 5 - 2 ** 3` 40-43 us vs 57-58 us, `(3+4)*2/5` 24-27 vs 36-38, `1+2` 5-6 vs 14.
"""

from __future__ import annotations

import decimal
import re
from fractions import Fraction

from agentrl.toolservers.server import Tool, ToolFailure, ToolSpec

MAX_EXPRESSION_CHARS = 2000
MAX_EXPONENT = 1000
MAX_RESULT_DIGITS = 10_000

MAX_RESULT_BITS = int(MAX_RESULT_DIGITS * 3.3219280948873626) + 1  # log2(10) bits per digit
# Multiplying or reducing operands of a and b bits costs about a * b (1.6 ns per bit^2 measured
# here for fraction sums); five operations at the size limit (~10 ms) per expression.
MAX_WORK_BITS2 = 5 * MAX_RESULT_BITS**2
# Python's int -> str refuses more than 4,300 digits (sys.get_int_max_str_digits); decimal does not.
_STR_SAFE_BITS = 14_000

_DECIMAL_CONTEXT = decimal.Context(prec=30)
# (number, operator, anything else) per token; a non-empty third group is an error.
_TOKEN = re.compile(
    r"\s*(?:(\d[\d_]*(?:\.[\d_]*)?(?:[eE][+-]?\d+)?|\.\d[\d_]*(?:[eE][+-]?\d+)?)|(\*\*|//|[-+*/%()])|(\S))"
)
# Binding strength of binary operators; a unary sign is 3: tighter than * and looser than ** on
# its left.
_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2, "//": 2, "%": 2, "**": 4}
_UNARY = 3
_ONLY = "only numbers, + - * / // % ** and parentheses"

Number = int | Fraction  # ints stay ints until a division needs a fraction (int ops are ~10x faster)


def evaluate(expression: str) -> Number:
    """Exact value of `expression`; raises ToolFailure saying what is wrong with it, and where."""
    values: list[Number] = []
    ops: list[str] = []  # binary operators, "(", and unary signs "u+" / "u-"
    work = _Work()
    want_operand = True
    tokens = _TOKEN.findall(expression)
    for k, (number, op, bad) in enumerate(tokens):
        if bad:
            _fail(expression, k, f"unsupported element {bad!r}: {_ONLY}")
        if number:
            if not want_operand:
                _fail(expression, k, f"missing operator before {number!r}")
            values.append(_number(number, expression, k))
            want_operand = False
        elif want_operand:
            if op == "(":
                ops.append("(")
            elif op in ("+", "-"):
                ops.append("u" + op)
            else:
                _fail(expression, k, f"expected a number or '(' but found {op!r}")
        elif op == ")":
            while ops and ops[-1] != "(":
                _reduce(values, ops, work)
            if not ops:
                _fail(expression, k, "')' without a matching '('")
            ops.pop()
        elif op == "(":
            _fail(expression, k, "missing operator before '('")
        else:
            prec = _PRECEDENCE[op]
            while ops and ops[-1] != "(":
                top = ops[-1]
                top_prec = _UNARY if top[0] == "u" else _PRECEDENCE[top]
                if top_prec > prec or (top_prec == prec and op != "**"):  # ** is right-associative
                    _reduce(values, ops, work)
                else:
                    break
            ops.append(op)
            want_operand = True
    if want_operand:
        _fail(expression, len(tokens), "the expression is empty" if not tokens else "the expression ends early")
    while ops:
        if ops[-1] == "(":
            _fail(expression, len(tokens), "missing ')'")
        _reduce(values, ops, work)
    return values[0]


def _number(text: str, expression: str, k: int) -> Number:
    try:
        if "." not in text and "e" not in text and "E" not in text:
            return int(text)
        mantissa, _, exponent = text.lower().partition("e")
        if exponent and abs(int(exponent)) + len(mantissa) > MAX_RESULT_DIGITS:  # "1e9999999" is 10**9999999
            raise ToolFailure(f"the number {text[:40]!r} would have more than {MAX_RESULT_DIGITS} digits")
        value = Fraction(text.replace("_", ""))  # from the text: "0.1" is exactly 1/10
    except ValueError:
        _fail(expression, k, f"malformed number {text!r}")
    return value.numerator if value.denominator == 1 else value


def _bits(value: Number) -> int:
    if isinstance(value, int):
        return value.bit_length()
    return max(value.numerator.bit_length(), value.denominator.bit_length())


class _Work:
    """The big-number work of one expression so far, in bits^2 (see MAX_WORK_BITS2)."""

    def __init__(self) -> None:
        self.bits2 = 0

    def check(self, op: str, left: Number, right: Number) -> None:
        """Refuse `left op right` before computing it if its result could pass MAX_RESULT_BITS
        (a sum of integers has at most one bit more than its larger operand; anything else at
        most the sum of both operands' bits, fractions being cross-multiplied) or if the
        expression's work would pass MAX_WORK_BITS2. `**` bounds its result in _power."""
        left_bits, right_bits = _bits(left), _bits(right)
        linear = op in ("+", "-") and isinstance(left, int) and isinstance(right, int)
        bound = max(left_bits, right_bits) + 1 if linear else left_bits + right_bits + 1
        if op != "**" and bound > MAX_RESULT_BITS:
            raise ToolFailure(f"result of {op!r} would have about {int(bound * 0.30103)} digits "
                              f"(limit {MAX_RESULT_DIGITS})")
        if not linear:
            cost = _bits(right) * MAX_RESULT_BITS if op == "**" else (left_bits + 1) * (right_bits + 1)
            self.bits2 += cost if isinstance(left, int) and isinstance(right, int) else 4 * cost
            if self.bits2 > MAX_WORK_BITS2:
                raise ToolFailure("the expression needs too much big-number arithmetic (more than about "
                                  f"{MAX_WORK_BITS2 // MAX_RESULT_BITS**2} operations on {MAX_RESULT_DIGITS}-digit numbers)")


def _reduce(values: list[Number], ops: list[str], work: _Work) -> None:
    op = ops.pop()
    if op[0] == "u":
        if op == "u-":
            values[-1] = -values[-1]
        return
    right = values.pop()
    left = values.pop()
    work.check(op, left, right)
    if op == "+":
        values.append(left + right)
    elif op == "-":
        values.append(left - right)
    elif op == "*":
        values.append(left * right)
    elif op == "**":
        values.append(_power(left, right))
    elif right == 0:
        raise ToolFailure("division by zero")
    elif op == "/":
        value = Fraction(left) / right
        values.append(value.numerator if value.denominator == 1 else value)
    elif op == "//":
        values.append(left // right)
    else:
        values.append(left % right)


def _fail(expression: str, k: int, message: str) -> None:
    matches = list(_TOKEN.finditer(expression))
    where = matches[k].start(matches[k].lastindex or 0) if k < len(matches) else len(expression.rstrip())
    raise ToolFailure(f"cannot parse expression: {message} at position {where} of {expression.strip()[:80]!r}")


def _power(base: Number, exponent: Number) -> Number:
    if isinstance(exponent, Fraction):
        raise ToolFailure(f"exponent {exponent} is not an integer; the result would not be exact")
    if abs(exponent) > MAX_EXPONENT:
        raise ToolFailure(f"exponent {exponent} is larger than {MAX_EXPONENT} in magnitude")
    if base == 0 and exponent < 0:
        raise ToolFailure("division by zero (zero to a negative power)")
    num, den = (base, 1) if isinstance(base, int) else (base.numerator, base.denominator)
    digits = int(abs(exponent) * max(abs(num).bit_length(), den.bit_length()) * 0.30103)  # log10(2)
    if digits > MAX_RESULT_DIGITS:
        raise ToolFailure(f"result would have about {digits} digits (limit {MAX_RESULT_DIGITS})")
    if exponent < 0:
        return Fraction(1) / Fraction(base) ** -exponent
    return base**exponent


def _int_text(value: int) -> str:
    return str(value) if value.bit_length() <= _STR_SAFE_BITS else str(decimal.Decimal(value))


def format_result(value: Number) -> dict:
    """`value`: exact ("7/2" or "12"); `decimal`: 30 significant digits for reading."""
    if isinstance(value, int) or value.denominator == 1:
        exact = _int_text(int(value))
        return {"value": exact, "decimal": exact if len(exact) <= 30 else str(_DECIMAL_CONTEXT.plus(int(value)))}
    exact = f"{_int_text(value.numerator)}/{_int_text(value.denominator)}"
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
