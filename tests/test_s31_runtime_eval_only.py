"""`llmfoundry eval` of a trained checkpoint under the training run's name, with the `jsonl`
logger in both YAMLs: the evaluation-only Trainer never fits, so the logger's check for an
earlier run (made at FIT_START) never ran. Its step-0 record went after the training's 12 steps,
which `foundry-fp8 report` read as a later attempt replacing them all (and then refused the run
for its missing per-layer series), and its hparams.json replaced the training's (recipe,
fp8_stats' thresholds) without a word. Now it is a fresh run reusing the name, as a training
run at batch 0 is: the training's files are moved aside, byte for byte, with one warning."""

from __future__ import annotations

import logging

import pytest

from foundry_fp8.jsonl import read_jsonl
from tests.tiny_run import run_tiny, tiny_config

NAME = "evaluated"


@pytest.mark.slow
def test_an_evaluation_under_the_training_runs_name_moves_its_records_aside(
        tmp_path, tiny_data, monkeypatch):
    from llmfoundry.command_utils import evaluate
    from omegaconf import OmegaConf as om

    monkeypatch.chdir(tmp_path)  # the evaluation has no save_folder: its run folder is runs/NAME
    runs = tmp_path / "runs"
    run_tiny(runs, tiny_data, {"variables": {"run_name": NAME}, "max_duration": "2ba",
                               "eval_interval": "2ba", "save_interval": "2ba"}).close()
    folder = runs / NAME
    trained = (folder / "metrics.jsonl").read_bytes()
    trained_hparams = (folder / "hparams.json").read_bytes()
    assert b'"fp8/recipe"' in trained_hparams

    train = tiny_config(runs, tiny_data, {"variables": {"run_name": NAME}})
    cfg = om.create({
        "run_name": NAME, "seed": 17, "max_seq_len": 64, "device_eval_batch_size": 8,
        "precision": "fp32", "eval_subset_num_batches": 1, "icl_tasks": [],
        "eval_loader": om.to_container(train.eval_loader, resolve=True),
        "models": [{"model_name": "ba2", "load_path": str(folder / "checkpoints/latest-rank0.pt"),
                    "model": om.to_container(train.model, resolve=True),
                    "tokenizer": om.to_container(train.tokenizer, resolve=True)}],
        "loggers": {"jsonl": {}}})
    # on the logger itself: LLM-Foundry reconfigures the root's handlers, caplog's among them
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("foundry_fp8.composer.jsonl_logger").addHandler(handler)
    try:
        evaluate(cfg)
    finally:
        logging.getLogger("foundry_fp8.composer.jsonl_logger").removeHandler(handler)

    assert (folder / "metrics.1.jsonl").read_bytes() == trained
    assert (folder / "hparams.1.json").read_bytes() == trained_hparams
    [(step, metrics)] = read_jsonl(folder / "metrics.jsonl")
    assert step == 0 and sorted(metrics) == ["metrics/eval/LanguageCrossEntropy",
                                             "metrics/eval/LanguagePerplexity",
                                             "metrics/eval/TokenAccuracy"]
    [said] = [r.getMessage() for r in records if "earlier run" in r.getMessage()]
    assert "runs/evaluated/metrics.1.jsonl" in said and "hparams.1.json" in said


def test_the_models_of_one_evaluation_share_one_file(tmp_path):
    """`llmfoundry eval` of several models builds the loggers once and gives each model's
    Trainer the same ones (llmfoundry/command_utils/eval.py, `evaluate`): the second model's
    evaluation is no fresh run that moves the first one's records aside, and says nothing."""
    import torch
    from composer import Trainer
    from composer.models import ComposerClassifier
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from foundry_fp8.composer.jsonl_logger import JSONLLogger

    path = tmp_path / "metrics.jsonl"
    shared = JSONLLogger(path=str(path))
    data = TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,)))
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("foundry_fp8.composer.jsonl_logger").addHandler(handler)
    try:
        for seed in (0, 1):
            torch.manual_seed(seed)
            trainer = Trainer(model=ComposerClassifier(nn.Linear(4, 2), num_classes=2),
                              run_name="llm", device="cpu", progress_bar=False,
                              loggers=[shared])
            trainer.eval(eval_dataloader=DataLoader(data, batch_size=8))
            trainer.close()
    finally:
        logging.getLogger("foundry_fp8.composer.jsonl_logger").removeHandler(handler)
    assert [step for step, _ in read_jsonl(path)] == [0, 0]
    assert not list(tmp_path.glob("metrics.*.jsonl")) and records == []
