"""Every check on the options of our entries (`te_swap`, `fp8_stats`, `fp8_state`, `fp8_lint`,
`jsonl`), in one place: unknown options, types from the `__init__` annotations
(`entries.accepts`), and the values those types still let through that the constructors refuse
(`OPTION_VALUES`: counts below their minimum, regexes that do not compile, unknown choices,
unknown `{placeholders}` in paths, FP8 recipes through `recipe.recipe_problems`).

The linter reports them as FP8019 (unknown), FP8020 (type), FP8023 (value) and FP8008
(recipe); a constructor can call `check_options(name, options)` to raise the first one, so that
a YAML the linter passes is one the run accepts. Choices the code keeps as constants (fp8_lint's
FAIL_ON, fp8_stats' TENSOR_KINDS, the jsonl logger's PLACEHOLDERS) are read from their modules'
source (`entries.module_constant`), never imported: those modules import torch.
"""

from __future__ import annotations

import math
import re
import string
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from foundry_fp8.lint.entries import (
    Entry,
    Option,
    accepts,
    literal_values,
    module_constant,
    our_entries,
)
from foundry_fp8.lint.known import did_you_mean
from foundry_fp8.recipe import recipe_problems

Kind = Literal["unknown", "reserved", "type", "value", "recipe"]


@dataclass(frozen=True)
class OptionProblem:
    """`option`: the option's name, dotted into it for a recipe key (`fp8_recipe.margin`);
    `message`: a sentence naming `<entry>.<option>`."""

    option: str
    kind: Kind
    message: str
    fix: str


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _shown(value: Any) -> str:
    return "null" if value is None else repr(value)


def choice_problem(allowed: Sequence[Any], value: Any) -> tuple[str, str]:
    """(message, fix) for a value outside `allowed`, naming the closest choice."""
    choices = ", ".join(map(_shown, allowed))
    return (f"must be one of {choices}, got {_shown(value)}"
            + did_you_mean(str(value), [str(a) for a in allowed if a is not None]),
            f"use one of {choices}")


# -- value constraints: each returns (message, fix) for a value of the annotated type --------

@dataclass(frozen=True)
class Count:
    """An integer of at least `minimum`."""

    minimum: int

    def problem(self, value: Any) -> tuple[str, str] | None:
        if _is_int(value) and value >= self.minimum:
            return None
        word = {0: "a non-negative integer", 1: "a positive integer"}.get(
            self.minimum, f"an integer >= {self.minimum}")
        return f"must be {word}, got {value!r}", f"use {word}"


@dataclass(frozen=True)
class Number:
    """A number (int or float) of at least `minimum`."""

    minimum: float

    def problem(self, value: Any) -> tuple[str, str] | None:
        if isinstance(value, (int, float)) and not isinstance(value, bool) \
                and value >= self.minimum:
            return None
        return f"must be a number >= {self.minimum:g}, got {value!r}", \
            f"use a number >= {self.minimum:g}"


@dataclass(frozen=True)
class Regex:
    """A pattern `re.compile` accepts."""

    def problem(self, value: Any) -> tuple[str, str] | None:
        try:
            re.compile(value)
        except (re.error, TypeError) as e:
            return (f"is not a valid regular expression ({e})",
                    "fix the pattern; a backslash makes ( [ { . * + ? literal")
        return None


@dataclass(frozen=True)
class Choice:
    """One of a constant of ours (`module`, `name`); `each`: every item of a list is."""

    module: str
    name: str
    each: bool = False

    def problem(self, value: Any) -> tuple[str, str] | None:
        allowed = module_constant(self.module, self.name)
        if not self.each:
            return choice_problem(allowed, value) if value not in allowed else None
        choices = ", ".join(map(_shown, allowed))
        for item in value:
            if item not in allowed:
                return (f"may list only {choices}, got {_shown(item)}"
                        + did_you_mean(str(item), allowed), f"use items among {choices}")
        return None


@dataclass(frozen=True)
class PathTemplate:
    """A path that `str.format` fills with the placeholders of constant (`module`, `name`);
    `required`: it may not be empty."""

    module: str
    name: str
    required: bool = False

    def problem(self, value: Any) -> tuple[str, str] | None:
        names = module_constant(self.module, self.name)
        allowed = ", ".join(f"{{{n}}}" for n in names)
        if self.required and not str(value).strip():
            return "must be a file path, got an empty one", f"give a path (placeholders: {allowed})"
        try:
            fields = [f for _, f, _, _ in string.Formatter().parse(value) if f is not None]
        except ValueError as e:
            return f"is not a valid path template ({e})", \
                "write {{ and }} for literal braces"
        unknown = [f for f in fields if f not in names]
        if unknown:
            return (f"has unknown placeholder {{{unknown[0]}}}"
                    + did_you_mean(unknown[0], names), f"use only {allowed} (or no placeholder)")
        return None


@dataclass(frozen=True)
class Batches:
    """A number of batches of at least `minimum`: an integer, or a Composer time string in
    batches (`"100ba"`, as Composer's Time.from_timestring reads it)."""

    minimum: int

    def problem(self, value: Any) -> tuple[str, str] | None:
        fix = f"use batches such as '100ba' or 100 (at least {self.minimum})"
        count: float | None = value if _is_int(value) else None
        if isinstance(value, str):
            match = re.fullmatch(r"(.+)ba", value, re.IGNORECASE)
            try:
                count = float(match[1]) if match else None
            except ValueError:
                count = None
            if count is None:
                return f"must be a number of batches, got {value!r}", fix
            if not math.isfinite(count) or not count.is_integer():
                return f"must be a whole number of batches, got {value!r}", fix
        if count is None or count < self.minimum:
            return f"must be at least {self.minimum} batch{'es' * (self.minimum != 1)}, got " \
                f"{value!r}", fix
        return None


@dataclass(frozen=True)
class Recipe:
    """An FP8 recipe mapping, checked by `recipe_problems` (FP8008). `string_form`: a string
    (or null) also works, as the scaling (`parse_recipe`: null means current)."""

    string_form: bool = False


Constraint = Count | Number | Regex | Choice | PathTemplate | Batches | Recipe

_JSONL = "foundry_fp8.composer.jsonl_logger"

#: What the constructors refuse beyond the annotated type, per entry and option. Verified in:
#: te_swap: foundry_fp8/swap.py SwapConfig.__post_init__, foundry_fp8/recipe.py
#: FP8Recipe.from_options; fp8_stats: foundry_fp8/composer/stats.py _batches and FP8Stats
#: (dump_folder.format(run_name=...)), foundry_fp8/monitor.py MonitorConfig.__post_init__ and
#: parse_recipe; fp8_state: foundry_fp8/composer/state.py FP8State.__init__; fp8_lint:
#: foundry_fp8/composer/lint.py FAIL_ON; jsonl: foundry_fp8/composer/jsonl_logger.py check_path.
OPTION_VALUES: dict[str, dict[str, Constraint]] = {
    "te_swap": {
        "keep_first_blocks": Count(0), "keep_last_blocks": Count(0), "min_gemm_size": Count(0),
        "tokens_per_microbatch": Count(1), "include": Regex(), "exclude": Regex(),
        "fp8_recipe": Recipe(),
    },
    "fp8_stats": {
        "interval": Batches(1), "layers": Regex(), "exclude": Regex(), "dump_layers": Regex(),
        "tensors": Choice("foundry_fp8.monitor", "TENSOR_KINDS", each=True),
        "dump_max_mb": Number(0), "recipe": Recipe(string_form=True),
        "dump_folder": PathTemplate(_JSONL, "PLACEHOLDERS"),
    },
    "fp8_state": {"watch_batches": Count(0)},
    "fp8_lint": {"fail_on": Choice("foundry_fp8.composer.lint", "FAIL_ON")},
    "jsonl": {"path": PathTemplate(_JSONL, "PLACEHOLDERS", required=True)},
}


def _recipe_problems(entry: str, option: str, value: Any, constraint: Recipe,
                     ) -> Iterator[OptionProblem]:
    if value is None and not constraint.string_form:
        return  # te_swap: no fp8_recipe means the default recipe
    if constraint.string_form and not isinstance(value, Mapping):
        recipe, given = {"scaling": value or "current"}, {"scaling": option}  # parse_recipe
    else:
        recipe, given = value, {}
    for problem in recipe_problems(recipe):
        where = given.get(problem.key) or (f"{option}.{problem.key}" if problem.key else option)
        yield OptionProblem(where, "recipe", f"{entry}.{where}: {problem.message}", problem.fix)


def option_problems(entry: Entry, options: Mapping[Any, Any]) -> Iterator[OptionProblem]:
    """Every problem with the options a YAML (or a caller) gives `entry`."""
    constraints = OPTION_VALUES.get(entry.name, {})
    for name, value in options.items():
        name = str(name)
        subject = f"{entry.name}.{name}"
        option = entry.options.get(name)
        if name in entry.reserved:
            yield OptionProblem(name, "reserved", f"LLM-Foundry passes `{name}` to {entry.name} "
                                "itself and refuses it in the YAML", f"remove {subject}")
        elif option is None:
            if not entry.any_options:
                yield OptionProblem(name, "unknown", f"{entry.name} has no option `{name}`"
                                    + did_you_mean(name, entry.options),
                                    f"use one of: {', '.join(sorted(entry.options))}")
        elif isinstance(constraint := constraints.get(name), Recipe):
            yield from _recipe_problems(entry.name, name, value, constraint)
        elif not accepts(option.annotation, value):
            allowed = literal_values(option.annotation)
            if allowed is not None:
                message, fix = choice_problem(allowed, value)
            else:
                message = f"takes {option.annotation}, got {type(value).__name__} {value!r}"
                fix = f"give {name} a value of type {option.annotation}"
            yield OptionProblem(name, "type", f"{subject} {message}", fix)
        elif constraint is not None and value is not None:
            found = constraint.problem(value)
            if found:
                yield OptionProblem(name, "value", f"{subject} {found[0]}", found[1])


def check_options(name: str, options: Mapping[str, Any]) -> None:
    """For constructors: raise ValueError (one line) for the first problem with the options
    of our entry `name`; keys that are not its options (`self`, `train_config`) are skipped,
    so `check_options("fp8_state", locals())` works."""
    entry = next((e for e in our_entries().values() if e.name == name), None)
    if entry is None:  # not installed with its entry points: the value checks alone
        entry = Entry("", name, "", {k: Option(k, None) for k in OPTION_VALUES.get(name, {})},
                      any_options=True)
    given = {k: v for k, v in options.items() if k in entry.options}
    for problem in option_problems(entry, given):
        raise ValueError(f"{problem.message} (fix: {problem.fix})")

