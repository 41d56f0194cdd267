"""Options that build and run but do nothing, which the linter now names at their line: a
te_swap `exclude` matching none of an MPT's layers (FP8055), fp8_stats' `exclude`/dump options
that change nothing (FP8056), a `{run_name}` in W&B's `init_kwargs.dir` (FP8057). Each judged
against the run's own code: te_swap's plan and fp8_stats' selection on the MPT LLM-Foundry
builds, W&B's own folder choice."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml

from foundry_fp8.environment import Snapshot
from foundry_fp8.lint.cli import lint_file
from tests.mpt_yaml import TINY_MPT, build_tiny_mpt

MPT = TINY_MPT


@pytest.fixture(scope="module")
def mpt():
    return build_tiny_mpt()


def _findings(tmp_path: Path, config: dict[str, Any], rule: str) -> list[dict[str, Any]]:
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump({"model": MPT, **config}))
    entry = lint_file(path, 1, Snapshot(python="3.11"))
    assert entry["error"] is None
    return [f for f in entry["findings"] if f["rule"] == rule]


@pytest.mark.parametrize(("exclude", "fires"), [
    ("^transformer\\.blocks\\.0\\.", True),  # the docs' try: names begin with Composer's model.
    ("^model\\.transformer\\.blocks\\.0\\.", False),
    ("blocks\\.1\\.ffn", False),
    ("wte", True),  # a module name, but no layer te_swap converts: the run does not warn
    ("lm_head", True),  # tied embeddings: MPT builds no lm_head
    ("Wqkv$", False),
])
def test_fp8055_fires_exactly_where_exclude_leaves_te_swaps_plan_unchanged(
        tmp_path, mpt, exclude, fires):
    from foundry_fp8.options import SwapConfig
    from foundry_fp8.swap import plan_swap

    def plan(**options: Any) -> list[tuple[str, bool]]:
        config = SwapConfig(backend="emulate", **options)
        return [(d.name, d.convert) for d in plan_swap(mpt, config, precision="fp32").decisions]

    assert (plan(exclude=exclude) == plan()) == fires
    hits = _findings(tmp_path, {"precision": "fp32", "algorithms": {
        "te_swap": {"backend": "emulate", "exclude": exclude}}}, "FP8055")
    assert [h["key"] for h in hits] == (["algorithms.te_swap.exclude"] if fires else [])
    if exclude.startswith("^transformer"):
        assert "nearest: 'model.transformer.blocks.0." in hits[0]["message"]
        assert hits[0]["fix"] == "write `^model\\.transformer\\.blocks\\.0\\.`, searched in the " \
            "full names"


def test_fp8055_is_quiet_for_hf_models_whose_names_it_cannot_know(tmp_path):
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"name": "hf_causal_lm", "pretrained_model_name_or_path": "gpt2"},
        "algorithms": {"te_swap": {"backend": "emulate", "exclude": "^transformer\\.h\\.0\\."}}}))
    entry = lint_file(path, 1, Snapshot(python="3.11"))
    assert "FP8055" not in {f["rule"] for f in entry["findings"]}


@pytest.mark.parametrize(("stats", "key"), [
    ({"exclude": "^transformer"}, "callbacks.fp8_stats.exclude"),  # leaves out nothing
    ({"exclude": "out_proj"}, None),
    ({"layers": "ffn", "exclude": "attn"}, "callbacks.fp8_stats.exclude"),  # none watched
    ({"dump_layers": "Wqkv"}, "callbacks.fp8_stats.dump_layers"),  # no dump_steps
    ({"dump_max_mb": 8}, "callbacks.fp8_stats.dump_max_mb"),
    ({"dump_layers": "Wqkv", "dump_steps": [10]}, None),
    ({"dump_layers": "^blocks", "dump_steps": [10]}, "callbacks.fp8_stats.dump_layers"),
    ({"layers": "ffn", "dump_layers": "attn", "dump_steps": 10},
     "callbacks.fp8_stats.dump_layers"),
])
def test_fp8056_fires_exactly_where_fp8_stats_own_selection_is_unchanged(
        tmp_path, mpt, stats, key):
    from foundry_fp8.monitor import dump_layers_of, select_layers
    from foundry_fp8.options import build

    built = build("fp8_stats", stats)
    watched = select_layers(mpt, built.monitor)
    unchanged = (
        ("exclude" in stats and watched.keys() == select_layers(
            mpt, build("fp8_stats", {**stats, "exclude": None}).monitor).keys())
        or (("dump_layers" in stats or "dump_max_mb" in stats)
            and not any(built.schedule.dumps(step) for step in range(1000)))
        or ("dump_layers" in stats and not dump_layers_of(watched, built.monitor)))
    assert unchanged == (key is not None)
    hits = _findings(tmp_path, {"callbacks": {"fp8_stats": stats}}, "FP8056")
    assert [h["key"] for h in hits] == ([key] if key else [])


def test_fp8057_wandb_dir_placeholder_lands_in_the_temp_folder(tmp_path, monkeypatch):
    from composer.loggers import WandBLogger
    from wandb.sdk.wandb_settings import _get_wandb_dir

    folder = "runs/{run_name}"
    # Composer keeps init_kwargs as written, and W&B takes an unwritable dir's temp fallback
    assert WandBLogger(init_kwargs={"dir": folder})._init_kwargs["dir"] == folder
    monkeypatch.chdir(tmp_path)
    assert _get_wandb_dir(folder) == os.path.join(tempfile.gettempdir(), "wandb", "")
    (tmp_path / "runs" / "x").mkdir(parents=True)
    assert _get_wandb_dir("runs/x") == os.path.join("runs/x", "wandb", "")
    hits = _findings(tmp_path, {"run_name": "x", "loggers": {"wandb": {"init_kwargs": {
        "dir": folder}}}}, "FP8057")
    assert [h["key"] for h in hits] == ["loggers.wandb.init_kwargs.dir"]
    assert not _findings(tmp_path, {"run_name": "x", "loggers": {"wandb": {"init_kwargs": {
        "dir": "runs/${run_name}"}}}}, "FP8057")


@pytest.mark.parametrize(("duration", "stats", "keys"), [
    ("2ba", {"dump_steps": [1, 2], "interval": 1}, ["callbacks.fp8_stats.dump_steps"]),  # CPU try
    ("2ba", {"dump_steps": [0, 1]}, []),
    ("1000ba", {"dump_steps": 1000}, ["callbacks.fp8_stats.dump_steps"]),
    ("1e3ba", {"dump_steps": [999]}, []),
    ("100ba", {"start": 100, "interval": 10}, ["callbacks.fp8_stats.start"]),
    ("100ba", {"start": 5, "interval": 10, "end": 9}, ["callbacks.fp8_stats.end"]),
    ("100ba", {"start": 95, "interval": 10, "dump_steps": [96]}, []),  # the dump step logs
    (2, {"dump_steps": [5]}, []),  # an int is epochs: batches unknown
    ("1ep", {"dump_steps": [5]}, []),
])
def test_fp8058_is_the_schedule_against_composers_last_batch(tmp_path, duration, stats, keys):
    from types import SimpleNamespace

    from composer.core import Time

    from foundry_fp8.composer.stats import last_batch
    from foundry_fp8.options import build

    schedule = build("fp8_stats", stats).schedule
    if isinstance(duration, str) and duration.endswith("ba"):
        last = last_batch(SimpleNamespace(max_duration=Time.from_timestring(duration),
                                          dataloader_len=None))
        batches = range(last + 1)
        missed = [s for s in schedule.dump_steps if not schedule.dumps(s) or s not in batches]
        logged = any(schedule.logs(b) for b in batches)
        assert bool(missed) == ("callbacks.fp8_stats.dump_steps" in keys)
        assert (not logged) == any(k != "callbacks.fp8_stats.dump_steps" for k in keys)
    hits = _findings(tmp_path, {"max_duration": duration, "callbacks": {"fp8_stats": stats}},
                     "FP8058")
    assert [h["key"] for h in hits] == keys


@pytest.mark.parametrize(("extra", "swap", "key"), [
    ({}, {"keep_lm_head": False}, "algorithms.te_swap.keep_lm_head"),  # tied: MPT's default
    ({"tie_word_embeddings": False}, {"keep_lm_head": False}, None),
    ({}, {"fuse_ln_mlp": True}, "algorithms.te_swap.fuse_ln_mlp"),
    ({}, {"convert_layernorm": True}, "algorithms.te_swap.convert_layernorm"),
    ({}, {"min_gemm_size": 128}, None),  # keeps the 64-wide GEMMs
])
def test_fp8059_fires_exactly_where_te_swaps_conversions_are_unchanged(tmp_path, extra, swap, key):
    from foundry_fp8.options import SwapConfig
    from foundry_fp8.swap import plan_swap

    model = build_tiny_mpt(**extra)

    def converted(**options: Any) -> list[str]:
        plan = plan_swap(model, SwapConfig(backend="emulate", **options), precision="fp32")
        return [d.name for d in plan.converted]

    assert (converted(**swap) == converted()) == (key is not None)
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump({"model": {**MPT, **extra}, "precision": "fp32",
                                    "algorithms": {"te_swap": {"backend": "emulate", **swap}}}))
    entry = lint_file(path, 1, Snapshot(python="3.11"))
    assert [f["key"] for f in entry["findings"] if f["rule"] == "FP8059"] == ([key] if key else [])
