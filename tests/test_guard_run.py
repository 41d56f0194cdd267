"""fp8_guard in real tiny LLM-Foundry runs (te_swap's emulated backend): one layer driven into
persistent FP8 trouble by an injected outlier channel falls back alone, at the step its health
rule says, the loss moves toward the run without FP8, resumes reproduce the same run, fp8_stats'
summary stops counting the layer once it runs in high precision and its table marks the layer's
what-if rows, and `foundry-fp8 report` on the run shows the fallback.

The runs are shared by every test here (one module fixture) and carry only what some test
reads: fp8_stats' pictures and W&B (offline) only in the guarded run, no evaluation,
checkpoints only in the guarded and re-promoted runs."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from statistics import mean

import pytest
import torch
import yaml
from composer.core import Callback, State
from composer.loggers import Logger, LoggerDestination
from torch import nn

from foundry_fp8 import wandb_history
from foundry_fp8.cli import main
from foundry_fp8.composer.guard import FALLBACK_LAYERS, FP8_FLOPS_SHARE, FP8Guard
from foundry_fp8.composer.state import fp8_state_from_checkpoint
from foundry_fp8.composer.stats import TABLE_NAME, FP8Stats
from foundry_fp8.fault import InjectOutlier, stats_table
from foundry_fp8.fp8_meta import canonical_modules
from foundry_fp8.health import TENSORS, layer_key, summary_key
from foundry_fp8.jsonl import read_jsonl
from tests.test_wandb_sink import RefusesFP8, added_to_trainer
from tests.tiny_run import run_folder, tiny_config

LAYER = "blocks.1.attn.out_proj"
START, INTERVAL, CONSECUTIVE, END = 6, 2, 2, 20
STATS = {"fp8_stats": {"interval": INTERVAL, "image_interval": None}}
# heatmaps and the per-layer table every IMAGE_INTERVAL batches (and at fit end)
IMAGE_INTERVAL = 4
PICTURES = {"fp8_stats": {"interval": INTERVAL, "image_interval": IMAGE_INTERVAL}}
FAULT = {"guard_inject_outlier": {"layer": LAYER, "start": START}}
GUARD = {"fp8_guard": {"consecutive": CONSECUTIVE}}
# the fault ends at batch STOP: the layer's what-if statistics turn healthy and, after
# REPROMOTE_AFTER logging steps of them, it runs in FP8 again
STOP, REPROMOTE_AFTER = 10, 3
TRANSIENT = {"guard_inject_outlier": {"layer": LAYER, "start": START, "stop": STOP},
             "fp8_guard": {"consecutive": CONSECUTIVE, "repromote_after": REPROMOTE_AFTER}}
# NaN in one input channel of another layer at two logging steps before the fault (batches
# NAN_START..START-1); those steps are skipped (their gradients zeroed) and training goes on
NAN_LAYER, NAN_START = "blocks.0.attn.Wqkv", 2
NAN = {"guard_inject_nan": {"layer": NAN_LAYER, "start": NAN_START, "stop": START,
                            "factor": float("nan")},
       "guard_skip_nonfinite": {}}
# the tiny MPT's linear-GEMM multiply-adds per token: 2 blocks x (64x192 + 64x64 + 64x256 +
# 256x64) in FP8, and the tied 64x512 LM head in high precision
BLOCKS, TOTAL = 2 * (64 * 192 + 64 * 64 + 64 * 256 + 256 * 64), 2 * 49152 + 64 * 512


def _run(tmp: Path, tiny_data, name: str, callbacks: dict, fp8: bool = True,
         load: str | None = None, stats: bool = True, save: int | None = None,
         loggers: Sequence[LoggerDestination] = (), wandb: bool = False):
    from llmfoundry.command_utils import train

    overrides = {"variables": {"run_name": name}, "max_duration": f"{END}ba",
                 "eval_interval": f"{END}ba",
                 "save_interval": f"{save or END}ba",  # by default only at the end
                 "callbacks": {**(STATS if stats else {}), **callbacks}}
    if load:
        overrides["load_path"] = str(run_folder(tmp, load.split("/")[0]) / "checkpoints"
                                     / load.split("/")[1])
    cfg = tiny_config(tmp, tiny_data, overrides, wandb=wandb)
    del cfg["eval_loader"]  # no test reads an evaluation
    if not fp8:
        del cfg.algorithms["te_swap"]
    (tmp / name).mkdir(parents=True, exist_ok=True)
    with added_to_trainer(callbacks=[FlagLog()], loggers=loggers):  # before LLM-Foundry's own
        trainer = train(cfg)
    if wandb:
        trainer.close()  # finishes the W&B run, whose service writes the last rows
    guard = next((c for c in trainer.state.callbacks if isinstance(c, FP8Guard)), None)
    metrics: dict[int, dict] = {}
    for step, values in read_jsonl(run_folder(tmp, name) / "metrics.jsonl"):
        metrics.setdefault(step, {}).update(values)
    return guard, metrics, trainer


class FlagLog(Callback):
    """fp8_stats' health flags of every logging step, in order (its listeners'; the monitor
    keeps only the last step's)."""

    def __init__(self) -> None:
        self.flags: list = []

    def fit_start(self, state: State, logger: Logger) -> None:
        stats = next((c for c in state.callbacks if isinstance(c, FP8Stats)), None)
        if stats is not None:
            stats.listeners.append(lambda step, table, raised: self.flags.extend(
                f for found in raised.values() for f in found))


class SkipNonFinite(Callback):
    """A step with a non-finite gradient changes no weight (as a GradScaler skips it): its
    gradients are zeroed."""

    def after_backward(self, state: State, logger: Logger) -> None:
        grads = [p.grad for p in state.model.parameters() if p.grad is not None]
        if not all(torch.isfinite(g).all() for g in grads):
            for g in grads:
                g.zero_()


@pytest.fixture(scope="module")
def fault_registered() -> None:
    """LLM-Foundry finds the injected faults by name, as a user's YAML would name a callback."""
    from llmfoundry.registry import callbacks

    callbacks.register("guard_inject_outlier", func=InjectOutlier)
    callbacks.register("guard_inject_nan", func=InjectOutlier)
    callbacks.register("guard_skip_nonfinite", func=SkipNonFinite)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_data, fault_registered):
    tmp = tmp_path_factory.mktemp("guard")
    out = {
        "no_fp8": _run(tmp, tiny_data, "no_fp8", FAULT, fp8=False, stats=False),  # losses only
        "unguarded": _run(tmp, tiny_data, "unguarded", FAULT),
        "guarded": _run(tmp, tiny_data, "guarded", {**PICTURES, **FAULT, **GUARD}, save=4,
                        wandb=True),
        "healthy": _run(tmp, tiny_data, "healthy", GUARD),
        # a logger before the jsonl one raising at every FP8 series (W&B's service gone)
        "refused": _run(tmp, tiny_data, "refused", {**FAULT, **GUARD},
                        loggers=[RefusesFP8(["metrics"])]),
        "repromoted": _run(tmp, tiny_data, "repromoted", TRANSIENT, save=2),
    }
    out["repromoted_resumed"] = _run(tmp, tiny_data, "repromoted_resumed", TRANSIENT,
                                     load="repromoted/ep0-ba12-rank0.pt")
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


def _bad_steps(metrics: dict[int, dict], layer: str, guard: FP8Guard) -> dict[str, list[int]]:
    """Per tensor of the layer, the logging steps at which it crossed a limit of the guard's."""
    c = guard.config
    bad: dict[str, list[int]] = {}
    for step, values in sorted(metrics.items()):
        for (name, tensor), r in stats_table(values).items():
            if name.endswith(layer) and not r.get("initial_scale") and (
                    r["underflow_pct"] > c.max_underflow_pct
                    or r["overflow_pct"] > c.max_overflow_pct or r["cos_sim"] < c.min_cos_sim
                    or r["nan_count"] + r["inf_count"] > 0):
                bad.setdefault(tensor, []).append(step)
    return bad


@pytest.mark.slow
def test_exactly_the_faulty_layer_falls_back_when_its_rule_says(runs):
    guard, metrics, _ = runs["guarded"]
    assert list(guard.core.fallbacks) == [LAYER]
    fallback = guard.core.fallbacks[LAYER]
    # from the unguarded run's numbers: the first logging step at which one of the layer's
    # tensors has crossed a limit at CONSECUTIVE logging steps in a row (the fault's first step
    # is one of them)
    bad = _bad_steps(runs["unguarded"][1], LAYER, guard)
    assert min(steps[0] for steps in bad.values()) == START
    expected = min(s for steps in bad.values() for s in steps
                   if all(s - INTERVAL * k in steps for k in range(CONSECUTIVE)))
    assert fallback.step == expected
    unguarded = stats_table(runs["unguarded"][1][expected])
    assert fallback.numbers["activation/underflow_pct"] == next(
        stats["underflow_pct"] for (name, tensor), stats in unguarded.items()
        if name.endswith(LAYER) and tensor == "activation")
    # the W&B series: 0 then 1 layer; the FP8 FLOPs share drops by out_proj's 64 x 64 GEMM
    # of the model's 2 x (64x192 + 64x64 + 64x256 + 256x64) + 64x512 (tied LM head)
    logged = {s: (m[FALLBACK_LAYERS], m[FP8_FLOPS_SHARE]) for s, m in metrics.items()
              if FALLBACK_LAYERS in m}
    for step, (layers, share) in logged.items():
        fallen = step >= fallback.step
        assert layers == float(fallen)
        assert share == pytest.approx((BLOCKS - fallen * 64 * 64) / TOTAL)
    assert sorted(logged) == list(range(0, END, INTERVAL))  # batch indices 0..END-1


@pytest.mark.slow
def test_every_other_layer_stays_in_fp8(runs):
    """From the checkpoint after the fallback to the end, only the fallen layer's delayed
    scaling state stands still: every other FP8 layer keeps casting."""
    guard = runs["guarded"][0]
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
    guard, metrics, _ = runs[resumed]
    straight, straight_metrics, _ = runs["guarded"]
    assert guard.core.fallbacks == straight.core.fallbacks
    losses, expected = _losses(metrics), _losses(straight_metrics)
    assert losses and max(losses) == END - 1  # Composer logs a batch's loss at its index
    for step, loss in losses.items():
        assert loss == expected[step], step


@pytest.mark.slow
def test_a_logger_that_raises_does_not_switch_the_guard_off(runs):
    """The layer falls back at the same step, the losses are the guarded run's bit for bit,
    and the guard's series still reach the `jsonl` logger after the failing one."""
    guard, metrics, _ = runs["refused"]
    straight, straight_metrics, _ = runs["guarded"]
    assert not guard.disabled and guard.core.fallbacks == straight.core.fallbacks
    assert _losses(metrics) == _losses(straight_metrics)

    def series(logged: dict[int, dict]) -> dict[int, tuple[float, float]]:
        return {s: (m[FALLBACK_LAYERS], m[FP8_FLOPS_SHARE]) for s, m in logged.items()
                if FALLBACK_LAYERS in m}

    assert series(metrics) == series(straight_metrics)
    assert sorted(series(metrics)) == list(range(0, END, INTERVAL))


@pytest.mark.slow
def test_a_healthy_run_has_no_fallback(runs):
    guard, metrics, _ = runs["healthy"]
    assert guard.core.fallbacks == {}
    assert {m[FALLBACK_LAYERS] for m in metrics.values() if FALLBACK_LAYERS in m} == {0.0}


def _flagged(trainer) -> dict[int, set[tuple[str, str]]]:
    """fp8_stats' own judgement, by logging step: the (layer, tensor) pairs its health rules
    flagged there, from the what-if numbers of a layer in high precision too."""
    log = next(c for c in trainer.state.callbacks if isinstance(c, FlagLog))
    flagged: dict[int, set[tuple[str, str]]] = {}
    for flag in log.flags:
        flagged.setdefault(flag.step, set()).add((flag.layer, flag.tensor))
    return flagged


def _check_summary(metrics: dict[int, dict], flagged: dict[int, set[tuple[str, str]]],
                   left_out: Callable[[int, str], bool]) -> None:
    """At every logging step, the summary series count the flagged layers and take the worst
    underflow over the layers that `left_out(step, layer)` does not name."""
    for step in range(0, END, INTERVAL):
        logged = metrics[step]
        counted = {(layer, t) for layer, t in flagged.get(step, ()) if not left_out(step, layer)}
        assert logged[summary_key(None, "flagged_layers")] == len({k[0] for k in counted}), step
        table = stats_table(logged)
        for tensor in TENSORS:
            assert logged[summary_key(tensor, "flagged_layers")] == len(
                {layer for layer, t in counted if t == tensor}), (step, tensor)
            underflow = [r["underflow_pct"] for (layer, t), r in table.items()
                         if t == tensor and not left_out(step, layer)
                         and not r.get("initial_scale")]
            # no layer counted (delayed scaling's first cast, all fallen): no worst value logged
            assert logged.get(summary_key(tensor, "worst_underflow_pct")) == max(
                underflow, default=None), (step, tensor)


@pytest.mark.slow
def test_the_summary_stops_counting_the_layer_the_guard_moved(runs):
    """fp8_stats goes on judging the fallen layer's what-if numbers (its per-layer series and
    warnings), and they still fail; `fp8/flagged_layers`, the per-tensor counts and worst values
    leave the layer out from the first logging step it runs in high precision: an alert on
    them stops once the guard has acted (its `fp8/guard/...` series report the layer)."""
    guard, metrics, trainer = runs["guarded"]
    step = guard.core.fallbacks[LAYER].step
    flagged = _flagged(trainer)
    after = range(step + INTERVAL, END, INTERVAL)
    assert all(any(layer == LAYER for layer, _ in flagged[s]) for s in after)
    assert all(layer_key("underflow_pct", "activation", LAYER) in metrics[s] for s in after)
    assert metrics[step][summary_key(None, "flagged_layers")] >= 1  # the step that decided
    _check_summary(metrics, flagged, lambda at, layer: layer == LAYER and at > step)


@pytest.mark.slow
def test_the_table_marks_the_what_if_rows_of_the_layer_in_fallback(runs):
    """In W&B's copy of each per-layer table: every row of the FP8 run is the layer's own FP8
    numbers, except the fallen layer's after the logging step that moved it."""
    guard = runs["guarded"][0]
    step = guard.core.fallbacks[LAYER].step
    [run] = wandb_history.read_runs(run_folder(runs["tmp"], "guarded"), wait=120)
    assert run.complete
    at = run.media("table-file")[TABLE_NAME]
    assert at == [*range(IMAGE_INTERVAL, END, IMAGE_INTERVAL), END]  # and at fit end
    assert at[0] <= step < at[-1]
    for table_step in at:
        columns, rows = run.table(TABLE_NAME, table_step)
        numbers = {(row[1], row[2]): row[columns.index("numbers")] for row in rows}
        assert len(numbers) == 8 * len(TENSORS)  # 2 blocks x 4 linear layers
        assert numbers == {(layer, tensor): "what-if (fp8_guard fallback)"
                           if layer == LAYER and table_step > step else "FP8"
                           for layer, tensor in numbers}, table_step


def _report(folder: Path, capsys) -> tuple[str, str]:
    """`foundry-fp8 report` on a run folder: its terminal output and fp8_report.md."""
    capsys.readouterr()
    assert main(["report", str(folder)]) == 0
    return capsys.readouterr().out, (folder / "fp8_report.md").read_text()


@pytest.mark.slow
def test_the_report_shows_the_fallback_and_the_yaml_for_next_time(runs, capsys):
    """On the run's own metrics.jsonl and hparams.json: the fallback with its step, FLOPs share
    and triggering number, the FP8 share before and after, the YAML that keeps exactly that
    layer out of FP8, and the flagged layer marked as already in high precision."""
    guard, metrics, trainer = runs["guarded"]
    step = guard.core.fallbacks[LAYER].step
    out, md = _report(run_folder(runs["tmp"], "guarded"), capsys)
    section = md.split("## fp8_guard\n", 1)[1].split("\n## ", 1)[0]
    underflow = metrics[step][layer_key("underflow_pct", "activation", LAYER)]
    assert underflow > guard.config.max_underflow_pct
    row = (f"| {LAYER} | {step + 1} | the end | {100 * 64 * 64 / TOTAL:.1f} % | activation "
           f"underflow_pct {underflow:.3g} % (> {guard.config.max_underflow_pct:g} %) |")
    assert row in section.splitlines()
    assert section.count(f"| {LAYER} |") == 1  # no other layer fell back
    first, last = (100 * BLOCKS / TOTAL, 100 * (BLOCKS - 64 * 64) / TOTAL)
    assert f"{first:.1f} % at the first logging step, {last:.1f} % at the last" in section
    # the YAML block, read as YAML: te_swap's exclude matches exactly the fallen layer
    block = section.split("```yaml\n", 1)[1].split("\n```", 1)[0]
    exclude = yaml.safe_load(block)["algorithms"]["te_swap"]["exclude"]
    linear = [n for n, m in canonical_modules(trainer.state.model) if isinstance(m, nn.Linear)]
    assert len(linear) == 8  # 2 blocks x 4 (the LM head is the tied embedding)
    assert [n for n in linear if re.search(exclude, n)] == [f"model.transformer.{LAYER}"]
    assert f"Next time: {block}" in out
    # the findings: the layer is flagged, and said to run in high precision already
    flagged = [line for line in md.split("## Flagged", 1)[1].split("\n## ", 1)[0].splitlines()
               if line.startswith(f"| {LAYER} (high precision from step {step + 1}: fp8_guard)")]
    assert flagged and all("fp8_guard ran it in high precision" in line for line in flagged)
    assert f"fp8_guard ran it in high precision from step {step + 1}" in out


@pytest.mark.slow
@pytest.mark.parametrize("resumed", ["resumed_after", "resumed_before"])
def test_a_resumed_run_logs_the_same_fallback_record_for_the_report(runs, resumed):
    """The report reads the fallbacks from the run folder's hparams.json, which a resumed run
    writes anew: the restored (or replayed) fallback is in it, as the run that did not stop
    logged it."""
    record = f"fp8/guard/fallback/{LAYER}"
    straight = json.loads((run_folder(runs["tmp"], "guarded") / "hparams.json").read_text())
    again = json.loads((run_folder(runs["tmp"], resumed) / "hparams.json").read_text())
    assert [k for k in again if k.startswith("fp8/guard/fallback/")] == [record]
    assert again[record] == straight[record]
    assert again[record]["step"] == runs["guarded"][0].core.fallbacks[LAYER].step


@pytest.mark.slow
def test_the_report_of_a_healthy_guarded_run_says_nothing_fell_back(runs, capsys):
    out, md = _report(run_folder(runs["tmp"], "healthy"), capsys)
    logging_steps = len(range(0, END, INTERVAL))
    assert (f"fp8_guard watched {logging_steps} logging steps and moved no layer to high "
            f"precision (FP8 share of the linear-GEMM FLOPs: {100 * BLOCKS / TOTAL:.1f} %)."
            in md)
    assert "high precision from step" not in md and "fp8_guard moved" not in out


def _within_limits(metrics: dict[int, dict], layer: str, guard: FP8Guard) -> list[int]:
    """Logging steps at which every tensor of the layer was within the guard's limits."""
    bad = _bad_steps(metrics, layer, guard)
    return [step for step, values in sorted(metrics.items())
            if any(name.endswith(layer) for name, _ in stats_table(values))
            and not any(step in steps for steps in bad.values())]


@pytest.mark.slow
def test_a_layer_whose_fault_ends_runs_in_fp8_again_with_a_fresh_state(runs):
    """The fault ends at batch STOP: the layer's what-if statistics (fp8_stats keeps computing
    them in high precision) are within the limits from then on, and after REPROMOTE_AFTER such
    logging steps it runs in FP8 again, from a fresh delayed-scaling state, and stays so."""
    guard, metrics, _ = runs["repromoted"]
    fallback_step = runs["guarded"][0].core.fallbacks[LAYER].step  # the same fault until then
    assert guard.core.fallbacks == {}
    (fallback,) = guard.core.ended
    assert (fallback.layer, fallback.step) == (LAYER, fallback_step)
    healthy = [s for s in _within_limits(metrics, LAYER, guard) if s > fallback_step]
    assert healthy[0] == STOP  # the first logging step without the fault
    expected = next(s for s in healthy
                    if all(s - INTERVAL * k in healthy for k in range(REPROMOTE_AFTER)))
    (repromoted,) = guard.core.repromotions
    assert (repromoted.layer, repromoted.step, repromoted.fallen_at) == (
        LAYER, expected, fallback_step)
    logged = {s: m[FALLBACK_LAYERS] for s, m in metrics.items() if FALLBACK_LAYERS in m}
    assert logged == {s: float(fallback_step <= s < expected) for s in range(0, END, INTERVAL)}
    # its delayed-scaling state: still in high precision, then one FP8 batch from a fresh state
    folder = run_folder(runs["tmp"], "repromoted") / "checkpoints"
    name = f"model.transformer.{LAYER}"

    def state(batches: int) -> dict[str, torch.Tensor]:
        return fp8_state_from_checkpoint(folder / f"ep0-ba{batches}-rank0.pt")[name]

    frozen, back = state(fallback_step + 2), state(expected + 2)  # ran to batch expected + 1
    before = state(expected)
    assert all(torch.equal(frozen[k], before[k]) for k in frozen)
    assert (before["fwd_amax_history"].abs().sum(dim=1) > 0).sum() > 1  # the old amaxes
    assert (back["fwd_amax_history"].abs().sum(dim=1) > 0).sum() == 1  # one FP8 batch's
    assert not torch.equal(back["fwd_scale"], torch.ones_like(back["fwd_scale"]))


@pytest.mark.slow
def test_a_resume_before_the_repromotion_takes_it_at_the_same_step_bit_exact(runs):
    guard, metrics, _ = runs["repromoted_resumed"]
    straight, straight_metrics, _ = runs["repromoted"]
    assert guard.core.repromotions == straight.core.repromotions
    assert guard.core.ended == straight.core.ended and guard.core.fallbacks == {}
    losses, expected = _losses(metrics), _losses(straight_metrics)
    assert losses and min(losses) == 12 and max(losses) == END - 1
    assert all(loss == expected[step] for step, loss in losses.items())
    again = json.loads((run_folder(runs["tmp"], "repromoted_resumed") / "hparams.json")
                       .read_text())
    first = json.loads((run_folder(runs["tmp"], "repromoted") / "hparams.json").read_text())
    keys = [k for k in first if k.startswith("fp8/guard/")]
    assert keys == [f"fp8/guard/fallback/{LAYER}", f"fp8/guard/repromotion/{LAYER}",
                    "fp8/guard/fallbacks"]
    # the resumed run's fit-end table under its own key: loggers refuse a changed value
    assert again.keys() >= {*keys[:2], f"fp8/guard/fallbacks.ba{END}"}
    assert {k: again[k] for k in keys[:2]} == {k: first[k] for k in keys[:2]}
    assert again[f"fp8/guard/fallbacks.ba{END}"] == first["fp8/guard/fallbacks"]


@pytest.mark.slow
def test_the_fit_end_table_keeps_a_fallback_that_ended(runs):
    """A layer back in FP8 by the end still was in high precision for part of the run: the
    fit-end table (hparams `fp8/guard/fallbacks`) says from when to when."""
    guard = runs["repromoted"][0]
    (repromoted,) = guard.core.repromotions
    table = json.loads((run_folder(runs["tmp"], "repromoted") / "hparams.json")
                       .read_text())["fp8/guard/fallbacks"]
    assert (f"| {LAYER} | {repromoted.fallen_at + 1} | step {repromoted.step + 1} (back in FP8) |"
            in table)


@pytest.mark.slow
def test_the_report_shows_the_repromotion_and_no_yaml(runs, capsys):
    guard = runs["repromoted"][0]
    (repromoted,) = guard.core.repromotions
    out, md = _report(run_folder(runs["tmp"], "repromoted"), capsys)
    section = md.split("## fp8_guard\n", 1)[1].split("\n## ", 1)[0]
    assert (f"{LAYER} from step {repromoted.step + 1} (its what-if statistics within the limits "
            f"at {REPROMOTE_AFTER} logging steps in a row)") in section
    assert "No layer is in fallback at the end of the run." in section and "```yaml" not in md
    span = f"from step {repromoted.fallen_at + 1} to {repromoted.step}"
    assert f"| {LAYER} (high precision {span}: fp8_guard) |" in md
    assert f"fp8_guard moved 1 layer(s) to high precision: {LAYER} {span}." in out


def test_a_guard_with_nothing_in_fp8_says_so(tmp_path, tiny_data, capfd):
    """Without te_swap nothing runs in FP8: fp8/guard/fp8_flops_share is 0 from the start, which
    alone would read like a run whose every layer fell back. (LLM-Foundry's train replaces the
    logging handlers, so the warning is read where the user sees it, on stderr.)"""
    guard, metrics, _ = _run(tmp_path, tiny_data, "nothing", GUARD, fp8=False)
    err = capfd.readouterr().err
    assert err.count("fp8_guard: no layer of this model runs in FP8") == 1, err[-2000:]
    assert not guard.core.fallbacks
    assert {m.get(FP8_FLOPS_SHARE) for m in metrics.values()} <= {0.0, None}


@pytest.mark.slow
def test_without_fp8_layers_the_summary_counts_the_layers_that_would_fail(
        tmp_path, tiny_data, capfd, fault_registered):
    """Without te_swap every number is fp8_stats' what-if: `fp8/flagged_layers` says which
    layers would fail in FP8 (the fault's, from its first batch), with the guard beside it
    (nothing to guard, nothing in fallback), the table marks every row a what-if, and the
    warnings say so, advising no change to a layer that runs in high precision."""
    guard, metrics, trainer = _run(tmp_path, tiny_data, "what_if",
                                   {**PICTURES, **FAULT, **GUARD}, fp8=False, wandb=True)
    warned = [line for line in capfd.readouterr().err.splitlines()
              if f"layer '{LAYER}' at step {START}" in line]
    assert warned and all(
        f"FP8 what-if for the activation of layer '{LAYER}' at step {START} (it does not run in "
        "FP8; these numbers are what fp8_stats' recipe (current scaling) would do to it): "
        in line and "Change:" not in line for line in warned), warned
    assert not guard.core.fallbacks
    flagged = _flagged(trainer)
    assert all(any(layer == LAYER for layer, _ in flagged[s]) for s in range(START, END, INTERVAL))
    _check_summary(metrics, flagged, lambda at, layer: False)
    assert metrics[START][summary_key(None, "flagged_layers")] >= 1
    [run] = wandb_history.read_runs(run_folder(tmp_path, "what_if"), wait=120)
    assert run.complete and run.media("table-file")[TABLE_NAME]
    for at in run.media("table-file")[TABLE_NAME]:
        columns, rows = run.table(TABLE_NAME, at)
        assert len(rows) == 8 * len(TENSORS)
        assert {row[columns.index("numbers")] for row in rows} == {"what-if"}, at


@pytest.mark.slow
def test_nan_before_any_cast_moves_no_layer_and_is_said_once(runs, tmp_path, tiny_data, capfd):
    """NaN in the high-precision input of NAN_LAYER at two logging steps (their updates skipped,
    training goes on) reaches every layer's statistics there. No FP8 cast made it and no
    fallback fixes it: the guard judges neither step, says so once, and moves exactly the
    guarded run's faulty layer, at the same step; the records and the report name it alone."""
    capfd.readouterr()
    guard, metrics, _ = _run(tmp_path, tiny_data, "nan", {**NAN, **FAULT, **GUARD})
    err = capfd.readouterr().err
    nonfinite = {step: [t for t in TENSORS if logged[summary_key(t, "nonfinite")]]
                 for step, logged in metrics.items() if summary_key(None, "flagged_layers") in logged}
    assert {step: t for step, t in nonfinite.items() if t} == {
        NAN_START: ["activation", "gradient"], NAN_START + INTERVAL: ["activation", "gradient"]}
    said = [line for line in err.splitlines() if "newly hold NaN/Inf" in line]
    assert len(said) == 1, said
    assert (f"fp8_guard: at step {NAN_START}, 8 layer(s) newly hold NaN/Inf in their high-precision "
            "activation, gradient, before any FP8 cast: no FP8 failure" in said[0])
    step = runs["guarded"][0].core.fallbacks[LAYER].step
    assert list(guard.core.fallbacks) == [LAYER] and guard.core.fallbacks[LAYER].step == step
    assert {s: m[FALLBACK_LAYERS] for s, m in metrics.items() if FALLBACK_LAYERS in m} == {
        s: float(s >= step) for s in range(0, END, INTERVAL)}
    assert torch.isfinite(torch.tensor(_losses(metrics)[END - 1]))
    folder = run_folder(tmp_path, "nan")
    hparams = json.loads((folder / "hparams.json").read_text())
    assert [k for k in hparams if k.startswith("fp8/guard/fallback/")] == [
        f"fp8/guard/fallback/{LAYER}"]
    out, md = _report(folder, capfd)
    section = md.split("## fp8_guard\n", 1)[1].split("\n## ", 1)[0]
    assert [line for line in section.splitlines() if line.startswith("| blocks.")] == [
        line for line in section.splitlines() if line.startswith(f"| {LAYER} |")]
    assert f"Next time: algorithms: {{te_swap: {{exclude: '^(?:model\\.)?(?:transformer\\.)?{re.escape(LAYER)}(?:\\..+)?$'}}}}" in out
