"""Our entries' option problems for the lint rules: FP8019 (unknown), FP8020 (type), FP8023
(value) and FP8008 (recipe), as `foundry_fp8.options` finds them with the classes the
constructors build (one check per value, written once there).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from foundry_fp8.lint.entries import Entry
from foundry_fp8.options import Kind


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
