"""The report's "FP8 is not working for this run as a whole" rule counts the run's FP8 layers:
te_swap's `fp8/modules_converted` also counted converted LayerNorms (te.LayerNorm runs no FP8
GEMM), so 8 FP8 linears all flagged out of 12 converted modules gave no whole-run line but an
exclude of all 8. te_swap now logs `fp8/modules_in_fp8` (`Decision.in_fp8`), which the report
reads (`fp8/modules_converted` for an older run)."""

from __future__ import annotations

from types import SimpleNamespace

from foundry_fp8.composer.te_swap import TESwap
from foundry_fp8.health.keys import MODULES_CONVERTED, MODULES_IN_FP8
from foundry_fp8.report.markdown import fp8_layers, whole_run
from foundry_fp8.report.read import swap_filters
from foundry_fp8.swap import Decision, SwapPlan

LINEARS = [f"blocks.{b}.{m}" for b in range(2) for m in ("attn.Wqkv", "attn.out_proj",
                                                          "ffn.up_proj", "ffn.down_proj")]
NORMS = [f"blocks.{b}.{n}" for b in range(2) for n in ("norm_1", "norm_2")]


def test_te_swap_logs_the_modules_whose_gemms_run_in_fp8():
    plan = SwapPlan(tuple([Decision(n, "linear", True, "converted", 8, 8, 64, 128, 1 / 8)
                           for n in LINEARS] +
                          [Decision(n, "layernorm", True, "converted", 8, 8, 16) for n in NORMS]),
                    "te", 1024)
    logged: dict = {}
    destination = SimpleNamespace(log_hyperparameters=logged.update)
    state = SimpleNamespace(model=None, precision=SimpleNamespace(value="amp_bf16"))
    TESwap(backend="emulate")._say_coverage(state, SimpleNamespace(destinations=[destination]),
                                            plan, 0)
    assert (logged[MODULES_CONVERTED], logged[MODULES_IN_FP8]) == (12, 8)


def test_the_report_counts_fp8_layers_not_converted_layernorms():
    run = swap_filters({MODULES_CONVERTED: 12, MODULES_IN_FP8: 8}, LINEARS)
    said = whole_run(LINEARS, fp8_layers(LINEARS, run), "are flagged")
    assert said is not None and "8 of its 8 FP8 layers are flagged" in said
    older = swap_filters({MODULES_CONVERTED: 8}, LINEARS)  # before fp8/modules_in_fp8
    assert fp8_layers(LINEARS, older).count == 8
