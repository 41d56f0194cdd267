"""The options of our registry entries (`te_swap`, `fp8_stats`, `fp8_state`, `fp8_guard`,
`fp8_lint`, `jsonl`) as frozen dataclasses that check themselves, in torchao's
`Float8LinearConfig` style.

Pure Python, no torch: the constructors build these (one check per value, raising one line that
names the key path, `callbacks.fp8_stats.interval: must be ...`), and the linter asks the same
classes for every problem of a YAML mapping (`ENTRIES[name].problems(mapping)`), so a YAML the
linter passes is one the run accepts. Each field's check (type and range, with its source) is
written once, in the field's declaration (`option(default, check)`).
"""

from __future__ import annotations

import difflib
import math
import re
import string
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence, Set
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar, Literal

import regex

from foundry_fp8.health.keys import TENSORS
from foundry_fp8.health.thresholds import DEFAULT_THRESHOLDS
from foundry_fp8.paths import path_fix, path_problem
from foundry_fp8.recipe import FP8Recipe, recipe_problems

Kind = Literal["unknown", "reserved", "type", "value", "recipe"]

#: fp8_lint's `fail_on` choices, the jsonl path's placeholders (fp8_stats' tensor kinds are
#: health.keys.TENSORS).
FAIL_ON = ("error", "never")
PLACEHOLDERS = ("run_name",)


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """' (did you mean `x`?)' for the closest choice, or '' when none is close."""
    close = difflib.get_close_matches(word, sorted(choices), n=1)
    return f" (did you mean `{close[0]}`?)" if close else ""


@dataclass(frozen=True)
class Problem:
    """One thing wrong with an entry's options. `key`: the option, dotted into it for a recipe
    key or a list item (`fp8_recipe.margin`, `tensors.2`); `detail`: what is wrong, without
    the subject (`must be a positive integer, got 0`)."""

    key: str
    kind: Kind
    detail: str
    fix: str


class OptionError(ValueError):
    """Options an entry refuses: one line naming the key path, what is wrong and the fix."""

    def __init__(self, path: str, problem: Problem):
        self.path = f"{path}.{problem.key}" if problem.key else path
        self.problem = problem
        super().__init__(f"{self.path}: {problem.detail} (fix: {problem.fix})")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _shown(value: Any) -> str:
    return "null" if value is None else repr(value)


def _got(value: Any) -> str:
    return "null" if value is None else f"{type(value).__name__} {value!r}"


def shown_key(name: Any) -> str:
    """A mapping key as a message shows it: itself, or its repr when it would break the line
    or hide in it (`'\\n'`, `' '`, `''`)."""
    text = str(name)
    return text if text and text.isprintable() and text.strip() == text else repr(text)


# -- checks: each lists (key suffix, kind, detail, fix) for a value -----------------------

Found = tuple[str, Kind, str, str]


class Check:
    """What one option admits. `type_text`: the type as messages name it."""

    type_text = "any"

    def problems(self, value: Any) -> list[Found]:
        raise NotImplementedError

    def normal(self, value: Any) -> Any:
        """The value the dataclass keeps (a list as a tuple, `"10ba"` as 10)."""
        return value

    def _type(self, value: Any) -> list[Found]:
        return [("", "type", f"takes {self.type_text}, got {_got(value)}",
                 f"give a value of type {self.type_text}")]


@dataclass(frozen=True)
class Optional(Check):
    """`inner`, or null."""

    inner: Check

    @property
    def type_text(self) -> str:  # type: ignore[override]
        return f"{self.inner.type_text} | None"

    def problems(self, value: Any) -> list[Found]:
        if value is None:
            return []
        return [(k, kind, f"takes {self.type_text}, got {_got(value)}", fix)
                if kind == "type" and detail.startswith("takes ") else (k, kind, detail, fix)
                for k, kind, detail, fix in self.inner.problems(value)]

    def normal(self, value: Any) -> Any:
        return None if value is None else self.inner.normal(value)


@dataclass(frozen=True)
class Number(Check):
    """An int or float (not NaN) in [minimum, maximum]."""

    minimum: float
    maximum: float | None = None
    type_text = "float"

    def fits(self, value: Any) -> bool:
        return _is_int(value) or isinstance(value, float)

    def problems(self, value: Any) -> list[Found]:
        if not self.fits(value):
            return self._type(value)
        if self.minimum <= value and (self.maximum is None or value <= self.maximum):
            return []
        return [("", "value", f"must be {self.word()}, got {value!r}", f"use {self.word()}")]

    def word(self) -> str:
        if self.maximum is None:
            return f"a number >= {self.minimum:g}"
        return f"a number from {self.minimum:g} to {self.maximum:g}"


@dataclass(frozen=True)
class Integer(Number):
    """An int (not a bool) in [minimum, maximum]."""

    type_text = "int"

    def fits(self, value: Any) -> bool:
        return _is_int(value)

    def word(self) -> str:
        if self.maximum is not None:
            return f"an integer from {self.minimum} to {self.maximum}"
        return {0: "a non-negative integer", 1: "a positive integer"}.get(
            int(self.minimum), f"an integer >= {self.minimum}")


@dataclass(frozen=True)
class Flag(Check):
    type_text = "bool"

    def problems(self, value: Any) -> list[Found]:
        return [] if isinstance(value, bool) else self._type(value)


@dataclass(frozen=True)
class Text(Check):
    type_text = "str"

    def problems(self, value: Any) -> list[Found]:
        return [] if isinstance(value, str) else self._type(value)


@dataclass(frozen=True)
class OneOf(Check):
    """One of `choices` (strings, or None for null). `kind`: how another value is reported:
    "type" for an option whose type is the choice (a `Literal`), "value" for a string option
    with a list of valid strings (another type is then a type problem)."""

    choices: tuple[str | None, ...]
    kind: Kind = "value"
    type_text = "str"

    def problems(self, value: Any) -> list[Found]:
        if any(value is c if c is None else value == c and isinstance(value, str)
               for c in self.choices):
            return []
        if not isinstance(value, str) and self.kind == "value":
            return self._type(value)
        choices = ", ".join(map(_shown, self.choices))
        return [("", self.kind, f"must be one of {choices}, got {_shown(value)}"
                 + did_you_mean(str(value), [c for c in self.choices if c]),
                 f"use one of {choices}")]


@dataclass(frozen=True)
class Pattern(Check):
    """A regular expression on module names, as the `regex` module compiles it (the engine
    `foundry_fp8.filters` matches with, bounded in time)."""

    type_text = "str"

    def problems(self, value: Any) -> list[Found]:
        if not isinstance(value, str):
            return self._type(value)
        try:
            regex.compile(value)
        except regex.error as e:
            return [("", "value", f"is not a valid regular expression ({e})",
                     "fix the pattern; a backslash makes ( [ { . * + ? literal")]
        return []


@dataclass(frozen=True)
class PathTemplate(Check):
    """A path that `str.format` fills with PLACEHOLDERS; `required`: not empty; `file`: it
    names a file (not the run folder or another folder: `paths.path_problem`)."""

    required: bool = False
    file: bool = False
    type_text = "str"

    def problems(self, value: Any) -> list[Found]:
        if not isinstance(value, str):
            return self._type(value)
        allowed = ", ".join(f"{{{n}}}" for n in PLACEHOLDERS)
        if self.required and not value.strip():
            return [("", "value", "must be a file path, got an empty one",
                     f"give a path (placeholders: {allowed})")]
        try:
            found = [(f, spec, conv) for _, f, spec, conv in string.Formatter().parse(value)
                     if f is not None]
        except ValueError as e:
            return [("", "value", f"is not a valid path template ({e})",
                     "write {{ and }} for literal braces")]
        unknown = [n for n, _, _ in found if n not in PLACEHOLDERS]
        if unknown:
            return [("", "value", f"has unknown placeholder {{{unknown[0]}}}"
                     + did_you_mean(unknown[0], PLACEHOLDERS),
                     f"use only {allowed} (or no placeholder)")]
        # the name is filled as one folder name (paths.safe_run_name): a conversion (`!r` adds
        # quotes) or a format spec (`:d` raises on a string) would change or refuse it
        for name, spec, conv in found:
            if spec or conv:
                written = f"{{{name}{'!' + conv if conv else ''}{':' + spec if spec else ''}}}"
                return [("", "value", f"has {written}: a placeholder takes no conversion or "
                         "format spec", f"use {{{name}}} as is")]
        outside = path_problem(value, self.file)
        if outside:
            return [("", "value", outside, path_fix(self.file))]
        return []


def batch_count(value: Any) -> float | None:
    """How many batches `value` says (100, "100ba", "1e2BA"); None when it names none."""
    if _is_int(value):
        return value
    match = regex.fullmatch(r"(.+)ba", value, regex.IGNORECASE) if isinstance(value, str) \
        else None
    try:
        return float(match[1]) if match else None
    except ValueError:
        return None


@dataclass(frozen=True)
class Batches(Check):
    """A number of batches of at least `minimum`: an int, or a Composer time string in batches
    (`"100ba"`, read as Composer's Time.from_timestring reads it; a test checks)."""

    minimum: int
    type_text = "int | str"

    def problems(self, value: Any) -> list[Found]:
        if not (_is_int(value) or isinstance(value, str)):
            return self._type(value)
        fix = f"use batches such as '100ba' or 100 (at least {self.minimum})"
        count = batch_count(value)
        if count is None:
            return [("", "value", f"must be a number of batches, got {value!r}", fix)]
        if isinstance(count, float) and not (math.isfinite(count) and count.is_integer()):
            return [("", "value", f"must be a whole number of batches, got {value!r}", fix)]
        if count < self.minimum:
            return [("", "value", f"must be at least {self.minimum} batch"
                     f"{'es' * (self.minimum != 1)}, got {value!r}", fix)]
        return []

    def normal(self, value: Any) -> int:
        return int(batch_count(value))  # type: ignore[arg-type]


@dataclass(frozen=True)
class Items(Check):
    """A list whose every item meets `item`, each wrong item its own problem (`tensors.2`);
    `bare`: a single item counts as a list of one (`dump_steps: 1000`); `needed`: the fix for an
    empty list, which is then refused (a watch of nothing looks like a healthy run)."""

    item: Check
    bare: bool = False
    needed: str | None = None

    @property
    def type_text(self) -> str:  # type: ignore[override]
        listed = f"Sequence[{self.item.type_text}]"
        return f"{self.item.type_text} | {listed}" if self.bare else listed

    def problems(self, value: Any) -> list[Found]:
        if isinstance(value, (list, tuple)) and not value and self.needed:
            return [("", "value", "must not be empty (nothing would be done, and nothing says so)",
                     self.needed)]
        if isinstance(value, (list, tuple)):
            return [(f".{i}{k}", kind, detail, fix) for i, item in enumerate(value)
                    for k, kind, detail, fix in self._item_problems(item)]
        if self.bare and not isinstance(value, (str, Mapping)):
            return self._item_problems(value)
        return self._type(value)

    def _item_problems(self, item: Any) -> list[Found]:
        """An item's problems; an item of the wrong type is a wrong value (`must be ...`)."""
        found = self.item.problems(item)
        if found and found[0][1] == "type" and isinstance(self.item, Integer):
            return [("", "value", f"must be {self.item.word()}, got {item!r}",
                     f"use {self.item.word()}")]
        return found

    def normal(self, value: Any) -> tuple[Any, ...]:
        items = value if isinstance(value, (list, tuple)) else (value,)
        return tuple(self.item.normal(v) for v in items)


@dataclass(frozen=True)
class Recipe(Check):
    """An FP8 recipe: a mapping checked by `recipe_problems` (FP8008), or a built FP8Recipe.
    `scaling_name`: a string (or null) is also accepted, as the scaling (null: current)."""

    scaling_name: bool = False

    @property
    def type_text(self) -> str:  # type: ignore[override]
        return "str | Mapping | None" if self.scaling_name else "Mapping | None"

    def _mapping(self, value: Any) -> Any:
        if self.scaling_name and not isinstance(value, Mapping):
            return {"scaling": value or "current"}
        return {} if value is None else value

    def problems(self, value: Any) -> list[Found]:
        if isinstance(value, FP8Recipe):
            return []
        recipe = self._mapping(value)
        named = recipe is not value and value is not None  # the string is the scaling
        return [("" if named and p.key == "scaling" or not p.key else f".{shown_key(p.key)}",
                 "recipe", p.message, p.fix) for p in recipe_problems(recipe)]

    def normal(self, value: Any) -> FP8Recipe:
        if isinstance(value, FP8Recipe):
            return value
        return FP8Recipe.from_options(self._mapping(value))


@dataclass(frozen=True)
class Function(Check):
    """A Python callable (never given in a YAML), or null."""

    type_text = "Callable | None"

    def problems(self, value: Any) -> list[Found]:
        return [] if value is None or callable(value) else self._type(value)


def option(default: Any, check: Check) -> Any:
    """A dataclass field that is a YAML option, with its check."""
    return field(default=default, metadata={"check": check})


class Relation:
    """A bound between options, of one class or of it and its parts (`names`: the options it
    reads), checked once each option it reads is right on its own."""

    @property
    def names(self) -> tuple[str, ...]:
        raise NotImplementedError

    def problems(self, values: Mapping[str, Any], given: Set[str]) -> Iterator[Problem]:
        """Its problems for `values` (every name, at its default where not `given`)."""
        raise NotImplementedError


@dataclass(frozen=True)
class Above(Relation):
    """Option `option` is greater than option `other` when both hold an int (null: no bound)."""

    option: str
    other: str

    @property
    def names(self) -> tuple[str, ...]:
        return (self.option, self.other)

    def problems(self, values: Mapping[str, Any], given: Set[str]) -> Iterator[Problem]:
        value, other = values[self.option], values[self.other]
        if not (_is_int(value) and _is_int(other)) or value > other:
            return
        yield Problem(self.option if self.option in given else self.other, "value",
                      f"must be greater than {self.other} ({other}), got {value}",
                      f"give {self.option} above {self.other}, or null for no {self.option}")


def one_pattern(include: str, exclude: str | None) -> str:
    """One regex, searched, for the names `include` matches and `exclude` does not: for an
    engine that takes one (TE's debug API: `te.debug.layer_pattern`)."""
    return f"^(?!.*(?:{exclude}))(?=.*(?:{include}))" if exclude else include


def _re_error(pattern: str) -> str | None:
    try:
        re.compile(pattern)
    except re.error as e:
        return str(e)
    return None


@dataclass(frozen=True)
class PythonRe(Relation):
    """With option `when` set, the regexes `include` and `exclude` (valid for `regex`, the
    engine of `foundry_fp8.filters`) compile with Python's `re` too, and so does `one_pattern`
    of them (TE's debug API gets it with end anchors widened, which adds no group or flag):
    nvdlfw-inspect matches TE's layer names with `re`, which lacks some of `regex`'s syntax (a
    variable-width lookbehind, `\\p{...}`)."""

    when: str
    include: str
    exclude: str

    @property
    def names(self) -> tuple[str, ...]:
        return (self.when, self.include, self.exclude)

    def problems(self, values: Mapping[str, Any], given: Set[str]) -> Iterator[Problem]:
        if values[self.when] is None:
            return
        include, exclude = values[self.include], values[self.exclude]
        needs = f"{self.when} needs one: nvdlfw-inspect matches TE's layer names with `re`"
        for name, pattern in ((self.include, include), (self.exclude, exclude)):
            error = _re_error(pattern) if pattern else None
            if error:
                yield Problem(name, "value", f"is not a pattern Python's `re` compiles ({error});"
                              f" {needs}", "write it for `re` too (a fixed-width lookbehind, no "
                              f"\\p{{...}}), or leave {self.when} unset")
                return
        error = _re_error(one_pattern(include, exclude))
        if error:
            yield Problem(self.exclude, "value", f"does not combine with {self.include} into "
                          f"one pattern Python's `re` compiles ({error}); {needs}, in one pattern",
                          "scope inline flags ((?i:attn), not (?i)attn), name each group once, "
                          f"or leave {self.when} unset")


class Options:
    """Base of the option dataclasses: `PATH` is where the YAML holds them; each field made with
    `option()` is checked in `__post_init__` (the first problem raises OptionError) and kept in
    its normal form; `RELATIONS` bound fields by each other and by the parts' options."""

    PATH: ClassVar[str] = ""
    RELATIONS: ClassVar[tuple[Relation, ...]] = ()

    def __post_init__(self) -> None:
        values = {f.name: getattr(self, f.name) for f in fields(self)}  # type: ignore[arg-type]
        for name, cls in parts(type(self)).items():  # what relations read of the parts
            if isinstance(values[name], cls):
                values = {**{n: getattr(values[name], n) for n in checks(cls)}, **values}
        found = next(iter(type(self).value_problems(values)), None)
        if found is not None:
            raise OptionError(self.PATH, found)
        for name, check in checks(type(self)).items():
            object.__setattr__(self, name, check.normal(values[name]))

    @classmethod
    def value_problems(cls, values: Mapping[str, Any]) -> Iterator[Problem]:
        """The problems of the values given for this class's options (others are skipped, but
        for the relations, which read its parts' options too, and an option not given at its
        default)."""
        own = checks(cls)
        every = {n: c for k in option_classes(cls) for n, c in checks(k).items()}
        wrong = set()
        for name, value in values.items():
            check = own.get(name)
            for suffix, kind, detail, fix in check.problems(value) if check else ():
                wrong.add(name)
                yield Problem(name + suffix, kind, detail, fix)
        # a part's wrong value is its own class's problem: no relation reads it
        wrong |= {n for n, v in values.items() if n not in own and n in every
                  and every[n].problems(v)}
        base = {n: v for k in option_classes(cls) for n, v in defaults(k).items()}
        for relation in cls.RELATIONS:
            names = set(relation.names)
            if wrong & names or not names & set(values):
                continue
            yield from relation.problems({n: values.get(n, base.get(n)) for n in names},
                                         set(values))


def checks(cls: type) -> dict[str, Check]:
    """A dataclass's YAML options and their checks."""
    return {f.name: f.metadata["check"] for f in fields(cls) if "check" in f.metadata}


def defaults(cls: type) -> dict[str, Any]:
    """A dataclass's options' defaults."""
    return {f.name: f.default for f in fields(cls) if "check" in f.metadata
            and f.default is not MISSING}


def parts(cls: type) -> dict[str, type[Options]]:
    """Field name -> options class, for the fields of `cls` that are parts (fp8_stats'
    schedule), built from the same flat mapping."""
    return {f.name: f.default_factory for f in fields(cls)  # type: ignore[misc]
            if f.default_factory is not MISSING and isinstance(f.default_factory, type)
            and issubclass(f.default_factory, Options)}


def option_classes(cls: type) -> list[type]:
    """`cls`'s parts' classes and `cls`: every class holding one of its flat options."""
    return [*parts(cls).values(), cls]


# -- the entries' options -----------------------------------------------------------------

@dataclass(frozen=True)
class SwapConfig(Options):
    """Which layers `te_swap` converts (the config of `foundry_fp8.convert_to_fp8`).

    `min_gemm_size`: GEMMs whose smaller weight dim is below it stay high precision (too small
    to gain from FP8). `tokens_per_microbatch`: when given, checked against TE's rule that a GEMM
    input's leading dims multiply to a multiple of 8. `keep_lm_head: false` converts an untied
    LM head; MPT ties it to the embedding by default (`F.linear` on `wte.weight`, no module), so
    a tied head always stays. `convert_layernorm` and `fuse_ln_mlp` need the `te` backend.
    `include`/`exclude`: regexes on module names (`foundry_fp8.filters`); `module_filter_fn`:
    torchao's `(module, name) -> bool`, Python only.
    """

    PATH: ClassVar[str] = "algorithms.te_swap"

    backend: Literal["te", "emulate"] = option("te", OneOf(("te", "emulate"), kind="type"))
    # block counts: any non-negative number (more than the model has keeps every block)
    keep_first_blocks: int = option(0, Integer(0))
    keep_last_blocks: int = option(0, Integer(0))
    keep_lm_head: bool = option(True, Flag())
    convert_layernorm: bool = option(False, Flag())
    fuse_ln_mlp: bool = option(False, Flag())
    include: str | None = option(None, Optional(Pattern()))
    exclude: str | None = option(None, Optional(Pattern()))
    min_gemm_size: int = option(0, Integer(0))
    # at least one token; TE's multiple-of-8 rule is a plan decision, not an error
    tokens_per_microbatch: int | None = option(None, Optional(Integer(1)))
    module_filter_fn: Callable[[Any, str], bool] | None = option(None, Function())


@dataclass(frozen=True)
class TESwapOptions(SwapConfig):
    """`algorithms: {te_swap: {...}}`: SwapConfig's fields, the run's FP8 recipe (a mapping
    as `FP8Recipe` takes it; kept as an FP8Recipe) and `strict` (te_swap's own autocast
    failures stop the run)."""

    fp8_recipe: FP8Recipe | Mapping[str, Any] | None = option(None, Recipe())
    strict: bool = option(True, Flag())


@dataclass(frozen=True)
class Schedule(Options):
    """Which steps fp8_stats logs (every `interval` batches in [start, end), plus the dump
    steps) and dumps. `interval` takes Composer's `"10ba"` too; it is kept as an int."""

    PATH: ClassVar[str] = "callbacks.fp8_stats"
    RELATIONS: ClassVar[tuple[Relation, ...]] = (Above("end", "start"),)

    # fp8_stats' and FP8Monitor's default: the README's `interval: 100ba` (a logging step costs
    # about 1.7 training steps of the tiny CPU run, `benchmarks/stats_overhead.py`)
    interval: int | str = option(100, Batches(1))
    start: int = option(0, Integer(0))
    end: int | None = option(None, Optional(Integer(0)))
    dump_steps: int | Sequence[int] = option((), Items(Integer(0), bare=True))

    def logs(self, step: int) -> bool:
        in_window = step >= self.start and (self.end is None or step < self.end)
        return (in_window and step % self.interval == 0) or step in self.dump_steps  # type: ignore[operator]

    def dumps(self, step: int) -> bool:
        return step in self.dump_steps  # type: ignore[operator]

    def next_log(self, step: int) -> int | None:
        """The first logging step after `step`."""
        interval = int(self.interval)
        first = max(step + 1, self.start)
        candidates = [d for d in self.dump_steps if d > step]  # type: ignore[union-attr]
        regular = -(-first // interval) * interval
        if self.end is None or regular < self.end:
            candidates.append(regular)
        return min(candidates, default=None)

    def records(self, step: int, window: int) -> bool:
        """Whether `step` lies in the `window` batches before a logging step."""
        following = self.next_log(step)
        return following is not None and following - step <= window


@dataclass(frozen=True)
class MonitorConfig(Options):
    """Which layers and tensors FP8Monitor watches, the what-if recipe for layers not in FP8
    (`"current"`, `"delayed"` or a recipe mapping; kept as an FP8Recipe), warning thresholds
    and dumps. `layers`, `exclude` and `dump_layers` are regexes searched in the same full
    module names (`model.transformer.blocks.0.attn.Wqkv`, wrappers' segments removed), as TE's
    debug API (`te_debug`) matches `layers`; the metric keys shorten them (`blocks.0.attn.Wqkv`),
    so `^blocks` selects nothing. `dump_folder`: where dumps go (a path, not checked; fp8_stats
    fills it from its own `dump_folder` template)."""

    PATH: ClassVar[str] = "callbacks.fp8_stats"

    layers: str = option(".*", Pattern())
    exclude: str | None = option(None, Optional(Pattern()))
    tensors: Sequence[str] = option(TENSORS, Items(OneOf(TENSORS), needed=(
        f"list some of {', '.join(TENSORS)}, or leave tensors out for all of them")))
    recipe: FP8Recipe | str | Mapping[str, Any] | None = option(
        "current", Recipe(scaling_name=True))
    # percentages and a cosine: their mathematical ranges
    max_underflow_pct: float = option(DEFAULT_THRESHOLDS.max_underflow_pct, Number(0, 100))
    max_overflow_pct: float = option(DEFAULT_THRESHOLDS.max_overflow_pct, Number(0, 100))
    min_cos_sim: float = option(DEFAULT_THRESHOLDS.min_cos_sim, Number(-1, 1))
    dump_layers: str | None = option(None, Optional(Pattern()))
    # dumped tensors are copied on the device until written: 256 GiB is above any one GPU's
    # memory (H200: 141 GB), so a larger cap is a typo, not a plan
    dump_max_mb: float = option(64.0, Number(0, 262144))
    dump_folder: str | Path | None = None


@dataclass(frozen=True)
class FP8StatsOptions(Options):
    """`callbacks: {fp8_stats: {...}}`: the Schedule's and MonitorConfig's options plus these:
    `dump_folder` (a template with `{run_name}`; default `<run folder>/fp8_dumps`), TE's own
    statistics (`te_debug: delayed|current`, into `te_debug_folder`), the images' and table's
    `image_interval`, `console_layers` and `strict`."""

    PATH: ClassVar[str] = "callbacks.fp8_stats"
    RELATIONS: ClassVar[tuple[Relation, ...]] = (PythonRe("te_debug", "layers", "exclude"),)

    schedule: Schedule = field(default_factory=Schedule)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    dump_folder: str | None = option(None, Optional(PathTemplate()))
    te_debug: Literal["delayed", "current"] | None = option(
        None, OneOf(("delayed", "current", None), kind="type"))
    te_debug_folder: str = option("te_debug", Text())
    # heatmaps and the per-layer table every this many batches (null: never); kept as an int
    image_interval: int | str | None = option(1000, Optional(Batches(1)))
    console_layers: bool = option(False, Flag())  # per-layer series on the console too
    strict: bool = option(False, Flag())


@dataclass(frozen=True)
class FP8StateOptions(Options):
    """`callbacks: {fp8_state: {...}}`."""

    PATH: ClassVar[str] = "callbacks.fp8_state"

    strict: bool = option(True, Flag())
    # 0 switches the TE #1190 watch off; any count is affordable (one state copy per batch)
    watch_batches: int = option(8, Integer(0))


@dataclass(frozen=True)
class FP8LintOptions(Options):
    """`callbacks: {fp8_lint: {...}}`."""

    PATH: ClassVar[str] = "callbacks.fp8_lint"

    fail_on: str = option("error", OneOf(FAIL_ON))


@dataclass(frozen=True)
class JSONLOptions(Options):
    """`loggers: {jsonl: {...}}`."""

    PATH: ClassVar[str] = "loggers.jsonl"

    path: str = option("metrics.jsonl", PathTemplate(required=True, file=True))  # in the run folder
    strict: bool = option(False, Flag())


@dataclass(frozen=True)
class FP8GuardOptions(Options):
    """`callbacks: {fp8_guard: {...}}` (see `foundry_fp8.guard`). `consecutive`: logging steps
    in a row at which a health rule flags a layer before it falls back; `max_fallback_share`: of
    the FLOPs that ran in FP8 at the start, the most that may fall back; `repromote_after`:
    healthy what-if logging steps before a layer in fallback runs in FP8 again (null: never);
    `strict`: past the budget stop the run (else warn, the layer staying in FP8), and raise the
    guard's own errors."""

    PATH: ClassVar[str] = "callbacks.fp8_guard"

    consecutive: int = option(DEFAULT_THRESHOLDS.persist_steps, Integer(1))
    max_fallback_share: float = option(0.1, Number(0, 1))
    max_underflow_pct: float = option(DEFAULT_THRESHOLDS.max_underflow_pct, Number(0, 100))
    # The guard acts, so it asks for ten times the overflow fp8_stats warns about: under delayed
    # scaling a weight that grows by its updates saturates its largest element at every step
    # (one of 4096, 0.024 %, in the tiny MPT's healthy out_proj weights), which costs nothing.
    max_overflow_pct: float = option(10 * DEFAULT_THRESHOLDS.max_overflow_pct, Number(0, 100))
    min_cos_sim: float = option(DEFAULT_THRESHOLDS.min_cos_sim, Number(-1, 1))
    # off (null) by default: logging steps in a row at which every what-if statistic of a layer
    # in fallback (fp8_stats computes them under its `recipe`) is within the limits before the
    # layer runs in FP8 again, with a fresh delayed-scaling state
    repromote_after: int | None = option(None, Optional(Integer(1)))
    strict: bool = option(False, Flag())


#: LLM-Foundry's `build_callback` (llmfoundry/utils/builders.py) passes the train config as
#: this keyword to callbacks_with_config and raises if the YAML gives it too.
TRAIN_CONFIG_KWARG = "train_config"


@dataclass(frozen=True)
class Entry:
    """A registry entry of ours: its YAML section and name, its options' dataclass, the parts
    (fields holding another options dataclass, built from the same flat mapping) and the keys
    LLM-Foundry passes itself."""

    section: str
    name: str
    options: type[Options]
    reserved: tuple[str, ...] = ()
    #: (entry of the same section, what this one takes from it): it refuses to start without
    #: them, and the linter says so from the YAML
    needs: tuple[tuple[str, str], ...] = ()

    @property
    def path(self) -> str:
        return f"{self.section}.{self.name}"

    def need_problem(self, name: str) -> Problem:
        """What is wrong when entry `name` of this entry's section, which it needs, is missing
        (`OptionError(self.path, ...)` is the constructors' one line)."""
        return Problem("", "value", f"needs {self.section}.{name}, {dict(self.needs)[name]}",
                       f"add `{name}: {{}}` to {self.section}")

    def missing(self, present: Iterable[str]) -> list[Problem]:
        """A problem for each entry this one needs that `present` (its section's names) lacks."""
        names = set(present)
        return [self.need_problem(name) for name, _ in self.needs if name not in names]

    def classes(self) -> list[type]:
        return option_classes(self.options)

    def option_names(self) -> list[str]:
        return [name for cls in self.classes() for name in checks(cls)]

    def defaults(self) -> dict[str, Any]:
        return {k: v for cls in self.classes() for k, v in defaults(cls).items()}

    def problems(self, options: Mapping[Any, Any]) -> list[Problem]:
        """Every problem with a mapping of options: unknown and reserved keys (did-you-mean),
        then each class's values and relations, every wrong list item on its own."""
        known = self.option_names()
        found = []
        for key in options:
            name = shown_key(key)
            if name in self.reserved:
                found.append(Problem(name, "reserved", "is passed by LLM-Foundry itself and "
                                     "refused in the YAML", f"remove {self.path}.{name}"))
            elif name not in known:
                found.append(Problem(name, "unknown", "is not an option"
                                     + did_you_mean(name, known),
                                     f"use one of: {', '.join(sorted(known))}"))
        given = {k: v for k, v in options.items() if isinstance(k, str) and k in known}
        for cls in self.classes():
            found += cls.value_problems(given)  # its own options; relations read any
        return found

    def build(self, options: Mapping[str, Any]) -> Options:
        """The options dataclass for `options` (keyword arguments or a YAML mapping), raising
        OptionError for the first unknown or reserved key, else the first wrong value."""
        known = self.option_names()
        for key in options:
            if key in self.reserved or key not in known:
                raise OptionError(self.path, self.problems({key: None})[0])
        built = {name: cls(**{k: v for k, v in options.items() if k in checks(cls)})
                 for name, cls in parts(self.options).items()}
        own = checks(self.options)
        return self.options(**built, **{k: v for k, v in options.items() if k in own})


ENTRIES: dict[str, Entry] = {e.name: e for e in (
    Entry("algorithms", "te_swap", TESwapOptions),
    Entry("callbacks", "fp8_stats", FP8StatsOptions),
    Entry("callbacks", "fp8_state", FP8StateOptions),
    Entry("callbacks", "fp8_guard", FP8GuardOptions,
          needs=(("fp8_stats", "whose statistics it acts on"),)),
    Entry("callbacks", "fp8_lint", FP8LintOptions, reserved=(TRAIN_CONFIG_KWARG,)),
    Entry("loggers", "jsonl", JSONLOptions),
)}


def build(name: str, options: Mapping[str, Any]) -> Any:
    """Entry `name`'s options dataclass from its keyword arguments (the constructors' one call)."""
    return ENTRIES[name].build(options)
