"""A recipe's numbers are judged exactly, never through `float`: an integer past any float
(`margin: 1` and 400 zeros), its negative, a Fraction, a Decimal or a numpy scalar gets the
recipe's one line with the reason any out-of-range value gets, never an OverflowError (which
made 7 lint rules report a foundry-fp8 bug, and `FP8Recipe(margin=10**400)` raise).

References: TE's `margin: int` declared in a pydantic dataclass as TE declares it
(common/recipe/__init__.py:12, 253 at d0067d0), under pydantic 2 and under pydantic 1 (TE's
setup.py pins no pydantic; `pydantic.v1` is pydantic 1's validation), E4M3 casts by torch, and
digit counts by `str`."""

from __future__ import annotations

import numbers
import subprocess
import sys
from decimal import Decimal
from fractions import Fraction
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from pydantic import ValidationError
from pydantic.dataclasses import dataclass as pydantic_dataclass
from pydantic.v1.dataclasses import dataclass as pydantic1_dataclass

from foundry_fp8.composer.state import run_recipe
from foundry_fp8.lint.registry import LintContext
from foundry_fp8.lint.rules import lint_config
from foundry_fp8.recipe import FP8Recipe, RecipeError

BIG = 10**400  # no float holds it: float(BIG) raises OverflowError
PAST_REPR = 10**5000  # past Python's 4300-digit str limit: repr(PAST_REPR) raises ValueError


@pydantic_dataclass
class _TEDelayed:
    margin: int = 0


@pydantic1_dataclass
class _TEDelayedPydantic1:
    margin: int = 0


def _id(value: Any) -> str:
    """A test id: pytest's `str` of PAST_REPR raises."""
    return f"{type(value).__name__}-{len(str(abs(value))) if abs(value) < BIG else 'big'}" if (
        isinstance(value, int)) else type(value).__name__


def _line(key: str, value: Any, how: str = "options") -> str:
    with pytest.raises(RecipeError) as error:
        if how == "options":
            FP8Recipe.from_options({key: value})
        else:
            FP8Recipe(**{key: value})
    message = str(error.value)
    assert message.startswith(f"fp8_recipe.{key}: must be an integer from ") and "\n" not in message
    return message


def _why(message: str) -> str:
    """The reason in a margin line: the parenthesis after `got ...`."""
    return message.split(" (fix: ")[0].rsplit(" (", 1)[1].removesuffix(")")


def _e4m3(value: float) -> float:
    return torch.tensor(value, dtype=torch.float32).to(torch.float8_e4m3fn).float().item()


@pytest.mark.parametrize("how", ["options", "constructor"])
def test_a_margin_past_any_float_gets_the_bound_s_reason(how):
    """Before: OverflowError: int too large to convert to float (recipe.py `float(margin)`)."""
    fp8 = torch.finfo(torch.float8_e4m3fn)  # from margin 18 E4M3's max amax is scaled below
    assert 448.0 * 2.0**-18 < fp8.smallest_normal * 2.0**-3 == 2.0**-9  # the smallest subnormal
    assert _e4m3(448.0 * 2.0**-19) == 0.0  # and all but the largest elements flush to 0
    assert 448.0 * 2.0**1 > fp8.max  # below 0 the amax is scaled past E4M3's max
    for value, like in [(BIG, 18), (PAST_REPR, 18), (-BIG, -1), (-PAST_REPR, -1),
                        (Fraction(BIG), 18), (Decimal("1e400"), 18), (Decimal("-1e5000"), -1),
                        (np.longdouble("1e4000"), 18), (np.uint64(2**64 - 1), 18),
                        (np.int8(-128), -1), (1e308, 18), (-1e308, -1)]:
        assert _why(_line("margin", value, how)) == _why(_line("margin", like, how)), value
    assert "flushes to 0" in _why(_line("margin", BIG, how))
    assert "saturate" in _why(_line("margin", -BIG, how))


@pytest.mark.parametrize("value", [BIG, -BIG, PAST_REPR, 10**20, -(10**20), BIG - 1], ids=_id)
def test_a_long_integer_is_shown_by_its_digit_count(value):
    digits = len(str(abs(value))) if abs(value) < 10**4000 else 5001
    sign = "negative " if value < 0 else ""
    for key in ("margin", "amax_history_len"):
        assert f"got a {sign}{digits}-digit integer (" in _line(key, value) + " ("


def test_a_20_digit_integer_is_still_shown_as_written():
    assert f"got {10**20 - 1} (" in _line("margin", 10**20 - 1)


@pytest.mark.parametrize("value", [BIG, -BIG, PAST_REPR, Fraction(BIG), Fraction(PAST_REPR),
                                   Decimal("1e400"), np.longdouble("1e4000"), 1e308, -0.0,
                                   np.uint64(2**64 - 1), Decimal("NaN"), Decimal("sNaN"),
                                   float("nan"), np.float32("inf")], ids=_id)
@pytest.mark.parametrize("how", ["options", "constructor"])
def test_amax_history_len_refuses_odd_numbers_with_one_line(value, how):
    _line("amax_history_len", value, how)


@pytest.mark.parametrize(("value", "why"), [
    (-0.0, "a float: write 0"), (Decimal("2"), "a Decimal: write 2"),
    (Fraction(4), "a Fraction: write 4"), (np.float16(3), "a float16: write 3"),
    (Decimal("sNaN"), "not a finite number"), (np.float32("inf"), "not a finite number"),
    (complex(1, 0), "a complex, not a real number"),
])
def test_an_integral_number_that_is_no_int_is_told_the_int_te_reads(value, why):
    if why.startswith(("a float", "a Decimal")):
        assert _TEDelayed(margin=value).margin == int(why.rsplit(" ", 1)[1])
    assert _why(_line("margin", value)) == why


@pytest.mark.parametrize("value", [2.5, Fraction(5, 2), Decimal("2.5"), np.float32(2.5)])
def test_a_fractional_margin_is_told_what_each_pydantic_does(value):
    """TE pins no pydantic: pydantic 2 refuses 2.5, pydantic 1 truncates it to 2. The line
    said TransformerEngine refuses it, which is untrue under pydantic 1."""
    assert _TEDelayedPydantic1(margin=2.5).margin == 2
    with pytest.raises(ValidationError):
        _TEDelayed(margin=2.5)
    assert _why(_line("margin", value)) == (
        "a fraction: TransformerEngine's recipes declare margin an int, which pydantic 2 "
        "refuses and pydantic 1 truncates to 2")


@pytest.mark.parametrize("how", ["options", "constructor"])
def test_a_fraction_truncating_past_repr_names_the_truncation_by_its_digit_count(how):
    """The fraction's reason printed pydantic 1's truncation with `int`'s str, which raises
    past 4300 digits: a ValueError escaped `recipe_problems` and `FP8Recipe`."""
    value = Fraction(PAST_REPR + 1, 2)
    assert _TEDelayedPydantic1(margin=value).margin == 5 * 10**4999  # 5000 digits
    assert _why(_line("margin", value, how)) == (
        "a fraction: TransformerEngine's recipes declare margin an int, which pydantic 2 "
        "refuses and pydantic 1 truncates to a 5000-digit integer")


class _OpaqueReal:
    """A real number by registration only: no `as_integer_ratio`, no comparisons."""


numbers.Real.register(_OpaqueReal)


def test_a_real_number_without_an_exact_ratio_is_refused_with_one_line():
    assert _why(_line("margin", _OpaqueReal())) == (
        "a _OpaqueReal, a number foundry-fp8 cannot read exactly")


@pytest.mark.parametrize("key", ["scaling", "amax_compute_algo"])
def test_an_array_for_a_choice_is_refused_with_one_line(key):
    """Before: ValueError 'The truth value of an array ... is ambiguous' (`in`, `==`)."""
    for build in (FP8Recipe.from_options, lambda options: FP8Recipe(**options)):
        with pytest.raises(RecipeError, match=rf"^fp8_recipe\.{key}: unknown .*array\(\[1, 2\]\)"):
            build({key: np.array([1, 2])})


@pytest.mark.parametrize("scope", ["file", "run"])
@pytest.mark.parametrize("key", ["margin", "amax_history_len"])
def test_no_lint_rule_crashes_on_a_recipe_number(scope, key):
    """Before: FP8005, 008, 019, 020, 023, 034 and 048 each reported an OverflowError."""
    for value in (BIG, -BIG, 1e308, float("nan"), -0.0):
        for config in ({"algorithms": {"te_swap": {"fp8_recipe": {key: value}}}},
                       {"callbacks": {"fp8_stats": {"recipe": {key: value}}}}):
            findings = lint_config({"precision": "amp_fp8", **config}, LintContext(scope=scope))
            assert not [f for f in findings if f.crashed], (config, findings)
            assert [f.rule for f in findings if f.key.endswith(key)] == ["FP8008"], findings


def test_the_lint_cli_gives_one_line_and_exit_1_for_a_400_digit_margin(tmp_path):
    path = tmp_path / "big.yaml"
    path.write_text("precision: fp32\nalgorithms:\n  te_swap:\n    backend: emulate\n"
                    "    fp8_recipe:\n      margin: 1" + "0" * 400 + "\n")
    done = subprocess.run([sys.executable, "-m", "foundry_fp8", "lint", str(path)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Traceback" not in done.stderr and "check failed" not in done.stdout
    lines = [line for line in done.stdout.splitlines() if "FP8008" in line]
    assert len(lines) == 1, done.stdout
    assert lines[0].split()[:4] == ["6:7", "error", "FP8008",
                                    "algorithms.te_swap.fp8_recipe.margin"]
    assert lines[0].endswith(
        "te_swap.fp8_recipe.margin must be an integer from 0 to 17, got a 401-digit integer (a "
        "larger margin scales even the amax below E4M3's smallest subnormal: the tensor flushes "
        "to 0)")


def test_fp8_state_reads_a_precision_config_margin_past_any_float_as_unknown():
    """Composer's precision_config goes to TE's DelayedScaling, whose `margin: int` takes
    10**400 (pydantic 2); `run_recipe` raised OverflowError (it catches ValueError only)."""
    assert _TEDelayed(margin=BIG).margin == BIG
    state = SimpleNamespace(algorithms=[], precision=SimpleNamespace(value="amp_fp8"),
                            precision_config={"margin": BIG})
    assert run_recipe(state) is None  # type: ignore[arg-type]
