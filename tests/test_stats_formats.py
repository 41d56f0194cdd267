"""The FP8 formats in fp8_stats' heatmap titles, at the sink: a tiny Composer run whose te_swap
recipe is `fp8_format: E4M3` casts gradients in E4M3, and the heatmaps W&B (offline, read back
with W&B's reader) and the other loggers hold say so; a head left to fp8_stats' what-if (its
`recipe`, HYBRID) adds E5M2 to the gradient panel. Each image is compared, pixel for pixel, with
the same heatmap drawn from the run's metrics.jsonl, its panels titled as written here."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from foundry_fp8 import wandb_history
from foundry_fp8.composer.stats import IMAGE_PREFIX, FP8Stats
from foundry_fp8.health import collect
from foundry_fp8.health.plots import heatmap
from foundry_fp8.health.raster import raster
from foundry_fp8.jsonl import read_jsonl
from foundry_fp8.recipe import FP8Recipe
from tests.test_stats_resume import BATCHES
from tests.test_stats_resume import _fit as fit

INTERVAL = 2
IMAGE_STEPS = list(range(2 * INTERVAL, BATCHES + 1, 2 * INTERVAL))  # image_interval
E4M3 = FP8Recipe(fp8_format="E4M3", amax_history_len=4)  # te_swap's


def _fit(folder: Path, wandb: bool, **stats: Any) -> tuple[FP8Stats, dict]:
    """Train with te_swap's E4M3 recipe on the blocks; returns fp8_stats and its images."""
    run = fit(folder, {"interval": INTERVAL, "image_interval": 2 * INTERVAL, **stats},
              wandb=wandb, fp8_recipe=E4M3.as_config())
    return run.stats, run.images


def _drawn(folder: Path, stat: str, step: int, stats: FP8Stats, titles: Mapping[str, str]
           ) -> np.ndarray:
    """The heatmap of `stat` over the logging steps up to `step` of the run's metrics.jsonl,
    each panel titled `titles[tensor]` (and ` - all 0` where it is)."""
    shown = collect((s, m) for s, m in read_jsonl(folder / "metrics.jsonl") if s <= step)
    hm = heatmap(shown, stat, stats.monitor.tracker.thresholds)
    panels = [dataclasses.replace(p, title=titles[p.tensor] + (
        " - all 0" if p.title.endswith(" - all 0") else "")) for p in hm.panels]
    return raster(dataclasses.replace(hm, panels=panels))


def test_wandb_holds_heatmaps_titled_with_the_runs_own_formats(tmp_path):
    """Only te_swap's layers watched: every tensor, the gradient too, is cast in E4M3."""
    stats, images = _fit(tmp_path, wandb=True, layers="blocks")
    titles = {t: f"{t} (E4M3)" for t in ("activation", "weight", "gradient")}
    [run] = wandb_history.read_runs(tmp_path, wait=120)
    assert run.complete
    stored = run.media("images/separated")
    assert f"{IMAGE_PREFIX}underflow_pct" in stored
    for key, steps in stored.items():
        assert steps == IMAGE_STEPS, key
        stat = key.removeprefix(IMAGE_PREFIX)
        for step in steps:
            pixels = _pixels(run, key, step)
            assert np.array_equal(pixels, images[(stat, step)]), (key, step)
            assert np.array_equal(pixels, _drawn(tmp_path, stat, step, stats, titles))
            hybrid = {**titles, "gradient": "gradient (E5M2)"}  # what every title used to say
            assert not np.array_equal(pixels, _drawn(tmp_path, stat, step, stats, hybrid))


def test_a_what_if_layer_adds_its_recipes_format_to_the_panel(tmp_path):
    """The head is fp8_stats' what-if, under its `recipe` (current scaling, HYBRID): the
    gradient panel holds E4M3 rows (the blocks) and an E5M2 row (the head)."""
    stats, images = _fit(tmp_path, wandb=False)
    titles = {"activation": "activation (E4M3)", "weight": "weight (E4M3)",
              "gradient": "gradient (E4M3 or E5M2)"}
    assert sorted({step for _, step in images}) == IMAGE_STEPS
    for (stat, step), pixels in images.items():
        assert np.array_equal(pixels, _drawn(tmp_path, stat, step, stats, titles)), (stat, step)


def _pixels(run: wandb_history.WandbRun, key: str, step: int) -> np.ndarray:
    """The image W&B stored for `key` at `step`, decoded."""
    from PIL import Image

    value = next(row[key] for row in run.rows if row["_step"] == step and key in row)
    [name] = value["filenames"]
    return np.array(Image.open(run.path.parent / "files" / name))
