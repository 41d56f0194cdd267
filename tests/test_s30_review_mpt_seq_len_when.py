"""FP8061 says when the run crashes: ICL pads its tasks to `icl_seq_len` and runs them at an
evaluation, not at the first batch (the message said 'at the first batch' for icl_seq_len, as
for the train loader)."""

from __future__ import annotations

import copy
from pathlib import Path

import yaml

from foundry_fp8.lint.cli import lint_file
from tests.test_s30_configs_mpt_seq_len import BASE


def _messages(tmp_path: Path, config: dict) -> list[str]:
    path = tmp_path / "mpt.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return [f["message"] for f in lint_file(path)["findings"] if f["rule"] == "FP8061"]


def test_icl_seq_len_past_the_model_crashes_at_an_evaluation(tmp_path):
    config = copy.deepcopy(BASE)
    config["icl_tasks"] = [{"label": "piqa", "dataset_uri": "eval/local_data/piqa.jsonl",
                            "num_fewshot": [0], "icl_task_type": "multiple_choice"}]
    config["icl_seq_len"] = 4096
    [message] = _messages(tmp_path, config)
    assert message.startswith("icl_seq_len is 4096, above the model's max_seq_len 2048")
    assert message.endswith("at the first evaluation"), message
    config["icl_seq_len"] = 2048
    config["train_loader"]["dataset"]["max_seq_len"] = 4096
    [message] = _messages(tmp_path, config)
    assert message.endswith("at the first batch"), message
