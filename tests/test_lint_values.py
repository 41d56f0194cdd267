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
from foundry_fp8.lint.values import (
    OPTION_RELATIONS,
    OPTION_VALUES,
    as_items,
    batches,
    check_options,
    option_problems,
)

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
        ("FP8008", "callbacks.fp8_stats.recipe.interval"), ("FP8023", "loggers.jsonl.path"),
        ("FP8028", "precision")}  # amp_fp8 with the emulated backend: Composer refuses it here
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
    ("fp8_stats", "interval", "abc", "must be a number of batches, got 'abc'"),
    ("fp8_stats", "start", -1, "must be a non-negative integer, got -1"),
    ("fp8_stats", "end", 0, "must be greater than start (0), got 0"),
    ("fp8_stats", "dump_steps", [10, -1], "item 1 must be a non-negative integer, got -1"),
    ("fp8_stats", "dump_steps", [True], "item 0 must be a non-negative integer, got True"),
    ("fp8_stats", "dump_steps", ["1000"], "item 0 must be a non-negative integer, got '1000'"),
    ("fp8_stats", "dump_steps", -5, "must be a non-negative integer, got -5"),
    ("fp8_stats", "max_underflow_pct", -1, "must be a number from 0 to 100, got -1"),
    ("fp8_stats", "max_overflow_pct", 100.5, "must be a number from 0 to 100, got 100.5"),
    ("fp8_stats", "max_overflow_pct", float("nan"), "must be a number from 0 to 100, got nan"),
    ("fp8_stats", "min_cos_sim", 2, "must be a number from -1 to 1, got 2"),
    ("fp8_stats", "min_cos_sim", -1.5, "must be a number from -1 to 1"),
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
    ("fp8_stats", "start", 0), ("fp8_stats", "start", 500), ("fp8_stats", "end", 1),
    ("fp8_stats", "end", None), ("fp8_stats", "dump_steps", 1000),
    ("fp8_stats", "dump_steps", [0, 1000]), ("fp8_stats", "dump_steps", []),
    ("fp8_stats", "max_underflow_pct", 0), ("fp8_stats", "max_underflow_pct", 100),
    ("fp8_stats", "max_overflow_pct", 0.01), ("fp8_stats", "min_cos_sim", -1),
    ("fp8_stats", "min_cos_sim", 1), ("fp8_stats", "min_cos_sim", 0.999),
    ("fp8_stats", "strict", False), ("te_swap", "strict", False),
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
    ({"strict": "false"}, "strict", "takes bool, got str 'false'"),
    ({"interval": 10.0}, "interval", "takes int | str, got float 10.0"),
    ({"interval": None}, "interval", "takes int | str, got null"),
    ({"dump_steps": "1000"}, "dump_steps", "takes int | Sequence[int], got str '1000'"),
    ({"tensors": "weight"}, "tensors", "takes Sequence[str], got str 'weight'"),
    ({"layers": 5}, "layers", "takes str, got int 5"),
    ({"start": "10ba"}, "start", "takes int, got str '10ba'"),
    ({"min_cos_sim": "0.99"}, "min_cos_sim", "takes float, got str '0.99'"),
])
def test_types_from_the_annotations(options, key, snippet):
    found = lint_config({"callbacks": {"fp8_stats": options}})
    assert [(f.rule, f.key) for f in found] == [("FP8020", f"callbacks.fp8_stats.{key}")], found
    assert snippet in found[0].message


@pytest.mark.parametrize(("options", "key", "snippet"), [
    ({"fp8_recipe": "delayed"}, "fp8_recipe", "must be a mapping, got str"),
    ({"include": 5}, "include", "takes str | None, got int 5"),
    ({"tokens_per_microbatch": True}, "tokens_per_microbatch", "takes int | None, got bool"),
    ({"keep_lm_head": "false"}, "keep_lm_head", "takes bool, got str 'false'"),
])
def test_te_swap_types(options, key, snippet):
    found = lint_config({"algorithms": {"te_swap": {"backend": "emulate", **options}}})
    assert [f.key for f in found] == [f"algorithms.te_swap.{key}"], found
    assert snippet in found[0].message


@pytest.mark.parametrize(("options", "found"), [
    ({"start": 10, "end": 5}, ["end"]),
    ({"start": 10, "end": 10}, ["end"]),
    ({"start": 10, "end": 11}, []),
    ({"start": 10}, []),  # end: null, no end
    ({"end": 0}, ["end"]),  # start's default, 0
    ({"start": -3, "end": 0}, ["start"]),  # start's own problem first, no relation then
    ({"start": "0", "end": 0}, ["start"]),
    ({"start": 5, "end": None}, []),
])
def test_fp8_stats_end_is_after_start(options, found):
    findings = lint_config({"callbacks": {"fp8_stats": options}})
    assert [f.key.split(".")[-1] for f in findings] == found, findings
    if found == ["end"]:
        assert findings[0].rule == "FP8023" and "must be greater than start" in \
            findings[0].message
        with pytest.raises(ValueError, match=r"^callbacks\.fp8_stats\.end: must be greater "
                                             r"than start \("):
            check_options("fp8_stats", {"start": 0, **options})


def test_a_literal_annotation_is_enforced():
    found = lint_config({"algorithms": {"te_swap": {"backend": "transformer_engine"}}})
    assert [(f.rule, f.message) for f in found] == [
        ("FP8020", "te_swap.backend must be one of 'te', 'emulate', got 'transformer_engine'")]


def test_check_options_raises_one_line_naming_the_key_path():
    """The key path as the linter's findings have it (`callbacks.fp8_state.watch_batches`)."""
    with pytest.raises(ValueError, match=r"^callbacks\.fp8_state\.watch_batches: must be a "
                                         r"non-negative integer, got -1 \(fix: use a "
                                         r"non-negative integer\)$"):
        check_options("fp8_state", {"self": object(), "strict": True, "watch_batches": -1})
    with pytest.raises(ValueError, match=r"^callbacks\.fp8_lint\.fail_on: must be one of"):
        check_options("fp8_lint", {"train_config": {}, "fail_on": "warning"})
    with pytest.raises(ValueError, match=r"^callbacks\.fp8_stats\.recipe\.interval: "
                                         "TransformerEngine no longer accepts"):
        check_options("fp8_stats", {"recipe": {"interval": 1}})
    with pytest.raises(ValueError, match=r"^callbacks\.fp8_stats\.recipe: unknown scaling"):
        check_options("fp8_stats", {"recipe": "delyaed"})
    with pytest.raises(ValueError, match=r"^algorithms\.te_swap\.keep_lm_head: takes bool"):
        check_options("te_swap", {"keep_lm_head": "true"})
    with pytest.raises(ValueError, match=r"^loggers\.jsonl\.path: has unknown placeholder"):
        check_options("jsonl", {"path": "{run}.jsonl"})
    # the path is the finding's key, the rest its message without the entry.option subject
    for section, name, option, value in [("callbacks", "fp8_stats", "interval", 0),
                                         ("algorithms", "te_swap", "include", "(")]:
        [finding] = [f for f in lint_config({section: {name: {option: value}}})
                     if f.rule == "FP8023"]
        with pytest.raises(ValueError) as error:
            check_options(name, {option: value})
        detail = finding.message.removeprefix(f"{name}.{option} ")
        assert str(error.value) == f"{finding.key}: {detail} (fix: {finding.fix})"


def test_check_options_never_stops_a_run_for_a_bug_of_its_own(monkeypatch, caplog):
    from foundry_fp8.lint import values

    def broken(entry, options):
        raise KeyError("our bug")

    monkeypatch.setattr(values, "option_problems", broken)
    check_options("fp8_state", {"watch_batches": -1})  # not checked, not raised
    assert "checking fp8_state's options failed" in caplog.text


def test_check_options_accepts_what_constructors_hold_by_default():
    """Tuples (defaults) for Sequence options, callables for Callable ones."""
    check_options("fp8_stats", {"interval": "100ba", "tensors": ("activation", "weight"),
                                "dump_steps": (), "recipe": "current", "te_debug": None})
    check_options("te_swap", {"backend": "te", "module_filter_fn": lambda module, name: True,
                              "fp8_recipe": None, "include": None})
    check_options("jsonl", {"path": "runs/{run_name}/metrics.jsonl", "strict": False})
    from foundry_fp8.recipe import FP8Recipe

    check_options("fp8_stats", {"recipe": FP8Recipe(scaling="delayed"), "dump_steps": 1000})


def test_the_table_names_only_options_that_exist():
    from foundry_fp8.lint.entries import our_entries

    entries = {entry.name: entry for entry in our_entries().values()}
    assert set(OPTION_VALUES) <= set(entries)
    for name, constraints in OPTION_VALUES.items():
        assert set(constraints) <= set(entries[name].options), name
    for name, relations in OPTION_RELATIONS.items():
        for relation in relations:
            assert {relation.option, relation.other} <= set(entries[name].options), name


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
    from foundry_fp8.lint.entries import our_entries

    entry = next(e for e in our_entries().values() if e.name == name)
    for problem in option_problems(entry, {key: value}):  # raises on a bug of ours
        assert problem.detail and "\n" not in problem.message + problem.detail
    try:
        check_options(name, {key: value})
    except ValueError as e:
        assert str(e).startswith(f"{section}.{name}.{key}") and "\n" not in str(e)


def test_a_bare_value_is_a_list_of_one():
    assert as_items(1000) == (1000,) and as_items([1, 2]) == (1, 2) and as_items(()) == ()
    assert batches(7) == 7 and batches("1e2BA") == 100 and batches(" 5ba") == 5
