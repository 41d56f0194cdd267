"""Which import failures are ours: the one predicate the CLI's one line (`foundry_fp8.cli`) and
the linter's per-file line (`foundry_fp8.lint.cli`) share. A module of this checkout that does
not import is our bug (its traceback, or the file's bug line, is the report); any other missing
module is a dependency this Python lacks. Plain Python: importable where every dependency is
missing."""

from __future__ import annotations

#: The distribution name pip installs this project as (setup.cfg `name`).
DISTRIBUTION = "foundry-fp8"

#: Top-level packages of this checkout (`tests` and `benchmarks`: its scripts import them).
OUR_PACKAGES = ("foundry_fp8", "tests", "benchmarks")


def is_ours(missing: ModuleNotFoundError) -> bool:
    """True when the module that failed to import is one of ours, or is not named (no
    dependency to name, so it is reported as a bug)."""
    return missing.name is None or missing.name.split(".")[0] in OUR_PACKAGES
