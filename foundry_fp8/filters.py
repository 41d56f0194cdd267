"""Which modules a user's regexes select (te_swap's `include`/`exclude`, fp8_stats' `layers`/
`exclude`/`dump_layers`), matched so that no pattern can hang a run.

Python's `re` backtracks without limit: `^([\\w.]+)+!` on a 40-character module name never
returns. We match with the `regex` module (a dependency of transformers, so already installed
with LLM-Foundry), whose engine cuts most such backtracking short, and with its `timeout`: a
pattern that still takes longer than MATCH_TIMEOUT_S on one module name stops the run with one
line naming the option, instead of hanging INIT. Torch-free; the style is torchao's
`module_filter_fn(module, fqn) -> bool`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import regex

from foundry_fp8.options import OptionError, Problem

#: Seconds one search may take (regex checks its timeout coarsely: it returns within ~4x).
MATCH_TIMEOUT_S = 0.05


@functools.lru_cache(maxsize=256)
def _compiled(pattern: str) -> regex.Pattern:
    return regex.compile(pattern)


def search(key_path: str, pattern: str, name: str) -> bool:
    """Whether `pattern` (the option at `key_path`) matches somewhere in module name `name`;
    OptionError (one line) when the search runs out of time."""
    try:
        return _compiled(pattern).search(name, timeout=MATCH_TIMEOUT_S) is not None
    except TimeoutError:
        section, _, key = key_path.rpartition(".")
        raise OptionError(section, Problem(
            key, "value", f"regex {pattern!r} takes more than {MATCH_TIMEOUT_S:g} s on module "
            f"name {name!r} (catastrophic backtracking)",
            "simplify it: no nested repetition such as ([\\w.]+)+")) from None


def module_filter_fn(section: str, layers: str | None, exclude: str | None,
                     include_key: str = "layers") -> Callable[[Any, str], bool]:
    """torchao-style `(module, fqn) -> bool`: `fqn` matches `layers` (None: any) and not
    `exclude`; `section` and `include_key` name the options in errors."""
    def selected(module: Any, fqn: str) -> bool:
        del module
        return ((layers is None or search(f"{section}.{include_key}", layers, fqn))
                and not (exclude is not None and search(f"{section}.exclude", exclude, fqn)))

    return selected
