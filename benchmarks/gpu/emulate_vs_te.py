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

import foundry_fp8.emulate as emulate  # noqa: E402
from foundry_fp8.emulate import EmulatedFP8Linear, fp8_autocast  # noqa: E402
from foundry_fp8.fp8_meta import read_fp8_meta  # noqa: E402
from foundry_fp8.numerics import dequantize  # noqa: E402
from foundry_fp8.recipe import FP8Recipe  # noqa: E402
from tests.test_emulate_gpu import _te_autocast, _te_recipe  # noqa: E402


def _split_fprop(te_linear_module: Any, recipe: Any, on: bool) -> None:
    """Force (or restore) the split accumulator in TE's forward GEMM."""
    te_linear_module._2X_ACC_FPROP = on
    if hasattr(recipe, "fp8_gemm_fprop"):
        from transformer_engine.common.recipe import MMParams

        recipe.fp8_gemm_fprop = MMParams(use_split_accumulator=on)


def run_case(te: Any, dtype: torch.dtype, scaling: str, split: bool) -> dict[str, Any]:
    import transformer_engine.pytorch.module.linear as te_linear

    recipe = FP8Recipe(amax_history_len=4) if scaling == "delayed" else FP8Recipe(scaling="current")
    torch.manual_seed(0)
    reference = te.Linear(768, 768, params_dtype=dtype, device="cuda")
    emulated = EmulatedFP8Linear(768, 768, dtype=dtype, device="cuda")
    with torch.no_grad():
        emulated.weight.copy_(reference.weight)
        emulated.bias.copy_(reference.bias)
    generator = torch.Generator(device="cuda").manual_seed(1)
    seen: list[tuple[torch.Tensor, torch.Tensor, str]] = []
    quantize = emulate.quantize

    def recording(x: torch.Tensor, scale: torch.Tensor, fmt: str) -> torch.Tensor:
        q = quantize(x, scale, fmt)
        seen.append((q, scale, fmt))
        return q

    steps = []
    emulate.quantize = recording
    default_split = te_linear._2X_ACC_FPROP
    try:
        for step in range(10):
            x = torch.randn(64, 768, device="cuda", generator=generator).to(dtype) * (step % 3 + 1)
            grad = torch.randn(64, 768, device="cuda", generator=generator).to(dtype) * 10 ** -step
            inputs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
            te_recipe = _te_recipe(recipe)
            _split_fprop(te_linear, te_recipe, split)
            with _te_autocast(te, te_recipe):
                out_te = reference(inputs[0])
            seen.clear()
            with fp8_autocast(recipe=recipe):
                out_emulated = emulated(inputs[1])
            (qx, sx, _), (qw, sw, _) = seen[:2]
            exact = (dequantize(qx, sx).double() @ dequantize(qw, sw).double().t()
                     + emulated.bias.to(torch.bfloat16 if dtype == torch.float32 else dtype)
                     .double())
            out_te.backward(grad)
            out_emulated.backward(grad)
            torch.cuda.synchronize()
            scale = out_te.detach().abs().max().item()

            def err(a: torch.Tensor, b: torch.Tensor) -> float:
                return (a.detach().double() - b.detach().double()).abs().max().item()

            row = {"step": step, "max_abs_out": scale,
                   "out_te_vs_emulated": err(out_te, out_emulated),
                   "out_te_vs_exact": err(out_te, exact),
                   "out_emulated_vs_exact": err(out_emulated, exact),
                   "dgrad": err(inputs[0].grad, inputs[1].grad),
                   "wgrad": err(reference.weight.grad, emulated.weight.grad),
                   "bgrad": err(reference.bias.grad, emulated.bias.grad)}
            if scaling == "delayed":
                got, want = read_fp8_meta(emulated), read_fp8_meta(reference)
                row["meta_bit_exact"] = all(torch.equal(got[k], want[k]) for k in (
                    "fwd_amax_history", "fwd_scale", "bwd_amax_history", "bwd_scale"))
            steps.append(row)
            with torch.no_grad():
                for p_te, p_emulated in ((reference.weight, emulated.weight),
                                         (reference.bias, emulated.bias)):
                    p_te -= 0.01 * p_te.grad
                    p_emulated.copy_(p_te)
            for p in (*reference.parameters(), *emulated.parameters()):
                p.grad = None
    finally:
        emulate.quantize = quantize
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
