"""Our registry entries (`te_swap`, `fp8_stats`, `fp8_state`, `fp8_guard`, `fp8_lint`, `jsonl`)
as the lint rules see them, from their option dataclasses (`foundry_fp8.options`, torch-free):
the same classes the constructors build, so the linter reads no source and imports no torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from importlib import metadata
from typing import Any

from foundry_fp8.options import ENTRIES
from foundry_fp8.options import Entry as Spec

NO_DEFAULT = object()  # a required option
UNREADABLE = object()  # a default the linter cannot use (none today: every default is a value)


@dataclass(frozen=True)
class Option:
    """One option: its name and default."""

    name: str
    default: Any = NO_DEFAULT


@dataclass(frozen=True)
class Entry:
    """A registry entry of ours: YAML section, name, options, and its options' spec."""

    section: str
    name: str
    options: Mapping[str, Option]
    spec: Spec


def our_entries() -> dict[tuple[str, str], Entry]:
    """(section, name) -> Entry for every entry of ours."""
    entries = {}
    for spec in ENTRIES.values():
        defaults = spec.defaults()
        options = {n: Option(n, defaults.get(n, NO_DEFAULT)) for n in spec.option_names()}
        entries[(spec.section, spec.name)] = Entry(spec.section, spec.name, options, spec)
    return entries


@cache
def _entry_points() -> metadata.EntryPoints | None:
    """Every installed package's entry points, read once (one `entry_points(group=...)` call per
    group would scan every package again); None when the metadata cannot be read."""
    try:
        return metadata.entry_points()
    except Exception:  # broken metadata: judge by the built-ins and our own entries
        return None


@cache
def entry_point_names(group: str) -> frozenset[str]:
    """The names installed packages register in an entry-point group (LLM-Foundry's registries
    read `llmfoundry_<registry>`), from package metadata, importing nothing."""
    found = _entry_points()
    try:
        return frozenset(ep.name for ep in found.select(group=group)) if found else frozenset()
    except Exception:  # a broken entry in the metadata
        return frozenset()


@cache
def entry_point_value(group: str, name: str) -> str | None:
    """The object reference (`module:attr`) an installed package registers as `name` in an
    entry-point group, from package metadata, importing nothing; None where none does."""
    found = _entry_points()
    try:
        return next((ep.value for ep in found.select(group=group, name=name)), None) \
            if found else None
    except Exception:  # a broken entry in the metadata
        return None
