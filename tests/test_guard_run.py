"""fp8_guard in real tiny LLM-Foundry runs (te_swap's emulated backend): one layer driven into
persistent FP8 trouble by an injected outlier channel falls back alone, at the step its health
rule says, the loss moves toward the run without FP8, and resumes reproduce the same run."""

from __future__ import annotations

from pathlib import Path
from statistics import mean

import pytest
import torch

from foundry_fp8.composer.guard import FALLBACK_LAYERS, FP8_FLOPS_SHARE, FP8Guard
from foundry_fp8.composer.state import fp8_state_from_checkpoint
from foundry_fp8.composer.stats import stats_table
from foundry_fp8.fault import InjectOutlier
from foundry_fp8.jsonl import read_jsonl
from tests.tiny_run import run_folder, tiny_config

LAYER = "blocks.1.attn.out_proj"
START, INTERVAL, CONSECUTIVE, END = 6, 2, 2, 20
STATS = {"fp8_stats": {"interval": INTERVAL}}
FAULT = {"guard_inject_outlier": {"layer": LAYER, "start": START}}
GUARD = {"fp8_guard": {"consecutive": CONSECUTIVE}}


def _run(tmp: Path, tiny_data, name: str, callbacks: dict, fp8: bool = True,
         load: str | None = None):
    from llmfoundry.command_utils import train

    overrides = {"variables": {"run_name": name}, "max_duration": f"{END}ba",
                 "eval_interval": "100ba", "save_interval": "4ba",
                 "callbacks": {**STATS, **callbacks}}
    if load:
        overrides["load_path"] = str(run_folder(tmp, load.split("/")[0]) / "checkpoints"
                                     / load.split("/")[1])
    cfg = tiny_config(tmp, tiny_data, overrides)
    if not fp8:
        del cfg.algorithms["te_swap"]
    (tmp / name).mkdir(parents=True, exist_ok=True)
    trainer = train(cfg)
    guard = next((c for c in trainer.state.callbacks if isinstance(c, FP8Guard)), None)
    metrics: dict[int, dict] = {}
    for step, values in read_jsonl(run_folder(tmp, name) / "metrics.jsonl"):
        metrics.setdefault(step, {}).update(values)
    return guard, metrics


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_data):
    from llmfoundry.registry import callbacks

    callbacks.register("guard_inject_outlier", func=InjectOutlier)
    tmp = tmp_path_factory.mktemp("guard")
    out = {
        "no_fp8": _run(tmp, tiny_data, "no_fp8", FAULT, fp8=False),
        "unguarded": _run(tmp, tiny_data, "unguarded", FAULT),
        "guarded": _run(tmp, tiny_data, "guarded", {**FAULT, **GUARD}),
        "healthy": _run(tmp, tiny_data, "healthy", GUARD),
    }
    step = out["guarded"][0].core.fallbacks[LAYER].step
    after, before = (4 * (step // 4 + 1), 4 * (step // 4))  # checkpoints around the fallback
    out["resumed_after"] = _run(tmp, tiny_data, "resumed_after", {**FAULT, **GUARD},
                                load=f"guarded/ep0-ba{after}-rank0.pt")
    out["resumed_before"] = _run(tmp, tiny_data, "resumed_before", {**FAULT, **GUARD},
                                 load=f"guarded/ep0-ba{before}-rank0.pt")
    out["tmp"] = tmp
    return out


def _losses(metrics: dict[int, dict]) -> dict[int, float]:
    return {s: m["loss/train/total"] for s, m in metrics.items() if "loss/train/total" in m}


def _bad_steps(metrics: dict[int, dict], layer: str, guard: FP8Guard) -> list[int]:
    """Logging steps at which one of the layer's tensors crossed a limit of the guard's."""
    c = guard.config
    bad = []
    for step, values in sorted(metrics.items()):
        rows = [stats for (name, _), stats in stats_table(values).items()
                if name.endswith(LAYER) and not stats.get("initial_scale")]
        if any(r["underflow_pct"] > c.max_underflow_pct or r["overflow_pct"] > c.max_overflow_pct
               or r["cos_sim"] < c.min_cos_sim or r["nan_count"] + r["inf_count"] > 0
               for r in rows):
            bad.append(step)
    return bad


@pytest.mark.slow
def test_exactly_the_faulty_layer_falls_back_when_its_rule_says(runs):
    guard, metrics = runs["guarded"]
    assert list(guard.core.fallbacks) == [LAYER]
    fallback = guard.core.fallbacks[LAYER]
    # from the unguarded run's numbers: the first logging step at which the layer has crossed a
    # limit at CONSECUTIVE logging steps in a row (the fault's first step is one of them)
    bad = _bad_steps(runs["unguarded"][1], LAYER, guard)
    assert bad[0] == START
    expected = next(s for s in bad
                    if all(s - INTERVAL * k in bad for k in range(CONSECUTIVE)))
    assert fallback.step == expected
    unguarded = stats_table(runs["unguarded"][1][expected])
    assert fallback.numbers["activation/underflow_pct"] == next(
        stats["underflow_pct"] for (name, tensor), stats in unguarded.items()
        if name.endswith(LAYER) and tensor == "activation")
    # the W&B series: 0 then 1 layer; the FP8 FLOPs share drops by out_proj's 64 x 64 GEMM
    # of the model's 2 x (64x192 + 64x64 + 64x256 + 256x64) + 64x512 (tied LM head)
    logged = {s: (m[FALLBACK_LAYERS], m[FP8_FLOPS_SHARE]) for s, m in metrics.items()
              if FALLBACK_LAYERS in m}
    total = 2 * (64 * 192 + 64 * 64 + 64 * 256 + 256 * 64) + 64 * 512
    for step, (layers, share) in logged.items():
        fallen = step >= fallback.step
        assert layers == float(fallen)
        assert share == pytest.approx((2 * 49152 - fallen * 64 * 64) / total)
    assert sorted(logged) == list(range(0, END, INTERVAL))  # batch indices 0..END-1


@pytest.mark.slow
def test_every_other_layer_stays_in_fp8(runs):
    """From the checkpoint after the fallback to the end, only the fallen layer's delayed
    scaling state stands still: every other FP8 layer keeps casting."""
    guard, _ = runs["guarded"]
    step = guard.core.fallbacks[LAYER].step
    folder = run_folder(runs["tmp"], "guarded") / "checkpoints"
    early = fp8_state_from_checkpoint(folder / f"ep0-ba{4 * (step // 4 + 1)}-rank0.pt")
    late = fp8_state_from_checkpoint(folder / f"ep0-ba{END}-rank0.pt")
    assert len(early) == 8
    frozen = {name for name in early
              if all(torch.equal(early[name][k], late[name][k]) for k in early[name])}
    assert frozen == {f"model.transformer.{LAYER}"}


@pytest.mark.slow
def test_the_loss_after_the_fallback_is_closer_to_the_run_without_fp8(runs):
    step = runs["guarded"][0].core.fallbacks[LAYER].step
    reference = _losses(runs["no_fp8"][1])
    guarded, unguarded = _losses(runs["guarded"][1]), _losses(runs["unguarded"][1])
    after = [s for s in reference if s > step + 1]
    assert len(after) >= 5
    gap_guarded = mean(abs(guarded[s] - reference[s]) for s in after)
    gap_unguarded = mean(abs(unguarded[s] - reference[s]) for s in after)
    assert gap_guarded < gap_unguarded, (gap_guarded, gap_unguarded, reference, guarded, unguarded)


@pytest.mark.slow
@pytest.mark.parametrize("resumed", ["resumed_after", "resumed_before"])
def test_a_resume_reproduces_the_decision_and_the_losses_bit_exact(runs, resumed):
    guard, metrics = runs[resumed]
    straight, straight_metrics = runs["guarded"]
    assert guard.core.fallbacks == straight.core.fallbacks
    losses, expected = _losses(metrics), _losses(straight_metrics)
    assert losses and max(losses) == END - 1  # Composer logs a batch's loss at its index
    for step, loss in losses.items():
        assert loss == expected[step], step


@pytest.mark.slow
def test_a_healthy_run_has_no_fallback(runs):
    guard, metrics = runs["healthy"]
    assert guard.core.fallbacks == {}
    assert {m[FALLBACK_LAYERS] for m in metrics.values() if FALLBACK_LAYERS in m} == {0.0}
