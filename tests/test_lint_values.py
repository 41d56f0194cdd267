"""Option values of our entries: a file whose entries would all fail at construction must not
lint clean. Types come from the `__init__` annotations (FP8020), values from one table
(FP8023), recipes from `recipe_problems` (FP8008). No torch here; tests/test_lint_known.py
checks the verdicts against the real constructors."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from foundry_fp8.lint.cli import lint_file
from foundry_fp8.lint.entries import module_constant
from foundry_fp8.lint.rules import lint_config
from foundry_fp8.lint.values import OPTION_VALUES, check_options

#: The audit's file: every entry in it fails at construction.
ALL_BROKEN = """\
precision: amp_fp8
algorithms:
  te_swap:
    backend: emulate
    include: "("
    exclude: "[a"
    keep_first_blocks: -1
callbacks:
  fp8_lint:
    fail_on: warning
  fp8_state:
    watch_batches: -1
  fp8_stats:
    interval: 0
    layers: "("
    tensors: [activations]
    dump_max_mb: -1
    recipe: {scaling: delayed, interval: 1}
loggers:
  jsonl:
    path: '{runname}/m.jsonl'
"""


def test_a_file_whose_entries_all_fail_at_construction_does_not_lint_clean(tmp_path: Path):
    path = tmp_path / "broken.yaml"
    path.write_text(ALL_BROKEN)
    entry = lint_file(path)
    assert entry["error"] is None
    found = {(f["rule"], f["key"]) for f in entry["findings"]}
    assert found == {
        ("FP8023", "algorithms.te_swap.include"), ("FP8023", "algorithms.te_swap.exclude"),
        ("FP8023", "algorithms.te_swap.keep_first_blocks"),
        ("FP8023", "callbacks.fp8_lint.fail_on"), ("FP8023", "callbacks.fp8_state.watch_batches"),
        ("FP8023", "callbacks.fp8_stats.interval"), ("FP8023", "callbacks.fp8_stats.layers"),
        ("FP8023", "callbacks.fp8_stats.tensors"), ("FP8023", "callbacks.fp8_stats.dump_max_mb"),
        ("FP8008", "callbacks.fp8_stats.recipe.interval"), ("FP8023", "loggers.jsonl.path")}
    lines = path.read_text().splitlines()
    for f in entry["findings"]:  # each at its own key
        text = lines[f["line"] - 1][f["column"] - 1:]
        assert text.startswith(f["key"].split(".")[-1] + ":"), (text, f)


@pytest.mark.parametrize(("entry", "option", "value", "snippet"), [
    ("fp8_lint", "fail_on", "warning", "must be one of 'error', 'never', got 'warning'"),
    ("fp8_lint", "fail_on", "nevr", "did you mean `never`"),
    ("fp8_state", "watch_batches", -1, "must be a non-negative integer, got -1"),
    ("te_swap", "min_gemm_size", -16, "must be a non-negative integer"),
    ("te_swap", "tokens_per_microbatch", 0, "must be a positive integer"),
    ("te_swap", "include", "(attn", "is not a valid regular expression"),
    ("fp8_stats", "exclude", "*", "is not a valid regular expression"),
    ("fp8_stats", "dump_layers", "[", "is not a valid regular expression"),
    ("fp8_stats", "interval", 0, "must be at least 1 batch"),
    ("fp8_stats", "interval", "0ba", "must be at least 1 batch"),
    ("fp8_stats", "interval", "2.5ba", "whole number of batches"),
    ("fp8_stats", "interval", "10ep", "must be a number of batches"),
    ("fp8_stats", "tensors", ["activation", "grad"], "got 'grad' (did you mean `gradient`?)"),
    ("fp8_stats", "dump_max_mb", -0.5, "must be a number >= 0"),
    ("fp8_stats", "dump_folder", "dumps/{run}", "unknown placeholder {run}"),
    ("jsonl", "path", "{runname}/m.jsonl", "unknown placeholder {runname} (did you mean"),
    ("jsonl", "path", "runs/{run_name/m.jsonl", "is not a valid path template"),
    ("jsonl", "path", "  ", "must be a file path"),
])
def test_values_the_constructors_refuse(entry, option, value, snippet):
    section = {"te_swap": "algorithms", "jsonl": "loggers"}.get(entry, "callbacks")
    options = {option: value, **({"backend": "emulate"} if entry == "te_swap" else {})}
    found = lint_config({section: {entry: options}})
    assert [(f.rule, f.key) for f in found] == [
        ("FP8023", f"{section}.{entry}.{option}")], found
    assert snippet in found[0].message and found[0].fix


@pytest.mark.parametrize(("entry", "option", "value"), [
    ("fp8_lint", "fail_on", "never"), ("fp8_state", "watch_batches", 0),
    ("te_swap", "min_gemm_size", 0), ("te_swap", "tokens_per_microbatch", None),
    ("te_swap", "tokens_per_microbatch", 8), ("te_swap", "include", r"blocks\.\d+\.ffn"),
    ("te_swap", "exclude", None), ("fp8_stats", "interval", 1), ("fp8_stats", "interval", "10BA"),
    ("fp8_stats", "interval", "1e2ba"), ("fp8_stats", "tensors", ["weight"]),
    ("fp8_stats", "dump_max_mb", 0), ("fp8_stats", "dump_folder", "{run_name}/dumps"),
    ("fp8_stats", "dump_folder", ""), ("fp8_stats", "recipe", "delayed"),
    ("fp8_stats", "recipe", {"scaling": "current"}), ("fp8_stats", "recipe", None),
    ("jsonl", "path", "runs/{run_name}/metrics.jsonl"), ("jsonl", "path", "m{{x}}.jsonl"),
    ("fp8_stats", "te_debug", None), ("fp8_stats", "te_debug", "current"),
])
def test_near_misses_lint_clean(entry, option, value):
    section = {"te_swap": "algorithms", "jsonl": "loggers"}.get(entry, "callbacks")
    options = {option: value, **({"backend": "emulate"} if entry == "te_swap" else {})}
    assert lint_config({section: {entry: options}}) == []


@pytest.mark.parametrize(("recipe", "key", "snippet"), [
    ({"scaling": "delayed", "interval": 1}, "callbacks.fp8_stats.recipe.interval",
     "no longer accepts"),
    ({"fp8_format": "E5M2"}, "callbacks.fp8_stats.recipe.fp8_format", "pure E5M2"),
    ("delyaed", "callbacks.fp8_stats.recipe", "unknown scaling 'delyaed'"),
    (3, "callbacks.fp8_stats.recipe", "unknown scaling 3"),
])
def test_fp8_stats_recipe_is_checked_like_te_swaps(recipe, key, snippet):
    found = lint_config({"callbacks": {"fp8_stats": {"recipe": recipe}}})
    assert [(f.rule, f.key) for f in found] == [("FP8008", key)], found
    assert snippet in found[0].message


@pytest.mark.parametrize(("options", "key", "snippet"), [
    ({"te_debug": "dleayed"}, "te_debug",
     "must be one of 'delayed', 'current', null, got 'dleayed' (did you mean `delayed`?)"),
    ({"strict": "true"}, "strict", "takes bool, got str 'true'"),
    ({"interval": True}, "interval", "takes int | str, got bool True"),
    ({"dump_steps": 5}, "dump_steps", "takes Sequence[int], got int 5"),
    ({"tensors": "weight"}, "tensors", "takes Sequence[str], got str 'weight'"),
])
def test_types_from_the_annotations(options, key, snippet):
    found = lint_config({"callbacks": {"fp8_stats": options}})
    assert [(f.rule, f.key) for f in found] == [("FP8020", f"callbacks.fp8_stats.{key}")], found
    assert snippet in found[0].message


def test_a_literal_annotation_is_enforced():
    found = lint_config({"algorithms": {"te_swap": {"backend": "transformer_engine"}}})
    assert [(f.rule, f.message) for f in found] == [
        ("FP8020", "te_swap.backend must be one of 'te', 'emulate', got 'transformer_engine'")]


def test_check_options_raises_one_line_for_the_first_problem():
    with pytest.raises(ValueError, match=r"^fp8_state\.watch_batches must be a non-negative "
                                         r"integer, got -1 \(fix: use a non-negative integer\)$"):
        check_options("fp8_state", {"self": object(), "strict": True, "watch_batches": -1})
    with pytest.raises(ValueError, match="fp8_lint.fail_on must be one of"):
        check_options("fp8_lint", {"train_config": {}, "fail_on": "warning"})
    with pytest.raises(ValueError, match="fp8_stats.recipe.interval"):
        check_options("fp8_stats", {"recipe": {"interval": 1}})
    with pytest.raises(ValueError, match="te_swap.keep_lm_head takes bool"):
        check_options("te_swap", {"keep_lm_head": "true"})


def test_check_options_accepts_what_constructors_hold_by_default():
    """Tuples (defaults) for Sequence options, callables for Callable ones."""
    check_options("fp8_stats", {"interval": "100ba", "tensors": ("activation", "weight"),
                                "dump_steps": (), "recipe": "current", "te_debug": None})
    check_options("te_swap", {"backend": "te", "module_filter_fn": lambda module, name: True,
                              "fp8_recipe": None, "include": None})
    check_options("jsonl", {"path": "runs/{run_name}/metrics.jsonl", "strict": False})


def test_the_table_names_only_options_that_exist():
    from foundry_fp8.lint.entries import our_entries

    entries = {entry.name: entry for entry in our_entries().values()}
    assert set(OPTION_VALUES) <= set(entries)
    for name, constraints in OPTION_VALUES.items():
        assert set(constraints) <= set(entries[name].options), name


def test_choices_are_read_from_the_code_without_importing_it():
    assert module_constant("foundry_fp8.composer.lint", "FAIL_ON") == ("error", "never")
    assert "run_name" in module_constant("foundry_fp8.composer.jsonl_logger", "PLACEHOLDERS")
    with pytest.raises(LookupError):
        module_constant("foundry_fp8.monitor", "NO_SUCH_CONSTANT")


_any = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=6)
_options = st.sampled_from(sorted((n, o) for n, c in OPTION_VALUES.items() for o in c))


@settings(max_examples=300, deadline=None)
@given(_options, _any)
def test_option_checks_never_crash(option, value):
    name, key = option
    section = {"te_swap": "algorithms", "jsonl": "loggers"}.get(name, "callbacks")
    for finding in lint_config({section: {name: {key: value}}}):
        assert finding.message and finding.fix and "\n" not in finding.message
    try:
        check_options(name, {key: value})
    except ValueError as e:
        assert str(e).startswith(f"{name}.{key}") and "\n" not in str(e)
