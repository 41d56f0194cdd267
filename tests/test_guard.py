"""fp8_guard: an FP8 layer that stays unhealthy moves to high precision mid-run, alone, at the
same step on every rank and after a resume; its decisions, budget and messages."""

from __future__ import annotations

import re
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from omegaconf import OmegaConf as om
from torch import nn

from foundry_fp8.composer.guard import FP8Guard, high_precision_hooks, layer_flops
from foundry_fp8.emulate import EmulatedFP8Linear, fp8_autocast
from foundry_fp8.fp8_meta import read_fp8_meta
from foundry_fp8.guard import (
    GuardConfig,
    GuardCore,
    exclude_regex,
    render_fallbacks,
    static_yaml,
)
from foundry_fp8.options import OptionError
from foundry_fp8.recipe import FP8Recipe
from foundry_fp8.swap import SwapConfig, plan_swap

HEALTHY = {"underflow_pct": 0.0, "overflow_pct": 0.0, "cos_sim": 0.9996, "scale_ratio": 1.0}
UNDERFLOWING = {"underflow_pct": 21.9, "overflow_pct": 0.0, "cos_sim": 0.9997, "scale_ratio": 0.9}


@pytest.mark.parametrize(("options", "key"), [
    ({"consecutive": 0}, "consecutive"), ({"consecutive": 2.5}, "consecutive"),
    ({"max_fallback_share": 1.5}, "max_fallback_share"),
    ({"max_fallback_share": True}, "max_fallback_share"),
    ({"max_underflow_pct": -1}, "max_underflow_pct"), ({"min_cos_sim": 2}, "min_cos_sim"),
    ({"strict": "yes"}, "strict")])
def test_bad_options_name_their_key_path(options, key):
    with pytest.raises(OptionError, match=rf"^callbacks\.fp8_guard\.{key}: (must be|takes) ") as e:
        FP8Guard(**options)
    assert "\n" not in str(e.value)


def _table(bad: set[str], layers=("a", "b", "c")) -> dict:
    return {(layer, tensor): dict(UNDERFLOWING if layer in bad and tensor == "activation"
                                  else HEALTHY)
            for layer in layers for tensor in ("activation", "weight", "gradient")}


def test_a_layer_falls_back_after_consecutive_bad_logging_steps_within_budget():
    core = GuardCore(GuardConfig(consecutive=3, max_fallback_share=0.25),
                     {"a": 0.1, "b": 0.2, "c": 0.5})
    seen = [core.candidates(step, _table({"a", "c"} if step >= 4 else set()))
            for step in range(0, 10, 2)]
    # bad from step 4: the third consecutive bad logging step is step 8
    assert seen == [[], [], [], [], ["a", "c"]]
    verdict = core.decide(8, seen[4], _table({"a", "c"}))
    assert [f.layer for f in verdict.fallbacks] == ["a"]  # c: 0.5 / 0.8 of the FP8 FLOPs
    assert verdict.refused == ["c"]
    assert ("putting 75.0 % of the FP8 FLOPs" in verdict.budget_message
            and "max_fallback_share = 25 %" in verdict.budget_message)
    assert core.fp8_flops_share == pytest.approx(0.7)
    assert core.fallback_share == pytest.approx(0.1 / 0.8)
    fallback = core.fallbacks["a"]
    assert fallback.numbers["activation/underflow_pct"] == 21.9 and fallback.step == 8
    assert "underflow" in fallback.reasons[0] and "at step 8" in fallback.reasons[0]
    # a layer in fallback is no longer judged; an unflagged layer never becomes a candidate
    assert core.candidates(10, _table({"a", "c"})) == ["c"]


def test_a_single_amax_spike_moves_no_layer():
    spike = {**HEALTHY, "overflow_pct": 1.56, "cos_sim": 0.37, "scale_ratio": 2.8e4}
    core = GuardCore(GuardConfig(consecutive=2), {"a": 0.05, "b": 0.05})
    seen = [core.candidates(step, {(layer, "activation"): dict(spike if step == 0 and layer == "a"
                                                               else HEALTHY)
                                   for layer in ("a", "b")})
            for step in (0, 2, 4)]
    assert seen == [[], [], []]


def test_a_layer_with_nan_or_inf_is_not_judged_the_other_layers_are():
    """NaN/Inf are counted in the high-precision tensor, before any FP8 cast: `b`'s inf weight
    (FP8's saturating cast lets training run on with it) never makes `b` a candidate, and its
    underflow there does not count; `a` and `c` are judged at the same steps, `a`'s streak
    growing across them (the old guard judged no layer at all from `b`'s first inf on). A step
    where every layer holds NaN (a NaN loss) is not judged: `a`'s streak neither grows nor
    resets. A resume replays the same."""
    inf_weight = {**UNDERFLOWING, "inf_count": 1.0}
    nan = {**HEALTHY, "nan_count": 4.0}
    rows = {0: {"a": UNDERFLOWING},
            2: {"a": UNDERFLOWING, "b": inf_weight},
            4: {"a": UNDERFLOWING, "b": inf_weight, "c": UNDERFLOWING},
            6: {"a": nan, "b": nan, "c": nan},
            8: {"a": UNDERFLOWING, "b": UNDERFLOWING, "c": UNDERFLOWING}}
    tables = {step: {(layer, "weight"): dict(row.get(layer, HEALTHY)) for layer in "abc"}
              for step, row in rows.items()}
    config = GuardConfig(consecutive=3, max_fallback_share=1.0)
    core = GuardCore(config, {"a": 0.05, "b": 0.05, "c": 0.05})
    seen = {}
    for step, table in tables.items():
        seen[step] = (core.candidates(step, table), sorted({layer for layer, _ in core.nonfinite}))
        if step == 2:
            saved = core.state_dict()
    assert seen == {0: ([], []), 2: ([], ["b"]), 4: (["a"], ["b"]), 6: ([], ["a", "b", "c"]),
                    8: (["a"], [])}
    # streaks over the judged steps: a at 0, 2, 4, 8; b at 8 alone; c at 4 and 8
    assert [core._tracker.streak(layer, "weight") for layer in "abc"] == [4, 1, 2]
    resumed = GuardCore(config, {"a": 0.05, "b": 0.05, "c": 0.05})
    resumed.load_state_dict(saved)
    assert [resumed.candidates(step, tables[step]) for step in (4, 6, 8)] == [["a"], [], ["a"]]


def test_a_layer_in_fallback_holding_nan_or_inf_is_not_repromoted_then():
    """Its what-if statistics at that step are not evidence of health either."""
    config = GuardConfig(consecutive=1, repromote_after=2, max_fallback_share=1.0)
    core = GuardCore(config, {"a": 0.05, "b": 0.05})
    table = {("a", "weight"): dict(UNDERFLOWING), ("b", "weight"): dict(HEALTHY)}
    core.decide(0, core.candidates(0, table), table)
    assert list(core.fallbacks) == ["a"]
    healthy = {("a", "weight"): dict(HEALTHY), ("b", "weight"): dict(HEALTHY)}
    core.candidates(2, healthy)
    core.candidates(4, healthy)
    nan = {("a", "weight"): {**HEALTHY, "nan_count": 1.0}, ("b", "weight"): dict(HEALTHY)}
    assert core.candidates(6, nan) == [] and core.ready(6, nan) == []
    assert core.candidates(8, healthy) == [] and core.ready(8, healthy) == ["a"]


def _decisions(core: GuardCore, tables: dict[int, dict], steps: list[int]) -> list[tuple]:
    """Per step: candidates, fallbacks, layers ready, re-promotions."""
    out = []
    for step in steps:
        table = tables[step]
        wanted = core.candidates(step, table)
        fallen = [f.layer for f in core.decide(step, wanted, table).fallbacks]
        ready = core.ready(step, table)
        back = [r.layer for r in core.repromote(step, ready, table)]
        out.append((step, wanted, fallen, ready, back))
    return out


def _resumed_after_each_step(config: GuardConfig, tables: dict[int, dict]) -> list[tuple]:
    """Reference (a run that never stops) and, after each step, a checkpointed-and-resumed
    run's decisions at the steps left."""
    flops, steps = {"a": 0.05, "b": 0.05}, sorted(tables)
    reference = _decisions(GuardCore(config, flops), tables, steps)
    for cut in range(1, len(steps)):
        first = GuardCore(config, flops)
        _decisions(first, tables, steps[:cut])
        resumed = GuardCore(config, flops)
        resumed.load_state_dict(yaml.safe_load(yaml.safe_dump(first.state_dict())))
        assert _decisions(resumed, tables, steps[cut:]) == reference[cut:], steps[cut - 1]
    return reference


@pytest.mark.parametrize("b_too", [False, True], ids=["a_alone", "every_layer"])
def test_a_resume_keeps_the_bad_streak_of_a_layer_unjudged_at_the_last_steps(b_too):
    """`a` is flagged at 0 and 2, holds NaN at 4 and 6 (not judged: its streak neither grows
    nor resets), flagged at 8: its third bad judged step in a row, so it falls back at 8
    (consecutive 3). A checkpoint after 6 kept only the last 3 steps (2, 4, 6), in which `a`
    had one row: the resumed run's streak was 2 at 8 and `a` stayed in FP8. Also where every
    layer holds NaN at 4 and 6 (nothing judged there)."""
    nan = {**HEALTHY, "nan_count": 4.0}
    rows = {0: UNDERFLOWING, 2: UNDERFLOWING, 4: nan, 6: nan, 8: UNDERFLOWING}
    tables = {step: {("a", "weight"): dict(row),
                     ("b", "weight"): dict(nan if b_too and row is nan else HEALTHY)}
              for step, row in rows.items()}
    reference = _resumed_after_each_step(GuardConfig(consecutive=3, max_fallback_share=1.0),
                                         tables)
    assert [(step, fallen) for step, _, fallen, _, _ in reference if fallen] == [(8, ["a"])]


@pytest.mark.parametrize("b_too", [False, True], ids=["a_alone", "every_layer"])
def test_a_resume_keeps_the_healthy_streak_of_a_layer_unjudged_at_the_last_steps(b_too):
    """`a` falls back at 0; its what-if rows are healthy at 2 and 4, hold NaN at 6 and 8 (not
    judged), healthy at 10: the third healthy judged step in a row, so it is re-promoted at 10
    (repromote_after 3). A checkpoint after 8 kept only steps 4, 6, 8: the resumed good streak
    was 2 at 10 and `a` stayed in high precision."""
    nan = {**HEALTHY, "nan_count": 4.0}
    rows = {0: UNDERFLOWING, 2: HEALTHY, 4: HEALTHY, 6: nan, 8: nan, 10: HEALTHY, 12: HEALTHY}
    tables = {step: {("a", "weight"): dict(row),
                     ("b", "weight"): dict(nan if b_too and row is nan else HEALTHY)}
              for step, row in rows.items()}
    config = GuardConfig(consecutive=1, repromote_after=3, max_fallback_share=1.0)
    reference = _resumed_after_each_step(config, tables)
    assert [(step, fallen, back) for step, _, fallen, _, back in reference
            if fallen or back] == [(0, ["a"], []), (10, [], ["a"])]


def test_past_the_budget_the_smallest_candidates_fall_back_first_ties_in_model_order():
    """`flops` comes in model order (the model's FP8 modules): the two small layers take half
    the FP8 FLOPs, within the budget; the large one alone would too, but not with either."""
    core = GuardCore(GuardConfig(consecutive=1, max_fallback_share=0.5),
                     {"blocks.2.small": 0.05, "blocks.10.small": 0.05, "blocks.1.large": 0.1})
    verdict = core.decide(4, ["blocks.1.large", "blocks.10.small", "blocks.2.small"], {})
    assert [f.layer for f in verdict.fallbacks] == ["blocks.2.small", "blocks.10.small"]
    assert verdict.refused == ["blocks.1.large"]


def test_the_streak_is_one_tensor_bad_in_a_row_rising_gradient_underflow_included():
    """health's streak is the guard's count: a layer whose bad tensor alternates moves nothing;
    a gradient whose underflow doubles below the limit, then crosses it, is bad twice."""
    core = GuardCore(GuardConfig(consecutive=2), {"a": 0.05, "b": 0.05})
    rows = [{("a", "activation"): UNDERFLOWING}, {("a", "weight"): UNDERFLOWING},
            {("b", "gradient"): {**HEALTHY, "underflow_pct": 0.6}},
            {("b", "gradient"): {**HEALTHY, "underflow_pct": 1.5}},
            {("b", "gradient"): {**HEALTHY, "underflow_pct": 6.0}}]
    seen = []
    for step, bad in enumerate(rows):
        table = {(layer, tensor): dict(HEALTHY) for layer in ("a", "b")
                 for tensor in ("activation", "weight", "gradient")}
        seen.append(core.candidates(step, {**table, **bad}))
    assert seen == [[], [], [], [], ["b"]]
    assert [f.rule for f in core._flags["b"]] == ["underflow"]
    assert core._tracker.streak("b", "gradient") == 2


def test_resume_mid_streak_decides_at_the_same_step():
    config = GuardConfig(consecutive=3)
    flops = {"a": 0.05, "b": 0.05}
    tables = [_table({"a"} if step >= 2 else set(), ("a", "b")) for step in range(6)]
    straight = GuardCore(config, flops)
    decided = [straight.candidates(step, t) for step, t in enumerate(tables)]
    assert decided == [[], [], [], [], ["a"], ["a"]]
    first = GuardCore(config, flops)
    for step in range(3):  # stop after two bad steps
        first.candidates(step, tables[step])
    saved = first.state_dict()
    assert yaml.safe_load(yaml.safe_dump(saved)) is not None  # plain data
    resumed = GuardCore(config, flops)
    resumed.load_state_dict(saved)
    assert [resumed.candidates(step, tables[step]) for step in range(3, 6)] == decided[3:]


#: `a` is bad at steps 0-2 and 6-7 of 8, `b` never
REPROMOTION_TABLES = [_table({"a"} if step in (0, 1, 2, 6, 7) else set(), ("a", "b"))
                      for step in range(8)]
REPROMOTION_FLOPS = {"a": 0.05, "b": 0.05}


def repromotion_run(core: GuardCore, steps: range) -> list[tuple[list[str], list[str]]]:
    """`core`'s fallbacks and re-promotions at `steps` of REPROMOTION_TABLES."""
    out = []
    for step in steps:
        table = REPROMOTION_TABLES[step]
        fallen = [f.layer for f in core.decide(step, core.candidates(step, table),
                                               table).fallbacks]
        back = [r.layer for r in core.repromote(step, core.ready(step, table), table)]
        out.append((fallen, back))
    return out


def test_repromotion_after_healthy_what_if_steps_and_any_resume_decides_the_same():
    """`a` is bad at steps 0-2 and 6-7: it falls back at 1 (2 bad steps), its what-if rows are
    healthy at 3-5 so it is back in FP8 from 6 (repromote_after 3) with fresh streaks, and falls
    back again at 7. A resume after any step takes the same decisions."""
    config = GuardConfig(consecutive=2, repromote_after=3, max_fallback_share=0.5)
    flops, run = REPROMOTION_FLOPS, repromotion_run
    straight = GuardCore(config, flops)
    decided = run(straight, range(8))
    assert decided == [([], []), (["a"], []), ([], []), ([], []), ([], []), ([], ["a"]),
                       ([], []), (["a"], [])]
    (repromoted,) = straight.repromotions
    assert (repromoted.step, repromoted.fallen_at, repromoted.healthy_steps) == (5, 1, 3)
    assert repromoted.numbers["activation/underflow_pct"] == 0.0  # the what-if row at step 5
    assert sorted(straight.records()) == ["fp8/guard/fallback/a", "fp8/guard/fallback/a.ba7",
                                          "fp8/guard/repromotion/a"]
    assert straight.records()["fp8/guard/fallback/a"]["step"] == 1
    for cut in range(1, 8):
        first = GuardCore(config, flops)
        run(first, range(cut))
        resumed = GuardCore(config, flops)
        resumed.load_state_dict(yaml.safe_load(yaml.safe_dump(first.state_dict())))
        assert run(resumed, range(cut, 8)) == decided[cut:], cut
        assert resumed.records() == straight.records()
    off = GuardCore(GuardConfig(consecutive=2, max_fallback_share=0.5), flops)
    assert [back for _, back in run(off, range(8))] == [[]] * 8  # default: never


def test_fallbacks_survive_the_state_dict():
    config = GuardConfig(consecutive=1, max_fallback_share=0.5)
    core = GuardCore(config, {"a": 0.05, "b": 0.05})
    core.decide(4, core.candidates(4, _table({"a"}, ("a", "b"))), _table({"a"}, ("a", "b")))
    resumed = GuardCore(config, {"a": 0.05, "b": 0.05})
    resumed.load_state_dict(core.state_dict())
    assert resumed.fallbacks == core.fallbacks and resumed.fp8_flops_share == pytest.approx(0.05)
    assert "| a | 5 | the end | 5.0 % |" in render_fallbacks(resumed.fallbacks.values(), 0.05)


def test_a_logged_fallback_record_equals_itself_read_back():
    """W&B and MLflow refuse a hyperparameter logged again (on resume) with an unequal value:
    the record survives JSON unchanged, NaN included, and reads back as the fallback."""
    import json
    import math

    from foundry_fp8.guard import Fallback

    fallback = Fallback("blocks.1.x", 8, 0.03, ("why",), {"activation/cos_sim": float("nan"),
                                                          "activation/underflow_pct": 21.9},
                        ("activation underflow_pct 21.9 % (> 5 %)",))
    record = fallback.record()
    assert json.loads(json.dumps(record)) == record
    back = Fallback.from_dict(json.loads(json.dumps(record)))
    assert math.isnan(back.numbers.pop("activation/cos_sim"))
    assert back == Fallback("blocks.1.x", 8, 0.03, ("why",), {"activation/underflow_pct": 21.9},
                            ("activation underflow_pct 21.9 % (> 5 %)",))


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.Module()
        self.attn.Wqkv, self.attn.out_proj = nn.Linear(16, 48), nn.Linear(16, 16)


class _Model(nn.Module):
    """LLM-Foundry's module names: `model.transformer.blocks.<i>....`."""

    def __init__(self):
        super().__init__()
        self.model = nn.Module()
        self.model.transformer = nn.Module()
        self.model.transformer.blocks = nn.ModuleList([_Block(), _Block()])


def test_static_yaml_makes_te_swap_keep_exactly_those_layers():
    layers = ["blocks.1.attn.out_proj"]
    text = static_yaml(layers, existing=r"blocks\.0\.attn\.Wqkv")
    options = om.to_container(om.create(yaml.safe_load(text)))["algorithms"]["te_swap"]
    plan = plan_swap(_Model(), SwapConfig(backend="emulate", **options))
    kept = {d.name for d in plan.decisions if not d.convert}
    assert kept == {"model.transformer.blocks.1.attn.out_proj",
                    "model.transformer.blocks.0.attn.Wqkv"}
    assert re.search(exclude_regex(["blocks.1.attn.out_proj"]), "blocks.11.attn.out_proj") is None


def test_without_te_swap_flops_shares_are_of_the_models_linear_gemms():
    """The count te_swap's plan uses (`swap.linear_flops`); a real run with te_swap, a TE module
    and a tied head: tests/test_guard_flops.py."""
    model = _Model()
    layers = {"blocks.1.attn.out_proj": model.model.transformer.blocks[1].attn.out_proj}
    # 16x16 of (2 x (16x48 + 16x16)) multiply-adds
    assert layer_flops(model, layers, None) == {"blocks.1.attn.out_proj": 256 / 2048}


def _emulated_pair() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(EmulatedFP8Linear(16, 16), EmulatedFP8Linear(16, 16))
    with torch.no_grad():
        model[0].weight[:, 0] *= 1e-3  # values FP8 cannot hold exactly
    return model


def test_a_fallen_back_layer_computes_exactly_in_high_precision_and_keeps_its_state():
    model = _emulated_pair()
    x = torch.randn(4, 16, requires_grad=True)
    recipe = FP8Recipe(scaling="delayed", amax_history_len=4)
    with fp8_autocast(recipe=recipe):  # the first FP8 forward sizes both layers' state
        model(x).sum().backward()
    before = [read_fp8_meta(m) for m in model]
    handles = high_precision_hooks(model[0])
    model.zero_grad()
    with fp8_autocast(recipe=recipe):
        hidden = model[0](x)
        out = model[1](hidden)
    hidden.retain_grad()
    out.sum().backward()
    reference = nn.functional.linear(x, model[0].weight, model[0].bias)
    assert torch.equal(hidden, reference)  # no FP8 rounding in layer 0's forward
    # nor in its backward: torch's own linear backward of the same output gradient
    reference.backward(hidden.grad)
    weight_grad = model[0].weight.grad.clone()
    model[0].weight.grad = None
    reference = nn.functional.linear(x, model[0].weight, model[0].bias)
    reference.backward(hidden.grad)
    assert torch.equal(weight_grad, 2 * model[0].weight.grad)
    after = [read_fp8_meta(m) for m in model]
    for key in before[0]:  # layer 0 recorded nothing and updated nothing
        assert torch.equal(before[0][key], after[0][key]), key
    assert not torch.equal(before[1]["fwd_amax_history"], after[1]["fwd_amax_history"])
    assert not torch.equal(out, nn.functional.linear(hidden, model[1].weight, model[1].bias))
    for handle in handles:
        handle.remove()
    with fp8_autocast(recipe=recipe):
        assert not torch.equal(model[0](x), reference)  # FP8 again without the hooks


@pytest.mark.parametrize("nested_off", [False, True])
def test_a_fallback_forward_leaves_the_runs_most_recent_algorithm_in_force(nested_off):
    # TE updates each amax buffer with the recipe last entered under its text, which leaves
    # out amax_compute_algo (quantization.py:714-727, 743-746, 675): a fallback region entered
    # with TE's default recipe (max) made a most_recent run's next update take the max, also
    # where the fallback ran in a nested region with FP8 off.
    recipe = FP8Recipe(scaling="delayed", amax_history_len=1024, amax_compute_algo="most_recent")
    fp8_layer, fallback = EmulatedFP8Linear(16, 16), EmulatedFP8Linear(16, 16)
    with fp8_autocast(recipe=recipe):  # a large amax, then only small ones
        fp8_layer(100 * torch.randn(16, 16))
        fallback(torch.randn(16, 16))
    high_precision_hooks(fallback)
    with fp8_autocast(recipe=recipe):
        fp8_layer(torch.ones(16, 16))
        with fp8_autocast(enabled=False, recipe=recipe) if nested_off else nullcontext():
            fallback(torch.ones(16, 16))
    # most_recent, margin 0: scale = E4M3's max (448) / the amax just recorded
    weight_amax = fp8_layer.weight.detach().abs().max()
    expected = torch.stack([torch.tensor(448.0), 448.0 / weight_amax])
    assert torch.allclose(fp8_layer.fp8_meta["scaling_fwd"].scale[:2], expected, rtol=1e-6)


def test_the_region_is_left_when_the_forward_raises():
    model = _emulated_pair()
    high_precision_hooks(model[0])
    with fp8_autocast(recipe=FP8Recipe()), pytest.raises(RuntimeError):
        model[0](torch.randn(4, 3))  # wrong shape
    with fp8_autocast(recipe=FP8Recipe()):
        x = torch.randn(4, 16)
        assert not torch.equal(model[1](x), nn.functional.linear(x, model[1].weight,
                                                                 model[1].bias))


def _loop(guard: FP8Guard, steps: int = 10, log_hyperparameters: Any = None) -> list[str]:
    """fp8_stats (every 2 batches) and `guard` over an emulated 2-layer model whose last layer
    gets an outlier channel from batch 4 (a mean loss keeps the gradients, and so the first
    layer, unaffected), then FIT_END; returns the guard's warnings."""
    import logging
    import types

    from composer.core import Event
    from composer.devices import DeviceCPU

    from foundry_fp8.composer.stats import FP8Stats
    from foundry_fp8.fault import InjectOutlier

    torch.manual_seed(0)
    model = nn.Sequential(EmulatedFP8Linear(32, 32), nn.GELU(), EmulatedFP8Linear(32, 32))
    callbacks = [FP8Stats(interval=2), guard, InjectOutlier("2", start=4)]
    state = types.SimpleNamespace(model=model, run_name="run", callbacks=callbacks,
                                  algorithms=[], device=DeviceCPU(),
                                  precision=types.SimpleNamespace(value="fp32"),
                                  timestamp=types.SimpleNamespace(batch=0))
    hyperparameters = log_hyperparameters or (lambda *a, **k: None)

    class Destination:  # one logger destination: the callbacks log to each on its own
        log_metrics = log_images = log_table = staticmethod(lambda *a, **k: None)
        log_hyperparameters = staticmethod(hyperparameters)

    logger = types.SimpleNamespace(destinations=[Destination()])
    warnings: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    watched = [logging.getLogger(f"foundry_fp8.composer.{name}")
               for name in ("guard", "destinations")]
    for watching in watched:
        watching.addHandler(handler)
    try:
        for callback in callbacks:
            callback.run_event(Event.FIT_START, state, logger)
        for batch in range(steps):
            state.timestamp.batch = batch
            for callback in callbacks:
                callback.run_event(Event.BATCH_START, state, logger)
            with fp8_autocast(recipe=FP8Recipe(scaling="delayed", amax_history_len=4)):
                model(torch.randn(256, 32)).mean().backward()
            state.timestamp.batch = batch + 1
            for event in (Event.AFTER_TRAIN_BATCH, Event.BATCH_END, Event.BATCH_CHECKPOINT):
                for callback in callbacks:
                    callback.run_event(event, state, logger)
        for callback in callbacks:
            callback.run_event(Event.FIT_END, state, logger)
    finally:
        for watching in watched:
            watching.removeHandler(handler)
    return warnings


def test_past_the_budget_strict_stops_the_run_and_otherwise_warns_once():
    with pytest.raises(RuntimeError, match=r"^fp8_guard: at step 6, 2 would also fall back, "
                                           r"putting 50\.0 % of the FP8 FLOPs"):
        _loop(FP8Guard(consecutive=2, strict=True))
    guard = FP8Guard(consecutive=2)
    warnings = _loop(guard)
    assert guard.core.fallbacks == {}
    assert [w for w in warnings if "max_fallback_share" in w] == [warnings[0]]
    assert "stays in FP8" in warnings[0]


def test_a_logger_refusing_the_records_neither_stops_the_guard_nor_the_run():
    """W&B refuses a changed config value on a resumed run; the fallback records and the fit-end
    table are hyperparameters, so a refusal must be reported, not crash the run."""
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise ValueError("Attempted to change value of key")

    guard = FP8Guard(consecutive=2, max_fallback_share=0.6)
    warnings = _loop(guard, log_hyperparameters=refuse)
    assert list(guard.core.fallbacks) == ["2"]
    assert not guard.disabled
    assert sum("the logger Destination failed to log hyperparameters (ValueError: Attempted to "
               "change value of key)" in w for w in warnings) == 1  # once per logger and kind
    with pytest.raises(ValueError, match="change value"):
        _loop(FP8Guard(consecutive=2, max_fallback_share=0.6, strict=True),
              log_hyperparameters=refuse)


def test_the_guard_needs_fp8_stats():
    import types

    state = types.SimpleNamespace(callbacks=[FP8Guard()])
    with pytest.raises(ValueError, match=r"^callbacks\.fp8_guard: needs callbacks\.fp8_stats"):
        FP8Guard().fit_start(state, None)


def test_the_linter_says_what_the_guard_raises_without_fp8_stats():
    """One fact, two readers: the callback's refusal at FIT_START and lint rule FP8033 read the
    entry's `needs` (foundry_fp8/options.py), so their words cannot drift apart."""
    import types

    from foundry_fp8.lint.rules import lint_config

    with pytest.raises(ValueError) as raised:
        FP8Guard().fit_start(types.SimpleNamespace(callbacks=[FP8Guard()]), None)
    detail, _, fix = str(raised.value).removeprefix("callbacks.fp8_guard: ").partition(" (fix: ")
    hit, = [f for f in lint_config({"callbacks": {"fp8_guard": {}}}) if f.rule == "FP8033"]
    assert hit.key == "callbacks.fp8_guard"
    assert hit.message.startswith(f"fp8_guard {detail}") and hit.fix == fix.removesuffix(")")
    assert not [f for f in lint_config({"callbacks": {"fp8_guard": {}, "fp8_stats": {}}})
                if f.rule == "FP8033"]


def test_the_injected_outlier_harms_fp8_only():
    """The fault the run tests use: in high precision the layer and its gradients are as
    without it up to float32 rounding of the 1e5-times channel (about 1 % of the output's
    largest value); in FP8 its output is off by more than that value."""
    import types

    from foundry_fp8.fault import InjectOutlier

    torch.manual_seed(0)
    layer = EmulatedFP8Linear(64, 64, bias=False)
    x = torch.randn(8, 16, 64, requires_grad=True)
    healthy = layer(x)
    (grad_x, grad_w) = torch.autograd.grad(healthy.square().sum(), (x, layer.weight))
    fault = InjectOutlier("", start=0)
    fault.fit_start(types.SimpleNamespace(model=layer), None)
    faulty = layer(x)
    (fault_x, fault_w) = torch.autograd.grad(faulty.square().sum(), (x, layer.weight))
    scale = healthy.abs().max()
    assert (faulty - healthy).abs().max() < 2e-2 * scale
    assert (fault_x - grad_x).abs().max() < 2e-2 * grad_x.abs().max()
    assert (fault_w - grad_w).abs().max() < 2e-2 * grad_w.abs().max()
    with fp8_autocast(recipe=FP8Recipe(scaling="delayed", amax_history_len=4)):
        layer(x)  # the first FP8 forward sizes the scale for the outlier
        in_fp8 = layer(x)
    assert (in_fp8 - healthy).abs().max() > scale


def test_the_decision_core_imports_no_torch():
    import subprocess
    import sys

    code = "import sys, foundry_fp8.guard; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_a_layer_flipping_all_run_keeps_bounded_records_and_the_report_counts_the_older():
    """Bad 2 logging steps, healthy 3, over and over: `a` falls back at 5c+1 and is back in FP8
    at 5c+4 (consecutive 2, repromote_after 3). Each pair grew the checkpoint and the records by
    ~1.4 kB; past KEPT_DECISIONS pairs the older are counted in the checkpoint, and only the
    first pairs and the summaries at 1, 2, 4, ... pairs are logged: hparams.json keeps every key
    logged. The report takes every span from the series `IN_FALLBACK_PREFIX<layer>`."""
    import json

    from foundry_fp8.guard import FALLBACK_LAYERS, IN_FALLBACK_PREFIX, KEPT_DECISIONS
    from foundry_fp8.report.markdown import guard_section
    from foundry_fp8.report.read import guard_run

    cycles = 3 * KEPT_DECISIONS
    config = GuardConfig(consecutive=2, repromote_after=3, max_fallback_share=0.5)
    core = GuardCore(config, REPROMOTION_FLOPS)
    hparams: dict[str, Any] = {"callbacks": {"fp8_stats": {}, "fp8_guard": {}}}
    series: dict[int, dict[str, float]] = {}
    for step in range(5 * cycles + 2):  # ends one fallback into the next cycle
        table = _table({"a"} if step % 5 < 2 else set(), ("a", "b"))
        core.decide(step, core.candidates(step, table), table)
        core.repromote(step, core.ready(step, table), table)
        hparams.update(core.records())  # hparams.json keeps every key logged
        series[step] = {FALLBACK_LAYERS: float(len(core.fallbacks)), **core.in_fallback()}
    state = json.loads(json.dumps(core.state_dict()))
    assert (len(state["ended"]), len(state["repromotions"])) == (KEPT_DECISIONS, KEPT_DECISIONS)
    assert state["summaries"] == [{"layer": "a", "step": 5 * (cycles - KEPT_DECISIONS) - 1,
                                   "pairs": cycles - KEPT_DECISIONS, "first_step": 1}]
    assert list(core.records()) == [f"fp8/guard/summary/a.ba{5 * (cycles - KEPT_DECISIONS) - 1}"]
    # the first pairs whole, the summaries at 1, 2, 4, 8 pairs
    assert len(hparams) - 1 == 2 * KEPT_DECISIONS + 4
    assert series[5 * cycles + 1][IN_FALLBACK_PREFIX + "a"] == 1.0
    resumed = GuardCore(config, REPROMOTION_FLOPS)
    resumed.load_state_dict(state)
    assert list(resumed.fallbacks) == ["a"] and resumed.fallbacks["a"].step == 5 * cycles + 1
    guard = guard_run(series, hparams, Path("hparams.json"), pytest.fail)
    assert guard is not None and guard.kept == ["a"] and guard.summaries == ()
    assert [f.step for f in guard.fallbacks] == [5 * c + 1 for c in range(cycles + 1)]
    assert [(start, end) for _, start, end in guard.spans()] == [
        (5 * c + 1, 5 * c + 4) for c in range(cycles)] + [(5 * cycles + 1, None)]
    assert f"in {cycles + 1} fallbacks" in "\n".join(guard_section(guard, {"a": "a"}))
    # without the series (a logger that lost it): the records and the latest summary logged
    guard = guard_run({}, hparams, Path("config.yaml"), pytest.fail)
    assert guard is not None and len(guard.fallbacks) == KEPT_DECISIONS
    text = "\n".join(guard_section(guard, {"a": "a"}))
    assert "fp8/guard/summary/" in text and "8 fallback/re-promotion pair(s)" in text


def test_guard_records_after_reset_time_keep_their_keys_and_the_report_counts_every_fallback():
    """A layer flipping in two fits, the second with `reset_time` (steps from 0 again): a fold
    gave a new record a key an older, folded one had held, or moved `<key>.2` back to `<key>`
    (W&B and MLflow refuse a changed value). The second fit's spans, which no record holds
    (past the first KEPT_DECISIONS pairs), come from its series."""
    from foundry_fp8.guard import FALLBACK_LAYERS
    config = GuardConfig(consecutive=2, repromote_after=3, max_fallback_share=0.5)
    core = GuardCore(config, REPROMOTION_FLOPS)
    logged: dict[str, Any] = {}
    changed = []
    fell = 0
    series: dict[int, dict[str, float]] = {}
    for fit, steps in ((1, range(5 * 6 + 2)), (2, range(5 * 3 + 2))):
        series.clear()  # the report keeps the later fit's steps (`_attempts`)
        for step in steps:
            table = {k: {**v, "fit": float(fit)}
                     for k, v in _table({"a"} if step % 5 < 2 else set(), ("a", "b")).items()}
            fell += len(core.decide(step, core.candidates(step, table), table).fallbacks)
            core.repromote(step, core.ready(step, table), table)
            for key, value in core.records().items():
                if logged.setdefault(key, value) != value:
                    changed.append(key)
            series[step] = {FALLBACK_LAYERS: float(len(core.fallbacks)), **core.in_fallback()}
    assert changed == []
    assert fell == 7 + 3  # each fit's 5c+1 steps
    from foundry_fp8.report.read import guard_run
    guard = guard_run(series, {"callbacks": {"fp8_guard": {}}, **logged}, Path("hparams.json"),
                      pytest.fail, since=0)
    assert guard is not None and guard.kept == ["a"]
    # the second fit's spans: in fallback from its first step (the first fit's), then its own
    assert [(start, end) for _, start, end in guard.spans()] == [
        (-1, 4), (6, 9), (11, 14), (16, None)]
