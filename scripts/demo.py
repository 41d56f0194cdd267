"""The main job behind `make run` (this repository's own, not shipped): train the tiny MPT with
our callbacks, then report.

The training run goes through LLM-Foundry's own `llmfoundry train` command, exactly as a user
would start it: `yamls/mpt-tiny-cpu.yaml` with `te_swap` (emulated FP8 backend), `fp8_lint` and
`fp8_stats`, logging to W&B
(offline) and to a local JSONL file; then `foundry-fp8 report` summarises the FP8 statistics.
"""

from __future__ import annotations

import argparse
import math
import shutil
import subprocess
import sys
from pathlib import Path

from foundry_fp8 import wandb_history
from foundry_fp8.cli import EXIT_INTERRUPTED, interrupted_by
from foundry_fp8.jsonl import read_jsonl

TINY_YAML = Path(__file__).resolve().parents[1] / "yamls" / "mpt-tiny-cpu.yaml"
RUN_NAME = "mpt-tiny-cpu"
RESUME_STEP = 20
GUARD = "callbacks.fp8_guard={}"  # healthy, it never acts (step 3 shows it acting)


def _train(data_root: Path, run_root: Path, run_name: str, *extra: str) -> None:
    llmfoundry = Path(sys.executable).with_name("llmfoundry")
    cmd = [str(llmfoundry), "train", str(TINY_YAML), f"variables.data_root={data_root}",
           f"variables.run_root={run_root}", f"variables.run_name={run_name}", *extra]
    print("$", " ".join(cmd), flush=True)
    from foundry_fp8.fault import run_logged  # torch and Composer: not before the first line

    log = run_root / f"{run_name}.log"
    returncode = run_logged(cmd, log, run_root / run_name)
    # Our warnings and the loss are what a user looks for in the log.
    for line in log.read_text().splitlines():
        if "foundry_fp8" in line or line.startswith(("|", "+")) or "Train loss/train/total" in line:
            print("  " + line)
    if returncode != 0:
        raise SystemExit(f"training failed (exit {returncode}); full log: {log}")


def _losses(metrics_file: Path) -> dict[int, float]:
    return {step: m["loss/train/total"] for step, m in read_jsonl(metrics_file)
            if "loss/train/total" in m}


def compare_resume(full: Path, resumed: Path, final_step: int) -> list[str]:
    """Differences between the uninterrupted and the resumed run (empty when identical)."""
    import torch

    from foundry_fp8.composer.state import fp8_state_from_checkpoint

    problems = []
    loss_full, loss_resumed = _losses(full / "metrics.jsonl"), _losses(resumed / "metrics.jsonl")
    for step in sorted(loss_resumed):
        if loss_full.get(step) != loss_resumed[step]:
            problems.append(f"loss at step {step}: {loss_full.get(step)} vs {loss_resumed[step]}")
    name = f"ep0-ba{final_step}-rank0.pt"
    state_full = fp8_state_from_checkpoint(full / "checkpoints" / name)
    state_resumed = fp8_state_from_checkpoint(resumed / "checkpoints" / name)
    if not state_full or state_full.keys() != state_resumed.keys():
        problems.append("missing or different FP8 modules in the two checkpoints")
    for module in state_full.keys() & state_resumed.keys():
        for key, tensor in state_full[module].items():
            if not torch.equal(tensor, state_resumed[module][key]):
                problems.append(f"{module}.{key} differs")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-root", type=Path, default=Path("data"))
    parser.add_argument("--run-root", type=Path, default=Path("runs"))
    args = parser.parse_args(argv)
    data_root, run_root = args.data_root.resolve(), args.run_root.resolve()
    full, resumed = run_root / RUN_NAME, run_root / f"{RUN_NAME}-resumed"
    # A reused run root keeps the last `make run`'s records; step 5 must read this run's alone.
    for folder in (full, resumed):
        (folder / "metrics.jsonl").unlink(missing_ok=True)
        shutil.rmtree(folder / "wandb", ignore_errors=True)

    print(f"== 1. train {RUN_NAME} on CPU with te_swap (emulated FP8), fp8_lint, fp8_stats and fp8_state through `llmfoundry train`", flush=True)
    _train(data_root, run_root, RUN_NAME, GUARD)
    losses = _losses(full / "metrics.jsonl")
    print(f"   loss {losses[min(losses)]:.3f} -> {losses[max(losses)]:.3f} over {len(losses)} "
          f"batches (uniform guess: ln(512) = {math.log(512):.3f})")

    print(f"== 2. resume from the step-{RESUME_STEP} checkpoint", flush=True)
    checkpoint = full / "checkpoints" / f"ep0-ba{RESUME_STEP}-rank0.pt"
    _train(data_root, run_root, resumed.name, f"load_path={checkpoint}", GUARD)
    problems = compare_resume(full, resumed, final_step=len(losses))
    if problems:
        print("   RESUME MISMATCH:\n   " + "\n   ".join(problems))
        return 1
    print(f"   identical FP8 state at step {len(losses)} and identical losses after resuming")

    print("== 3. fp8_guard: the same run, one layer's input given an outlier channel (x1e5) from "
          "step 10", flush=True)
    from foundry_fp8.fault import demo as guard_demo

    guard_demo(TINY_YAML, data_root, run_root, full)

    print("== 4. FP8 statistics report", flush=True)
    subprocess.run([sys.executable, "-m", "foundry_fp8.cli", "report", str(full)], check=True)

    print("== 5. what reached the W&B offline history (read back with W&B's own reader)", flush=True)
    print(wandb_history.describe(wandb_history.read_runs(full, wait=60)))
    wandb_runs = sorted((full / "wandb").glob("offline-run-*"))
    print("\nOutputs:")
    print(f"  metrics (JSONL):   {full / 'metrics.jsonl'}")
    print(f"  W&B offline run:   {wandb_runs[-1] if wandb_runs else 'missing'}"
          "  (upload later with `wandb sync <dir>`)")
    print(f"  FP8 report:        {full / 'fp8_report.md'}  (flagged layers, reading guide, plots)")
    pngs = sorted(full.glob("fp8_*.png"))
    print(f"  FP8 plots:         {len(pngs)} PNGs in {full}: " + ", ".join(p.name for p in pngs))
    print(f"  checkpoints:       {full / 'checkpoints'}")
    return 0


def entry(argv: list[str] | None = None) -> int:
    """Ctrl-C is one line and exit 130, as in the `foundry-fp8` CLI: no stack for a user who
    pressed it (subprocess.run has already killed the training run it waited for). Once
    `_train` has imported Composer, its SIGINT handler raises SystemExit(130) instead of
    KeyboardInterrupt (composer/core/engine.py, `sigterm_handler`), which said nothing; one
    during an extension's import arrives as another exception (`interrupted_by`)."""
    outer = sys.exc_info()[1]  # a caller's, when entry is called inside its own `except`
    try:
        return main(argv)
    except BaseException as stop:
        if not interrupted_by(stop, outer):
            raise
        print("make run: interrupted", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    raise SystemExit(entry())
