"""The ``calculator`` skill: ``calculate`` (arithmetic as said: "15% of 80", "12 times 4", "sqrt(2)") and
``convert_units`` ("5 miles" to "km", "70 fahrenheit" to "celsius").

Why a tool: a small model's arithmetic is a guess. Why never ``eval``: the expression is a user's speech passed on
by a model; it is parsed with ``ast`` and walked here, numbers, operators and a few functions only, with bounds on
the sizes that could take the server's time (``9**9**9``, ``factorial(10**6)``). Units are ``pint``'s.
"""

from __future__ import annotations

import ast
import math
import operator
import re
import threading
from collections.abc import Callable
from functools import cache
from typing import Any

import pint
from text_to_num import alpha2digit

from app.skills.base import ServerTool, SkillOwner, unasked

MAX_EXPRESSION_CHARS = 200
MAX_UNIT_CHARS = 60
MAX_WORDS_SEARCHED = 40  # of the user's words, for the unit a quantity is converted to (``unit_named``)
MAX_EXPONENT = 1000
MAX_RESULT_BITS = 4096  # an integer power larger than this is computed as a float (and may overflow)
MAX_FACTORIAL = 170  # the largest whose value a float holds
SIGNIFICANT_DIGITS = 10


class CalculationError(ValueError):
    """What is wrong with an expression or a conversion, in words the LLM can read back."""


# ---------------------------------------------------------------- arithmetic
_WORDS = (  # spoken operators -> symbols, longest first where one contains another
    (r"\b(?:what is|what's|calculate|compute|how much is)\b|\?|=\s*$|\bequals?\s*$", " "),
    (r"\b(?:raised )?to the power of\b|\braised to\b", "**"),
    (r"\bsquared\b", "**2"),
    (r"\bcubed\b", "**3"),
    (r"\b(?:the )?square root of\b", "sqrt"),
    (r"\b(?:the )?cube root of\b", "cbrt"),
    (r"\b(?:the )?factorial of\b", "factorial"),
    (r"\b(?:multiplied by|times)\b|[×·]", "*"),
    (r"\b(?:divided by|over)\b|÷", "/"),
    (r"\bplus\b", "+"),
    (r"\bminus\b|−", "-"),
    (r"\bper ?cent\b", "%"),
    (r"\^", "**"),
)
_FUNCTIONS: dict[str, Callable[[float], float]] = {
    "sqrt": math.sqrt,
    "cbrt": lambda x: math.copysign(abs(x) ** (1 / 3), x),
    "abs": abs,
    "round": round,
    "floor": math.floor,
    "ceil": math.ceil,
    "exp": math.exp,
    "ln": math.log,
    "log": math.log10,
    "log10": math.log10,
    "log2": math.log2,
    "sin": math.sin,
    "cos": math.cos,
    "tan": math.tan,
    "factorial": lambda x: _factorial(x),
}
_CONSTANTS = {"pi": math.pi, "e": math.e, "tau": math.tau}
_OPERATORS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_NUMBER = r"\d+(?:\.\d+)?"


def symbolic(expression: str) -> str:
    """The expression with spoken numbers and operators as digits and symbols ("twelve times four" -> "12 * 4")."""
    text = " ".join(expression.lower().split())
    text = alpha2digit(text, "en", threshold=0) if text else text
    text = re.sub(r"(?<=\d),(?=\d{3}\b)", "", text)  # 1,000 -> 1000
    for pattern, symbol in _WORDS:
        text = re.sub(pattern, f" {symbol} ", text)
    text = re.sub(r"(?<=[\d)])\s*x\s*(?=[\d(])", " * ", text)
    return " ".join(text.split())


def _python(text: str) -> str:
    """The symbolic expression as Python: percents ("15 % of 80" -> "(15/100)*80", "20 %" -> "(20/100)"), "mod",
    "5 !" (factorial) and a function applied without parentheses ("sqrt 16")."""
    text = re.sub(rf"({_NUMBER})\s*%\s*of\b", r"(\1/100)*", text)
    text = re.sub(rf"({_NUMBER})\s*%", r"(\1/100)", text)
    text = re.sub(r"\b(?:mod|modulo)\b", "%", text)
    text = re.sub(rf"({_NUMBER})\s*!", r"factorial(\1)", text)
    names = "|".join(_FUNCTIONS)
    return re.sub(rf"\b({names})\s+(-?{_NUMBER}|pi|e)\b", r"\1(\2)", text)


def spoken(text: str) -> str:
    """The symbolic expression as words ("(3 + 4) * 2" -> "(3 plus 4) times 2")."""
    words = {"**": " to the power of ", "*": " times ", "/": " divided by ", "+": " plus ", "-": " minus "}
    text = re.sub(r"\*\*|[*/+-]", lambda m: words[m[0]], text)
    text = re.sub(r"\bsqrt\b", " the square root of ", text).replace("%", " percent")
    return " ".join(text.split())


def evaluate(expression: str) -> float | int:
    """The value of a Python arithmetic expression: numbers, + - * / // % **, the functions and constants above."""
    try:
        tree = ast.parse(expression, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise CalculationError(f"I could not read '{expression}' as arithmetic") from None
    try:
        return _value(tree.body)
    except ZeroDivisionError:
        raise CalculationError("that divides by zero") from None
    except OverflowError:
        raise CalculationError("the result is too large") from None
    except RecursionError:
        raise CalculationError("the expression is nested too deeply") from None
    except (ValueError, TypeError) as error:
        if isinstance(error, CalculationError):
            raise
        raise CalculationError(f"that has no real answer ({error})") from None


def _value(node: ast.AST) -> float | int:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.Name) and node.id in _CONSTANTS:
        return _CONSTANTS[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _value(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
        return _power(_value(node.left), _value(node.right))
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        return _finite(_OPERATORS[type(node.op)](_value(node.left), _value(node.right)))
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in _FUNCTIONS
        and len(node.args) == 1
        and not node.keywords
    ):
        return _finite(_FUNCTIONS[node.func.id](_value(node.args[0])))
    raise CalculationError(f"I can only do arithmetic, not '{ast.unparse(node)[:40]}'")


def _power(base: float | int, exponent: float | int) -> float | int:
    if abs(exponent) > MAX_EXPONENT:
        raise CalculationError(f"the exponent {exponent:g} is too large (at most {MAX_EXPONENT})")
    if isinstance(base, int) and isinstance(exponent, int) and exponent >= 0:
        if max(abs(base).bit_length(), 1) * exponent <= MAX_RESULT_BITS:
            return base**exponent
    return _finite(math.pow(base, exponent))


def _factorial(value: float) -> int:
    if value != int(value) or not 0 <= value <= MAX_FACTORIAL:
        raise CalculationError(f"I can take the factorial of whole numbers from 0 to {MAX_FACTORIAL} only")
    return math.factorial(int(value))


def _finite(value: float | int) -> float | int:
    if isinstance(value, float) and not math.isfinite(value):
        raise OverflowError
    if isinstance(value, int) and value.bit_length() > 4 * MAX_RESULT_BITS:  # products of bounded powers
        raise OverflowError
    return value


def rounded(value: float | int, digits: int = SIGNIFICANT_DIGITS) -> float | int:
    """``value`` to ``digits`` significant digits, an int when it is whole (48.0 -> 48, 1/3 -> 0.3333333333)."""
    if isinstance(value, int) and abs(value) < 10**18:
        return value
    value = float(value)  # OverflowError for an int no float holds
    if value == 0:
        return 0
    value = round(value, digits - 1 - math.floor(math.log10(abs(value))))
    return int(value) if value.is_integer() and abs(value) < 1e15 else value


def say_number(value: float | int) -> str:
    """A number as a voice says it: whole, or to 4 significant digits ("about 1.414"); no exponent below 1e15."""
    short = rounded(value, 4)
    text = str(short) if isinstance(short, int) else f"{short:.15g}"
    return text if short == value else f"about {text}"


def calculate(expression: Any, heard: str = "") -> dict[str, Any]:
    """``expression`` worked out; a quantity with a unit ("5 miles", which the default brain passes for "How many
    kilometers is 5 miles?") is converted to the one other unit of its kind the user's words name (``heard``)."""
    if not isinstance(expression, str) or not expression.strip():
        return {"error": "I need an expression, like '12 times 4'"}
    if len(expression) > MAX_EXPRESSION_CHARS:
        return {"error": f"the expression is too long (at most {MAX_EXPRESSION_CHARS} characters)"}
    text = symbolic(expression)
    try:
        value = rounded(evaluate(_python(text)))
    except OverflowError:
        return {"error": "the result is too large"}
    except CalculationError as error:
        if (quantity := _quantity(expression)) is not None:
            target = unit_named(heard, quantity[1])
            if target is not None:
                return convert_units(expression, target)
            return {"error": f"'{expression}' is a quantity with a unit: convert_units converts it to the unit asked"}
        return {"error": str(error)}
    return {"result": value, "say": f"{spoken(text)} is {say_number(value)}"}


# ---------------------------------------------------------------- units
_UNIT_ALIASES = {
    "c": "degC",
    "°c": "degC",
    "celsius": "degC",
    "centigrade": "degC",
    "f": "degF",
    "°f": "degF",
    "fahrenheit": "degF",
    "k": "kelvin",
    "fl oz": "fluid_ounce",
    "fluid ounce": "fluid_ounce",
    "fluid ounces": "fluid_ounce",
}
_registry_lock = threading.Lock()


@cache
def _registry() -> pint.UnitRegistry:
    """One registry per process (building it takes a fraction of a second)."""
    return pint.UnitRegistry(cache_folder=None)


def _unit(text: str) -> pint.Unit:
    """The unit ``text`` names: pint's names ("km", "miles per hour", "light year"), a few spoken ones ("degrees
    fahrenheit", "fl oz"), in any case."""
    name = " ".join(text.strip().split())
    if not name or len(name) > MAX_UNIT_CHARS or not re.fullmatch(r"[\w°µ /*^.\-]+", name):
        raise CalculationError(f"I do not know the unit '{text[:MAX_UNIT_CHARS]}'")
    name = re.sub(r"^(?:degrees?|deg)\s+(?=c|f|k|celsius|fahrenheit|centigrade|kelvin)", "", name, flags=re.I)
    name = _UNIT_ALIASES.get(name.lower(), name)
    for candidate in (name, name.lower(), name.lower().replace(" ", "_")):  # "light year" -> light_year
        try:
            return _registry().parse_units(candidate)
        except Exception:  # pint's parser raises several kinds; any of them: not a unit it knows
            continue
    raise CalculationError(f"I do not know the unit '{text}'")


def convert_units(quantity: Any, to: Any, heard: str = "") -> dict[str, Any]:
    """``quantity`` ("5 miles") in the unit ``to``; a bare number takes the unit the user said after it (``heard``:
    the default brain passed "100" for "Convert 100 Fahrenheit to Celsius")."""
    if not isinstance(quantity, str) or not isinstance(to, str) or not quantity.strip() or not to.strip():
        return {"error": "I need a quantity and a unit, like '5 miles' to 'km'"}
    if len(quantity) > MAX_UNIT_CHARS or len(to) > MAX_UNIT_CHARS:
        return {"error": "the quantity or unit is too long"}
    quantity = unit_said_after(quantity, heard) or quantity
    match = _number_and_rest(quantity)
    if match is None:
        return {"error": f"I could not understand the quantity '{quantity}' (say it like '5 miles')"}
    try:
        with _registry_lock:
            source, target = _unit(match[2]), _unit(to)
            converted = _registry().Quantity(float(match[1]), source).to(target).magnitude
        value = rounded(converted, 4)
    except CalculationError as error:
        return {"error": str(error)}
    except pint.errors.DimensionalityError:
        return {"error": f"I cannot convert {match[2]} to {to}: they measure different things"}
    except (pint.errors.PintError, OverflowError, ValueError) as error:
        return {"error": f"I could not convert that ({error})"[:200]}
    return {
        "result": value,
        "unit": to.strip(),
        "say": f"{match[1]} {match[2]} is {say_number(converted)} {to.strip()}",
    }


def _in_digits(words: str) -> str:
    """``words`` with their numbers in digits and no thousands commas ("five thousand miles" -> "5000 miles")."""
    return alpha2digit(" ".join(words.split()), "en", threshold=0).replace(",", "")


def _single_unit(span: str) -> pint.Unit | None:
    """The one unit a word or two name ("kilometers", "fluid ounces"), or None: not a unit, a product pint reads
    into two words ("are in": are x inch), or no dimension."""
    try:
        with _registry_lock:
            unit = _unit(span)
    except CalculationError:
        return None
    return None if re.search(r"[*/]", str(unit)) or unit.dimensionless else unit


def _number_and_rest(quantity: str) -> re.Match[str] | None:
    """ "five miles" -> ("5", "miles"): a number (in words or digits), then the rest."""
    number = re.sub(r"^(?:an?)\s+", "1 ", _in_digits(quantity))
    return re.fullmatch(r"([-+]?\d+(?:\.\d+)?)\s*([^\d\s.,].*)", number)


def unit_said_after(number: str, words: str) -> str | None:
    """``number`` ("100") with the unit ``words`` say right after it ("100 Fahrenheit"), or None where it is not a
    bare number or they say none."""
    if re.fullmatch(r"[-+]?\d+(?:\.\d+)?", number.strip()) is None:
        return None
    said = _in_digits(words)
    for match in re.finditer(rf"(?<![\d.]){re.escape(number.strip())}\s*([^\W\d_]+)(?:\s+([^\W\d_]+))?", said):
        for span in (f"{match[1]} {match[2]}" if match[2] else None, match[1]):
            if span is not None and _single_unit(span) is not None:
                return f"{number.strip()} {span}"
    return None


def conversion_asked(words: str) -> dict[str, Any] | None:
    """The conversion ``words`` ask for, done: a number with a unit ("3 kilograms") and one other unit of its kind
    ("How many pounds is 3 kilograms?"); None where they ask none. For a call whose numbers are not the user's: the
    default brain passed "3 * 2.2" (its own factor) for that question."""
    said = _in_digits(words)
    for number in re.findall(r"(?<![\d.])\d+(?:\.\d+)?", said)[:MAX_WORDS_SEARCHED]:
        quantity = unit_said_after(number, said)
        parsed = _quantity(quantity) if quantity is not None else None
        target = unit_named(words, parsed[1]) if parsed is not None else None
        if quantity is not None and target is not None:
            result = convert_units(quantity, target)
            if "error" not in result:
                return result
    return None


def unit_named(words: str, source: pint.Unit) -> str | None:
    """The one unit of ``source``'s kind, other than it, that ``words`` name (a word or two: "kilometers",
    "fluid ounces"), as said; None where they name none or several (of several, those of three letters or more are
    preferred: "in" is an inch to pint). Unit names are pint's, so English ones."""
    spoken = re.findall(r"[^\W\d_]+", words)[:MAX_WORDS_SEARCHED]
    found: dict[pint.Unit, str] = {}
    for size in (2, 1):
        for start in range(len(spoken) - size + 1):
            span = " ".join(spoken[start : start + size])
            unit = _single_unit(span)
            same_kind = unit is not None and unit.dimensionality == source.dimensionality and unit != source
            if same_kind and not any(span in earlier.split() for earlier in found.values()):
                found.setdefault(unit, span)
    if len(found) > 1:
        found = {unit: span for unit, span in found.items() if len(span) >= 3}
    return next(iter(found.values())) if len(found) == 1 else None


def _quantity(text: str) -> tuple[float, pint.Unit] | None:
    """``text`` is a number and a unit pint knows ("5 miles"), or None."""
    match = _number_and_rest(text) if len(text) <= MAX_UNIT_CHARS else None
    if match is None:
        return None
    try:
        with _registry_lock:
            unit = _unit(match[2])
        return (float(match[1]), unit) if not unit.dimensionless else None
    except CalculationError:
        return None


def _numbers(text: str) -> set[float]:
    found = re.findall(r"\d+(?:\.\d+)?", _in_digits(text.lower()))
    return {float(n) for n in found}


def numbers_heard(argument: str, heard: str) -> bool:
    """Every number of ``argument`` is one the user said (or it as a percentage: "15%" for 0.15), and there is one:
    arithmetic the user did not ask for is not done ("3 times 1000" for "How many pounds is 3 kilograms?")."""
    said = _numbers(heard)
    wanted = _numbers(argument)
    return bool(wanted) and all(n in said or round(n * 100, 6) in said for n in wanted)


class CalculatorSkill:
    """``calculate`` and ``convert_units``: the same for every conversation."""

    name = "calculator"

    def tools(self, owner: SkillOwner) -> tuple[ServerTool, ...]:
        def grounded(text: Any, run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
            heard = owner.heard()
            if heard and isinstance(text, str) and not numbers_heard(text, heard):
                return conversion_asked(heard) or unasked("the numbers are not the user's")
            return run()

        return (
            ServerTool(
                "calculate",
                lambda arguments: grounded(
                    arguments.get("expression"), lambda: calculate(arguments.get("expression"), owner.heard())
                ),
                "Do arithmetic, e.g. '15% of 80', '(3+4)*2', 'sqrt(2)', '12 times 4'.",
                {
                    "type": "object",
                    "properties": {"expression": {"type": "string", "description": "The arithmetic to do."}},
                    "required": ["expression"],
                },
            ),
            ServerTool(
                "convert_units",
                lambda arguments: grounded(
                    arguments.get("quantity"),
                    lambda: convert_units(arguments.get("quantity"), arguments.get("to"), owner.heard()),
                ),
                "Convert a quantity to another unit, e.g. '5 miles' to 'km'.",
                {
                    "type": "object",
                    "properties": {
                        "quantity": {"type": "string", "description": "A number and its unit, e.g. '5 miles'."},
                        "to": {"type": "string", "description": "The unit wanted, e.g. 'km'."},
                    },
                    "required": ["quantity", "to"],
                },
            ),
        )

    def close(self, owner: SkillOwner) -> None:
        """Nothing is kept per conversation."""
