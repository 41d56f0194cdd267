"""Where the report says "FP8 is not working for this run as a whole": only in a run with FP8
layers (te_swap logged its count; a bf16 run's fp8_stats what-if flags got "6 of its 8 FP8
layers ... or train without te_swap"), not counting flags that are all what-if, and once where
both the budget's refused layers and the held ones reach the share (it was said twice)."""

from __future__ import annotations

from foundry_fp8.guard import Fallback, Refusal
from foundry_fp8.health.keys import MODULES_IN_FP8
from foundry_fp8.health.rules import Flag
from foundry_fp8.report.markdown import Finding, flagged_whole, fp8_layers, guard_section
from foundry_fp8.report.read import GuardRun, swap_filters

LAYERS = [f"blocks.{b}.attn.{m}" for b in range(4) for m in ("Wqkv", "out_proj")]
HEAD = "FP8 is not working for this run as a whole"


def _found(layer: str, whatif: int) -> Finding:
    flag = Flag("underflow", layer, "gradient", 4, "underflow_pct", 50.0, "> 1 %", "cause",
                "algorithms.te_swap.exclude: x")
    return Finding(flag, 2, 3, 5, whatif)


def test_a_run_without_te_swap_gets_no_whole_run_line():
    found = [_found(layer, 0) for layer in LAYERS[:6]]
    bf16 = fp8_layers(LAYERS, swap_filters({}, LAYERS))  # fp8_stats' what-if only
    assert flagged_whole(found, [], bf16, None, [f.worst for f in found]) is None
    fp8 = fp8_layers(LAYERS, swap_filters({MODULES_IN_FP8: 8}, LAYERS))
    said = flagged_whole(found, [], fp8, None, [f.worst for f in found])
    assert said is not None and "6 of its 8 FP8 layers are flagged" in said


def test_flags_that_are_all_what_if_are_not_counted():
    fp8 = fp8_layers(LAYERS, swap_filters({MODULES_IN_FP8: 8}, LAYERS))
    # 5 layers flagged in FP8, 2 more at what-if steps only (3 of 3): 5 of 8, under 3/4
    found = [_found(layer, 0) for layer in LAYERS[:5]] + [
        _found(layer, 3) for layer in LAYERS[5:7]]
    assert flagged_whole(found, [], fp8, None, [f.worst for f in found]) is None


def test_refused_and_held_layers_get_one_whole_run_paragraph():
    held = LAYERS[:6]  # 6 of 8 held at the end, 2 refused: each set reaches 3/4
    guard = GuardRun({}, [Fallback(layer, 2, 0.1, ("flagged",)) for layer in held], None,
                     refusals=tuple(Refusal(layer, 4, 0.1, 0.8, 0.5) for layer in LAYERS[6:]))
    swap = swap_filters({MODULES_IN_FP8: 8}, LAYERS)
    text = "\n".join(guard_section(guard, {n: n for n in LAYERS}, swap, fp8_layers(LAYERS, swap)))
    assert text.count(HEAD) == 1, text
    assert "8 of its 8 FP8 layers are refused by fp8_guard's budget or held" in text
    assert "```yaml" not in text  # no static YAML of 6 of the 8 layers
