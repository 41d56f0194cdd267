"""On a GPU with TE: the emulated FP8 Linear against `te.Linear` on identical weights, inputs and
output gradients, 10 steps, float32 and bfloat16, delayed and current scaling (the steps of
tests/test_emulate_gpu.py), with each forward output also compared with the exact product of
the FP8 operands the emulation quantized (float64), so a difference is placed on one side.

TE's forward FP8 GEMM accumulates in reduced precision on Hopper unless the recipe asks for a
split accumulator (`_2X_ACC_FPROP = False`, pytorch/module/base.py:83, used at
pytorch/module/linear.py:609-613; `Float8CurrentScaling.fp8_gemm_fprop` defaults to
`MMParams(use_split_accumulator=False)`, common/recipe/__init__.py:307). Each case runs twice:
TE as configured, and TE with the split accumulator forced for the forward GEMM.

    PYTHONPATH=$PWD/.gpu-site python3 benchmarks/gpu/emulate_vs_te.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from foundry_fp8.fp8_meta import read_fp8_meta  # noqa: E402
from tests.test_emulate_gpu import paired_steps  # noqa: E402


def _split_fprop(te_linear_module: Any, recipe: Any, on: bool) -> None:
    """Force (or restore) the split accumulator in TE's forward GEMM."""
    te_linear_module._2X_ACC_FPROP = on
    if hasattr(recipe, "fp8_gemm_fprop"):
        from transformer_engine.common.recipe import MMParams

        recipe.fp8_gemm_fprop = MMParams(use_split_accumulator=on)


def run_case(te: Any, dtype: torch.dtype, scaling: str, split: bool) -> dict[str, Any]:
    import transformer_engine.pytorch.module.linear as te_linear

    def err(a: torch.Tensor, b: torch.Tensor) -> float:
        return (a.detach().double() - b.detach().double()).abs().max().item()

    steps = []
    default_split = te_linear._2X_ACC_FPROP
    try:
        for step in paired_steps(te, dtype, scaling,
                                 lambda te_recipe: _split_fprop(te_linear, te_recipe, split)):
            reference, emulated = step.reference, step.emulated
            row = {"step": step.index, "max_abs_out": step.out_te.detach().abs().max().item(),
                   "out_te_vs_emulated": err(step.out_te, step.out_emulated),
                   "out_te_vs_exact": err(step.out_te, step.exact),
                   "out_emulated_vs_exact": err(step.out_emulated, step.exact),
                   "dgrad": err(step.dgrad_te, step.dgrad_emulated),
                   "wgrad": err(reference.weight.grad, emulated.weight.grad),
                   "bgrad": err(reference.bias.grad, emulated.bias.grad)}
            if scaling == "delayed":
                got, want = read_fp8_meta(emulated), read_fp8_meta(reference)
                row["meta_bit_exact"] = all(torch.equal(got[k], want[k]) for k in (
                    "fwd_amax_history", "fwd_scale", "bwd_amax_history", "bwd_scale"))
            steps.append(row)
    finally:
        te_linear._2X_ACC_FPROP = default_split
    return {"dtype": str(dtype).removeprefix("torch."), "scaling": scaling,
            "te_fprop_split_accumulator": split, "steps": steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args()
    from importlib.metadata import version

    import transformer_engine.pytorch as te

    cases = [run_case(te, dtype, scaling, split)
             for dtype in (torch.float32, torch.bfloat16) for scaling in ("delayed", "current")
             for split in (False, True)]
    result = {"gpu": torch.cuda.get_device_name(),
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "versions": {"torch": torch.__version__, "cuda": torch.version.cuda,
                           "transformer_engine": version("transformer_engine")},
              "tf32": {"matmul.allow_tf32": torch.backends.cuda.matmul.allow_tf32,
                       "float32_matmul_precision": torch.get_float32_matmul_precision()},
              "cases": cases}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "emulate_vs_te.json").write_text(json.dumps(result, indent=2) + "\n")
    for case in cases:
        worst = {k: max(s[k] / (s["max_abs_out"] if k.startswith("out") else 1)
                        for s in case["steps"])
                 for k in ("out_te_vs_emulated", "out_te_vs_exact", "out_emulated_vs_exact")}
        exact_meta = all(s.get("meta_bit_exact", True) for s in case["steps"])
        print(case["dtype"], case["scaling"], "split" if case["te_fprop_split_accumulator"]
              else "default", {k: f"{v:.2e}" for k, v in worst.items()}, "meta exact:", exact_meta)


if __name__ == "__main__":
    main()
