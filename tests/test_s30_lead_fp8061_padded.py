"""FP8061 on a finetuning train loader that pads to the longest example: LLM-Foundry's collator
cuts each example at the dataset's max_seq_len and pads a batch only to its longest example
(llmfoundry/data/finetuning/collator.py), so the run crashes only at a batch holding an example
longer than the model's max_seq_len, maybe never: a warning, not the error that a text loader's
fixed-length samples (or a packed finetuning loader's bins, padded to max_seq_len) get."""

from __future__ import annotations

from pathlib import Path

import yaml

from foundry_fp8.lint.cli import lint_file
from tests.test_s30_configs_mpt_seq_len import BASE


def _fp8061(tmp_path: Path, dataset: dict) -> list[tuple[str, str]]:
    config = {**BASE, "model": {**BASE["model"], "max_seq_len": 2048},
              "train_loader": {"name": "finetuning", "drop_last": True, "num_workers": 8,
                               "dataset": {"hf_name": "org/sft-data", "split": "train",
                                           "max_seq_len": 4096, "decoder_only_format": True,
                                           "shuffle": True, **dataset}}}
    path = tmp_path / "ft.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    entry = lint_file(path)
    assert entry["error"] is None
    return [(f["severity"], f["message"]) for f in entry["findings"] if f["rule"] == "FP8061"]


def test_pad_to_longest_is_a_warning_at_the_first_long_example(tmp_path):
    [(severity, message)] = _fp8061(tmp_path, {"pad_to_longest": True})
    assert severity == "warning"
    assert message.endswith("'Cannot forward input with seq_len=S, this model only supports "
                            "seq_len<=2048' at the first batch whose longest example has more "
                            "than 2048 tokens (`pad_to_longest`: a batch is as long as its "
                            "longest example)"), message


def test_padded_to_max_seq_len_or_packed_stays_an_error(tmp_path):
    for dataset in ({}, {"pad_to_longest": True, "packing_ratio": 4.0}):
        [(severity, message)] = _fp8061(tmp_path, dataset)
        assert severity == "error", dataset
        assert "seq_len=4096, this model only supports seq_len<=2048' at the first batch" \
            in message
