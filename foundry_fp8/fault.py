"""An injected FP8 fault for fp8_guard's tests and `make run`'s demonstration.

`InjectOutlier` multiplies one input channel of one layer by `factor` in training forwards from
batch `start` on, and subtracts that channel's extra contribution from the layer's output again:
in high precision the layer computes what it did (up to rounding), gradients included, but the
tensor it casts holds an outlier feature. At 1e5 that tensor spans more than E4M3 holds with its
subnormals (448 / 2^-9, about 2.3e5, over a spread of values), so the scale delayed scaling
sizes for the outlier flushes most of the rest to 0 at every step, and the FP8 rounding error of
the outlier itself no longer cancels: persistent FP8 trouble that only FP8 has.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from composer.core import Callback, State
from composer.loggers import Logger
from composer.utils import dist
from torch import nn

from foundry_fp8.fp8_meta import canonical_modules

#: The last log line of a run that lost streaming's shared-memory race: StreamingDataset looks
#: for a free `/NNNNNN_locals` prefix, then creates it, so two processes building a dataset at
#: once on one machine can pick the same one (streaming/base/shared/prefix.py, get_shm_prefix;
#: mosaicml/streaming issues 884 and 901). Nothing was trained yet: training again is safe.
SHM_RACE = re.compile(r"FileExistsError: \[Errno 17\] File exists: '/\d+_\w+'$")


def run_logged(cmd: Sequence[str], log: Path, folder: Path) -> int:
    """`make run`'s training subprocesses: `cmd` with its output in `log` and its run in
    `folder`, once more from a fresh folder when it lost streaming's shared-memory race (another
    process on this machine, not this run). Returns the exit code."""
    for attempt in (1, 2):
        # W&B writes into `init_kwargs.dir` only when that folder already exists.
        folder.mkdir(parents=True, exist_ok=True)
        with log.open("w") as f:
            result = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT)
        last = (log.read_text().splitlines() or [""])[-1].strip()
        if result.returncode == 0 or attempt == 2 or not SHM_RACE.search(last):
            return result.returncode
        print(f"  lost streaming's shared-memory race with another process ({last}):"
              " training again", flush=True)
        (folder / "metrics.jsonl").unlink(missing_ok=True)
        shutil.rmtree(folder / "wandb", ignore_errors=True)
    raise AssertionError("unreachable")


class InjectOutlier(Callback):
    """`callbacks: {inject_outlier: {layer: blocks.1.attn.out_proj, start: 6}}` (registered by the
    tests and the demo, not an entry point). `ranks`: only these ranks see the fault; `stop`:
    the first batch without it (None: to the end)."""

    def __init__(self, layer: str, start: int, factor: float = 1e5, channel: int = 0,
                 ranks: Sequence[int] | None = None, stop: int | None = None):
        self.layer, self.start, self.factor, self.channel = layer, start, factor, channel
        self.stop = stop
        self.ranks = None if ranks is None else tuple(ranks)
        self._batch = 0
        self._extra: torch.Tensor | None = None  # this forward's added outlier
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def fit_start(self, state: State, logger: Logger) -> None:
        """Hooked once: a second fit() hooked the layer again, scaling the channel by
        `factor` squared and compensating once, so the layer computed a wrong output in high
        precision too."""
        self.close(state, logger)
        if self.ranks is not None and dist.get_global_rank() not in self.ranks:
            return
        module = find_layer(state.model, self.layer)
        self._handles = [module.register_forward_pre_hook(self._scale),
                         module.register_forward_hook(self._compensate)]

    def close(self, state: State, logger: Logger) -> None:
        """Off the model with its Trainer, which a new Trainer may train healthy."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def batch_start(self, state: State, logger: Logger) -> None:
        self._batch = int(state.timestamp.batch)

    def _active(self, module: nn.Module) -> bool:
        return (module.training and self._batch >= self.start
                and (self.stop is None or self._batch < self.stop))

    def _scale(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        if not self._active(module):
            return None
        x = args[0].clone()
        channel = x[..., self.channel]
        self._extra = (self.factor - 1) * channel.detach()
        x[..., self.channel] = channel + self._extra  # the gradient to x passes unscaled
        return (x, *args[1:])

    def _compensate(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        """Subtract extra * W[:, channel]: with W attached, the weight's gradient is its
        healthy one in high precision too."""
        if not self._active(module) or self._extra is None:
            return None
        extra, self._extra = self._extra, None
        return output - extra.unsqueeze(-1) * module.weight[:, self.channel]


def stats_table(metrics: Mapping[str, float]) -> dict[tuple[str, str], dict[str, float]]:
    """`{(layer, tensor): {stat: value}}` from a logged step's per-layer FP8 metrics (the health
    key layout, or the older `fp8/<layer>/<tensor>/<stat>`); other keys are left out."""
    from foundry_fp8.health.keys import parse_key

    table: dict[tuple[str, str], dict[str, float]] = {}
    for key, value in metrics.items():
        parsed = parse_key(key)
        if parsed is None and key.startswith("fp8/") and key.count("/") >= 3:
            layer, tensor, stat = key.removeprefix("fp8/").rsplit("/", 2)
            parsed = stat, tensor, layer
        if parsed is not None and isinstance(value, int | float):
            stat, tensor, layer = parsed
            table.setdefault((layer, tensor), {})[stat] = value
    return table


def find_layer(model: nn.Module, layer: str) -> nn.Module:
    """The module whose wrapper-free name is `layer` or ends with `.<layer>`."""
    for name, module in canonical_modules(model):
        if name == layer or name.endswith(f".{layer}"):
            return module
    raise KeyError(f"no module named {layer!r}")


def train_with_fault(yaml_path: Path, data_root: Path, run_root: Path, run_name: str,
                     layer: str, start: int, interval: int = 5, consecutive: int = 2) -> Path:
    """`make run`'s fault demonstration: the tiny YAML with the outlier injected into `layer`
    from `start` on and fp8_guard watching fp8_stats every `interval` batches. In this process:
    the fault is registered here, not an entry point. Returns the run folder."""
    from llmfoundry.command_utils import train
    from llmfoundry.registry import callbacks
    from omegaconf import OmegaConf as om

    callbacks.register("inject_outlier", func=InjectOutlier)
    cfg = om.load(yaml_path)
    cfg.variables.update(data_root=str(data_root), run_root=str(run_root), run_name=run_name)
    cfg.callbacks.fp8_stats.interval = f"{interval}ba"
    cfg.callbacks.fp8_guard = {"consecutive": consecutive}
    cfg.callbacks.inject_outlier = {"layer": layer, "start": start}
    cfg.save_interval = cfg.max_duration
    folder = run_root / run_name
    folder.mkdir(parents=True, exist_ok=True)
    train(cfg)
    return folder


def before_after(healthy: Path, faulty: Path, layer: str) -> list[str]:
    """Lines comparing the two runs' `metrics.jsonl` at the faulty run's logging steps: the
    losses and the layer's activation underflow, and where it ran in high precision."""
    from foundry_fp8.composer.guard import FALLBACK_LAYERS
    from foundry_fp8.jsonl import read_jsonl

    def merged(folder: Path) -> dict[int, dict[str, Any]]:
        steps: dict[int, dict[str, Any]] = {}
        for step, metrics in read_jsonl(folder / "metrics.jsonl"):
            steps.setdefault(step, {}).update(metrics)
        return steps

    ok, bad = merged(healthy), merged(faulty)
    lines = [f"{'step':>6} {'loss, healthy':>14} {'loss, fault':>12} "
             f"{'underflow % (fault)':>20}  {layer}"]
    fallen = 0.0
    for step in sorted(s for s, m in bad.items() if FALLBACK_LAYERS in m):
        where = ("in FP8" if not bad[step][FALLBACK_LAYERS] else "high precision" if fallen
                 else "falls back after this step")
        fallen = bad[step][FALLBACK_LAYERS]
        underflow = next((stats.get("underflow_pct") for (name, tensor), stats
                          in stats_table(bad[step]).items()
                          if name.endswith(layer) and tensor == "activation"), float("nan"))
        loss_ok = ok.get(step, {}).get("loss/train/total", float("nan"))
        loss_bad = bad[step].get("loss/train/total", float("nan"))
        lines.append(f"{step:>6} {loss_ok:>14.4f} {loss_bad:>12.4f} {underflow:>20.2f}  {where}")
    return lines


#: make run's fault: the second block's attention output projection, from batch 10 on.
DEMO_LAYER, DEMO_START = "blocks.1.attn.out_proj", 10


def guard_lines(log: str) -> list[str]:
    """The fault run's lines `make run` shows: fp8_guard's messages (its failures included)
    and the tables, not the `fp8_guard:` key of the config LLM-Foundry's log dumps."""
    return [line for line in log.splitlines()
            if "fp8_guard: " in line or "fp8_guard failed" in line or line.startswith("|")]


def demo(yaml_path: Path, data_root: Path, run_root: Path, healthy: Path) -> None:
    """`make run`'s fp8_guard step: the fault run in a subprocess (its log beside the run), the
    guard's lines from it, then the before/after table against the healthy run."""
    from foundry_fp8.composer.guard import FALLBACK_LAYERS
    from foundry_fp8.jsonl import read_jsonl

    moved = [m[FALLBACK_LAYERS] for _, m in read_jsonl(healthy / "metrics.jsonl")
             if FALLBACK_LAYERS in m]
    print(f"   the healthy run above had fp8_guard on: {max(moved, default=float('nan')):.0f} "
          f"layers fell back over {len(moved)} logging steps", flush=True)
    name = f"{healthy.name}-fault"
    log = run_root / f"{name}.log"
    cmd = [sys.executable, "-m", "foundry_fp8.fault", str(yaml_path), str(data_root),
           str(run_root), name]
    print("$", " ".join(cmd), flush=True)
    returncode = run_logged(cmd, log, run_root / name)
    for line in guard_lines(log.read_text()):
        print("  " + line)
    if returncode != 0:
        raise SystemExit(f"the fault run failed (exit {returncode}); full log: {log}")
    print("   " + "\n   ".join(before_after(healthy, run_root / name, DEMO_LAYER)), flush=True)


if __name__ == "__main__":
    train_with_fault(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4],
                     DEMO_LAYER, DEMO_START)
