"""FP8048: fp8_stats' `layers`/`exclude` against the layers FP8Monitor itself selects in the MPT
LLM-Foundry builds (select_layers on build_composer_model's model)."""

from __future__ import annotations

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


def _lint(tmp_path: Path, stats: dict[str, Any]) -> list[tuple[str, str, str]]:
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump({"model": MPT, "callbacks": {"fp8_stats": stats}}))
    entry = lint_file(path, 1, Snapshot(python="3.11"))
    assert entry["error"] is None
    return [(f["rule"], f["key"], f["severity"]) for f in entry["findings"]
            if f["rule"] == "FP8048"]


@pytest.mark.parametrize(("stats", "want"), [
    ({}, None),
    ({"layers": "(a+)+$"}, ("FP8048", "callbacks.fp8_stats.layers", "warning")),
    ({"layers": "transformer\\.mlp"}, ("FP8048", "callbacks.fp8_stats.layers", "warning")),
    ({"layers": "ffn"}, None),
    ({"layers": "^blocks"}, ("FP8048", "callbacks.fp8_stats.layers", "warning")),  # model. first
    ({"layers": "blocks\\.1\\.", "exclude": "blocks\\.1"},
     ("FP8048", "callbacks.fp8_stats.exclude", "warning")),
    ({"layers": "lm_head", "strict": True}, ("FP8048", "callbacks.fp8_stats.layers", "error")),
])
def test_fp8048_is_the_monitors_own_selection(tmp_path, mpt, stats, want):
    from foundry_fp8.monitor import select_layers
    from foundry_fp8.options import build

    config = build("fp8_stats", stats).monitor
    selected = select_layers(mpt, config)
    assert (not selected) == (want is not None)
    assert _lint(tmp_path, stats) == ([want] if want else [])
