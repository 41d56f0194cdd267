"""Option values of our entries: a file whose entries would all fail at construction must not
lint clean. Types (FP8020), values (FP8023) and recipes (FP8008) come from the option
dataclasses the constructors build (`foundry_fp8.options`). No torch here;
tests/test_lint_known.py checks the verdicts against the real constructors."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from foundry_fp8.lint.cli import lint_file
from foundry_fp8.lint.entries import our_entries
from foundry_fp8.lint.rules import lint_config
from foundry_fp8.lint.values import option_problems
from foundry_fp8.options import ENTRIES, Batches, Integer, Items, OptionError, build

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
    # FP8038: a fragment of settings, not a whole train config (its warning, at `precision`)
    found = {(f["rule"], f["key"]) for f in entry["findings"]} - {("FP8038", "precision")}
    assert found == {
        ("FP8023", "algorithms.te_swap.include"), ("FP8023", "algorithms.te_swap.exclude"),
        ("FP8023", "algorithms.te_swap.keep_first_blocks"),
        ("FP8023", "callbacks.fp8_lint.fail_on"), ("FP8023", "callbacks.fp8_state.watch_batches"),
        ("FP8023", "callbacks.fp8_stats.interval"), ("FP8023", "callbacks.fp8_stats.layers"),
        ("FP8023", "callbacks.fp8_stats.tensors.0"),
        ("FP8023", "callbacks.fp8_stats.dump_max_mb"),
        ("FP8008", "callbacks.fp8_stats.recipe.interval"), ("FP8023", "loggers.jsonl.path"),
        ("FP8028", "precision")}  # amp_fp8 with the emulated backend: Composer refuses it here
    lines = path.read_text().splitlines()
    for f in entry["findings"]:  # each at its own key (a list item at the item)
        text = lines[f["line"] - 1][f["column"] - 1:]
        last = f["key"].split(".")[-1]
        assert text.startswith("activations]" if last == "0" else last + ":"), (text, f)


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
    ("fp8_stats", "tensors", ["grad"], "got 'grad' (did you mean `gradient`?)"),
    ("fp8_stats", "tensors", [], "must not be empty"),  # a watch of nothing looks healthy
    ("fp8_stats", "dump_max_mb", -0.5, "must be a number from 0 to 262144"),
    ("fp8_stats", "dump_max_mb", 1e9, "must be a number from 0 to 262144"),
    ("fp8_stats", "dump_folder", "dumps/{run}", "unknown placeholder {run}"),
    ("fp8_stats", "interval", "abc", "must be a number of batches, got 'abc'"),
    ("fp8_stats", "start", -1, "must be a non-negative integer, got -1"),
    ("fp8_stats", "end", 0, "must be greater than start (0), got 0"),
    ("fp8_stats", "dump_steps", [True], "must be a non-negative integer, got True"),
    ("fp8_stats", "dump_steps", ["1000"], "must be a non-negative integer, got '1000'"),
    ("fp8_stats", "dump_steps", -5, "must be a non-negative integer, got -5"),
    ("fp8_stats", "max_underflow_pct", -1, "must be a number from 0 to 100, got -1"),
    ("fp8_stats", "max_overflow_pct", 100.5, "must be a number from 0 to 100, got 100.5"),
    ("fp8_stats", "max_overflow_pct", float("nan"), "must be a number from 0 to 100, got nan"),
    ("fp8_stats", "min_cos_sim", 2, "must be a number from -1 to 1, got 2"),
    ("fp8_stats", "min_cos_sim", -1.5, "must be a number from -1 to 1"),
    ("jsonl", "path", "{runname}/m.jsonl", "unknown placeholder {runname} (did you mean"),
    ("jsonl", "path", "runs/{run_name/m.jsonl", "is not a valid path template"),
    ("jsonl", "path", "a}b.jsonl", "is not a valid path template"),
    # filled as one folder name: `:d` raised a bare ValueError, `!r` put quotes in the name
    ("jsonl", "path", "{run_name:d}", "has {run_name:d}: a placeholder takes no conversion"),
    ("jsonl", "path", "r/{run_name!r}.jsonl", "has {run_name!r}: a placeholder takes no"),
    ("fp8_stats", "dump_folder", "{run_name!s:>9}", "has {run_name!s:>9}: a placeholder"),
    ("jsonl", "path", "  ", "must be a file path"),
])
def test_values_the_constructors_refuse(entry, option, value, snippet):
    section = {"te_swap": "algorithms", "jsonl": "loggers"}.get(entry, "callbacks")
    options = {option: value, **({"backend": "emulate"} if entry == "te_swap" else {})}
    found = lint_config({section: {entry: options}})
    item = ".0" if isinstance(value, list) and value else ""
    assert [(f.rule, f.key) for f in found] == [
        ("FP8023", f"{section}.{entry}.{option}{item}")], found
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
    ("jsonl", "path", "logs/{run_name}/metrics.jsonl"), ("jsonl", "path", "m{{x}}.jsonl"),
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
     "no longer uses"),
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
        with pytest.raises(OptionError, match=r"^callbacks\.fp8_stats\.end: must be greater "
                                              r"than start \("):
            build("fp8_stats", {"start": 0, **options})


def test_a_literal_type_is_enforced():
    found = lint_config({"algorithms": {"te_swap": {"backend": "transformer_engine"}}})
    assert [(f.rule, f.message) for f in found] == [
        ("FP8020", "te_swap.backend must be one of 'te', 'emulate', got 'transformer_engine'")]


def test_every_wrong_item_of_a_list_is_its_own_problem():
    """Issue 14: three wrong items, three findings, each at its item's key."""
    found = lint_config({"callbacks": {"fp8_stats": {
        "tensors": ["activations", "weight", "grad", 3], "dump_steps": [1, -2, "x", 4]}}})
    assert sorted((f.rule, f.key.removeprefix("callbacks.fp8_stats.")) for f in found) == [
        ("FP8020", "tensors.3"), ("FP8023", "dump_steps.1"), ("FP8023", "dump_steps.2"),
        ("FP8023", "tensors.0"), ("FP8023", "tensors.2")], found
    with pytest.raises(OptionError, match=r"^callbacks\.fp8_stats\.tensors\.0: must be one of"):
        build("fp8_stats", {"tensors": ["activations", "weight", "grad"]})


def test_unknown_options_name_the_closest_one():
    found = lint_config({"callbacks": {"fp8_stats": {"intervall": 10}},
                         "loggers": {"jsonl": {"paht": "m.jsonl"}}})
    assert [(f.rule, f.key, f.message) for f in found] == [
        ("FP8019", "callbacks.fp8_stats.intervall",
         "fp8_stats.intervall is not an option (did you mean `interval`?)"),
        ("FP8019", "loggers.jsonl.paht", "jsonl.paht is not an option (did you mean `path`?)")]


def test_build_raises_one_line_naming_the_key_path():
    """The key path as the linter's findings have it (`callbacks.fp8_state.watch_batches`)."""
    with pytest.raises(OptionError, match=r"^callbacks\.fp8_state\.watch_batches: must be a "
                                          r"non-negative integer, got -1 \(fix: use a "
                                          r"non-negative integer\)$"):
        build("fp8_state", {"strict": True, "watch_batches": -1})
    with pytest.raises(OptionError, match=r"^callbacks\.fp8_lint\.fail_on: must be one of"):
        build("fp8_lint", {"fail_on": "warning"})
    with pytest.raises(OptionError, match=r"^callbacks\.fp8_lint\.train_config: is passed by "):
        build("fp8_lint", {"train_config": {}})
    with pytest.raises(OptionError, match=r"^callbacks\.fp8_stats\.recipe\.interval: "
                                          "TransformerEngine no longer uses"):
        build("fp8_stats", {"recipe": {"interval": 1}})
    with pytest.raises(OptionError, match=r"^callbacks\.fp8_stats\.recipe: unknown scaling"):
        build("fp8_stats", {"recipe": "delyaed"})
    with pytest.raises(OptionError, match=r"^algorithms\.te_swap\.keep_lm_head: takes bool"):
        build("te_swap", {"keep_lm_head": "true"})
    with pytest.raises(OptionError, match=r"^loggers\.jsonl\.path: has unknown placeholder"):
        build("jsonl", {"path": "{run}.jsonl"})
    # the path is the finding's key, the rest its message without the entry.option subject
    for section, name, option, value in [("callbacks", "fp8_stats", "interval", 0),
                                         ("algorithms", "te_swap", "include", "("),
                                         ("callbacks", "fp8_stats", "tensors", ["x"])]:
        [finding] = [f for f in lint_config({section: {name: {option: value}}})
                     if f.rule == "FP8023"]
        with pytest.raises(OptionError) as error:
            build(name, {option: value})
        detail = finding.message.removeprefix(f"{finding.key.removeprefix(section + '.')} ")
        assert str(error.value) == f"{finding.key}: {detail} (fix: {finding.fix})"


def test_a_failure_inside_the_checks_is_not_swallowed(monkeypatch):
    """Issue 15: a bug in a check must not silently switch checking off: the constructor raises,
    and the linter says which rule failed, as an error (tests/test_lint_numbers.py)."""
    def broken(self, value):
        raise KeyError("our bug")

    monkeypatch.setattr(Integer, "problems", broken)
    with pytest.raises(KeyError, match="our bug"):
        build("fp8_state", {"watch_batches": -1})
    failed = [f for f in lint_config({"callbacks": {"fp8_state": {"watch_batches": -1}}})
              if f.crashed]
    assert failed and all(f.severity == "error" and "KeyError" in f.message and "our bug"
                          in f.message for f in failed), failed


def test_build_accepts_what_python_callers_hold():
    """Tuples for list options, callables for Callable ones, a built FP8Recipe."""
    from foundry_fp8.recipe import FP8Recipe

    options = build("fp8_stats", {"interval": "100ba", "tensors": ("activation", "weight"),
                                  "dump_steps": (), "recipe": "current", "te_debug": None})
    assert options.schedule.interval == 100 and options.monitor.tensors == ("activation", "weight")
    assert build("te_swap", {"backend": "te", "module_filter_fn": lambda module, name: True,
                             "fp8_recipe": None, "include": None}).fp8_recipe == FP8Recipe()
    recipe = FP8Recipe(scaling="delayed")
    assert build("fp8_stats", {"recipe": recipe, "dump_steps": 1000}).monitor.recipe is recipe


def test_the_linter_sees_the_constructors_options():
    """The linter's entries are the option dataclasses, defaults included."""
    entries = {entry.name: entry for entry in our_entries().values()}
    assert set(entries) == set(ENTRIES) == {"te_swap", "fp8_stats", "fp8_state", "fp8_lint",
                                            "fp8_guard", "jsonl"}
    assert entries["te_swap"].options["backend"].default == "te"
    # the default the linter states is the one a run gets (the README's 100 batches)
    from foundry_fp8.composer.stats import FP8Stats

    assert entries["fp8_stats"].options["interval"].default == FP8Stats().options.schedule.interval == 100
    assert "schedule" not in entries["fp8_stats"].options  # parts are not YAML options
    for name, spec in ENTRIES.items():
        built = build(name, spec.defaults())  # every default passes its own check
        assert type(built) is spec.options


_any = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=6)
_options = st.sampled_from(sorted((n, o) for n, e in ENTRIES.items() for o in e.option_names()))


@settings(max_examples=300, deadline=None)
@given(_options, _any)
def test_option_checks_never_crash(option, value):
    name, key = option
    section = ENTRIES[name].section
    for finding in lint_config({section: {name: {key: value}}}):
        assert finding.message and finding.fix and "\n" not in finding.message
    entry = our_entries()[(section, name)]
    for problem in option_problems(entry, {key: value}):  # raises on a bug of ours
        assert problem.detail and "\n" not in problem.message + problem.detail
    try:
        build(name, {key: value})
    except OptionError as e:
        assert str(e).startswith(f"{section}.{name}.{key}") and "\n" not in str(e)


def test_a_bare_value_is_a_list_of_one():
    steps = Items(Integer(0), bare=True)
    assert steps.normal(1000) == (1000,) and steps.normal([1, 2]) == (1, 2) and \
        steps.normal(()) == ()
    assert [Batches(1).normal(v) for v in (7, "1e2BA", " 5ba")] == [7, 100, 5]


@pytest.mark.parametrize(("name", "options"), [
    ("te_swap", {"keep_first_blocks": 2, "include": "attn"}), ("te_swap", None),
    ("fp8_guard", {"consecutive": 3}), ("fp8_stats", {"interval": "10ba"}),
])
def test_built_options_are_what_the_constructor_builds(name, options):
    from foundry_fp8.lint.values import built_options

    assert built_options(name, options) == build(name, options or {})


@pytest.mark.parametrize("options", [{"keep_first_blocks": -1}, {"keep_frist_blocks": 1},
                                     {"include": "("}, ["keep_first_blocks"], "te"])
def test_built_options_are_none_where_the_constructor_refuses(options):
    from foundry_fp8.lint.values import built_options

    assert built_options("te_swap", options) is None
