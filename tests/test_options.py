"""The option dataclasses (`foundry_fp8.options`): bounds with sources (19.3), errors that name
the key (19.11), regexes that cannot hang a run (19.11), the framework-neutral API (12.5)."""

from __future__ import annotations

import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from foundry_fp8.lint.rules import lint_config
from foundry_fp8.options import MonitorConfig, OptionError, Schedule, SwapConfig, build
from foundry_fp8.recipe import FP8_MAX, FP8_MIN_SUBNORMAL, MAX_HISTORY, MAX_MARGIN


@contextmanager
def deadline(seconds: int) -> Iterator[None]:
    """Fail (instead of hanging the suite) if the block runs longer than `seconds`."""
    def expired(signum, frame):
        raise AssertionError(f"still running after {seconds} s: it hangs")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize(("key", "value"), [("margin", 100000), ("amax_history_len", 10**10),
                                            ("margin", MAX_MARGIN + 1),
                                            ("amax_history_len", MAX_HISTORY + 1)])
def test_recipe_values_out_of_bounds_are_refused_by_lint_and_constructor(key, value):
    """Issue 19.3: margin 100000 gave scale 0 and NaN loss; a history of 1e10 failed at INIT
    with a 120 GB allocation. Both are refused before training, with the same words."""
    for section, entry, option in [("algorithms", "te_swap", "fp8_recipe"),
                                   ("callbacks", "fp8_stats", "recipe")]:
        recipe = {"scaling": "delayed", key: value}
        base = {"backend": "emulate"} if entry == "te_swap" else {}
        [finding] = lint_config({section: {entry: {**base, option: recipe}}})
        assert (finding.rule, finding.key) == ("FP8008", f"{section}.{entry}.{option}.{key}")
        with pytest.raises(OptionError) as error:
            build(entry, {**base, option: recipe})
        assert str(error.value).startswith(f"{finding.key}: must be an integer from ")
        assert finding.message.endswith(str(error.value).split(": ", 1)[1].split(" (fix")[0])


def test_the_largest_margin_still_maps_the_amax_into_e4m3():
    """MAX_MARGIN against torch's own FP8 formats: at MAX_MARGIN the amax scaled by TE's formula
    (fp8_max * 2**-margin, delayed_scaling.cu:300) is at least E4M3's smallest subnormal, one
    more and it is below it."""
    import torch

    smallest = {f: torch.tensor([1], dtype=torch.uint8).view(d).float().item()
                for f, d in (("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2))}
    largest = {f: torch.finfo(d).max for f, d in (("e4m3", torch.float8_e4m3fn),
                                                  ("e5m2", torch.float8_e5m2))}
    assert smallest == FP8_MIN_SUBNORMAL and largest == FP8_MAX
    assert FP8_MAX["e4m3"] * 2.0**-MAX_MARGIN >= smallest["e4m3"]
    assert FP8_MAX["e4m3"] * 2.0**-(MAX_MARGIN + 1) < smallest["e4m3"]
    build("te_swap", {"fp8_recipe": {"margin": MAX_MARGIN}})  # the bound itself is allowed


@pytest.mark.parametrize(("name", "options", "path"), [
    ("jsonl", {"paht": "m.jsonl"}, "loggers.jsonl.paht: is not an option (did you mean `path`?)"),
    ("te_swap", {"keep_frist_blocks": 1},
     "algorithms.te_swap.keep_frist_blocks: is not an option (did you mean `keep_first_blocks`?)"),
    ("fp8_stats", {"layer": "attn"},
     "callbacks.fp8_stats.layer: is not an option (did you mean `layers`?)"),
])
def test_an_unknown_option_is_one_line_with_did_you_mean(name, options, path):
    """Issue 19.11: Python's `TypeError: __init__() got an unexpected keyword argument` before;
    now the constructors (with or without fp8_lint) say the key path and the closest option."""
    from tests.test_lint_known import _class

    with pytest.raises(OptionError) as error:
        _class(name)(**options)
    assert str(error.value).startswith(path) and "\n" not in str(error.value)


CATASTROPHIC = r"^([\w.]+)+!"  # the pattern: Python's re never returns on a long name


def test_a_catastrophic_regex_does_not_hang_te_swap_or_fp8_stats():
    """Issue 19.11: matched with the `regex` engine and a time bound, the issue's pattern returns
    (matching nothing) on real MPT module names, in te_swap's plan and fp8_stats' selection."""
    from foundry_fp8.monitor import select_layers
    from foundry_fp8.swap import plan_swap
    from tests.test_swap_plan import _mpt

    model = _mpt()
    with deadline(10):
        plan = plan_swap(model, SwapConfig(backend="emulate", include=CATASTROPHIC))
        assert not plan.converted
        assert select_layers(model, MonitorConfig(layers=CATASTROPHIC)) == {}
        assert select_layers(model, MonitorConfig(exclude=CATASTROPHIC))  # excludes nothing


def test_a_regex_that_runs_out_of_time_stops_with_the_key():
    """A pattern that even the `regex` engine backtracks on for long is cut off after
    MATCH_TIMEOUT_S: one line naming the option, not a hang."""
    from torch import nn

    from foundry_fp8.monitor import select_layers

    model = nn.ModuleDict({"a" * 40: nn.Linear(4, 4)})
    with deadline(10), pytest.raises(OptionError, match=r"^callbacks\.fp8_stats\.layers: regex "
                                                         r".* takes more than 0\.05 s on module"):
        select_layers(model, MonitorConfig(layers=r"^(a|aa)+(?<!a)b"))


@pytest.mark.parametrize(("options", "key", "words"), [
    ({"layers": r"(?<=blocks\.\d+)\.ffn"}, "layers", "look-behind requires fixed-width"),
    ({"exclude": r"\p{Lu}"}, "exclude", "bad escape \\p"),
    # each compiles alone; TE's debug API gets them as one pattern, where (?i) is not first
    ({"layers": "ffn", "exclude": "(?i)attn"}, "exclude", "does not combine with layers"),
])
def test_te_debug_needs_layer_regexes_pythons_re_compiles(options, key, words):
    """`regex` (our hooks' engine) takes these, nvdlfw-inspect's `re` does not: with te_debug
    the callback raised re.error from te.debug with a traceback naming no key."""
    from foundry_fp8.composer.stats import FP8Stats

    assert build("fp8_stats", options).monitor.layers  # the hooks alone take them
    [finding] = lint_config({"callbacks": {"fp8_stats": {**options, "te_debug": "delayed"}}})
    assert (finding.rule, finding.key) == ("FP8023", f"callbacks.fp8_stats.{key}")
    with pytest.raises(OptionError) as error:  # before TE is looked for: on any machine
        FP8Stats(**options, te_debug="delayed")
    message = str(error.value)
    assert message.startswith(f"callbacks.fp8_stats.{key}: ") and words in message
    assert "\n" not in message and "leave te_debug unset" in message
    assert finding.message.endswith(message.split(": ", 1)[1].split(" (fix")[0])


def test_the_framework_neutral_api_matches_the_callback():
    """Issue 12.5: a recipe name, an interval in Composer's batches, the option named `layers`."""
    assert MonitorConfig(recipe="delayed").recipe.scaling == "delayed"
    assert MonitorConfig(recipe={"scaling": "delayed", "amax_history_len": 4}) \
        .recipe.amax_history_len == 4
    assert Schedule(interval="10ba").interval == 10
    with pytest.raises(OptionError, match=r"^callbacks\.fp8_stats\.interval: must be a number "):
        Schedule(interval="10ep")
    assert MonitorConfig(layers="attn").layers == "attn"
    assert build("fp8_stats", {"layers": "attn"}).monitor == MonitorConfig(layers="attn")


def test_options_import_no_torch():
    import subprocess

    code = ("import sys; import foundry_fp8.options, foundry_fp8.filters, foundry_fp8.lint.values; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_plain_pytorch_example_runs(capsys):
    """Issue 12.5: the docs' plain-PyTorch example runs as written, logging at steps 0, 10, 20
    and summarising both watched layers' three tensors."""
    import re
    import warnings
    from pathlib import Path

    doc = Path(__file__).resolve().parents[1] / "docs" / "fp8_stats.md"
    [code] = re.findall(r"```python\n(.*?)```", doc.read_text(), flags=re.DOTALL)
    assert len(code.splitlines()) <= 22
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the monitor's threshold warnings
        exec(compile(code, str(doc), "exec"), {})
    out = capsys.readouterr().out
    assert re.findall(r"^step (\d+): \d+ values$", out, flags=re.MULTILINE) == ["0", "10", "20"]
    # plain nn.Linear layers: every row holds fp8_stats' what-if numbers, and says so
    rows = re.findall(r"^\| (\d) \| (\w+) \(what-if\) \|", out, flags=re.MULTILINE)
    assert sorted(rows) == sorted((layer, tensor) for layer in "02"
                                  for tensor in ("activation", "weight", "gradient"))
