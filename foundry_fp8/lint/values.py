"""Our entries' option problems for the lint rules: FP8019 (unknown), FP8020 (type), FP8023
(value) and FP8008 (recipe), as `foundry_fp8.options` finds them with the classes the
constructors build (one check per value, written once there); and the options themselves, as
the constructors build them, for the rules that predict what an entry then does.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from foundry_fp8.lint.entries import Entry
from foundry_fp8.options import ENTRIES, Kind, OptionError, Options


@dataclass(frozen=True)
class OptionProblem:
    """`option`: the key under the entry (`interval`, `fp8_recipe.margin`, `tensors.2`);
    `message`: a sentence naming `<entry>.<option>`; `detail`: the same without that subject
    (the constructors' one-line error says it after the key path)."""

    option: str
    kind: Kind
    message: str
    fix: str
    detail: str


def option_problems(entry: Entry, options: Mapping[Any, Any]) -> Iterator[OptionProblem]:
    """Every problem with the options a YAML gives `entry`."""
    for p in entry.spec.problems(options):
        yield OptionProblem(p.key, p.kind, f"{entry.name}.{p.key} {p.detail}", p.fix, p.detail)


def built_options(name: str, options: Any) -> Options | None:
    """Entry `name`'s options dataclass as its constructor builds it from the YAML's value (null:
    every default); None where the constructor refuses them (FP8019, FP8020, FP8023 say why)."""
    if options is None:
        options = {}
    if not isinstance(options, Mapping):
        return None
    try:
        return ENTRIES[name].build(options)
    except OptionError:
        return None
