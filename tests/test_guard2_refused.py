"""fp8_guard's budget refusing a fallback is on record, not only in a log line (QA s15): a tiny
LLM-Foundry run (te_swap's emulated backend) whose fault sits in a layer of more FP8 FLOPs than
`max_fallback_share` allows logs `fp8/guard/refused/<layer>` (hparams.json, MLflow), and
`foundry-fp8 report` says the guard wanted to move it. The shares are worked out here from the
tiny MPT's layer shapes, the flagged steps from the run's own numbers."""

from __future__ import annotations

import ast
import json

import pytest

from foundry_fp8.cli import main
from foundry_fp8.fault import InjectOutlier, stats_table
from foundry_fp8.guard import GuardConfig, GuardCore
from foundry_fp8.jsonl import read_jsonl
from tests.tiny_run import run_folder, run_tiny

LAYER = "blocks.1.ffn.down_proj"
START, INTERVAL, CONSECUTIVE, END = 2, 2, 2, 10
KEY = f"fp8/guard/refused/{LAYER}"
# the tiny MPT's FP8 linear GEMMs per token: 2 blocks x (64x192 + 64x64 + 64x256 + 256x64), and
# the tied 64x512 LM head in high precision; down_proj is one 256x64 GEMM
BLOCKS, TOTAL, DOWN = 2 * (64 * 192 + 64 * 64 + 64 * 256 + 256 * 64), 2 * 49152 + 64 * 512, 256 * 64
BUDGET = 0.1  # fp8_guard's default max_fallback_share (docs/fp8_guard.md)


def test_a_refusal_is_a_record_kept_in_the_checkpoint_state():
    """The budget's refusal of a layer worth 1/6 of the FP8 FLOPs: one record, its first step
    only, and back after `load_state_dict` (a resumed run logs it again unchanged)."""
    core = GuardCore(GuardConfig(), {"a": 0.5, "b": 0.1})
    table = {("a", "activation"): {"underflow_pct": 0.0}}
    for step in (4, 6):
        verdict = core.decide(step, ["a"], table)
        assert verdict.refused == ["a"] and not verdict.fallbacks
    assert core.records() == {"fp8/guard/refused/a": {
        "layer": "a", "step": 4, "flops_share": 0.5, "fallback_share": 0.5 / 0.6,
        "max_fallback_share": BUDGET}}
    again = GuardCore(GuardConfig(), {"a": 0.5, "b": 0.1})
    again.load_state_dict(json.loads(json.dumps(core.state_dict())))
    assert again.records() == core.records()


@pytest.mark.slow
def test_the_report_says_the_budget_refused_the_layer(tmp_path, tiny_data, capsys, monkeypatch):
    from llmfoundry.registry import callbacks
    from mlflow.tracking import MlflowClient

    callbacks.register("guard2_inject_outlier", func=InjectOutlier)
    monkeypatch.setenv("MLFLOW_ASYNC_LOGGING_THREADPOOL_SIZE", "1")  # docs/fp8_stats.md
    name, tracking = "refused", f"file://{tmp_path}/mlruns"
    trainer = run_tiny(tmp_path, tiny_data, {
        "variables": {"run_name": name}, "max_duration": f"{END}ba", "eval_interval": f"{END}ba",
        "save_interval": f"{END}ba",
        "callbacks": {"fp8_stats": {"interval": INTERVAL, "image_interval": None},
                      "guard2_inject_outlier": {"layer": LAYER, "start": START},
                      "fp8_guard": {"consecutive": CONSECUTIVE}},
        "loggers": {"mlflow": {"tracking_uri": tracking, "experiment_name": name}}})
    trainer.close()
    folder = run_folder(tmp_path, name)

    # the reference step: the first logging step at which one of the layer's tensors crossed a
    # default limit (underflow 5 %, overflow 1 %, cos_sim 0.99) at CONSECUTIVE logging steps in
    # a row, read from the run's own metrics (the layer stays in FP8 all run)
    bad: dict[str, list[int]] = {}
    for step, values in read_jsonl(folder / "metrics.jsonl"):
        for (layer, tensor), r in stats_table(values).items():
            if layer.endswith(LAYER) and not r.get("initial_scale") and (
                    r["underflow_pct"] > 5 or r["overflow_pct"] > 1 or r["cos_sim"] < 0.99):
                bad.setdefault(tensor, []).append(step)
    expected = min(s for steps in bad.values() for s in steps
                   if all(s - INTERVAL * k in steps for k in range(CONSECUTIVE)))

    hparams = json.loads((folder / "hparams.json").read_text())
    assert [k for k in hparams if k.startswith("fp8/guard/fallback/")] == []
    assert [k for k in hparams if k.startswith("fp8/guard/refused/")] == [KEY]
    record = hparams[KEY]
    assert record["step"] == expected
    assert record["flops_share"] == pytest.approx(DOWN / TOTAL)
    assert record["fallback_share"] == pytest.approx(DOWN / BLOCKS)  # 1/6
    assert record["max_fallback_share"] == BUDGET

    # MLflow holds the same record (Composer's MLFlowLogger logs a dict as its str)
    client = MlflowClient(tracking_uri=tracking)
    [experiment] = [e for e in client.search_experiments() if e.name == name]
    [mlrun] = client.search_runs([experiment.experiment_id])
    assert ast.literal_eval(mlrun.data.params[KEY]) == record

    capsys.readouterr()
    assert main(["report", str(folder)]) == 0
    out = capsys.readouterr().out
    md = (folder / "fp8_report.md").read_text()
    said = (f"fp8_guard wanted to move {LAYER} at step {expected} but the budget refused it "
            f"(share {100 * DOWN / BLOCKS:.1f} % > max_fallback_share {100 * BUDGET:g} %): "
            "raise callbacks.fp8_guard.max_fallback_share or exclude it in te_swap: ")
    assert "share 16.7 % > max_fallback_share 10 %" in said
    assert said + "algorithms: {te_swap: {exclude: '^(?:model\\.)?(?:transformer\\.)?blocks\\.1\\.ffn\\.down_proj(?:\\..+)?$'}}" in out
    section = md.split("## fp8_guard\n", 1)[1].split("\n## ", 1)[0]
    assert "moved no layer to high precision" in section and said in section
