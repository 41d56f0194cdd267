"""fp8_stats' layer order (`fp8/layers`, QA F2 s22) in real Composer runs: not printed by the
console (Composer's ConsoleLogger yaml-dumps every hyperparameter at fit start, one line per
layer), still in hparams.json and MLflow; and a resume whose layers changed (te_swap's
fuse_ln_mlp: `ffn` against `ffn.up_proj`, `ffn.down_proj`), which MLflow refuses, warns and
goes on under `strict`."""

from __future__ import annotations

import ast
import json
import logging

import torch
from composer import Trainer
from composer.loggers import MLFlowLogger
from composer.models import ComposerClassifier
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from foundry_fp8.composer.jsonl_logger import JSONLLogger
from foundry_fp8.composer.stats import FP8Stats
from foundry_fp8.health.keys import LAYER_ORDER, layer_order


class _Dense(nn.Module):
    """nn.Linear's parameters under a module fp8_stats does not watch: a resume whose watched
    modules changed with the same weights, as after te_swap's fuse_ln_mlp."""

    def __init__(self) -> None:
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.zeros(8, 8)), nn.Parameter(torch.zeros(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)


def _fit(tmp_path, capsys, resume: bool = False) -> str:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(8, 8), torch.randint(0, 2, (8,)))
    layers = [_Dense() if resume and i % 2 else nn.Linear(8, 8) for i in range(12)]
    model = ComposerClassifier(nn.Sequential(*layers, nn.Linear(8, 2)), num_classes=2)
    mlflow = MLFlowLogger(tracking_uri=f"file:{tmp_path / 'mlruns'}", experiment_name="e",
                          run_name="run", resume=True, synchronous=True)
    checkpoint = {"load_path": str(next((tmp_path / "ckpt").glob("*.pt")))} if resume else {
        "save_folder": str(tmp_path / "ckpt"), "save_interval": "1ba"}
    trainer = Trainer(model=model, train_dataloader=DataLoader(data, batch_size=8),
                      max_duration=f"{1 + resume}ba", run_name="run", seed=17, device="cpu",
                      progress_bar=False, **checkpoint,
                      callbacks=[FP8Stats(interval=1, image_interval=None, strict=True)],
                      loggers=[JSONLLogger(path=str(tmp_path / f"{resume}" / "metrics.jsonl")),
                               mlflow], log_to_console=True)
    capsys.readouterr()
    trainer.fit()
    trainer.close()
    captured = capsys.readouterr()
    return captured.out + captured.err  # Composer's console: stderr


def test_the_layer_order_skips_the_console_and_a_refused_change_does_not_stop_a_strict_run(
        tmp_path, capsys, caplog):
    import mlflow

    out = _fit(tmp_path, capsys)
    assert "Config:\n" in out and "rank_zero_seed" in out  # the console printed hyperparameters
    assert LAYER_ORDER not in out and "- module.6\n" not in out
    layers = [f"module.{i}" for i in range(13)]
    assert layer_order(json.loads((tmp_path / "False" / "hparams.json").read_text())) == layers
    client = mlflow.MlflowClient(f"file:{tmp_path / 'mlruns'}")
    [run] = client.search_runs([client.get_experiment_by_name("e").experiment_id])
    assert layer_order({k: ast.literal_eval(v) for k, v in run.data.params.items()
                        if k.startswith(LAYER_ORDER)}) == layers
    with caplog.at_level(logging.WARNING):
        _fit(tmp_path, capsys, resume=True)  # other layers watched: MLflow refuses them
    refused = [r.getMessage() for r in caplog.records if "failed to log hyperparameters" in
               r.getMessage()]
    assert len(refused) == 1 and "MLFlowLogger" in refused[0], refused
    resumed = [layer for layer in layers if int(layer.split(".")[1]) % 2 == 0 or layer == layers[-1]]
    assert layer_order(json.loads((tmp_path / "True" / "hparams.json").read_text())) == resumed
