"""FP8058 on a run that resumes: Composer restores the checkpoint's batch count, so a schedule
whose only logging step in the run is 0 logs nothing at all, under any scaling. Before, a
resumed run under current scaling linted clean and one under delayed scaling was told "only
step 0, which delayed scaling casts with its initial scale 1". The reference is the run
itself: a tiny LLM-Foundry run saved at batch 2, resumed with load_path to batch 4."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
from llmfoundry.command_utils import train
from omegaconf import OmegaConf as om

from foundry_fp8.environment import Snapshot
from foundry_fp8.lint.cli import lint_file
from tests.test_s29_dumps_step0_only import _Said
from tests.tiny_run import tiny_config

_STATS = {"callbacks": {"fp8_stats": {"interval": "100ba"}}}


def _fp8058(tmp_path: Path, cfg: Any) -> list[dict]:
    path = tmp_path / "train.yaml"
    path.write_text(om.to_yaml(cfg))
    entry = lint_file(path, 1, Snapshot(python="3.11"))
    assert entry["error"] is None
    return [f for f in entry["findings"] if f["rule"] == "FP8058"]


def _fp8_keys(jsonl: Path) -> set[str]:
    return {k for line in jsonl.read_text().splitlines()
            for k in json.loads(line).get("metrics", {}) if k.startswith("fp8")}


def _config(tmp_path: Path, tiny_data, scaling: str, overrides: dict[str, Any]):
    cfg = tiny_config(tmp_path, tiny_data, {"eval_interval": "2ba", **_STATS, **overrides})
    cfg.algorithms.te_swap.fp8_recipe = {"scaling": scaling}
    return cfg


@pytest.mark.parametrize("scaling", ["current", "delayed"])
def test_a_run_resumed_from_load_path_logs_nothing(tmp_path, tiny_data, monkeypatch, scaling):
    monkeypatch.chdir(tmp_path)
    first = _config(tmp_path / "first", tiny_data, scaling,
                    {"max_duration": "2ba", "save_interval": "2ba"})
    train(first).close()
    checkpoint = Path(first.save_folder) / "latest-rank0.pt"
    resumed = _config(tmp_path / "resumed", tiny_data, scaling, {
        "max_duration": "4ba", "save_folder": None, "load_path": str(checkpoint)})
    hits = _fp8058(tmp_path, resumed)
    said, stats = _Said(), logging.getLogger("foundry_fp8.composer.stats")
    stats.addHandler(said)
    try:
        train(resumed).close()
    finally:
        stats.removeHandler(said)
    # the run: batches 2 and 3, no logging step, said at FIT_START; no FP8 row in its JSONL
    assert len(said.lines) == 1 and "it ends after batch 3" in said.lines[0]
    # the first run logged step 0; the resumed one (without save_folder its run folder is
    # runs/<run_name> in the working directory) no FP8 row
    assert _fp8_keys(tmp_path / "first" / "mpt-tiny-cpu" / "metrics.jsonl")
    assert _fp8_keys(tmp_path / "runs" / "mpt-tiny-cpu" / "metrics.jsonl") == set()
    assert [h["key"] for h in hits] == ["callbacks.fp8_stats.interval"]
    assert "a run resumed from load_path starts at its checkpoint's batch count, after step 0" \
        in hits[0]["message"] and "delayed scaling" not in hits[0]["message"]


_RELAUNCH = "; a relaunch that autoresumes starts at its checkpoint's batch count, after step " \
    "0, and logs no FP8 statistics"


@pytest.mark.parametrize(("scaling", "extra", "said"), [
    ("current", {}, None),
    ("current", {"autoresume": True}, "it logs step 0 alone" + _RELAUNCH),
    ("delayed", {"autoresume": True}, "no layer is judged" + _RELAUNCH),
    ("delayed", {"load_path": "ckpt.pt", "load_weights_only": True}, "no layer is judged"),
    ("current", {"load_path": "ckpt.pt", "load_weights_only": True}, None),
    ("current", {"load_path": "ckpt.pt", "autoresume": True}, "no FP8 statistics at all"),
])
def test_what_each_resume_is_told(tmp_path, tiny_data, scaling, extra, said):
    """A weights-only load starts at batch 0, as a fresh run; autoresume's first launch too,
    its relaunches resume (Composer's autoresume loads with load_weights_only False)."""
    hits = _fp8058(tmp_path, _config(tmp_path, tiny_data, scaling, {"max_duration": "4ba",
                                                                    **extra}))
    assert len(hits) == (said is not None)
    if said is not None:
        assert hits[0]["message"].endswith(said), hits[0]["message"]
