"""fp8_stats' fit-end summary at MLflow, read back with MLflow's own client: MLflow refuses a
changed param and its asynchronous logger then drops the whole queued batch (the run's other
params and metrics too), and it cuts a param's value at 6000 characters."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from foundry_fp8.composer.stats import SUMMARY_KEY, FP8Stats

mlflow = pytest.importorskip("mlflow")
pytestmark = pytest.mark.usefixtures("one_mlflow_thread")


def _trainer(tmp_path, width: int, name: str):
    from composer import Trainer
    from composer.loggers import MLFlowLogger
    from composer.models import ComposerClassifier
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 8), torch.randint(0, 2, (64,)))
    layers = [nn.Linear(8, 8) for _ in range(width)]
    model = ComposerClassifier(nn.Sequential(*layers, nn.Linear(8, 2)), num_classes=2)
    logger = MLFlowLogger(tracking_uri=f"file://{tmp_path}/mlruns", experiment_name="fp8",
                          run_name=name)
    trainer = Trainer(model=model, train_dataloader=DataLoader(data, batch_size=8),
                      max_duration="4ba", callbacks=[FP8Stats(interval=2, image_interval=None)],
                      loggers=[logger], device="cpu", progress_bar=False, log_to_console=False)
    return trainer, logger


def _read(tmp_path, logger):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"file://{tmp_path}/mlruns")
    run = client.get_run(logger._run_id)
    return run.data.params, client.get_metric_history(run.info.run_id, "loss/train/total")


def test_a_second_fit_keeps_the_runs_params_and_metrics(tmp_path):
    """fit() twice: the second summary differs from the first; under one key MLflow refused it
    and dropped the batch holding it (QA: 0 params, 0 metrics in the run)."""
    trainer, logger = _trainer(tmp_path, 1, "twice")
    trainer.fit()
    trainer.fit(duration="2ba")
    trainer.close()
    params, losses = _read(tmp_path, logger)
    assert [m.step for m in losses] == list(range(6))
    assert SUMMARY_KEY in params and f"{SUMMARY_KEY}.ba6" in params
    assert params[SUMMARY_KEY] != params[f"{SUMMARY_KEY}.ba6"]  # each fit's own worst values


def test_a_long_summary_is_cut_at_a_row_and_says_so(tmp_path, capsys):
    """30 layers x 3 tensors: a summary over MLflow's 6000 characters reaches it cut at a row's
    end, with a line saying what was left out, not cut mid-row by MLflow."""
    trainer, logger = _trainer(tmp_path, 30, "long")
    trainer.fit()
    trainer.close()
    printed = capsys.readouterr().out.split("worst value per layer and tensor\n", 1)[1]
    params, _ = _read(tmp_path, logger)
    value = params[SUMMARY_KEY]
    assert len(printed) > 6000 >= len(value)
    head, note = value.rsplit("\n", 1)
    assert printed.startswith(head + "\n")
    left = len(printed.rstrip("\n").splitlines()) - len(head.splitlines())
    assert note.startswith(f"... {left} more lines: ")


def test_fp8_guards_records_are_keys_mlflow_keeps(tmp_path):
    """A layer's second fallback was logged under `<layer>@<step>`: MLflow refuses `@` in a key
    and, logging asynchronously as Composer's MLflow logger does, drops the whole batch with it
    (the first fallback's record and the re-promotion's too)."""
    from mlflow.tracking import MlflowClient

    from foundry_fp8.guard import GuardConfig, GuardCore
    from tests.test_guard import REPROMOTION_FLOPS, repromotion_run

    core = GuardCore(GuardConfig(consecutive=2, repromote_after=3, max_fallback_share=0.5),
                     REPROMOTION_FLOPS)
    repromotion_run(core, range(8))  # a falls back at 1, is back at 5, falls back at 7
    records = core.records()
    assert len(records) == 3
    mlflow.set_tracking_uri(f"file://{tmp_path}/mlruns")
    with mlflow.start_run() as run:
        mlflow.log_params(records, synchronous=False)
    params = MlflowClient().get_run(run.info.run_id).data.params
    assert params == {key: str(value) for key, value in records.items()}


class _TEDebugStub:
    """fp8_stats' TE debug session (TE is not installed here) as far as the callback sees it:
    at each logging step's `step()` it hands over one statistic under a name MLflow refuses,
    the one `te.debug.metric_name` gave TE's `underflows%` before it read `_pct`."""

    NAME = "fp8_te_underflows%/activation/module.0"

    def __init__(self, sink) -> None:
        self.sink = sink

    def name_layers(self, modules) -> None:
        pass

    def pause(self) -> None:
        pass

    def resume(self) -> None:
        pass

    def start_at(self, iteration: int) -> None:
        pass

    def step(self) -> None:
        self.sink(self.NAME, 0.5)

    def close(self) -> None:
        pass


def test_a_metric_name_mlflow_refuses_costs_mlflow_nothing_else(tmp_path, caplog):
    """A `%` in a name (TE's `underflows%` under `te_debug`, before `te.debug.our_stat`):
    MLflow's asynchronous queue dropped the whole batch with it, every FP8 series and
    Composer's loss of those steps (the run held no metric at all). Now that name alone stays
    out of MLflow, with one warning; read back with MLflow's client."""
    import logging

    from mlflow.tracking import MlflowClient

    trainer, logger = _trainer(tmp_path, 1, "percent")
    stats = next(c for c in trainer.state.callbacks if isinstance(c, FP8Stats))
    stats.te_debug = _TEDebugStub(stats._te_metrics.__setitem__)
    with caplog.at_level(logging.WARNING):
        trainer.fit()
        trainer.close()
    client = MlflowClient(tracking_uri=f"file://{tmp_path}/mlruns")
    run_id = client.get_run(logger._run_id).info.run_id

    def steps(key: str) -> list[int]:
        return sorted(m.step for m in client.get_metric_history(run_id, key))

    assert steps("loss/train/total") == [0, 1, 2, 3]
    assert steps("fp8_amax/activation/module.0") == [0, 2]
    assert steps("fp8_amax/gradient/module.1") == [0, 2]
    warned = [r.getMessage() for r in caplog.records if "MLflow refuses" in r.getMessage()]
    assert warned == [f"fp8_stats: MLflow refuses the metric names {_TEDebugStub.NAME}; they "
                      "are left out of MLflow only (every other logger gets them), so that "
                      "MLflow does not drop the step's other metrics with them"]


def test_fp8_guards_long_fallback_table_is_cut_at_a_row_and_says_so(tmp_path, capsys):
    """fp8_guard's fit-end table, `fp8/guard/fallbacks`, of 60 fallbacks (a 70B model's 10 %
    budget holds about that many layers): over MLflow's 6000 characters it reached MLflow cut
    mid-row by MLflow, with nothing saying so; now cut at a row's end with a line saying what
    was left out, as fp8_stats' summary."""
    from composer import Trainer
    from composer.loggers import MLFlowLogger
    from composer.models import ComposerClassifier
    from torch.utils.data import DataLoader, TensorDataset

    from foundry_fp8.composer.guard import FP8Guard
    from foundry_fp8.composer.te_swap import TESwap
    from foundry_fp8.guard import FALLBACKS_KEY, Fallback

    class Blocks(nn.Module):  # te_swap converts the linear layers of `blocks.<n>`
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([nn.Linear(16, 16)])
            self.head = nn.Linear(16, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.blocks[0](x))

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(16, 16), torch.randint(0, 2, (16,)))
    model = ComposerClassifier(Blocks(), num_classes=2)
    logger = MLFlowLogger(tracking_uri=f"file://{tmp_path}/mlruns", experiment_name="fp8",
                          run_name="guard")
    guard = FP8Guard()
    trainer = Trainer(model=model, train_dataloader=DataLoader(data, batch_size=8),
                      max_duration="2ba", algorithms=[TESwap(backend="emulate")],
                      callbacks=[FP8Stats(interval=1, image_interval=None), guard],
                      loggers=[logger], device="cpu", progress_bar=False, log_to_console=False)
    trainer.fit()
    assert guard.core is not None and not guard.core.fallbacks
    flagged = ("activation underflow_pct 21.9 % (> 1 %)",
               "gradient overflow_pct 0.406 % (> 0.1 % with scale_ratio > 1.04)")
    for n in range(60):  # what a long run's decisions leave, rendered at fit end
        layer = f"model.layers.{n}.mlp.down_proj"
        guard.core.fallbacks[layer] = Fallback(layer, n, 0.0015, ("flagged",), {}, flagged)
    guard.fit_end(trainer.state, trainer.logger)
    trainer.close()
    printed = capsys.readouterr().out.split("layers moved to high precision\n", 1)[1]
    # the table, up to the line after it (the YAML, or that te_swap keeps these layers already:
    # the layers made up here were not judged in this run)
    table = re.split(r"\n(?:Next time:|te_swap already keeps)", printed, maxsplit=1)[0]
    params, _ = _read(tmp_path, logger)
    value = params[FALLBACKS_KEY]
    assert len(table) > 6000 >= len(value)
    head, note = value.rsplit("\n", 1)
    assert table.startswith(head + "\n")
    left = len(table.splitlines()) - len(head.splitlines())
    assert note.startswith(f"... {left} more lines: ")
