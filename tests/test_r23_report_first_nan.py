"""NaN first in one layer long after an unrelated flag (QA s23): the loss line said `Loss is
nan at step 21 (...), 16 steps after the first FP8 flag (step 5)`, the first flag an underflow
in another layer, and named no tensor the NaN began in; the flagged table listed it among the
layers that followed it a step later. Now the loss line names where NaN/Inf first showed."""

from __future__ import annotations

import math

from foundry_fp8.cli import main
from foundry_fp8.health.keys import LOSS, layer_key
from foundry_fp8.jsonl import JsonlSink

LAYERS = ("blocks.0.fc", "blocks.1.fc", "blocks.2.fc")


def test_the_loss_line_names_the_first_nan_tensor(tmp_path, capsys):
    sink = JsonlSink(tmp_path / "metrics.jsonl")
    for step in range(30):
        metrics = {LOSS: 3.0 if step < 21 else math.nan}
        for i, layer in enumerate(LAYERS):
            for tensor in ("activation", "weight", "gradient"):
                creeping = layer == "blocks.0.fc" and tensor == "weight" and step >= 5
                # NaN shows in blocks.1.fc's gradient at step 20, in every tensor from 21
                nan = 4 if step > 20 and i >= 1 or (step == 20 and (i, tensor) == (
                    1, "gradient")) else 0
                metrics |= {layer_key("underflow_pct", tensor, layer): 25.0 if creeping else 0.1,
                            layer_key("cos_sim", tensor, layer): 0.9995,
                            layer_key("nan_count", tensor, layer): nan}
        sink.write(step, metrics)
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    loss_line = next(line for line in out.splitlines() if line.startswith("  Loss is nan"))
    assert loss_line.endswith(
        "16 steps after the first FP8 flag (step 5). Not back within the ratio by the last logged"
        " step, 29. The first NaN/Inf in a tensor: step 20, 'blocks.1.fc' gradient nan_count 4."
    ), loss_line
    md = (tmp_path / "fp8_report.md").read_text()
    assert "The first NaN/Inf in a tensor: step 20, `blocks.1.fc` gradient nan_count 4." in md
