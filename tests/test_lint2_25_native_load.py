"""FP8054: `load_path` into the model's own TE layers without fp8_state, where Composer's load of
a checkpoint without TE's `_extra_state` (a bf16 run's torch layers, te_swap's) fails at Trainer
init. Composer 0.32.1 decides by the settings the rule reads: FSDP `state_dict_type: full`
(torch's placeholder, which TE 2.20.2 refuses) and `sharded` (DCP's 'Missing key') fail strict
or not; without FSDP only a strict weights-only load fails (`_restore_checkpoint` passes
`strict` only there; a full-state load is non-strict). The no-FSDP verdicts are checked here
against Composer's own Trainer; the FSDP ones are tests/test_te220b_native_load.py's (ranks).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from torch import nn

from foundry_fp8.lint.cli import lint_file
from foundry_fp8.lint.registry import LintContext
from foundry_fp8.lint.rules import lint_config
from tests.test_lint import BASE, NO_FLASH, _merge, _write

TE = {"model": {"fc_type": "te"}}
LOAD = {"load_path": "s3://bucket/bf16-run/ep1-ba1000-rank0.pt"}
WEIGHTS = {"load_weights_only": True}
#: BASE trains with FSDP (its fsdp_config); `fsdp_config: null` is LLM-Foundry's no FSDP.
NO_FSDP = {"fsdp_config": None}


def _fp8054(edit: dict, **context: int) -> list[tuple[str, str, str]]:
    """(key, severity, message) of FP8054 for BASE with `edit`, as LLM-Foundry's loader takes it."""
    from llmfoundry.utils.config_utils import (
        TRAIN_CONFIG_KEYS,
        TrainConfig,
        make_dataclass_and_log_config,
    )
    from omegaconf import OmegaConf

    config = OmegaConf.merge(OmegaConf.create(BASE), OmegaConf.create(edit))
    # a valid train config: the loader takes every key the rule reads (and refuses a typo)
    make_dataclass_and_log_config(config, TrainConfig, TRAIN_CONFIG_KEYS, transforms="all")
    resolved = OmegaConf.to_container(config, resolve=True)
    return [(f.key, f.severity, f.message)
            for f in lint_config(resolved, LintContext(**context)) if f.rule == "FP8054"]


@pytest.mark.parametrize(("edit", "context", "says"), [
    # FSDP1's default state_dict_type is full: torch's placeholder, strict or not
    ({"fsdp_config": {}}, {}, "'Unsupported checkpoint format.'"),
    ({"fsdp_config": {}, **WEIGHTS, "load_strict_model_weights": False}, {},
     "'Unsupported checkpoint format.'"),
    ({"fsdp_config": {"state_dict_type": "full"}}, {"fsdp_version": 2},
     "'Unsupported checkpoint format.'"),
    # FSDP2's default is sharded: DCP's template holds the keys
    ({"fsdp_config": {}}, {"fsdp_version": 2}, "'Missing key in checkpoint state_dict"),
    ({"fsdp_config": {"state_dict_type": "sharded"}, **WEIGHTS}, {}, "'Missing key in"),
    # without FSDP, and where rank 0 loads before wrapping: a strict weights-only load
    ({**NO_FSDP, **WEIGHTS}, {}, "without FSDP, a strict weights-only load"),
    ({"fsdp_config": {}, **WEIGHTS}, {"gpus": 1}, "without FSDP, a strict weights-only load"),
    ({"fsdp_config": {"load_monolith_rank0_only": True}, **WEIGHTS}, {},
     "loaded on rank 0 before FSDP wraps the model"),
])
def test_a_load_that_fails_without_extra_state_is_warned_at_load_path(edit, context, says):
    for layers, key in ((TE, "model.fc_type"),
                        ({"model": {"ffn_config": {"ffn_type": "te_ln_mlp"}}},
                         "model.ffn_config.ffn_type")):
        found = _fp8054(_merge(layers, LOAD, edit), **context)
        assert [(k, s) for k, s, _ in found] == [("load_path", "warning")], (layers, found)
        assert says in found[0][2] and f"({key})" in found[0][2]


@pytest.mark.parametrize(("edit", "context"), [
    (NO_FSDP, {}),  # no FSDP, a full-state load: non-strict, the keys are skipped
    ({**NO_FSDP, **WEIGHTS, "load_strict_model_weights": False}, {}),
    ({"fsdp_config": {}}, {"gpus": 1}),  # one GPU: LLM-Foundry drops fsdp_config
    ({"fsdp_config": {"load_monolith_rank0_only": True}}, {}),
    ({"fsdp_config": {}, "model": {"init_device": "mixed"}}, {}),  # LLM-Foundry's default then
])
def test_a_load_that_skips_the_missing_keys_is_not_warned(edit, context):
    assert _fp8054(_merge(TE, LOAD, edit), **context) == []


def test_not_said_with_fp8_state_without_load_path_or_without_native_te_layers():
    fsdp = {"fsdp_config": {}}
    assert _fp8054(_merge(TE, LOAD, fsdp, {"callbacks": {"fp8_state": {}}})) == []
    # autoresume alone resumes this run's own checkpoints, which hold TE's keys
    assert _fp8054(_merge(TE, fsdp, {"autoresume": True, "save_folder": "ckpt"})) == []
    # te_swap's TE modules save no _extra_state key: the checkpoint loads
    assert _fp8054(_merge(LOAD, fsdp, {"algorithms": {"te_swap": {}}})) == []
    # any precision: the TE modules have the key whether or not they run in FP8
    assert _fp8054(_merge(TE, LOAD, fsdp, {"precision": "amp_fp8"}))
    assert _fp8054(_merge(TE, LOAD, fsdp, {"precision": "amp_bf16"}))


def test_the_finding_names_the_load_path_line_of_the_file(tmp_path):
    entry = lint_file(_write(tmp_path, _merge(TE, LOAD, {"fsdp_config": {}})), 1, NO_FLASH)
    assert entry["error"] is None, entry["error"]
    hit, = [f for f in entry["findings"] if f["rule"] == "FP8054"]
    assert hit["fix"] == "add `callbacks: {fp8_state: {}}`"
    line = (tmp_path / "train.yaml").read_text().splitlines()[hit["line"] - 1]
    assert line.startswith("load_path:")


def test_an_mcli_run_config_is_judged_with_its_gpus(tmp_path):
    """`parameters` is the train config; `compute.gpus: 1` drops fsdp_config (no FSDP)."""
    def run(gpus: int, weights_only: bool) -> list[tuple[str, str]]:
        path = tmp_path / "run.yaml"
        path.write_text(f"name: r\nimage: i\ncompute:\n  gpus: {gpus}\ncommand: composer "
                        "train.py /mnt/config/parameters.yaml\nparameters:\n  model:\n"
                        "    name: mpt_causal_lm\n    fc_type: te\n"
                        f"  load_path: {LOAD['load_path']}\n  load_weights_only: "
                        f"{str(weights_only).lower()}\n  fsdp_config:\n    sharding_strategy: "
                        "FULL_SHARD\n")
        done = subprocess.run([sys.executable, "-m", "foundry_fp8.cli", "lint", "--format",
                               "json", str(path)], capture_output=True, text=True, timeout=120,
                              check=False)
        [entry] = json.loads(done.stdout)["files"]
        return [(f["key"], f["severity"]) for f in entry["findings"] if f["rule"] == "FP8054"]

    assert run(8, False) == [("parameters.load_path", "warning")]
    assert run(1, False) == []
    assert run(1, True) == [("parameters.load_path", "warning")]


def test_without_fsdp_the_verdict_is_composers(fake_te, tmp_path):
    """Composer's own Trainer loading a bf16 checkpoint into TE layers (the stand-in loads
    `_extra_state` as TE 2.20.2 does), no FSDP: it fails exactly where FP8054 says."""
    from composer import Trainer
    from composer.models import ComposerClassifier

    fake_te("2.20.2")
    import transformer_engine.pytorch as te

    path = str(tmp_path / "bf16.pt")
    torch.manual_seed(3)
    trainer = Trainer(model=ComposerClassifier(nn.Sequential(nn.Linear(8, 8)), num_classes=8),
                      device="cpu", loggers=[], progress_bar=False)
    trainer.save_checkpoint(path)
    trainer.close()
    for weights_only in (False, True):
        for strict in (False, True):
            model = ComposerClassifier(nn.Sequential(te.Linear(8, 8, device="cpu")),
                                       num_classes=8)
            assert "module.0._extra_state" in model.state_dict()
            try:
                Trainer(model=model, device="cpu", loggers=[], progress_bar=False,
                        load_path=path, load_weights_only=weights_only,
                        load_strict_model_weights=strict).close()
                failed = False
            except RuntimeError as error:
                assert "_extra_state" in str(error)
                failed = True
            said = _fp8054(_merge(TE, LOAD, NO_FSDP, {"load_weights_only": weights_only,
                                             "load_strict_model_weights": strict}))
            assert failed == bool(said), (weights_only, strict, failed, said)
