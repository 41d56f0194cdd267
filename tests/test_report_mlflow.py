"""`foundry-fp8 report` of an MLflow run (a Databricks or MosaicML user logs to MLflow only),
read with MLflow's own client: the tiny MPT through LLM-Foundry's `train` with the mlflow (file
store) and jsonl loggers; the report from MLflow says what the report from the jsonl says.
The old report answered an MLflow run with "add the jsonl logger"."""

from __future__ import annotations

import sys

import pytest

from foundry_fp8 import wandb_history
from foundry_fp8.cli import main
from foundry_fp8.health import parse_key
from foundry_fp8.jsonl import read_jsonl
from tests.tiny_run import run_folder, run_tiny

mlflow = pytest.importorskip("mlflow")
pytestmark = pytest.mark.usefixtures("one_mlflow_thread")

LIMIT = 0.05  # fp8_stats' max_underflow_pct: the down_proj activations (about 0.1 %) only
INTERVAL = 2


def _report(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[str, str]:
    """(the terminal's worst-values table, the rest from `N flagged` to the plots)."""
    assert main(["report", *argv]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    table, _, rest = out.partition("\n\n")
    return table, rest.split("plots (")[0]


def _flagged_section(markdown: str) -> str:
    """fp8_report.md's headline and flagged table: its lines naming a flag."""
    return "\n".join(line for line in markdown.splitlines()
                     if line.startswith("First flagged") or "Likely cause" in line
                     or line.startswith("| `"))


def _layer_order(markdown: str) -> list[str]:
    """The layers in the order fp8_report.md's worst-value table lists its rows of 0 %
    underflow (ties: the run's layer order)."""
    table = markdown.split("## Worst value per layer and tensor")[1]
    return list(dict.fromkeys(cells[1].strip() for line in table.splitlines()
                              if len(cells := line.split("|")) > 3 and cells[3].strip() == "0"))


def _but_sources(markdown: str) -> str:
    """fp8_report.md less the line naming where the thresholds were read."""
    return "\n".join(line for line in markdown.splitlines()
                     if not line.startswith("Thresholds from"))


@pytest.mark.slow
def test_the_report_of_an_mlflow_or_wandb_run_is_the_report_of_its_jsonl(tmp_path, tiny_data,
                                                                         capsys, monkeypatch):
    """One run, three sinks, one report: the same lines, tables and layer order (the model's,
    fp8_stats' record `fp8/layers`). Before it, W&B's history rows came back with their keys in
    another order each and MLflow sorted them by name (`ffn.down_proj` before `ffn.up_proj`):
    tables, groups, the time series' "last block" and a step's flags in cast order differed."""
    name, tracking = "mlflow", f"file://{tmp_path}/mlruns"
    run_tiny(tmp_path, tiny_data, {
        "variables": {"run_name": name}, "max_duration": "12ba", "eval_interval": "12ba",
        "save_interval": "100ba",
        "callbacks": {"fp8_stats": {"interval": f"{INTERVAL}ba", "image_interval": None,
                                    "max_underflow_pct": LIMIT}},
        # Composer's default log_duplicated_metric_every_n_steps (100): MLflow holds a value
        # equal to the key's last only once (an overflow_pct of 0 at step 0)
        "loggers": {"mlflow": {"tracking_uri": tracking, "experiment_name": name}}},
        wandb=True).close()
    folder = run_folder(tmp_path, name)
    wandb_history.read_runs(folder, wait=120)  # W&B's service may still be writing the file
    capsys.readouterr()  # the training's console

    # the reference: the (layer, tensor) rows over the limit, from the jsonl itself (less
    # those cast with delayed scaling's initial scale, marked and not judged)
    over = sorted({(p[2], p[1]) for step, metrics in read_jsonl(folder / "metrics.jsonl")
                   for key, value in metrics.items()
                   if (p := parse_key(key)) and p[0] == "underflow_pct" and value > LIMIT
                   and not metrics.get(f"fp8_initial_scale/{p[1]}/{p[2]}")})
    assert over == [("blocks.0.ffn.down_proj", "activation"),
                    ("blocks.1.ffn.down_proj", "activation")]

    [run_dir] = (tmp_path / "mlruns").glob("*/*/meta.yaml")
    run_dir = run_dir.parent
    jsonl_table, jsonl_said = _report([str(folder), "--out", str(tmp_path / "j")], capsys)
    assert f"{len(over)} flagged\n  First flagged at step " in jsonl_said
    assert all(f"'{layer}' act" in jsonl_said for layer, _ in over)
    markdown = (tmp_path / "j" / "fp8_report.md").read_text()
    assert _flagged_section(markdown).count("First flagged") == 1
    # MPT's forward order (llmfoundry/models/layers/blocks.py, attention.py, ffn.py)
    assert _layer_order(markdown) == [f"blocks.{b}.{layer}" for b in (0, 1) for layer in (
        "attn.Wqkv", "attn.out_proj", "ffn.up_proj", "ffn.down_proj")]
    assert "Time series show `blocks.0.attn.Wqkv` (first block), " in markdown
    assert "`blocks.1.ffn.down_proj` (last block; " in markdown
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking)
    for n, given in enumerate([run_dir, run_dir.parent, f"mlflow:{run_dir.name}",
                               folder / "wandb"]):
        table, said = _report([str(given), "--out", str(tmp_path / f"m{n}")], capsys)
        assert said == jsonl_said, given
        assert table == jsonl_table, given
        assert _but_sources((tmp_path / f"m{n}" / "fp8_report.md").read_text()) == _but_sources(
            markdown), given


def test_an_mlflow_run_without_mlflow_installed_is_one_line(tmp_path, capsys, monkeypatch):
    for module in ("mlflow", "mlflow.exceptions", "mlflow.tracking"):  # as if not installed
        monkeypatch.setitem(sys.modules, module, None)  # their import raises ImportError
    assert main(["report", "mlflow:0123abcd"]) == 2
    out = capsys.readouterr()
    assert out.err == ("error: mlflow:0123abcd: an MLflow run: reading it needs MLflow, not "
                       "installed here (pip install mlflow)\n")


class _Logs:
    """A callback logging `records[step]` at its steps, through Composer's logger."""

    def __new__(cls, records: dict[int, dict[str, float]]):
        from composer.core import Callback

        class Logs(Callback):
            def batch_end(self, state, logger) -> None:
                step = int(state.timestamp.batch) - 1
                if step in records:
                    logger.log_metrics(records[step], step)

        return Logs()


def test_values_composers_mlflow_logger_skipped_and_renamed_keys_are_read_back(tmp_path):
    """Composer's MLFlowLogger skips a value equal to a key's last logged within
    log_duplicated_metric_every_n_steps (here 4) and renames keys by rename_metrics: the report
    reads back the values the run logged (the reference: the records given to the logger)."""
    import torch
    from composer import Trainer
    from composer.loggers import MLFlowLogger
    from composer.models import ComposerClassifier
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from foundry_fp8.health import collect
    from foundry_fp8.report.mlflow_run import load_mlflow, mlflow_run

    under = [0.0, 0.0, 0.0, 0.0, 5.0, 5.0]  # logged at 0, 4 (4 steps on), 8; skipped at 2, 6, 10
    records = {2 * n: {"fp8_underflow_pct/activation/blocks.0.fc": u,
                       "fp8_amax/activation/blocks.0.fc": 1.0 + n,
                       "fp8_underflow_pct/activation/blocks.1.fc": 0.0}
               for n, u in enumerate(under)}
    records[0]["fp8_initial_scale/activation/blocks.1.fc"] = 1.0  # a marker, at step 0 only
    renamed = "fp8_underflow_pct/activation/blocks.1.fc"
    logger = MLFlowLogger(tracking_uri=f"file://{tmp_path}/mlruns", experiment_name="fp8",
                          synchronous=True, log_duplicated_metric_every_n_steps=4,
                          rename_metrics={renamed: "b1_underflow"})
    data = TensorDataset(torch.randn(12, 4), torch.randint(0, 2, (12,)))
    trainer = Trainer(model=ComposerClassifier(nn.Linear(4, 2), num_classes=2),
                      train_dataloader=DataLoader(data, batch_size=1), max_duration="12ba",
                      callbacks=[_Logs(records)], loggers=[logger], device="cpu",
                      progress_bar=False, log_to_console=False)
    trainer.logger.log_hyperparameters({"loggers": {"mlflow": {
        "log_duplicated_metric_every_n_steps": 4, "rename_metrics": {renamed: "b1_underflow"}}}})
    trainer.fit()
    trainer.close()
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"file://{tmp_path}/mlruns")
    held = client.get_metric_history(logger._run_id, "fp8_underflow_pct/activation/blocks.0.fc")
    assert [m.step for m in held] == [0, 4, 8]  # what Composer's logger sent
    [run_dir] = (tmp_path / "mlruns").glob("*/*/meta.yaml")
    ml = mlflow_run(run_dir.parent)
    assert ml is not None
    run, _, _ = load_mlflow(ml, print)
    expected = collect(sorted(records.items()))
    assert run.values == expected.values
    assert run.initial == expected.initial
