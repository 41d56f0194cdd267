"""FP8006 judges the micro-batches TE's GEMMs really get where the GPU count is known: LLM-Foundry
cuts a micro-batch size above the sequences per GPU to them, and Composer's split_batch leaves a
last, smaller micro-batch where the size does not divide them. With the finetuning loader's
`pad_to_longest` (batches of micro x L tokens, any L) a micro-batch of 4 or 6 crashes TE's FP8
forward though the YAML says 8. FP8043 names a global batch the GPU count does not divide.
The sizes are LLM-Foundry's own calculate_batch_size_info and Composer's own split_batch."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from foundry_fp8.lint.cli import lint_file
from foundry_fp8.lint.registry import LintContext
from foundry_fp8.lint.rules import lint_config
from foundry_fp8.shapes import tokens_fit_fp8

#: A Llama finetune with te_swap under FP8, in the layout of LLM-Foundry's finetune YAMLs.
FINETUNE = {
    "variables": {"model_name": "meta-llama/Meta-Llama-3.1-8B", "max_seq_len": 4096},
    "max_seq_len": "${variables.max_seq_len}",
    "run_name": "llama-ft-fp8",
    "model": {"name": "hf_causal_lm", "pretrained_model_name_or_path": "${variables.model_name}",
              "pretrained": True},
    "tokenizer": {"name": "${variables.model_name}",
                  "kwargs": {"model_max_length": "${variables.max_seq_len}"}},
    "train_loader": {"name": "finetuning", "drop_last": True, "num_workers": 8,
                     "dataset": {"hf_name": "mosaicml/dolly_hhrlhf", "split": "train",
                                 "max_seq_len": "${variables.max_seq_len}",
                                 "decoder_only_format": True, "pad_to_longest": True,
                                 "shuffle": True}},
    "scheduler": {"name": "linear_decay_with_warmup", "t_warmup": "50ba", "alpha_f": 0},
    "optimizer": {"name": "decoupled_lionw", "lr": 5.0e-7, "betas": [0.9, 0.99]},
    "algorithms": {"te_swap": {}},
    "max_duration": "1ep",
    "eval_interval": 1,
    "global_train_batch_size": 96,
    "device_train_microbatch_size": 8,
    "device_eval_batch_size": 8,
    "precision": "amp_fp8",
    "fsdp_config": {"sharding_strategy": "FULL_SHARD", "mixed_precision": "PURE"},
}


def _reference_micro_batches(global_batch: int, micro: int, gpus: int,
                             monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The micro-batch sizes one GPU trains on: LLM-Foundry's calculate_batch_size_info at
    that world size, then Composer's split_batch on a batch of that many sequences."""
    import torch
    from composer.core.data_spec import _default_split_batch
    from llmfoundry.utils import config_utils

    monkeypatch.setattr(config_utils.dist, "get_world_size", lambda: gpus)
    batch, cut, _ = config_utils.calculate_batch_size_info(global_batch, micro)
    return [len(t) for t in _default_split_batch(torch.zeros(int(batch), 1), int(cut))]


def _lint(tmp_path: Path, config: dict, gpus: int | None) -> list[dict]:
    path = tmp_path / "finetune.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    entry = lint_file(path, gpus=gpus)
    assert entry["error"] is None
    return entry["findings"]


@pytest.mark.parametrize(("global_batch", "micro", "gpus"), [
    (96, 8, 8),    # 12 per GPU: micro-batches 8 and 4
    (96, 8, 16),   # 6 per GPU: the 8 cut to 6
    (64, 8, 8),    # 8 per GPU: 8, fine
    (128, 8, 8),   # 16 per GPU: 8 and 8, fine
    (96, 16, 8),   # 12 per GPU: the 16 cut to 12, a multiple of 4 only
    (48, 16, 2),   # 24 per GPU: 16 and 8, fine
])
def test_pad_to_longest_error_follows_the_real_micro_batches(tmp_path, monkeypatch,
                                                               global_batch, micro, gpus):
    sizes = _reference_micro_batches(global_batch, micro, gpus, monkeypatch)
    config = copy.deepcopy(FINETUNE)
    config.update(global_train_batch_size=global_batch, device_train_microbatch_size=micro)
    errors = [f for f in _lint(tmp_path, config, gpus)
              if f["rule"] == "FP8006" and f["severity"] == "error"]
    # pad_to_longest: micro x L tokens for any L, so only micro-batches of a multiple of 8 pass
    crashes = [s for s in sizes if not tokens_fit_fp8(s)]
    assert bool(errors) == bool(crashes), (sizes, errors)
    if crashes:
        assert errors[0]["key"] == "train_loader.dataset.pad_to_longest"
        assert f"with {crashes[0]} sequences per micro-batch" in errors[0]["message"]
        assert f"over {gpus} GPUs (`--gpus {gpus}`)" in errors[0]["message"]


def test_without_a_gpu_count_the_written_micro_batch_is_judged(tmp_path):
    """No --gpus, no compute.gpus: the sequences per GPU are unknown, 8 is judged as written
    (the warning for a multiple of 8 that is not one of 16)."""
    found = [(f["rule"], f["severity"]) for f in _lint(tmp_path, FINETUNE, None)
             if f["rule"] in ("FP8006", "FP8043")]
    assert found == [("FP8006", "warning")]


def test_an_mcli_run_config_s_gpus_give_the_micro_batches(tmp_path):
    run = {"name": "llama-ft", "image": "mosaicml/llm-foundry:2.7.0_cu128-latest",
           "compute": {"gpus": 16},
           "command": "cd llm-foundry/scripts\ncomposer train/train.py "
                      "/mnt/config/parameters.yaml",
           "parameters": FINETUNE}
    found = [f for f in _lint(tmp_path, run, None) if f["rule"] == "FP8006"]
    assert [(f["key"], f["severity"]) for f in found] == \
        [("parameters.train_loader.dataset.pad_to_longest", "error")]
    assert "over 16 GPUs (`compute.gpus: 16`) is 6 sequences per GPU" in found[0]["message"]


@pytest.mark.parametrize(("global_batch", "gpus"), [(100, 8), (96, 8), (12, 16), (7, 1)])
def test_a_global_batch_the_gpus_do_not_divide(tmp_path, monkeypatch, global_batch, gpus):
    from llmfoundry.utils import config_utils

    monkeypatch.setattr(config_utils.dist, "get_world_size", lambda: gpus)
    try:
        config_utils.calculate_batch_size_info(global_batch, 1)
        refused = False
    except ValueError as e:
        refused = "is not divisible" in str(e)
    config = copy.deepcopy(FINETUNE)
    config.update(global_train_batch_size=global_batch, device_train_microbatch_size=1)
    found = [f for f in _lint(tmp_path, config, gpus) if f["rule"] == "FP8043"]
    assert bool(found) == refused
    if refused:
        assert found[0]["key"] == "global_train_batch_size" and found[0]["line"] is not None


def test_in_a_run_the_device_batch_llm_foundry_wrote_gives_the_last_micro_batch(monkeypatch):
    """fp8_lint gets the config LLM-Foundry's update_batch_size_info filled in (its
    device_train_batch_size, the micro-batch size already cut): 12 per GPU in 8s leaves 4."""
    from llmfoundry.utils import config_utils
    from omegaconf import OmegaConf

    monkeypatch.setattr(config_utils.dist, "get_world_size", lambda: 8)
    config = OmegaConf.to_container(OmegaConf.create(FINETUNE), resolve=True)
    config = config_utils.update_batch_size_info(config)
    assert (config["device_train_batch_size"], config["device_train_microbatch_size"]) == (12, 8)
    found = [f for f in lint_config(config, LintContext(scope="run")) if f.rule == "FP8006"]
    assert [(f.key, f.severity) for f in found] == \
        [("train_loader.dataset.pad_to_longest", "error")]
    assert "device_train_batch_size is 12" in found[0].message


@pytest.mark.parametrize(("global_batch", "gpus", "first_crashes"), [
    (96, 8, True),    # starts at 12: a multiple of 4 only
    (96, 16, True),   # starts at 6
    (128, 8, False),  # starts at 16: only the halvings after out-of-memory errors reach 1
])
def test_auto_micro_batches_start_at_the_per_gpu_batch(tmp_path, monkeypatch, global_batch,
                                                       gpus, first_crashes):
    from composer.trainer.trainer import _get_initial_device_train_microbatch_size
    from llmfoundry.utils import config_utils

    monkeypatch.setattr(config_utils.dist, "get_world_size", lambda: gpus)
    batch, _, _ = config_utils.calculate_batch_size_info(global_batch, "auto")
    loader = type("Loader", (), {"batch_size": batch})()  # what LLM-Foundry's loader holds
    first = _get_initial_device_train_microbatch_size("auto", True, loader)
    assert (not tokens_fit_fp8(first)) == first_crashes
    config = copy.deepcopy(FINETUNE)
    config.update(global_train_batch_size=global_batch, device_train_microbatch_size="auto")
    found = [f for f in _lint(tmp_path, config, gpus) if f["rule"] == "FP8006"]
    assert [f["severity"] for f in found] == ["error" if first_crashes else "warning"]
    if first_crashes:
        assert f"first micro-batch (_get_initial_device_train_microbatch_size): at {first}," \
            in found[0]["message"]


def _epoch_end(findings: list[dict]) -> list[tuple[str, str]]:
    return [(f["key"], f["severity"]) for f in findings
            if f["rule"] == "FP8006" and "end of an epoch" in f["message"]]


def test_the_last_batch_of_an_epoch_with_pad_to_longest(tmp_path):
    """build_finetuning_dataloader's drop_last defaults to false and its DataLoader then yields
    each epoch's remainder as a last, smaller batch (any count of sequences)."""
    import inspect

    from llmfoundry.data.finetuning.dataloader import build_finetuning_dataloader
    from torch.utils.data import DataLoader

    assert inspect.signature(build_finetuning_dataloader).parameters["drop_last"].default is False
    assert [len(b) for b in DataLoader(list(range(21)), batch_size=16)] == [16, 5]
    config = copy.deepcopy(FINETUNE)
    config.update(global_train_batch_size=128)  # 16 per GPU on 8: micro-batches of 8 fit
    assert _epoch_end(_lint(tmp_path, config, 8)) == []  # drop_last: true
    del config["train_loader"]["drop_last"]
    assert _epoch_end(_lint(tmp_path, config, 8)) == [
        ("train_loader.dataset.pad_to_longest", "warning")]
    config["train_loader"]["drop_last"] = False
    assert _epoch_end(_lint(tmp_path, config, None)) == [("train_loader.drop_last", "warning")]
    config["train_loader"]["dataset"]["packing_ratio"] = 2.0  # bins padded to max_seq_len
    assert _epoch_end(_lint(tmp_path, config, 8)) == []


def test_a_gpu_count_no_launcher_runs_judges_no_global_batch(tmp_path):
    """compute.gpus -3 or 0 (MCLI refuses them) says nothing about the world size."""
    for gpus in (-3, 0):
        run = {"name": "llama-ft", "image": "mosaicml/llm-foundry:2.7.0_cu128-latest",
               "compute": {"gpus": gpus},
               "command": "composer train/train.py /mnt/config/parameters.yaml",
               "parameters": {**FINETUNE, "global_train_batch_size": 97}}
        assert [f for f in _lint(tmp_path, run, None) if f["rule"] == "FP8043"] == []
