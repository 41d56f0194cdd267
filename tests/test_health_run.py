"""FP8 health in real tiny LLM-Foundry runs: the healthy run is not flagged; a layer broken on
purpose (its weight scaled x1e4 at a logging step) is flagged by name, with the YAML key that
fixes it, on the console (fp8_stats' WARNING) and in `foundry-fp8 report`."""

from __future__ import annotations

import logging

import pytest
import torch
from composer.core import Callback, State
from composer.loggers import Logger

from foundry_fp8.cli import main
from foundry_fp8.health import parse_key
from foundry_fp8.health.keys import LOSS
from foundry_fp8.jsonl import read_jsonl
from tests.tiny_run import run_folder, run_tiny

BROKEN = "blocks.1.ffn.down_proj"


class BreakWeight(Callback):
    """Multiplies one layer's weight by `factor` at the start of batch `at_batch`."""

    def __init__(self, layer: str, at_batch: int, factor: float):
        self.layer, self.at_batch, self.factor = layer, at_batch, factor

    def batch_start(self, state: State, logger: Logger) -> None:
        if int(state.timestamp.batch) != self.at_batch:
            return
        [module] = [m for name, m in state.model.named_modules() if name.endswith(self.layer)]
        with torch.no_grad():
            module.weight.mul_(self.factor)


@pytest.fixture(scope="module", autouse=True)
def _registered():
    from llmfoundry.registry import callbacks

    callbacks.register("break_weight", func=BreakWeight)


def _overrides(run_name: str, **callbacks) -> dict:
    return {"variables": {"run_name": run_name}, "max_duration": "16ba",
            "eval_interval": "16ba", "save_interval": "16ba",
            "callbacks": {"fp8_stats": {"interval": "2ba"}, **callbacks}}


class _Warnings(logging.Handler):
    """fp8_stats' WARNING records, which `llmfoundry train` prints on the console (read here
    on the logger: pytest's own log capture keeps LLM-Foundry from installing its handler)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def fp8_warnings():
    handler, logger = _Warnings(), logging.getLogger("foundry_fp8.composer.stats")
    logger.addHandler(handler)
    yield handler.messages
    logger.removeHandler(handler)


@pytest.mark.slow
def test_the_healthy_tiny_run_is_not_flagged(tmp_path, tiny_data, capfd, fp8_warnings):
    run_tiny(tmp_path, tiny_data, _overrides("healthy"))
    folder = run_folder(tmp_path, "healthy")
    logged = [m for _, m in read_jsonl(folder / "metrics.jsonl") if any(map(parse_key, m))]
    assert len(logged) == 8  # steps 0, 2, ..., 14
    assert fp8_warnings == []
    assert all(m["fp8/flagged_layers"] == 0 for m in logged)
    # the loss (every batch) falls, unevenly: the report's loss line finds no spike in it
    losses = {step: m[LOSS] for step, m in read_jsonl(folder / "metrics.jsonl") if LOSS in m}
    steps = sorted(losses)
    assert losses[steps[-1]] < losses[steps[0]]
    capfd.readouterr()
    assert main(["report", str(folder)]) == 0
    out = capfd.readouterr().out
    assert "\n0 flagged\n" in out
    said = f"Loss: no spike at the logged steps {steps[0]} to {steps[-1]} (never more than "
    assert f"\n  {said}" in out
    md = (folder / "fp8_report.md").read_text()
    assert "No layer crosses a threshold." in md and f"\n{said}" in md


@pytest.mark.slow
def test_a_broken_layer_is_flagged_by_name_with_its_yaml_key(tmp_path, tiny_data, capfd,
                                                            fp8_warnings):
    run_tiny(tmp_path, tiny_data, _overrides(
        "broken", break_weight={"layer": BROKEN, "at_batch": 6, "factor": 1e4}))
    folder = run_folder(tmp_path, "broken")
    key = ("algorithms.te_swap.fp8_recipe.scaling: current (and remove amax_history_len, "
           "amax_compute_algo, margin, reduce_amax where set: delayed scaling only)")
    console = [w for w in fp8_warnings if f"layer '{BROKEN}'" in w and "FP8 weight" in w]
    assert console and console[0].startswith(f"FP8 weight of layer '{BROKEN}' at step 6: "
                                             "overflow_pct ")
    assert "amax spike" in console[0] and console[0].endswith(f"Change: {key}")
    by_step = {step: m for step, m in read_jsonl(folder / "metrics.jsonl")
               if "fp8/weight/flagged_layers" in m}
    assert by_step[6]["fp8/weight/flagged_layers"] >= 1 and by_step[4]["fp8/flagged_layers"] == 0
    capfd.readouterr()
    assert main(["report", str(folder)]) == 0
    out = capfd.readouterr().out
    assert f"'{BROKEN}' weight: overflow_pct" in out and f"Change: {key}" in out
    md = (folder / "fp8_report.md").read_text()
    assert f"| {BROKEN} | weight | overflow_pct |" in md and f"`{key}`" in md

