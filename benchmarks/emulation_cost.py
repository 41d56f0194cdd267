"""What the emulated FP8 backend costs on CPU: forward+backward time of a model with its linear
layers emulated in FP8 (`EmulatedFP8Linear` under `fp8_autocast`), relative to the same model
with the same weights without FP8.

Two models: the tiny MPT of `yamls/mpt-tiny-cpu.yaml` (the layers te_swap converts there, batch
8 x 64 tokens) and a stack of four 1024x1024 linear layers (1024 tokens), in float32 (delayed
and current scaling) and the stack in bfloat16 too. Each round times both variants, alternating
which goes first, so load changes on a shared machine fall on both; figures are medians over
rounds with their spread.

    .venv/bin/python benchmarks/emulation_cost.py [--rounds 7] [--steps 5]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from foundry_fp8.emulate import EmulatedFP8Linear, fp8_autocast  # noqa: E402
from foundry_fp8.recipe import FP8Recipe  # noqa: E402
from foundry_fp8.swap import SwapConfig, apply_swap, plan_swap  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"


def tiny_mpt() -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]:
    """The tiny YAML's MPT (d_model 64, 2 blocks) and a step computing its LM loss."""
    from llmfoundry.models.mpt import MPTConfig, MPTForCausalLM

    torch.manual_seed(0)
    config = MPTConfig(d_model=64, n_heads=4, n_layers=2, expansion_ratio=4, max_seq_len=64,
                       vocab_size=512, attn_config={"attn_impl": "torch"})
    model = MPTForCausalLM(config)
    ids = torch.randint(0, 512, (8, 64), generator=torch.Generator().manual_seed(1))

    def loss(m: nn.Module) -> torch.Tensor:
        return m(input_ids=ids, labels=ids).loss

    return model, loss


def linear_stack(dtype: torch.dtype) -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(1024, 1024) for _ in range(4))).to(dtype)
    x = torch.randn(1024, 1024, generator=torch.Generator().manual_seed(1)).to(dtype)
    x.requires_grad_()

    def loss(m: nn.Module) -> torch.Tensor:
        return m(x).float().square().mean()

    return model, loss


def emulated(model: nn.Module, mpt: bool) -> tuple[nn.Module, int]:
    """A copy with the linear layers emulated: te_swap's plan for the MPT, every layer for the
    stack. Returns the copy and how many layers it converted."""
    model = copy.deepcopy(model)
    if mpt:
        return model, apply_swap(model, plan_swap(model, SwapConfig(backend="emulate")))
    for i, layer in enumerate(model):
        model[i] = EmulatedFP8Linear.from_linear(layer)
    return model, len(model)


def time_steps(model: nn.Module, loss: Callable[[nn.Module], torch.Tensor],
               context: Callable[[], AbstractContextManager], steps: int) -> float:
    """Median seconds of a forward+backward, after one warm-up step."""
    times = []
    for step in range(steps + 1):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        with context():
            value = loss(model)
        value.backward()
        if step:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(name: str, build: Callable[[], tuple[nn.Module, Callable]], mpt: bool,
            recipe: FP8Recipe, rounds: int, steps: int) -> dict[str, Any]:
    plain, loss = build()
    fp8_model, converted = emulated(plain, mpt)
    base, emu = [], []
    for r in range(rounds):
        order = [("plain", plain, nullcontext), ("emulated", fp8_model,
                                                 lambda: fp8_autocast(recipe=recipe))]
        for label, model, context in (order if r % 2 == 0 else order[::-1]):
            seconds = time_steps(model, loss, context, steps)
            (base if label == "plain" else emu).append(seconds)
    ratios = [e / b for e, b in zip(emu, base, strict=True)]
    row = {"name": name, "layers_emulated": converted, "scaling": recipe.scaling,
           "plain_ms": 1000 * statistics.median(base), "emulated_ms": 1000 * statistics.median(emu),
           "ratio": statistics.median(ratios), "ratio_min": min(ratios),
           "ratio_max": max(ratios)}
    print(f"{name:32s} {row['plain_ms']:8.1f} ms {row['emulated_ms']:8.1f} ms "
          f"x{row['ratio']:.2f} ({row['ratio_min']:.2f}-{row['ratio_max']:.2f})", flush=True)
    return row


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "absent"


def _git() -> str:
    try:
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "foundry_fp8"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + (" + uncommitted changes" if dirty else "")


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def write_markdown(report: dict[str, Any], path: Path) -> None:
    rows = "\n".join(
        f"| {r['name']} | {r['layers_emulated']} | {r['scaling']} | {r['plain_ms']:.1f} | "
        f"{r['emulated_ms']:.1f} | **{r['ratio']:.2f}x** ({r['ratio_min']:.2f}-{r['ratio_max']:.2f}) |"
        for r in report["results"])
    versions = ", ".join(f"{k} {v}" for k, v in report["versions"].items())
    load = report["load_average"]
    path.write_text(f"""# Cost of the emulated FP8 backend on CPU ({report['date']})

Command: `{report['command']}`
Machine: {report['machine']['cpu']}, {report['machine']['cores']} cores (shared with other
jobs; load average {load['before'][0]:.2f} before, {load['after'][0]:.2f} after, {report['duration_s']} s).
Versions: {versions}.

Forward+backward of each model with its linear layers emulated in FP8 (`EmulatedFP8Linear`
inside `fp8_autocast`), against the same model and weights without FP8. {report['rounds']}
rounds, each timing both variants ({report['steps']} steps after a warm-up, median), the order
alternating; figures are medians over rounds (min-max of the per-round ratio).

| model | layers emulated | scaling | plain ms/step | emulated ms/step | emulated / plain |
|---|---|---|---|---|---|
{rows}

The tiny MPT converts only its block GEMMs (attention and embedding stay high precision), so
its ratio is diluted by the rest of the model; the 1024x1024 stack shows the per-layer cost:
each GEMM's operands are cast through saturating FP8 round trips (amax, scale, clamp, two
dtype casts), the amax recorded, and the GEMM run in float32 whatever the model's dtype (a
bfloat16 model pays for float32 GEMMs, which on CPU can be cheaper than bfloat16 ones).
Emulation is for studying FP8 numerics anywhere, not for speed.
""")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    started, load_before = time.monotonic(), os.getloadavg()
    delayed, current = FP8Recipe(), FP8Recipe(scaling="current")
    cases = [("tiny MPT, fp32", tiny_mpt, True, delayed),
             ("tiny MPT, fp32", tiny_mpt, True, current),
             ("4x Linear(1024, 1024), fp32", lambda: linear_stack(torch.float32), False, delayed),
             ("4x Linear(1024, 1024), fp32", lambda: linear_stack(torch.float32), False, current),
             ("4x Linear(1024, 1024), bf16", lambda: linear_stack(torch.bfloat16), False, delayed)]
    results = [measure(name, build, mpt, recipe, args.rounds, args.steps)
               for name, build, mpt, recipe in cases]
    report = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "duration_s": round(time.monotonic() - started),
        "command": "python benchmarks/emulation_cost.py " + " ".join(argv or sys.argv[1:]),
        "machine": {"cpu": _cpu(), "cores": os.cpu_count(), "platform": platform.platform()},
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "llm-foundry": _version("llm-foundry"), "foundry-fp8": f"0.1.0 (git {_git()})",
                     "torch_threads": str(torch.get_num_threads())},
        "load_average": {"before": list(load_before), "after": list(os.getloadavg())},
        "rounds": args.rounds, "steps": args.steps, "results": results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "emulation_cost_cpu.json").write_text(json.dumps(report, indent=2) + "\n")
    write_markdown(report, args.out / "emulation_cost_cpu.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
