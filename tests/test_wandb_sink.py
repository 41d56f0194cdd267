"""What reaches W&B, checked where the user looks: a real tiny LLM-Foundry training with
Composer's `WandBLogger` (offline), its `.wandb` file read back with W&B's own reader
(`foundry_fp8.wandb_history`), never "the logger was called" or "the folder exists"; and
what Composer's console printed."""

from __future__ import annotations

import contextlib
import importlib
import json
import re
from collections.abc import Iterable, Iterator, Sequence

import pytest
import torch
from composer.core import Callback
from composer.loggers import LoggerDestination

from foundry_fp8 import wandb_history
from foundry_fp8.composer.guard import FALLBACK_LAYERS, FP8_FLOPS_SHARE, FP8Guard
from foundry_fp8.composer.stats import IMAGE_PREFIX, TABLE_NAME
from foundry_fp8.fault import InjectOutlier
from foundry_fp8.health import INITIAL_SCALE, SUMMARIES, TENSORS, layer_key, summary_key
from foundry_fp8.jsonl import read_jsonl
from foundry_fp8.numerics import STAT_KEYS
from tests.tiny_run import run_folder, run_tiny

INTERVAL = 2
IMAGE_INTERVAL = 4
BATCHES = 12
RESUME_AT = 8
BROKEN_AT = 10
BROKEN = "blocks.1.attn.Wqkv"
LAYERS = [f"blocks.{b}.{linear}" for b in (0, 1)
          for linear in ("attn.Wqkv", "attn.out_proj", "ffn.up_proj", "ffn.down_proj")]
LAYER_KEYS = {layer_key(stat, tensor, layer) for layer in LAYERS for tensor in TENSORS
              for stat in STAT_KEYS}
SUMMARY_KEYS = {summary_key(t, name) for t in TENSORS for name in SUMMARIES} | {
    summary_key(None, "flagged_layers")}


def _steps_of(key: str, steps: list[int]) -> list[int]:
    """The logging steps that hold `key`: a worst_* summary none at step 0, where delayed
    scaling's first cast (the initial scale) leaves no layer to count."""
    return [s for s in steps if s != 0 or "/worst_" not in key]


def _overrides(run_name: str, **extra) -> dict:
    return {"variables": {"run_name": run_name}, "max_duration": f"{BATCHES}ba",
            "save_interval": f"{RESUME_AT}ba", "eval_interval": f"{BATCHES}ba",
            "console_log_interval": f"{INTERVAL}ba",
            "callbacks": {"fp8_stats": {"interval": f"{INTERVAL}ba",
                                        "image_interval": f"{IMAGE_INTERVAL}ba"}}, **extra}


def _logging_steps(run: wandb_history.WandbRun) -> list[int]:
    """The steps of Composer's own `loss/train/total` rows at fp8_stats' logging batches: where
    a user lines the FP8 statistics up with the loss."""
    return [step for step in run.steps("loss/train/total") if step % INTERVAL == 0]


class _BreakWeight(Callback):
    """Scales one layer's weight x1e4 just before batch BROKEN_AT's forward."""

    def batch_start(self, state, logger) -> None:
        if int(state.timestamp.batch) == BROKEN_AT:
            module = dict(state.model.named_modules())[f"model.transformer.{BROKEN}"]
            with torch.no_grad():
                module.weight.mul_(1e4)


@contextlib.contextmanager
def added_to_trainer(callbacks: Sequence[Callback] = (),
           loggers: Sequence[LoggerDestination] = ()) -> Iterator[None]:
    """LLM-Foundry's train() builds the Trainer itself: add callbacks after its own, and
    logger destinations before its own."""
    train_module = importlib.import_module("llmfoundry.command_utils.train")
    original = train_module.Trainer

    def trainer(*args, **kwargs):
        kwargs["callbacks"] = [*kwargs.get("callbacks", []), *callbacks]
        kwargs["loggers"] = [*loggers, *kwargs.get("loggers", [])]
        return original(*args, **kwargs)

    train_module.Trainer = trainer
    try:
        yield
    finally:
        train_module.Trainer = original


@pytest.mark.slow
def test_what_fp8_stats_logs_reaches_wandb_at_the_loss_steps_also_after_a_resume(
        tmp_path, tiny_data, capfd):
    # LLM-Foundry's train() leaves the Trainer open (the CLI closes it at exit); closing it
    # finishes the W&B run, whose service writes the last rows
    run_tiny(tmp_path, tiny_data, _overrides("full"), wandb=True).close()
    console = capfd.readouterr()
    [run] = wandb_history.read_runs(run_folder(tmp_path, "full"), wait=120)
    assert run.complete
    assert run.steps("loss/train/total") == list(range(BATCHES))
    steps = _logging_steps(run)
    assert steps == [0, 2, 4, 6, 8, 10]
    for key in sorted(LAYER_KEYS | SUMMARY_KEYS):
        assert run.steps(key) == _steps_of(key, steps), key
    # te_swap's emulated layers run delayed scaling: step 0 casts with the initial scale
    initial = {layer_key(INITIAL_SCALE, t, layer) for layer in LAYERS for t in TENSORS}
    for key in initial:
        assert run.steps(key) == [0], key
    media = {*run.media("images/separated"), *run.media("table-file")}
    assert {k for k in run.keys() if k.startswith("fp8")} - media == \
        LAYER_KEYS | SUMMARY_KEYS | initial
    # the healthy tiny run: nothing flagged, at any step
    assert all(row[summary_key(None, "flagged_layers")] == 0 for row in run.rows
               if summary_key(None, "flagged_layers") in row)
    # heatmaps and table every IMAGE_INTERVAL batches, and at fit end (step 12, for step 10)
    images = run.media("images/separated")
    assert {f"{IMAGE_PREFIX}{s}" for s in ("underflow_pct", "overflow_pct", "cos_sim")} <= \
        images.keys()
    assert all(at == [4, 8, 12] for at in images.values()), images
    assert run.media("table-file") == {TABLE_NAME: [4, 8, 12]}
    columns, rows = run.table(TABLE_NAME, 8)
    assert len(rows) == len(LAYERS) * len(TENSORS)
    row_8 = next(r for r in rows if r[1:3] == [BROKEN, "weight"])
    at_8 = next(r for r in run.rows if r["_step"] == 8 and layer_key("amax", "weight", BROKEN) in r)
    assert row_8[columns.index("amax")] == at_8[layer_key("amax", "weight", BROKEN)]
    # Composer's console: the summary series, none of the per-layer ones
    assert f"Train {summary_key('gradient', 'worst_underflow_pct')}: " in console.err + console.out
    assert "fp8_underflow_pct/" not in console.err + console.out

    # resume from the step-8 checkpoint, with one weight broken at batch 10: W&B offline starts
    # a new run file, whose history goes on at the resumed steps; the JSONL sink has them too
    checkpoint = run_folder(tmp_path, "full") / "checkpoints" / f"ep0-ba{RESUME_AT}-rank0.pt"
    with added_to_trainer([_BreakWeight()]):
        run_tiny(tmp_path, tiny_data, _overrides("resumed", load_path=str(checkpoint)),
                 wandb=True).close()
    [resumed] = wandb_history.read_runs(run_folder(tmp_path, "resumed"), wait=120)
    assert resumed.complete
    assert resumed.steps("loss/train/total") == list(range(RESUME_AT, BATCHES))
    assert _logging_steps(resumed) == [8, 10]
    for key in sorted(LAYER_KEYS | SUMMARY_KEYS):
        assert resumed.steps(key) == [8, 10], key
    jsonl = [step for step, m in read_jsonl(run_folder(tmp_path, "resumed") / "metrics.jsonl")
             if LAYER_KEYS <= m.keys()]
    assert jsonl == [8, 10]
    # the same model state at step 8 gives the same statistics in both runs
    resumed_8 = next(r for r in resumed.rows if r["_step"] == 8 and LAYER_KEYS <= r.keys())
    full_8 = next(r for r in run.rows if r["_step"] == 8 and LAYER_KEYS <= r.keys())
    assert {k: resumed_8[k] for k in LAYER_KEYS} == {k: full_8[k] for k in LAYER_KEYS}
    # the broken weight: counted in the summary at step 10, named in the fit-end table with
    # the YAML key that changes it
    at_10 = next(r for r in resumed.rows if r["_step"] == 10 and SUMMARY_KEYS <= r.keys())
    assert at_10[summary_key("weight", "flagged_layers")] == 1
    assert at_10[summary_key("weight", "worst_overflow_pct")] > 50
    assert resumed.media("table-file") == {TABLE_NAME: [8, 12]}
    columns, rows = resumed.table(TABLE_NAME, 12)
    flags = {(r[1], r[2]): r[-1] for r in rows}
    assert {r[columns.index("step")] for r in rows} == {10}  # the fit-end table at W&B step 12
    assert "algorithms.te_swap.fp8_recipe.scaling: current" in flags[(BROKEN, "weight")], flags


KINDS = ("hyperparameters", "images", "metrics", "table")


class RefusesFP8(LoggerDestination):
    """A logger destination that raises at what foundry_fp8 sends it of `kinds` (as W&B does
    when its service is gone), to be placed before the `jsonl` logger and W&B. It takes
    Composer's own series: Composer calls its destinations unguarded, so a loss it refused
    would end any run, ours or not."""

    def __init__(self, kinds: Sequence[str] = KINDS):
        self.kinds = set(kinds)

    def _refuse(self, kind: str, keys: Iterable[str] = ("fp8",)) -> None:
        if kind in self.kinds and any(key.startswith("fp8") for key in keys):
            raise RuntimeError("refused")

    def log_metrics(self, metrics, step=None) -> None:
        self._refuse("metrics", metrics)

    def log_hyperparameters(self, hyperparameters) -> None:
        self._refuse("hyperparameters", hyperparameters)

    def log_images(self, *args, **kwargs) -> None:
        self._refuse("images")

    def log_table(self, *args, **kwargs) -> None:
        self._refuse("table")


FAULTY = "blocks.1.attn.out_proj"


@pytest.mark.slow
def test_a_failing_logger_before_jsonl_and_wandb_takes_nothing_from_them(tmp_path, tiny_data,
                                                                        capfd):
    """fp8_stats' series, images, table and summary, fp8_guard's series and records, te_swap's
    and fp8_lint's hyperparameters all reach the `jsonl` logger and W&B after it; the guard
    still moves the faulty layer to high precision; one warning per kind names the logger."""
    overrides = _overrides("refused")
    overrides["callbacks"]["fp8_guard"] = {"consecutive": 2}
    with added_to_trainer([InjectOutlier(FAULTY, start=4)], [RefusesFP8()]):
        trainer = run_tiny(tmp_path, tiny_data, overrides, wandb=True)
    guard = next(c for c in trainer.state.callbacks if isinstance(c, FP8Guard))
    trainer.close()
    assert not guard.disabled and list(guard.core.fallbacks) == [FAULTY]
    steps = [0, 2, 4, 6, 8, 10]
    series = LAYER_KEYS | SUMMARY_KEYS | {FALLBACK_LAYERS, FP8_FLOPS_SHARE}
    folder = run_folder(tmp_path, "refused")
    jsonl: dict[int, dict] = {}
    for step, metrics in read_jsonl(folder / "metrics.jsonl"):
        jsonl.setdefault(step, {}).update(metrics)
    for key in sorted(series):
        assert [s for s in sorted(jsonl) if key in jsonl[s]] == _steps_of(key, steps), key
    assert jsonl[10][FALLBACK_LAYERS] == 1
    [run] = wandb_history.read_runs(folder, wait=120)
    assert run.complete
    for key in sorted(series):
        assert run.steps(key) == _steps_of(key, steps), key
    assert any(r.get(FALLBACK_LAYERS) == 1 for r in run.rows)
    assert all(at == [4, 8, 12] for at in run.media("images/separated").values())
    assert run.media("table-file") == {TABLE_NAME: [4, 8, 12]}
    hyperparameters = {"fp8/stats_summary", f"fp8/guard/fallback/{FAULTY}", "fp8/guard/fallbacks",
                       "fp8/backend", "fp8/coverage", "fp8_lint/findings"}
    assert hyperparameters <= json.loads((folder / "hparams.json").read_text()).keys()
    assert hyperparameters <= run.config.keys()
    warned = re.findall(r"WARNING: .*the logger RefusesFP8 failed to log (\w+) \(RuntimeError: "
                        r"refused\)", capfd.readouterr().err)
    assert sorted(warned) == list(KINDS)
