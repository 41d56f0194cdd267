"""Which import failures are ours: the one predicate the CLI's one line (`foundry_fp8.cli`) and
the linter's per-file line (`foundry_fp8.lint.cli`) share. A module of this checkout that does
not import is our bug (its traceback, or the file's bug line, is the report); any other missing
module is a dependency this Python lacks. Plain Python: importable where every dependency is
missing. Also the one reader of requirement strings (PEP 508) and of distribution names (PEP
503), shared by the doctor's probe and the linter's MCLI pins."""

from __future__ import annotations

import re
from dataclasses import dataclass

#: The distribution name pip installs this project as (setup.cfg `name`).
DISTRIBUTION = "foundry-fp8"

#: Top-level packages of this checkout (`tests` and `benchmarks`: its scripts import them).
OUR_PACKAGES = ("foundry_fp8", "tests", "benchmarks")


def is_ours(missing: ModuleNotFoundError) -> bool:
    """True when the module that failed to import is one of ours, or is not named (no
    dependency to name, so it is reported as a bug)."""
    return missing.name is None or missing.name.split(".")[0] in OUR_PACKAGES


def normalized(name: str) -> str:
    """A distribution's name as PEP 503 compares it (`LLM_Foundry` is `llm-foundry`)."""
    return re.sub(r"[-_.]+", "-", name).lower()


#: A PEP 508 requirement without a URL: name, [extras], specifiers (optionally in parentheses),
#: then `; marker`.
_REQUIREMENT = re.compile(r"\s*([A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?)\s*"
                          r"(?:\[([^\]]*)\])?\s*(?:\(([^()]*)\)|([^;()]*))\s*(?:;(.*))?")
#: One PEP 440 specifier clause: operator, then a version (`2.7.*`, `2.7.0+cu126` included).
_CLAUSE = re.compile(r"\s*(~=|==|!=|<=|>=|<|>)\s*([0-9][0-9A-Za-z.+!*-]*)\s*")


@dataclass(frozen=True)
class Requirement:
    """A requirement as pip reads it: `name` as written, `extras` normalized, `clauses` the
    (operator, version) specifier clauses in the order written, `marker` its environment
    marker (None without one)."""

    name: str
    extras: tuple[str, ...]
    clauses: tuple[tuple[str, str], ...]
    marker: str | None

    @property
    def distribution(self) -> str:
        return normalized(self.name)


def parse_requirement(text: str) -> Requirement | None:
    """`text` read as a PEP 508 requirement; None for a URL requirement or an unreadable one."""
    match = _REQUIREMENT.fullmatch(text)
    if match is None:
        return None
    name, extras, wrapped, bare, marker = match.groups()
    clauses = [_CLAUSE.fullmatch(c) for c in (wrapped or bare or "").split(",") if c.strip()]
    if not all(clauses):
        return None
    return Requirement(name, tuple(normalized(e.strip()) for e in (extras or "").split(",")
                                   if e.strip()),
                       tuple((c.group(1), c.group(2)) for c in clauses if c),
                       marker.strip() if marker is not None else None)
