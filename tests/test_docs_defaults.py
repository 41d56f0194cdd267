"""The option defaults the docs state equal the code's, `ENTRIES[name].defaults()` (the option
dataclasses the constructors build): docs/rules.md is generated and tested, but these are
written by hand and drifted silently. Read here: the options tables of docs/fp8_stats.md and
docs/te_swap.md (which must also list every option), README.md's "What the defaults do" and the
YAML block at the top of docs/fp8_guard.md. Each stated value is compared in the form the
option keeps (`100ba` is 100, a list a tuple, `null` for a recipe the default recipe)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from foundry_fp8.options import ENTRIES, Check, checks

ROOT = Path(__file__).resolve().parents[1]

#: (entry, option, the value as the doc states it, where: file and row)
Stated = tuple[str, str, Any, str]


def _option_checks(entry: str) -> dict[str, Check]:
    return {n: c for cls in ENTRIES[entry].classes() for n, c in checks(cls).items()}


def mismatches(stated: list[Stated]) -> list[str]:
    """Each stated default that is not the code's, or that names no option of its entry."""
    wrong = []
    for entry, option, value, where in stated:
        check = _option_checks(entry).get(option)
        if check is None:
            wrong.append(f"{where}: {entry} has no option {option!r}")
            continue
        default = ENTRIES[entry].defaults()[option]
        if check.problems(value) or check.normal(value) != check.normal(default):
            wrong.append(f"{where}: {entry}.{option} stated {value!r}, the code's default is "
                         f"{default!r}")
    return wrong


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _unquoted(cell: str) -> str:
    return cell[1:-1] if cell.startswith("`") and cell.endswith("`") else cell


#: Recipe prose (`delayed, HYBRID, history 16, \`max\``): each word's recipe key.
RECIPE_WORDS = {"delayed": "scaling", "current": "scaling", "HYBRID": "fp8_format",
                "E4M3": "fp8_format", "max": "amax_compute_algo",
                "most_recent": "amax_compute_algo"}


def _recipe_prose(cell: str) -> dict[str, Any]:
    """`delayed, HYBRID, history 16, \\`max\\`` as a recipe mapping; ValueError for a word
    this test does not know (a rewording must be read here, not skipped)."""
    recipe: dict[str, Any] = {}
    for word in (w.strip().strip("`") for w in cell.split(",")):
        history = re.fullmatch(r"history (\d+)", word)
        if history:
            recipe["amax_history_len"] = int(history[1])
        elif word in RECIPE_WORDS:
            recipe[RECIPE_WORDS[word]] = word
        else:
            raise ValueError(f"recipe prose {cell!r}: unknown word {word!r}")
    return recipe


def options_table(text: str, entry: str, name: str) -> list[Stated]:
    """The rows of the `| option | default | meaning |` table in `text` (doc `name`)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if _cells(line)[:2] == ["option", "default"])
    stated = []
    for n, line in enumerate(lines[start + 2:], start + 3):
        if not line.startswith("|"):
            break
        option, default = (_unquoted(c) for c in _cells(line)[:2])
        prose = option == "fp8_recipe" and not default.startswith(("{", "null"))
        value = _recipe_prose(default) if prose else yaml.safe_load(default)
        stated.append((entry, option, value, f"{name}:{n}"))
    return stated


#: README prose that states a default in words, per entry: (pattern, the options its groups are).
README_PROSE = {
    "fp8_stats": (r"warns above ([\d.]+) % underflow, ([\d.]+) % overflow, below ([\d.]+) "
                  r"cosine similarity", ("max_underflow_pct", "max_overflow_pct", "min_cos_sim")),
    "fp8_guard": (r"\(its own thresholds, overflow ([\d.]+) %\)", ("max_overflow_pct",)),
}


def readme_defaults(text: str) -> list[Stated]:
    """Every default the README's "What the defaults do" table states: `key: value` snippets,
    te_swap's `recipe \\`{...}\\``, and the thresholds said in words (README_PROSE)."""
    lines = text.splitlines()
    start = lines.index("## What the defaults do")
    stated = []
    for n, line in enumerate(lines[start + 1:], start + 2):
        if line.startswith("## "):
            break
        cells = _cells(line) if line.startswith("|") else []
        if len(cells) < 2 or not re.fullmatch(r"`\w+`", cells[0]):
            continue
        entry, cell, where = cells[0].strip("`"), cells[1], f"README.md:{n}"
        for key, value in re.findall(r"`(\w+): ([^`]+)`", cell):
            stated.append((entry, key, yaml.safe_load(f"{key}: {value}")[key], where))
        for recipe in re.findall(r"recipe `(\{[^`]+\})`", cell):
            stated.append((entry, "fp8_recipe", yaml.safe_load(recipe), where))
        if entry in README_PROSE:
            pattern, options = README_PROSE[entry]
            found = re.search(pattern, cell)
            assert found, f"{where}: {entry}'s thresholds no longer read as {pattern!r}"
            stated += [(entry, o, float(v), where)
                       for o, v in zip(options, found.groups(), strict=True)]
    return stated


def guard_yaml_defaults(text: str) -> list[Stated]:
    """The options of every entry in the first YAML block (docs/fp8_guard.md's top)."""
    block = re.search(r"```yaml\n(.*?)```", text, flags=re.DOTALL)
    assert block, "no YAML block"
    callbacks = yaml.safe_load(block[1])["callbacks"]
    return [(entry, option, value, "docs/fp8_guard.md YAML block")
            for entry, options in callbacks.items() for option, value in options.items()]


def _read(name: str) -> str:
    return (ROOT / name).read_text()


@pytest.mark.parametrize(("doc", "entry"), [("docs/fp8_stats.md", "fp8_stats"),
                                            ("docs/te_swap.md", "te_swap")])
def test_options_tables_list_every_option_with_the_codes_default(doc, entry):
    stated = options_table(_read(doc), entry, doc)
    assert sorted(o for _, o, _, _ in stated) == sorted(ENTRIES[entry].option_names())
    assert mismatches(stated) == []


def test_readme_defaults_are_the_codes():
    stated = readme_defaults(_read("README.md"))
    assert {e for e, _, _, _ in stated} == set(ENTRIES)  # every entry's row is read
    assert mismatches(stated) == []


def test_fp8_guard_yaml_block_states_the_defaults():
    stated = guard_yaml_defaults(_read("docs/fp8_guard.md"))
    assert {e for e, _, _, _ in stated} == {"fp8_stats", "fp8_guard"}
    assert {o for e, o, _, _ in stated if e == "fp8_guard"} == set(
        ENTRIES["fp8_guard"].option_names())
    assert mismatches(stated) == []


@pytest.mark.parametrize(("doc", "read", "old", "new"), [
    ("docs/fp8_stats.md", lambda t: options_table(t, "fp8_stats", "copy"),
     "| `interval` | `100` |", "| `interval` | `10` |"),
    ("docs/fp8_stats.md", lambda t: options_table(t, "fp8_stats", "copy"),
     "| `tensors` | `[activation, weight, gradient]` |", "| `tensors` | `[activation, weight]` |"),
    ("docs/te_swap.md", lambda t: options_table(t, "te_swap", "copy"),
     "history 16", "history 1024"),
    ("README.md", readme_defaults, "`watch_batches: 8`", "`watch_batches: 16`"),
    ("README.md", readme_defaults, "0.01 % overflow", "0.1 % overflow"),
    ("docs/fp8_guard.md", guard_yaml_defaults, "consecutive: 3 ", "consecutive: 4 "),
])
def test_a_wrong_default_in_a_copy_of_a_doc_is_caught(doc, read, old, new):
    """The checks above on a copy with one default changed (the docs themselves untouched)."""
    text = _read(doc)
    assert old in text
    assert mismatches(read(text)) == []
    [wrong] = mismatches(read(text.replace(old, new, 1)))
    assert "the code's default is" in wrong
