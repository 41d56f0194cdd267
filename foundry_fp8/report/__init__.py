"""`foundry-fp8 report RUN_FOLDER`: the FP8 health of a run, per layer and tensor.

Reads the run's `metrics.jsonl` (the `jsonl` logger's; `fp8_stats` logs
`fp8_<stat>/<tensor>/<layer>`, see `health.keys`) and writes, into the run folder or `--out`:
`fp8_heatmap_<stat>.png` (layers x logging steps, one panel per tensor kind),
`fp8_timeseries.png` (amax and scales of a few layers) and `fp8_report.md` (flagged layers with
the likely cause and the YAML key to change, the worst layers, a reading guide, the plots and
the worst value per layer and tensor). Flags come from the same `health` rules `fp8_stats`
warned with during the run, with the run's own thresholds (hparams.json).

`read` (metrics and thresholds), `markdown` (the report), `cli` (the command); the plots and the
rules live in `foundry_fp8.health`. No torch.
"""

from foundry_fp8.report.cli import add_arguments, run

__all__ = ["add_arguments", "run"]
