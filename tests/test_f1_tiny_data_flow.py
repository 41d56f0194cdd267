"""tiny-data's pasted YAML (helper F1, s22): only a string with a line break is double-quoted;
other values stay plain (`default_style='"'` tagged them: `!!int "5"`), and the line loads
back, by PyYAML and by OmegaConf (LLM-Foundry's loader), as the value written."""

from __future__ import annotations

import yaml
from omegaconf import OmegaConf

from foundry_fp8.tools.tiny_data import _flow


def test_only_strings_are_double_quoted_and_the_line_loads_back():
    value = {"name": "text", "dataset": {"local": "/tmp/bad\nname/data", "split": "train",
                                         "shuffle": True, "num_canonical_nodes": 5,
                                         "predownload": None, "epoch_size": 2.5}}
    line = _flow(value)
    assert "\n" not in line and "!!" not in line, line  # before: !!bool "true", !!int "5"
    assert '"/tmp/bad\\nname/data"' in line and "shuffle: true" in line
    assert yaml.safe_load(line) == value
    assert OmegaConf.to_container(OmegaConf.create(f"train_loader: {line}\n")) == {
        "train_loader": value}
