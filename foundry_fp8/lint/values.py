"""Every check on the options of our entries (`te_swap`, `fp8_stats`, `fp8_state`, `fp8_lint`,
`jsonl`), in one place: unknown options, types from the `__init__` annotations
(`entries.accepts`), and the values those types still let through that the constructors refuse
(`OPTION_VALUES`: counts below their minimum, numbers out of range, regexes that do not
compile, unknown choices, unknown `{placeholders}` in paths, FP8 recipes through
`recipe.recipe_problems`; `OPTION_RELATIONS`: options that bound each other, such as
fp8_stats' `end` after its `start`).

The linter reports them as FP8019 (unknown), FP8020 (type), FP8023 (value) and FP8008
(recipe). Every constructor of ours calls `check_options(name, locals())` before anything
else, which raises the first problem as a one-line ValueError naming its key path
(`callbacks.fp8_stats.interval: must be ...`): a YAML the linter passes is one the run
accepts, and no check is written twice. Choices the code keeps as constants (fp8_lint's
FAIL_ON, fp8_stats' TENSOR_KINDS, the jsonl logger's PLACEHOLDERS) are read from their modules'
source (`entries.module_constant`), never imported: those modules import torch.
"""

from __future__ import annotations

import logging
import math
import re
import string
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from foundry_fp8.lint.entries import (
    NO_DEFAULT,
    UNREADABLE,
    Entry,
    Option,
    accepts,
    literal_values,
    module_constant,
    our_entries,
)
from foundry_fp8.lint.known import did_you_mean
from foundry_fp8.recipe import FP8Recipe, recipe_problems

log = logging.getLogger(__name__)

Kind = Literal["unknown", "reserved", "type", "value", "recipe"]


@dataclass(frozen=True)
class OptionProblem:
    """`option`: the option's name, dotted into it for a recipe key (`fp8_recipe.margin`);
    `message`: a sentence naming `<entry>.<option>` (the linter's); `detail`: the same without
    that subject (`must be a positive integer, got 0`), for a message that names the key
    path itself (`check_options`)."""

    option: str
    kind: Kind
    message: str
    fix: str
    detail: str = ""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _shown(value: Any) -> str:
    return "null" if value is None else repr(value)


def _key(name: Any) -> str:
    """A mapping key as a message shows it: itself, or its repr when it would break the line
    or hide in it (`'\\n'`, `' '`, `''`)."""
    text = str(name)
    return text if text and text.isprintable() and text.strip() == text else repr(text)


def choice_problem(allowed: Sequence[Any], value: Any) -> tuple[str, str]:
    """(message, fix) for a value outside `allowed`, naming the closest choice."""
    choices = ", ".join(map(_shown, allowed))
    return (f"must be one of {choices}, got {_shown(value)}"
            + did_you_mean(str(value), [str(a) for a in allowed if a is not None]),
            f"use one of {choices}")


def as_items(value: Any) -> tuple[Any, ...]:
    """A list option's items; a bare value is a list of one (`dump_steps: 1000`). What `Each`
    checks is what the constructors use."""
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)


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
    """A number (int or float, not NaN) in [`minimum`, `maximum`]."""

    minimum: float
    maximum: float | None = None

    def problem(self, value: Any) -> tuple[str, str] | None:
        if isinstance(value, (int, float)) and not isinstance(value, bool) \
                and self.minimum <= value and (self.maximum is None or value <= self.maximum):
            return None
        word = (f"a number >= {self.minimum:g}" if self.maximum is None
                else f"a number from {self.minimum:g} to {self.maximum:g}")
        return f"must be {word}, got {value!r}", f"use {word}"


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
    """One of a constant of ours (`module`, `name`)."""

    module: str
    name: str

    def problem(self, value: Any) -> tuple[str, str] | None:
        allowed = module_constant(self.module, self.name)
        return choice_problem(allowed, value) if value not in allowed else None


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
        except (ValueError, TypeError) as e:
            return f"is not a valid path template ({e})", \
                "write {{ and }} for literal braces"
        unknown = [f for f in fields if f not in names]
        if unknown:
            return (f"has unknown placeholder {{{unknown[0]}}}"
                    + did_you_mean(unknown[0], names), f"use only {allowed} (or no placeholder)")
        return None


def _batch_count(value: Any) -> float | None:
    """How many batches `value` says (100, "100ba", "1e2BA"); None when it names none."""
    if _is_int(value):
        return value
    match = re.fullmatch(r"(.+)ba", value, re.IGNORECASE) if isinstance(value, str) else None
    try:
        return float(match[1]) if match else None
    except ValueError:
        return None


def batches(value: int | str) -> int:
    """The number of batches of a value `Batches` accepts: `100` or `"100ba"` -> 100."""
    count = _batch_count(value)
    if count is None:
        raise ValueError(f"not a number of batches: {value!r}")
    return int(count)


@dataclass(frozen=True)
class Batches:
    """A number of batches of at least `minimum`: an integer, or a Composer time string in
    batches (`"100ba"`; read as Composer's Time.from_timestring reads it, a test checks)."""

    minimum: int

    def problem(self, value: Any) -> tuple[str, str] | None:
        fix = f"use batches such as '100ba' or 100 (at least {self.minimum})"
        count = _batch_count(value)
        if count is None:
            return f"must be a number of batches, got {value!r}", fix
        if isinstance(count, float) and not (math.isfinite(count) and count.is_integer()):
            return f"must be a whole number of batches, got {value!r}", fix
        if count < self.minimum:
            return f"must be at least {self.minimum} batch{'es' * (self.minimum != 1)}, got " \
                f"{value!r}", fix
        return None


@dataclass(frozen=True)
class Each:
    """Every item of a list meets `item`; a bare value counts as a list of one (`as_items`)."""

    item: Count | Choice

    def problem(self, value: Any) -> tuple[str, str] | None:
        items = as_items(value)
        for i, item in enumerate(items):
            found = self.item.problem(item)
            if found:
                where = f"item {i} " if isinstance(value, (list, tuple)) else ""
                return f"{where}{found[0]}", found[1]
        return None


@dataclass(frozen=True)
class Recipe:
    """An FP8 recipe mapping, checked by `recipe_problems` (FP8008). `string_form`: a string
    (or null) also works, as the scaling (`as_mapping`: null means current)."""

    string_form: bool = False

    def as_mapping(self, value: Any) -> Any:
        """The recipe mapping a value means (what `FP8Recipe.from_options` builds from)."""
        if self.string_form and not isinstance(value, Mapping):
            return {"scaling": value or "current"}
        return value


Constraint = Count | Number | Regex | Choice | PathTemplate | Batches | Each | Recipe


@dataclass(frozen=True)
class Above:
    """`option` is greater than `other` where both hold a number (a null `option` means no
    bound); an option not given has its default."""

    option: str
    other: str

    def problem(self, value: Any, other: Any) -> tuple[str, str] | None:
        if not (_is_int(value) and _is_int(other)) or value > other:
            return None
        return (f"must be greater than {self.other} ({other}), got {value}",
                f"give {self.option} above {self.other}, or null for no {self.option}")


_JSONL = "foundry_fp8.composer.jsonl_logger"

#: What the constructors refuse beyond the annotated type, per entry and option: the
#: constructors (foundry_fp8/composer/*.py, and SwapConfig, Schedule, MonitorConfig,
#: parse_recipe, which Python users build themselves) check their options with
#: `check_options`, so this table is the only copy of these checks.
OPTION_VALUES: dict[str, dict[str, Constraint]] = {
    "te_swap": {
        "keep_first_blocks": Count(0), "keep_last_blocks": Count(0), "min_gemm_size": Count(0),
        "tokens_per_microbatch": Count(1), "include": Regex(), "exclude": Regex(),
        "fp8_recipe": Recipe(),
    },
    "fp8_stats": {
        "interval": Batches(1), "start": Count(0), "end": Count(0), "layers": Regex(),
        "exclude": Regex(), "dump_layers": Regex(),
        "tensors": Each(Choice("foundry_fp8.monitor", "TENSOR_KINDS")),
        "max_underflow_pct": Number(0, 100), "max_overflow_pct": Number(0, 100),
        "min_cos_sim": Number(-1, 1), "dump_steps": Each(Count(0)),
        "dump_max_mb": Number(0), "recipe": Recipe(string_form=True),
        "dump_folder": PathTemplate(_JSONL, "PLACEHOLDERS"),
    },
    "fp8_state": {"watch_batches": Count(0)},
    "fp8_lint": {"fail_on": Choice("foundry_fp8.composer.lint", "FAIL_ON")},
    "jsonl": {"path": PathTemplate(_JSONL, "PLACEHOLDERS", required=True)},
}

#: Options that bound each other, per entry: fp8_stats logs in [start, end), never empty.
OPTION_RELATIONS: dict[str, tuple[Above, ...]] = {"fp8_stats": (Above("end", "start"),)}


def _recipe_problems(entry: str, option: str, value: Any, constraint: Recipe,
                     ) -> Iterator[OptionProblem]:
    if isinstance(value, FP8Recipe) or (value is None and not constraint.string_form):
        return  # a built recipe (Python callers) is valid; te_swap's null: the default one
    recipe = constraint.as_mapping(value)
    given = {"scaling": option} if recipe is not value else {}  # the string is the scaling
    for problem in recipe_problems(recipe):
        key = _key(problem.key) if problem.key else ""
        where = given.get(problem.key) or (f"{option}.{key}" if key else option)
        yield OptionProblem(where, "recipe", f"{entry}.{where}: {problem.message}", problem.fix,
                            problem.message)


def _value(entry: Entry, options: Mapping[str, Any], name: str) -> Any:
    """An option's value: given, else its default (NO_DEFAULT when it has none we can read)."""
    if name in options:
        return options[name]
    option = entry.options.get(name)
    default = option.default if option is not None else NO_DEFAULT
    return NO_DEFAULT if default is UNREADABLE else default


def option_problems(entry: Entry, options: Mapping[Any, Any]) -> Iterator[OptionProblem]:
    """Every problem with the options a YAML (or a caller) gives `entry`."""
    constraints = OPTION_VALUES.get(entry.name, {})
    wrong: set[str] = set()
    for name, value in options.items():
        name = _key(name)
        subject = f"{entry.name}.{name}"
        option = entry.options.get(name)
        wrong.add(name)
        if name in entry.reserved:
            yield OptionProblem(name, "reserved", f"LLM-Foundry passes `{name}` to {entry.name} "
                                "itself and refuses it in the YAML", f"remove {subject}",
                                "is passed by LLM-Foundry itself")
        elif option is None:
            if not entry.any_options:
                yield OptionProblem(name, "unknown", f"{entry.name} has no option `{name}`"
                                    + did_you_mean(name, entry.options),
                                    f"use one of: {', '.join(sorted(entry.options))}",
                                    "is not an option" + did_you_mean(name, entry.options))
        elif isinstance(constraint := constraints.get(name), Recipe):
            found = list(_recipe_problems(entry.name, name, value, constraint))
            yield from found
            if not found:
                wrong.discard(name)
        elif not accepts(option.annotation, value):
            allowed = literal_values(option.annotation)
            if allowed is not None:
                message, fix = choice_problem(allowed, value)
            else:
                got = "null" if value is None else f"{type(value).__name__} {value!r}"
                message = f"takes {option.annotation}, got {got}"
                fix = f"give {name} a value of type {option.annotation}"
            yield OptionProblem(name, "type", f"{subject} {message}", fix, message)
        elif constraint is not None and value is not None \
                and (found := constraint.problem(value)):
            yield OptionProblem(name, "value", f"{subject} {found[0]}", found[1], found[0])
        else:
            wrong.discard(name)
    for relation in OPTION_RELATIONS.get(entry.name, ()):
        names = (relation.option, relation.other)
        if wrong & set(names) or not set(names) & set(map(_key, options)):
            continue
        found = relation.problem(_value(entry, options, relation.option),
                                 _value(entry, options, relation.other))
        if found:
            name = relation.option if relation.option in options else relation.other
            yield OptionProblem(name, "value", f"{entry.name}.{name} {found[0]}", found[1],
                                found[0])


def _entry(name: str) -> Entry:
    entry = next((e for e in our_entries().values() if e.name == name), None)
    if entry is None:  # not installed with its entry points: the value checks alone
        entry = Entry("", name, "", {k: Option(k, None) for k in OPTION_VALUES.get(name, {})},
                      any_options=True)
    return entry


def check_options(name: str, options: Mapping[str, Any]) -> None:
    """For constructors: raise ValueError, one line naming the key path
    (`callbacks.fp8_state.watch_batches: must be a non-negative integer, got -1 (fix: ...)`),
    for the first problem with the options of our entry `name`. Keys that are not its options
    (`self`, `train_config`) are skipped, so `check_options("fp8_state", locals())` works. A
    failure of the checks themselves (our bug) is logged and lets the options through."""
    try:
        entry = _entry(name)
        given = {k: v for k, v in options.items() if k in entry.options}
        problem = next(option_problems(entry, given), None)
    except Exception:
        log.exception("foundry_fp8: checking %s's options failed (a bug of ours); they are not "
                      "checked", name)
        return
    if problem is not None:
        path = ".".join(p for p in (entry.section, entry.name, problem.option) if p)
        raise ValueError(f"{path}: {problem.detail} (fix: {problem.fix})")
