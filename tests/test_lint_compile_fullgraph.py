"""FP8050: `compile_config: {fullgraph: true}` with FP8 layers whose forwards torch.compile does
not trace (te_swap, any backend; the model's own TE layers). LLM-Foundry's loader takes
`compile_config` as a top-level key, so without the linter the YAML passes every check until
the run's first batch (or te_swap's FIT_START refusal)."""

from __future__ import annotations

from pathlib import Path

import pytest

from foundry_fp8.lint.cli import lint_file
from tests.test_lint import BASE, NO_FLASH, _write

FULLGRAPH = {"compile_config": {"fullgraph": True}}


def _fp8050(tmp_path: Path, edit: dict) -> list[dict]:
    entry = lint_file(_write(tmp_path, edit), 1, NO_FLASH)
    assert entry["error"] is None, entry["error"]
    return [f for f in entry["findings"] if f["rule"] == "FP8050"]


@pytest.mark.parametrize("layers", [
    {"algorithms": {"te_swap": {"backend": "emulate"}}},
    {"algorithms": {"te_swap": {}}},  # the `te` backend: te.Linear's forward, no_torch_dynamo
    {"precision": "amp_fp8", "model": {"fc_type": "te"}},
    {"precision": "amp_fp8", "model": {"ffn_config": {"ffn_type": "te_ln_mlp"}}},
])
def test_fullgraph_with_fp8_layers_is_an_error_at_the_key(tmp_path, layers):
    found = _fp8050(tmp_path, {**layers, **FULLGRAPH})
    assert [(f["key"], f["severity"]) for f in found] == [("compile_config.fullgraph", "error")]
    assert found[0]["fix"] == "drop compile_config.fullgraph (the FP8 layers run outside the " \
        "compiled graph)"
    line = (tmp_path / "train.yaml").read_text().splitlines()[found[0]["line"] - 1]
    assert line.strip() == "fullgraph: true"


@pytest.mark.parametrize("edit", [
    {"algorithms": {"te_swap": {"backend": "emulate"}}, "compile_config": {}},  # no fullgraph
    {"algorithms": {"te_swap": {"backend": "emulate"}},
     "compile_config": {"fullgraph": False}},
    FULLGRAPH,  # no FP8 layers: the plain MPT compiles in one graph
])
def test_not_flagged_without_fullgraph_or_fp8_layers(tmp_path, edit):
    assert _fp8050(tmp_path, edit) == []


def test_llmfoundrys_loader_takes_compile_config_at_the_top_level():
    """The flagged YAML is otherwise a valid train config: TrainConfig has `compile_config`, and
    train() hands it to the Trainer (llmfoundry/command_utils/train.py)."""
    from llmfoundry.utils.config_utils import (
        TRAIN_CONFIG_KEYS,
        TrainConfig,
        make_dataclass_and_log_config,
    )
    from omegaconf import OmegaConf

    config = OmegaConf.merge(OmegaConf.create(BASE), OmegaConf.create(
        {"algorithms": {"te_swap": {"backend": "emulate"}}, **FULLGRAPH}))
    _, train = make_dataclass_and_log_config(config, TrainConfig, TRAIN_CONFIG_KEYS,
                                             transforms="all")
    assert train.compile_config == {"fullgraph": True}
    # and an unknown top-level key is refused by the same call: the check can fail
    with pytest.raises(ValueError, match="compile_confg"):
        make_dataclass_and_log_config(OmegaConf.merge(config, {"compile_confg": {}}),
                                      TrainConfig, TRAIN_CONFIG_KEYS, transforms="all")
