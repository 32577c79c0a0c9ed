"""The calculator: arithmetic as said, nothing but arithmetic, bounded; unit conversion with pint."""

from __future__ import annotations

import re
import time

import pytest
from skill_fakes import conversation

from app.skills.calculator import CalculatorSkill, calculate, convert_units


@pytest.mark.parametrize(
    ("expression", "result", "say"),
    [
        ("15% of 80", 12, "15 percent of 80 is 12"),
        ("(3+4)*2", 14, "(3 plus 4) times 2 is 14"),
        ("sqrt(2)", 1.414213562, "the square root of (2) is about 1.414"),
        ("twelve times four", 48, "12 times 4 is 48"),
        ("what is 2 plus 2?", 4, "2 plus 2 is 4"),
        ("100 divided by 3", 33.33333333, "100 divided by 3 is about 33.33"),
        ("seven over two", 3.5, "7 divided by 2 is 3.5"),
        ("three point five times two", 7, "3.5 times 2 is 7"),
        ("2^10", 1024, "2 to the power of 10 is 1024"),
        ("10 squared", 100, "10 to the power of 2 is 100"),
        ("the square root of 16", 4, "the square root of 16 is 4"),
        ("5!", 120, "5! is 120"),
        ("20 percent", 0.2, "20 percent is 0.2"),
        ("10 mod 3", 1, "10 mod 3 is 1"),
        ("-5 + 3", -2, "minus 5 plus 3 is -2"),
        ("2 x 3", 6, "2 times 3 is 6"),
        ("0.1 + 0.2", 0.3, "0.1 plus 0.2 is 0.3"),
        ("1,000 times 3", 3000, "1000 times 3 is 3000"),
    ],
)
def test_arithmetic_as_said(expression: str, result: float, say: str) -> None:
    assert calculate(expression) == {"result": result, "say": say}


@pytest.mark.parametrize(
    ("expression", "why"),
    [
        ("__import__('os').system('true')", "only do arithmetic"),
        ("(1).real", "only do arithmetic"),
        ("().__class__", "only do arithmetic"),
        ("'a' * 3", "only do arithmetic"),
        ("[1, 2]", "only do arithmetic"),
        ("lambda: 1", "only do arithmetic"),
        ("blorp", "only do arithmetic"),
        ("2 +", "could not read"),
        ("1/0", "divides by zero"),
        ("10 mod 0", "divides by zero"),
        ("9**9**9", "exponent .* is too large"),
        ("10**100000", "exponent 100000 is too large"),
        ("2**1000 * 2**1000 * 2**1000 * 2**1000 * 2**1000 * 2**1000 * 2**1000 * 2**1000", "too large"),
        ("1e308 * 10", "too large"),
        ("factorial(100000)", "factorial"),
        ("99999!", "factorial"),
        ("(-8) ** (1/3)", "no real answer"),
        ("sqrt(-1)", "no real answer"),
        ("1+" * 150 + "1", "too long"),
        ("", "I need an expression"),
    ],
)
def test_anything_but_bounded_arithmetic_is_refused_fast(expression: str, why: str) -> None:
    started = time.perf_counter()
    result = calculate(expression)
    assert time.perf_counter() - started < 5  # refused, not computed (9 ** 9 ** 9 would take hours)
    assert set(result) == {"error"}
    assert re.search(why, result["error"]), result


def test_the_deepest_nesting_the_length_allows_is_fine() -> None:
    assert calculate("(" * 99 + "1" + ")" * 99)["result"] == 1
    assert calculate("-" * 199 + "1")["result"] == -1


@pytest.mark.parametrize(
    ("quantity", "to", "result"),
    [
        ("5 miles", "km", 8.047),
        ("70 fahrenheit", "celsius", 21.11),
        ("70 degrees fahrenheit", "degrees celsius", 21.11),
        ("twenty celsius", "F", 68),
        ("300 K", "C", 26.85),
        ("a mile", "meters", 1609),
        ("100 km/h", "mph", 62.14),
        ("60 miles per hour", "km/h", 96.56),
        ("2 pounds", "kg", 0.9072),
        ("1 fl oz", "ml", 29.57),
        ("1 light year", "km", 9.461e12),
    ],
)
def test_units(quantity: str, to: str, result: float) -> None:
    converted = convert_units(quantity, to)
    assert converted["result"] == result
    assert converted["say"].endswith(f" {to}")


def test_unit_conversion_says_what_was_understood() -> None:
    assert convert_units("5 miles", "km") == {"result": 8.047, "unit": "km", "say": "5 miles is about 8.047 km"}


@pytest.mark.parametrize(
    ("quantity", "to", "why"),
    [
        ("1 blorp", "km", "I do not know the unit 'blorp'"),
        ("5 miles", "blorps", "I do not know the unit 'blorps'"),
        ("5 miles", "kg", "I cannot convert miles to kg: they measure different things"),
        ("5", "km", "I could not understand the quantity '5'"),
        ("miles", "km", "I could not understand the quantity 'miles'"),
        ("5 __import__('os')", "km", "I do not know the unit"),
        ("5 miles", "k" * 500, "too long"),
    ],
)
def test_unknown_units_are_clear_errors(quantity: str, to: str, why: str) -> None:
    assert why in convert_units(quantity, to)["error"]


def test_the_tools() -> None:
    owner, _ = conversation("a")
    tools = {t.name: t for t in CalculatorSkill().tools(owner)}
    assert set(tools) == {"calculate", "convert_units"}
    assert tools["calculate"].run({"expression": "12 times 4"})["result"] == 48
    assert tools["convert_units"].run({"quantity": "5 miles", "to": "km"})["result"] == 8.047
    assert "error" in tools["calculate"].run({})
    assert "error" in tools["convert_units"].run({"quantity": 5, "to": "km"})


@pytest.mark.parametrize(
    ("expression", "heard", "say"),
    [
        ("5 miles", "How many kilometers is five miles?", "5 miles is about 8.047 kilometers"),
        ("3 kg", "How many pounds is 3 kilograms?", "3 kg is about 6.614 pounds"),
        ("1 mile", "How many feet in a mile?", "1 mile is 5280 feet"),  # "in" is an inch to pint: not chosen
        ("2 cups", "How many fluid ounces are in 2 cups?", "2 cups is 16 fluid ounces"),  # not "are in" (are x inch)
        ("100 fahrenheit", "Convert 100 Fahrenheit to Celsius.", "100 fahrenheit is about 37.78 Celsius"),
    ],
)
def test_a_quantity_given_to_the_calculator_is_converted_to_the_unit_the_user_named(expression, heard, say) -> None:
    """The default brain called ``calculate("5 miles")`` for "How many kilometers is 5 miles?"."""
    assert calculate(expression, heard)["say"] == say


@pytest.mark.parametrize(
    ("expression", "heard"),
    [("5 miles", "How far is 5 miles?"), ("5 miles", ""), ("5 miles", "5 miles in kilometers or in meters?")],
)
def test_a_quantity_without_one_unit_named_to_convert_to_points_to_the_conversion(expression, heard) -> None:
    assert "convert_units" in calculate(expression, heard)["error"]


@pytest.mark.parametrize("expression", ["3 apples", "2 + x", "12 people"])
def test_words_that_are_no_unit_are_not_called_a_quantity(expression: str) -> None:
    assert "convert_units" not in calculate(expression, "How many pears is 3 apples?")["error"]


def test_a_quantity_without_a_unit_is_not_read_as_digits_and_a_unit() -> None:
    """ "100" was read as 10 of a unit named "0" (the default brain passed "100" for "Convert 100 Fahrenheit")."""
    assert "could not understand the quantity '100'" in convert_units("100", "celsius")["error"]


@pytest.mark.parametrize(
    ("quantity", "to", "heard", "say"),
    [
        ("100", "celsius", "Convert 100 Fahrenheit to Celsius.", "100 Fahrenheit is about 37.78 celsius"),
        (
            "100",
            "celsius",
            "convert one hundred degrees fahrenheit to celsius",
            "100 degrees fahrenheit is about 37.78 celsius",
        ),
        ("2", "fluid ounces", "how many fluid ounces in 2 cups", "2 cups is 16 fluid ounces"),
    ],
)
def test_a_bare_number_to_convert_takes_the_unit_the_user_said_after_it(quantity, to, heard, say) -> None:
    assert convert_units(quantity, to, heard)["say"] == say


def test_a_bare_number_with_no_unit_after_it_in_the_words_is_refused() -> None:
    assert "could not understand" in convert_units("5", "km", "What is 5 plus 3?")["error"]
    assert "could not understand" in convert_units("5", "km", "")["error"]
