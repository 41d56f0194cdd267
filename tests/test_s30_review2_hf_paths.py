"""FP8062/FP8063 on a `pretrained_model_name_or_path` the file system refuses to stat: a name
longer than a file name may be (ENAMETOOLONG), or, for a user other than root, a folder under
one they may not search (EACCES). Path.is_dir/is_file raise on those errnos (Python 3.11
ignores ENOENT, ENOTDIR, EBADF, ELOOP only): both rules reported "check failed ... this is a
foundry-fp8 bug" as errors (lint exit 1, fp8_lint's error count). Such a model is not found
here, so it is not judged, as a name with no config.json."""

from __future__ import annotations

from pathlib import Path

import yaml

from foundry_fp8.lint.cli import lint_file
from foundry_fp8.lint.rules.hf import hf_config


def test_a_name_too_long_to_stat_is_not_judged(tmp_path: Path):
    name = str(tmp_path / ("m" * 300))  # one component over NAME_MAX (255)
    hub = "org/" + "m" * 300
    environ = {"HF_HUB_CACHE": str(tmp_path / "hub")}
    for each in (name, hub):
        assert hf_config({"name": "hf_causal_lm", "pretrained_model_name_or_path": each},
                         environ) is None
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump({
        "precision": "amp_bf16",
        "model": {"name": "hf_causal_lm", "pretrained_model_name_or_path": name,
                  "pretrained": False},
        "algorithms": {"te_swap": {"backend": "emulate"}}}, sort_keys=False))
    entry = lint_file(path)
    assert entry["error"] is None
    assert [f for f in entry["findings"] if f["rule"] in ("FP8062", "FP8063")] == []
