"""fp8_stats across a resume, at the sink: a tiny Composer run (te_swap's emulated blocks, a
plain head under the delayed what-if) stopped at a checkpoint and resumed with `load_path` logs
every fp8 key at every step after the resume, the heatmaps, the per-layer table and the fit-end
summary exactly as the uninterrupted run (read back from the `jsonl` logger's files and what
Composer hands the logger destinations); a checkpoint without fp8_stats' state, or one whose
layers, tensors or recipe differ, or one of an earlier version without the heatmaps' history,
resumes with one line.

The inputs grow 1.5x per batch, so the delayed scales trail them and every tensor clips at
every judged logging step: `overflow_persistent` (3 logging steps in a row) first flags at the
step the run resumes from, which only a carried streak reproduces."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
from composer.loggers import LoggerDestination
from torch import nn

from foundry_fp8 import wandb_history
from foundry_fp8.composer.jsonl_logger import JSONLLogger
from foundry_fp8.composer.state import FP8State
from foundry_fp8.composer.stats import IMAGE_PREFIX, TABLE_NAME, FP8Stats
from foundry_fp8.composer.te_swap import TESwap
from foundry_fp8.health import INITIAL_SCALE, SUMMARIES, collect, layer_key, parse_key
from foundry_fp8.health.plots import heatmap, recipe_formats
from foundry_fp8.health.raster import render_heatmap
from foundry_fp8.jsonl import read_jsonl
from foundry_fp8.recipe import FP8Recipe

BATCHES, RESUME_AT, INTERVAL = 12, 6, 2
STATS = {"interval": INTERVAL, "image_interval": 2 * INTERVAL,
         "recipe": {"scaling": "delayed", "amax_history_len": 4}}
HEAD = "module.head"  # a plain nn.Linear: the what-if's delayed state
SUMMARY = "fp8/stats_summary"
#: a resumed run's summary: its own key, as loggers refuse a changed value (`FitEndKeys`)
RESUMED_SUMMARY = f"{SUMMARY}.ba{BATCHES}"


class Net(nn.Module):
    """Two blocks te_swap converts (their own delayed scaling) and a head it leaves alone."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(16, 16), nn.Linear(16, 16)])
        self.head = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.blocks[1](torch.relu(self.blocks[0](x)))))


class Tables(LoggerDestination):
    """The per-layer tables and the heatmaps fp8_stats logs, by step."""

    def __init__(self):
        super().__init__()
        self.tables: dict[int, list[list[Any]]] = {}  # [columns, *rows] by step
        self.images: dict[tuple[str, int], np.ndarray] = {}  # (statistic, step): RGB pixels

    def log_table(self, columns, rows, name="Table", step=None) -> None:
        if name == TABLE_NAME:
            self.tables[step] = [columns, *rows]

    def log_images(self, images, name="Images", channels_last=False, step=None, **kwargs) -> None:
        if name.startswith(IMAGE_PREFIX):
            self.images[(name.removeprefix(IMAGE_PREFIX), step)] = np.array(images)


class Run(NamedTuple):
    metrics: dict[int, dict[str, float]]  # fp8_stats' keys by step, from metrics.jsonl
    hparams: dict[str, Any]  # hparams.json
    tables: dict[int, list[list[Any]]]  # the per-layer tables by step
    images: dict[tuple[str, int], np.ndarray]  # the heatmaps by statistic and step
    stats: FP8Stats
    flags: list[Any]  # the health flags of every logging step, in order (fp8_stats' listeners)


def _fit(folder: Path, stats: dict[str, Any] | None = None, load: Path | None = None,
         wandb: bool = False, fp8_recipe: dict[str, Any] | None = None) -> Run:
    """Train (or resume from `load`) into `folder`; `wandb`: W&B offline there too;
    `fp8_recipe`: te_swap's (default: delayed scaling, a history of 4)."""
    from composer import Trainer
    from composer.models import ComposerClassifier
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    growth = 1.5 ** torch.arange(BATCHES).repeat_interleave(8)[:, None]
    data = TensorDataset(torch.randn(8 * BATCHES, 16) * growth,
                         torch.randint(0, 16, (8 * BATCHES,)))
    tables, callback = Tables(), FP8Stats(**(stats or STATS))
    flags: list[Any] = []  # the monitor keeps only the last logging step's
    callback.listeners.append(
        lambda step, table, raised: flags.extend(f for found in raised.values() for f in found))
    loggers: list[LoggerDestination] = [JSONLLogger(path=str(folder / "metrics.jsonl")), tables]
    if wandb:
        from composer.loggers import WandBLogger

        folder.mkdir(parents=True, exist_ok=True)  # W&B writes into `dir` only if it exists
        loggers.append(WandBLogger(project="fp8-resume", init_kwargs={
            "mode": "offline", "dir": str(folder),
            "settings": {"allow_offline_artifacts": False}}))
    trainer = Trainer(
        model=ComposerClassifier(Net(), num_classes=16), seed=17, run_name="run",
        train_dataloader=DataLoader(data, batch_size=8), max_duration=f"{BATCHES}ba",
        algorithms=[TESwap(backend="emulate", exclude="head",
                           fp8_recipe=fp8_recipe or {"amax_history_len": 4})],
        callbacks=[FP8State(), callback],
        loggers=loggers, device="cpu",
        progress_bar=False, save_folder=str(folder / "checkpoints"),
        save_interval=f"{RESUME_AT}ba", load_path=str(load) if load else None)
    trainer.fit()
    trainer.close()
    metrics: dict[int, dict[str, float]] = {}
    for step, values in read_jsonl(folder / "metrics.jsonl"):
        if ours := {k: v for k, v in values.items() if _ours(k)}:
            metrics.setdefault(step, {}).update(ours)
    return Run(metrics, json.loads((folder / "hparams.json").read_text()), tables.tables,
               tables.images, callback, flags)


def _ours(key: str) -> bool:
    """fp8_stats' keys: the per-layer series and the summary series (not te_swap's `fp8/...`)."""
    return parse_key(key) is not None or (key.startswith("fp8/")
                                          and key.rpartition("/")[2] in SUMMARIES)


@pytest.fixture(scope="module")
def full(tmp_path_factory) -> tuple[Path, Run]:
    folder = tmp_path_factory.mktemp("full")
    return folder, _fit(folder)


def _checkpoint(folder: Path) -> Path:
    return folder / "checkpoints" / f"ep0-ba{RESUME_AT}-rank0.pt"


def _after_resume(metrics: dict[int, dict[str, float]]) -> dict[int, dict[str, float]]:
    return {step: values for step, values in metrics.items() if step >= RESUME_AT}


def test_a_resumed_run_logs_every_fp8_key_and_the_summary_of_the_uninterrupted_run(
        full, tmp_path, caplog):
    folder, run = full
    # the run this test needs: a streak that flags at the resume step, worst values before it
    persistent = {f.step for f in run.flags
                  if f.rule == "overflow_persistent"}
    assert min(persistent) == RESUME_AT
    assert layer_key(INITIAL_SCALE, "activation", HEAD) in run.metrics[0]
    assert sorted(run.tables) == [4, 8, 12]  # every 4 batches and at fit end

    with caplog.at_level(logging.WARNING):
        resumed = _fit(tmp_path, load=_checkpoint(folder))
    after = _after_resume(resumed.metrics)
    assert sorted(after) == list(range(RESUME_AT, BATCHES, INTERVAL))
    # what the earlier run warned about is named in this run's log, once, not warned again
    before = sorted({(f.layer, f.tensor, f.rule) for f in run.flags
                     if f.step < RESUME_AT})
    assert before
    recalled = [r.getMessage() for r in caplog.records if "not repeated" in r.getMessage()]
    assert recalled == ["fp8_stats: resumed; warned before the checkpoint, not repeated: "
                        + ", ".join(" ".join(key) for key in before)]
    assert after == _after_resume(run.metrics)  # every key, every value, bit for bit
    assert resumed.tables == {s: t for s, t in run.tables.items() if s >= RESUME_AT}
    assert resumed.hparams[RESUMED_SUMMARY] == run.hparams[SUMMARY]
    # the health rules judged the same: every flag, with whether it was new (warned)
    assert resumed.flags == [
        f for f in run.flags if f.step >= RESUME_AT]


def _drawn(folder: Path, stat: str, step: int, stats: FP8Stats, formats: bool = True
           ) -> tuple[list[int], np.ndarray]:
    """The logging steps up to `step` of the run whose metrics.jsonl is in `folder`, and its
    heatmap of `stat` over them, drawn from what that file holds, its panels titled with the
    formats of te_swap's recipe (the blocks; hparams.json) and fp8_stats' (the head), or with
    none (`formats=False`)."""
    shown = collect((s, m) for s, m in read_jsonl(folder / "metrics.jsonl") if s <= step)
    thresholds = stats.monitor.tracker.thresholds
    swap = FP8Recipe.from_options(json.loads((folder / "hparams.json").read_text())["fp8/recipe"])
    titled = recipe_formats([swap, stats.config.recipe], shown.tensors) if formats else None
    return (heatmap(shown, stat, thresholds).steps,
            render_heatmap(shown, stat, thresholds, titled))


def test_a_resumed_runs_heatmaps_are_the_uninterrupted_runs(full, tmp_path):
    """The heatmaps' history is in the checkpoint: each heatmap the resumed run logs shows the
    logging steps before the resume too, pixel for pixel the uninterrupted run's image, which is
    that run's own metrics.jsonl drawn."""
    folder, run = full
    stats = sorted({stat for stat, _ in run.images})
    assert {"underflow_pct", "overflow_pct", "cos_sim"} <= set(stats)
    assert sorted(run.images) == [(stat, step) for stat in stats for step in (4, 8, 12)]
    resumed = _fit(tmp_path, load=_checkpoint(folder))
    assert sorted(resumed.images) == [(stat, step) for stat in stats for step in (8, 12)]
    for (stat, step), image in resumed.images.items():
        steps, drawn = _drawn(folder, stat, step, run.stats)
        assert steps == [s for s in range(0, BATCHES, INTERVAL) if s <= step]
        assert np.array_equal(image, drawn), (stat, step)
        assert np.array_equal(image, run.images[(stat, step)]), (stat, step)


def test_a_checkpoint_of_an_earlier_version_without_the_heatmaps_resumes_with_one_line(
        full, tmp_path, caplog):
    """Without the heatmaps' history (and the rows the summary marks as what-if): the series go
    on exactly, the heatmaps start at the resume, and one line says so."""
    folder, run = full
    saved = torch.load(_checkpoint(folder), weights_only=False)
    state = saved["state"]["callbacks"]["FP8Stats"]
    del state["heatmaps"], state["monitor"]["whatif_judged"]  # what this version added
    torch.save(saved, tmp_path / "earlier.pt")
    with caplog.at_level(logging.WARNING):
        resumed = _resume_with(full, tmp_path / "run", tmp_path / "earlier.pt")
    [line] = _fp8_stats_lines(caplog)
    assert "heatmaps' logging steps before it" in line and "\n" not in line
    assert _after_resume(resumed.metrics) == _after_resume(run.metrics)
    assert resumed.hparams[RESUMED_SUMMARY] == run.hparams[SUMMARY]  # the head is a what-if after it too
    assert resumed.images
    for (stat, step), image in resumed.images.items():
        steps, drawn = _drawn(tmp_path / "run", stat, step, run.stats)
        assert steps == [s for s in range(RESUME_AT, BATCHES, INTERVAL) if s <= step]
        assert np.array_equal(image, drawn), (stat, step)


def test_a_checkpoint_whose_heatmaps_have_no_formats_resumes_without_them(full, tmp_path):
    """Heatmaps saved without each step's formats (the version before them): the resumed run
    draws the steps before the resume as saved, and titles no format while one of them is in
    the picture (no format rather than a wrong one)."""
    folder, run = full
    saved = torch.load(_checkpoint(folder), weights_only=False)
    state = saved["state"]["callbacks"]["FP8Stats"]
    assert all(len(step) == 3 for step in state["heatmaps"])
    state["heatmaps"] = [step[:2] for step in state["heatmaps"]]
    torch.save(saved, tmp_path / "earlier.pt")
    resumed = _resume_with(full, tmp_path / "run", tmp_path / "earlier.pt")
    assert _after_resume(resumed.metrics) == _after_resume(run.metrics)
    for (stat, step), image in resumed.images.items():
        _, drawn = _drawn(folder, stat, step, run.stats, formats=False)
        assert np.array_equal(image, drawn), (stat, step)
        assert not np.array_equal(image, run.images[(stat, step)]), (stat, step)


def test_the_table_and_the_summary_mark_the_what_if_rows(full):
    """te_swap converts the blocks, not the head: the head's numbers are fp8_stats' `recipe`
    what-if, the blocks' their own FP8 casts; the table and the fit-end summary say which."""
    _, run = full
    expected = {(layer, tensor): "what-if" if layer == HEAD else "FP8"
                for layer in ("module.blocks.0", "module.blocks.1", HEAD)
                for tensor in ("activation", "weight", "gradient")}
    for step, (columns, *rows) in run.tables.items():
        assert {(r[1], r[2]): r[columns.index("numbers")] for r in rows} == expected, step
    lines = [line.split(" | ")[:2] for line in run.hparams[SUMMARY].splitlines()[2:]]
    assert {(layer.removeprefix("| "), tensor) for layer, tensor in lines} == {
        (layer, tensor + (" (what-if)" if numbers == "what-if" else ""))
        for (layer, tensor), numbers in expected.items()}


def _wandb_series(folder: Path) -> tuple[dict[int, dict[str, Any]], wandb_history.WandbRun]:
    """fp8_stats' keys by step from or after the resume, read back with W&B's reader."""
    [run] = wandb_history.read_runs(folder, wait=120)
    assert run.complete
    series: dict[int, dict[str, Any]] = {}
    for row in run.rows:
        if row["_step"] >= RESUME_AT and (ours := {k: v for k, v in row.items() if _ours(k)}):
            series.setdefault(row["_step"], {}).update(ours)
    return series, run


@pytest.mark.slow
def test_wandb_holds_the_uninterrupted_runs_fp8_series_and_summary_after_a_resume(tmp_path):
    _fit(tmp_path / "full", wandb=True)
    _fit(tmp_path / "resumed", load=_checkpoint(tmp_path / "full"), wandb=True)
    (full, full_run), (resumed, resumed_run) = (_wandb_series(tmp_path / name)
                                                for name in ("full", "resumed"))
    assert sorted(resumed) == list(range(RESUME_AT, BATCHES, INTERVAL))
    assert resumed == full
    assert resumed_run.config[RESUMED_SUMMARY] == full_run.config[SUMMARY]
    assert resumed_run.media("table-file") == {TABLE_NAME: [8, 12]}
    # the heatmaps W&B holds after the resume: the uninterrupted run's PNGs, pixel for pixel
    images = resumed_run.media("images/separated")
    assert f"{IMAGE_PREFIX}underflow_pct" in images and full_run.media("images/separated")
    for key, steps in images.items():
        assert steps == [8, 12], key
        for step in steps:
            assert np.array_equal(_pixels(resumed_run, key, step), _pixels(full_run, key, step))


def _pixels(run: wandb_history.WandbRun, key: str, step: int) -> np.ndarray:
    """The image W&B stored for `key` at `step`, decoded."""
    from PIL import Image

    value = next(row[key] for row in run.rows if row["_step"] == step and key in row)
    [name] = value["filenames"]
    return np.array(Image.open(run.path.parent / "files" / name))


def _resume_with(full, tmp_path: Path, checkpoint: Path | None = None, **stats: Any):
    folder, _ = full
    return _fit(tmp_path, {**STATS, **stats}, load=checkpoint or _checkpoint(folder))


def _fp8_stats_lines(caplog) -> list[str]:
    """fp8_stats' warnings other than the health rules' (`FP8 <tensor> of layer ...`) and the
    resume's recall of them (`... not repeated: ...`)."""
    return [r.getMessage() for r in caplog.records
            if r.name == "foundry_fp8.composer.stats" and r.levelno >= logging.WARNING
            and not r.getMessage().startswith("FP8 ") and "not repeated" not in r.getMessage()]


@pytest.mark.parametrize(("entry", "said"), [
    ({}, "no fp8_stats state"),  # what Composer saved of an earlier version (no state_dict)
    ({"version": 1, "monitor": {"tracker": 3}}, "not usable"),  # corrupt
])
def test_a_checkpoint_without_usable_fp8_stats_state_resumes_afresh_with_one_line(
        full, tmp_path, caplog, entry, said):
    folder, _ = full
    saved = torch.load(_checkpoint(folder), weights_only=False)
    assert saved["state"]["callbacks"]["FP8Stats"]  # this version saves some
    saved["state"]["callbacks"]["FP8Stats"] = entry
    torch.save(saved, tmp_path / "edited.pt")
    with caplog.at_level(logging.WARNING):
        resumed = _resume_with(full, tmp_path / "run", tmp_path / "edited.pt")
    [line] = _fp8_stats_lines(caplog)
    assert said in line and "\n" not in line
    assert sorted(_after_resume(resumed.metrics)) == list(range(RESUME_AT, BATCHES, INTERVAL))
    assert layer_key(INITIAL_SCALE, "activation", HEAD) in resumed.metrics[RESUME_AT]  # afresh
    assert resumed.hparams[RESUMED_SUMMARY]


def test_before_fit_start_the_state_is_what_was_loaded_or_nothing():
    """Composer builds a sharded checkpoint's load template from `state_dict()` in the Trainer's
    constructor, and a template key the checkpoint lacks fails the load: nothing of ours may be
    in it then (a checkpoint of an earlier version, or of a run without fp8_stats, must load)."""
    stats = FP8Stats(interval=INTERVAL)
    assert stats.state_dict() == {}
    loaded = {"version": 1, "monitor": None}
    stats.load_state_dict(loaded)
    assert stats.state_dict() == loaded


@pytest.mark.parametrize(("stats", "dropped"), [
    ({"layers": r"blocks\.1|head"}, "module.blocks.0"),
    ({"tensors": ["activation", "weight"]}, "gradient"),
    ({"recipe": {"scaling": "delayed", "amax_history_len": 8}}, "amax_history_len"),
])
def test_a_checkpoint_of_other_layers_or_recipe_restores_what_matches(
        full, tmp_path, caplog, stats, dropped):
    _, run = full
    with caplog.at_level(logging.WARNING):
        resumed = _resume_with(full, tmp_path, **stats)
    [line] = _fp8_stats_lines(caplog)
    assert dropped in line and "\n" not in line
    after, before = _after_resume(resumed.metrics), _after_resume(run.metrics)
    assert sorted(after) == list(range(RESUME_AT, BATCHES, INTERVAL))
    other_recipe = "recipe" in stats  # the head's what-if starts afresh, the blocks' go on
    kept = {k for k in after[RESUME_AT]
            if not k.startswith("fp8/") and not (other_recipe and k.endswith(HEAD))}
    assert any(k.endswith(HEAD) for k in kept) != other_recipe
    for step in after:  # the rows still watched go on exactly as in the uninterrupted run
        assert {k: after[step][k] for k in kept} == {k: before[step][k] for k in kept}
    fresh = layer_key(INITIAL_SCALE, "activation", HEAD) in after[RESUME_AT]
    assert fresh == other_recipe
    assert resumed.hparams[RESUMED_SUMMARY]


def _ranks_worker(rank: int, rendezvous: str, out_dir: str) -> None:
    """Train 5 steps on 2 ranks (different data per rank), save as Composer does (every rank
    calls `state_dict`), resume every rank from rank 0's state (a monolithic checkpoint)."""
    from tests.ranks import init_rank
    from tests.test_stats_distributed import _train

    init_rank(rank, rendezvous)
    try:
        out = {}
        for reduce_amax in (True, False):
            options = {"interval": 2, "recipe": {"scaling": "delayed", "amax_history_len": 2,
                                                 "reduce_amax": reduce_amax}}
            trained = FP8Stats(**options)
            _train(rank, trained, 5)
            saved = trained.state_dict()
            box = [saved if rank == 0 else None]  # every rank loads rank 0's file
            torch.distributed.broadcast_object_list(box, src=0)
            resumed = FP8Stats(**options)
            resumed.load_state_dict(box[0])
            _train(rank, resumed, 0)  # FIT_START builds the monitor and restores
            assert trained.monitor is not None and resumed.monitor is not None
            out[reduce_amax] = {"saved": saved, "restored": resumed.monitor.state_dict(),
                                "own": trained.monitor.state_dict()}
        torch.save(out, f"{out_dir}/rank{rank}.pt")
    finally:
        torch.distributed.destroy_process_group()


def _same(a: Any, b: Any) -> bool:
    """Equal, tensors by value."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return (isinstance(b, dict) and a.keys() == b.keys()
                and all(_same(a[k], b[k]) for k in a))
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


@pytest.mark.slow
def test_every_rank_resumes_its_own_state_from_rank_zeros_checkpoint(tmp_path):
    from tests.ranks import run_ranks

    run_ranks(_ranks_worker, str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    # reduce_amax on: the pooled tracker and the all_reduced what-if are the same on both ranks
    assert _same(ranks[0][True]["saved"], ranks[1][True]["saved"])
    assert "whatif_ranks" not in ranks[0][True]["saved"]
    # off: each rank's what-if is its own, saved from every rank in the one file
    assert not _same(ranks[0][False]["own"]["whatif"], ranks[1][False]["own"]["whatif"])
    assert len(ranks[0][False]["saved"]["whatif_ranks"]) == 2
    for rank in ranks:
        for reduce_amax in (True, False):
            assert _same(rank[reduce_amax]["restored"], rank[reduce_amax]["own"])
