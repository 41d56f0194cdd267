"""The scale FP8Monitor reports is the one each tensor was cast with: the real delayed scale of
EmulatedFP8Linear (read before the cast, not after TE-style updates) and the `recipe` what-if of
plain nn.Linear, both checked against a float64 hand replay of delayed scaling."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from foundry_fp8.emulate import EmulatedFP8Linear, fp8_autocast, fp8_checkpoint
from foundry_fp8.health import layer_key
from foundry_fp8.monitor import FP8Monitor, MonitorConfig, Schedule
from foundry_fp8.numerics import quantize_dequantize, tensor_stats
from foundry_fp8.recipe import FP8Recipe

E4M3_MAX, E5M2_MAX, INF = 448.0, 57344.0, float("inf")
X_AMAX = [1.0, 8.0, 0.25, 2.0, 0.5, 4.0]  # powers of 2: every hand-computed scale is exact
G_AMAX = [4.0, 0.5, 64.0, 1.0, 2.0, 0.125]
W_AMAX = 0.5


def _unit(*shape: int, seed: int) -> torch.Tensor:
    """Random values whose largest magnitude is exactly 1."""
    t = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    return t / t.abs().max()


def _delayed(amaxes: list[float], t: int, history: int, fp8_max: float, margin: int = 0) -> float:
    """Hand replay of delayed scaling from a fresh state: step t casts with the max of the
    `history` amaxes before it (TE's max algorithm), 1 before any amax exists."""
    window = amaxes[max(0, t - history):t]
    return fp8_max / max(window) / 2.0 ** margin if window else 1.0


def _emulated_model() -> nn.Sequential:
    layer = EmulatedFP8Linear(8, 4, bias=False)
    with torch.no_grad():
        layer.weight.copy_(_unit(4, 8, seed=2) * W_AMAX)
    return nn.Sequential(layer)


def _check_stats(metrics: dict, tensor: str, x: torch.Tensor, fmt: str, scale: float) -> None:
    want = tensor_stats(x, fmt, scale=scale)
    for key, value in want.items():
        assert metrics[layer_key(key, tensor, "0")] == pytest.approx(value, rel=1e-9, abs=1e-30), key


@pytest.mark.parametrize("checkpointed", [False, True])
def test_delayed_scale_is_the_one_in_force_at_cast_time(checkpointed):
    model = _emulated_model()
    layer = model[0]
    recipe = FP8Recipe(amax_history_len=2)
    monitor = FP8Monitor(model, MonitorConfig())
    base, gbase = _unit(16, 8, seed=0), _unit(16, 4, seed=1)
    for t, (a, b) in enumerate(zip(X_AMAX, G_AMAX, strict=True)):
        x, g = base * a, gbase * b
        monitor.start_step()
        with fp8_autocast(recipe=recipe):
            out = fp8_checkpoint(model, x) if checkpointed else model(x)
        read_after_forward = layer.fp8_meta["scaling_fwd"].scale[0].item()
        (out * g).sum().backward()
        metrics = monitor.finish_step()

        x_scale, g_scale = _delayed(X_AMAX, t, 2, E4M3_MAX), _delayed(G_AMAX, t, 2, E5M2_MAX)
        w_scale = 1.0 if t == 0 else E4M3_MAX / W_AMAX
        assert metrics[layer_key("scale", "activation", "0")] == x_scale
        assert metrics[layer_key("scale", "weight", "0")] == w_scale
        assert metrics[layer_key("scale", "gradient", "0")] == g_scale
        # ... which is what the layer really cast with: its output is the GEMM of those casts
        q = nn.functional.linear(quantize_dequantize(x, x_scale, "e4m3"),
                                 quantize_dequantize(layer.weight.detach(), w_scale, "e4m3"))
        assert torch.equal(out.detach(), q)
        # ... and not what the layer's state holds after the forward (already next step's)
        assert read_after_forward == E4M3_MAX / max(X_AMAX[max(0, t - 1):t + 1])
        if t in (0, 1, 3, 5):  # the amax moved, so the post-update scale is a different number
            assert read_after_forward != metrics[layer_key("scale", "activation", "0")]
        _check_stats(metrics, "activation", x, "e4m3", x_scale)
        _check_stats(metrics, "gradient", g, "e5m2", g_scale)
        assert metrics[layer_key("current_scale", "activation", "0")] == E4M3_MAX / a
        assert metrics[layer_key("scale_ratio", "activation", "0")] == pytest.approx(x_scale * a / E4M3_MAX)
        assert metrics[layer_key("scale_ratio", "gradient", "0")] == pytest.approx(g_scale * b / E5M2_MAX)
    assert metrics[layer_key("overflow_pct", "activation", "0")] > 0  # step 5: amax 4 cast with 448 / 2


def test_the_initial_delayed_scale_is_logged_but_neither_warned_about_nor_summarised():
    model = _emulated_model()
    warned: list[str] = []
    monitor = FP8Monitor(model, MonitorConfig(), on_warning=warned.append)
    logged = []
    for amax in (1e-4, 1e-4, 1e-2):  # scale 1 underflows everything; then 448/1e-4 overflows
        monitor.start_step()
        with fp8_autocast(recipe=FP8Recipe(amax_history_len=1)):
            model(_unit(16, 8, seed=0) * amax).sum().backward()
        logged.append(monitor.finish_step())
    assert logged[0][layer_key("underflow_pct", "activation", "0")] == 100.0  # logged as it happened
    assert logged[0][layer_key("initial_scale", "activation", "0")] == 1.0  # and marked for the report
    # the first backward casts with the initial scale too, though the forward sized the history
    assert logged[0][layer_key("initial_scale", "gradient", "0")] == 1.0
    assert not any(k.startswith("fp8_initial_scale/") for k in logged[1])
    assert logged[1][layer_key("underflow_pct", "activation", "0")] == 0.0
    assert logged[2][layer_key("overflow_pct", "activation", "0")] > 0
    assert [w for w in warned if "activation" in w] == [
        w for w in warned if "overflow" in w and "activation" in w]  # the step-2 warning only
    assert len([w for w in warned if "activation" in w]) == 1
    assert monitor.tracker.worst[("0", "activation")]["underflow_pct"] == 0.0  # step 0 left out


def test_current_scaling_module_reports_the_current_scale():
    model = _emulated_model()
    monitor = FP8Monitor(model, MonitorConfig())
    x = _unit(16, 8, seed=0) * 8.0
    for _ in range(2):
        monitor.start_step()
        with fp8_autocast(recipe=FP8Recipe(scaling="current")):
            model(x).sum().backward()
        metrics = monitor.finish_step()
        assert metrics[layer_key("scale", "activation", "0")] == E4M3_MAX / 8.0
        assert metrics[layer_key("scale_ratio", "activation", "0")] == 1.0


def _plain_model() -> nn.Sequential:
    model = nn.Sequential(nn.Linear(8, 4, bias=False))
    with torch.no_grad():
        model[0].weight.copy_(_unit(4, 8, seed=2) * W_AMAX)
    return model


def _run_whatif(recipe: dict, schedule: Schedule, steps: int, x_amax: list[float],
                g_amax: list[float]) -> tuple[list[bool], dict[int, dict]]:
    model = _plain_model()
    monitor = FP8Monitor(model, MonitorConfig(recipe=recipe), schedule=schedule)
    base, gbase = _unit(16, 8, seed=0), _unit(16, 4, seed=1)
    armed, logged = [], {}
    for t in range(steps):
        armed.append(monitor.start_step(t))
        hooks = bool(model[0]._forward_pre_hooks) or bool(model[0]._backward_pre_hooks)
        assert hooks == armed[-1]
        (model(base * x_amax[t]) * (gbase * g_amax[t])).sum().backward()
        metrics = monitor.finish_step()
        if metrics:
            logged[t] = metrics
        assert not model[0]._forward_pre_hooks and not model[0]._backward_pre_hooks
    return armed, logged


def test_whatif_delayed_records_only_the_window_before_each_logging_step():
    x_amax = [1.0, 2.0, 8.0, 0.5, 0.25, 4.0, 16.0, 0.5, 2.0, 1.0, 0.125]
    g_amax = [2.0, 1.0, 0.5, 32.0, 4.0, 1.0, 0.25, 8.0, 0.5, 2.0, 1.0]
    recipe = {"scaling": "delayed", "amax_history_len": 3, "margin": 1}
    armed, logged = _run_whatif(recipe, Schedule(interval=5), 11, x_amax, g_amax)
    # log at 0, 5, 10; amax-only recording in the 3 batches before 5 and before 10
    assert [t for t, a in enumerate(armed) if a] == [0, 2, 3, 4, 5, 7, 8, 9, 10]
    assert sorted(logged) == [0, 5, 10]
    assert logged[0][layer_key("scale", "activation", "0")] == 1.0  # a fresh delayed state, as TE starts
    for t in (5, 10):
        x_scale = _delayed(x_amax, t, 3, E4M3_MAX, margin=1)
        g_scale = _delayed(g_amax, t, 3, E5M2_MAX, margin=1)
        assert logged[t][layer_key("scale", "activation", "0")] == x_scale
        assert logged[t][layer_key("scale", "gradient", "0")] == g_scale
        assert logged[t][layer_key("scale", "weight", "0")] == E4M3_MAX / W_AMAX / 2
        _check_stats(logged[t], "activation", _unit(16, 8, seed=0) * x_amax[t], "e4m3",
                     x_scale)
        _check_stats(logged[t], "gradient", _unit(16, 4, seed=1) * g_amax[t], "e5m2",
                     g_scale)
    assert logged[10][layer_key("scale_ratio", "activation", "0")] == pytest.approx(
        _delayed(x_amax, 10, 3, E4M3_MAX, margin=1) * x_amax[10] / E4M3_MAX)
    # the spike at step 6 (16.0) is outside the window: nothing records it
    assert logged[10][layer_key("scale", "activation", "0")] == E4M3_MAX / 2.0 / 2


def test_whatif_delayed_is_continuous_when_the_window_covers_the_interval():
    x_amax = [1.0, 2.0, 8.0, 0.5, 0.25, 4.0, 16.0]
    g_amax = [2.0, 1.0, 0.5, 32.0, 4.0, 1.0, 0.25]
    recipe = {"scaling": "delayed", "amax_history_len": 3}
    armed, logged = _run_whatif(recipe, Schedule(interval=2), 7, x_amax, g_amax)
    assert all(armed)
    for t in (2, 4, 6):
        assert logged[t][layer_key("scale", "activation", "0")] == _delayed(x_amax, t, 3, E4M3_MAX)
        assert logged[t][layer_key("scale", "gradient", "0")] == _delayed(g_amax, t, 3, E5M2_MAX)
    recent, _ = _run_whatif({"scaling": "delayed", "amax_compute_algo": "most_recent"},
                            Schedule(interval=4), 5, x_amax, g_amax)
    assert [t for t, a in enumerate(recent) if a] == [0, 3, 4]  # most_recent needs one batch


def test_whatif_delayed_keeps_an_inf_amax_as_te_does():
    """TE's amax keeps an Inf (fmaxf), and its delayed update keeps the scale while the Inf is in
    the window: the what-if of a plain layer follows the emulated layer's real scales (bit-exact
    to TE's kernel, test_emulate_te) on the same inputs. It recorded the finite amax before, so
    after an Inf it reported scales TE would not have used."""
    recipe = {"scaling": "delayed", "amax_history_len": 2}
    plain, emulated = _plain_model(), _emulated_model()
    monitor = FP8Monitor(plain, MonitorConfig(recipe=recipe), schedule=Schedule(interval=1))
    base, gbase = _unit(16, 8, seed=0), _unit(16, 4, seed=1)
    logged, real = [], []
    for t, a in enumerate([1.0, 2.0, INF, 0.25, 0.5, 4.0]):
        x = base * (1.0 if a == INF else a)
        if a == INF:
            x[0, 0] = INF
        real.append(emulated[0].fp8_meta["scaling_fwd"].scale[0].item())  # in force at step t
        with fp8_autocast(recipe=FP8Recipe(**recipe)):
            out = emulated(x)
        (out * gbase).sum().backward()
        monitor.start_step(t)
        (plain(x) * gbase).sum().backward()
        logged.append(monitor.finish_step()[layer_key("scale", "activation", "0")])
    assert logged == real
    assert real[3] == real[4] == E4M3_MAX / 2.0  # kept while the Inf is in the window


@pytest.mark.parametrize("checkpointed", [False, True])
def test_a_nan_in_a_later_micro_batch_reaches_the_counts(checkpointed):
    """Gradient accumulation: the first micro-batch's tensors give the statistics and counts,
    but a NaN in micro-batch 3 of 4 must reach `nan_count` (it read 0 on the step whose loss was
    NaN): at least 1, from one cheap read of the later sightings, recomputes too."""
    model = _emulated_model()
    monitor = FP8Monitor(model, MonitorConfig())
    base, gbase = _unit(16, 8, seed=0), _unit(16, 4, seed=1)
    monitor.start_step()
    for micro in range(4):
        x = base.clone()
        if micro == 2:
            x[:3, 0] = float("nan")
        with fp8_autocast():
            out = fp8_checkpoint(model, x) if checkpointed else model(x)
        (out * gbase).sum().backward()
    metrics = monitor.finish_step()
    assert metrics[layer_key("nan_count", "activation", "0")] == 1.0
    assert metrics[layer_key("inf_count", "activation", "0")] == 0.0
    assert metrics[layer_key("nan_count", "gradient", "0")] == 0.0
    assert metrics[layer_key("nan_count", "weight", "0")] == 0.0
    first = tensor_stats(base, "e4m3", scale=1.0)  # the statistics: the first micro-batch's
    for key in ("amax", "mse", "cos_sim", "underflow_pct"):
        assert metrics[layer_key(key, "activation", "0")] == pytest.approx(first[key], rel=1e-9)


def test_a_gradient_that_is_always_zero_is_named_in_the_summary_as_never_judged():
    """A layer whose output does not reach the loss gets gradient 0: its delayed scale stays at
    the initial 1 (no amax recorded), so its row is never judged; it was missing from the
    summary with no word."""

    class TwoHeads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used, self.unused = _emulated_model()[0], _emulated_model()[0]

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.used(x) + 0.0 * self.unused(x)

    model = TwoHeads()
    monitor = FP8Monitor(model, MonitorConfig(), schedule=Schedule(interval=1))
    base, gbase = _unit(16, 8, seed=0), _unit(16, 4, seed=1)
    for t in range(3):
        monitor.start_step(t)
        with fp8_autocast():
            out = model(base)
        (out * gbase).sum().backward()
        monitor.finish_step()
    summary = monitor.summary()
    judged = {line.split(" | ")[0].strip("| ") + " " + line.split(" | ")[1]
              for line in summary.splitlines() if line.startswith("| ") and "---" not in line}
    assert {"used gradient", "unused activation", "unused weight"} <= judged
    assert "unused gradient" not in judged
    assert summary.rstrip().endswith("the gradient of a layer that does not reach the loss): "
                                     "unused gradient")


def test_current_recipe_never_records_and_has_ratio_one():
    armed, logged = _run_whatif({"scaling": "current"}, Schedule(interval=3), 4,
                                [1.0, 2.0, 4.0, 8.0], [1.0] * 4)
    assert armed == [True, False, False, True]
    assert logged[3][layer_key("scale", "activation", "0")] == E4M3_MAX / 8.0
    assert logged[3][layer_key("scale_ratio", "activation", "0")] == 1.0


def test_bad_recipe_names_the_key():
    with pytest.raises(ValueError, match=r"^callbacks\.fp8_stats\.recipe\.amax_history_len: "
                                         "must be an integer from 1 to"):
        MonitorConfig(recipe={"scaling": "delayed", "amax_history_len": 0})
    with pytest.raises(ValueError, match=r"^callbacks\.fp8_stats\.recipe: unknown scaling "
                                         "'sometimes'"):
        MonitorConfig(recipe="sometimes")
    with pytest.raises(ValueError, match=r"^callbacks\.fp8_stats\.recipe: unknown scaling "
                                         r"\['delayed'\]"):
        MonitorConfig(recipe=["delayed"])
    assert MonitorConfig(recipe=None).recipe.scaling == "current"
    assert MonitorConfig(recipe="delayed").recipe.scaling == "delayed"  # issue 12.5


@pytest.mark.parametrize("checkpointed", [False, True])
def test_with_micro_batch_boundaries_every_micro_batch_counts_and_a_recompute_once(checkpointed):
    """`next_microbatch` before each micro-batch's forward (fp8_stats calls it at Composer's
    BEFORE_FORWARD): the step's amax is the largest over the 4 micro-batches and the NaNs of
    micro-batch 3 are counted exactly, a recompute's second sighting not again. Reference: the
    micro-batches' own tensors, reduced with plain torch."""
    model = _emulated_model()
    monitor = FP8Monitor(model, MonitorConfig())
    base, gbase = _unit(16, 8, seed=0), _unit(16, 4, seed=1)
    inputs = [base * (1.0 + micro) for micro in range(4)]
    inputs[2][:3, 0] = float("nan")
    monitor.start_step()
    for x in inputs:
        monitor.next_microbatch()
        with fp8_autocast():
            out = fp8_checkpoint(model, x) if checkpointed else model(x)
        (out * gbase).sum().backward()
    metrics = monitor.finish_step()
    assert metrics[layer_key("amax", "activation", "0")] == \
        max(float(x.nan_to_num(0.0).abs().max()) for x in inputs) == 4.0
    assert metrics[layer_key("nan_count", "activation", "0")] == \
        sum(int(x.isnan().sum()) for x in inputs) == 3
    assert metrics[layer_key("amax", "weight", "0")] == float(model[0].weight.abs().max())
