"""Where an fp8_stats logging step's extra peak memory comes from (issue 16: on the H200, MPT-1B
te_swap at micro-batch 8 peaked at 58.3 GB, 77.9 GB with fp8_stats every batch, the same before
and after the statistics rewrite, whose own temporaries stay under 256 MiB).

The bench's fp8-te-swap run, five ways that differ only in one callback:

- `none`: no monitor;
- `hooks`: no-op hooks where fp8_stats puts its own (on each watched layer, for the whole
  batch, a forward pre-hook and a forward hook putting a hook on the output's gradient): the
  hooks' cost without statistics;
- `forward`: fp8_stats every batch, `tensors: [activation, weight]` (forward pre-hooks only);
- `gradient`: fp8_stats every batch, `tensors: [gradient]`;
- `all`: fp8_stats every batch, every tensor.

Per case: the peak (`torch.cuda.max_memory_allocated` on CUDA) and the memory live at that peak,
grouped by allocation site: the innermost Python frame outside torch's own files ("autograd
engine" for allocations with no Python frame: the backward's C++ ops). On CUDA the allocator's
own history is recorded (`torch.cuda.memory._record_memory_history`, Python stacks); without
CUDA (`--tiny`: the bench's tiny MPT on CPU, te_swap emulated) a dispatch mode tracks every
tensor storage an op creates until it is freed. The sites whose bytes grow from `none` name
the cause.

Each case runs in a fresh process (this script with `--in-process --cases <case>`): in one
process a case's leftovers (a run kept alive, as fp8_stats' hooks once kept the whole State)
were still allocated when the next case began, and `reset_peak_memory_stats` resets the peak to
what is allocated, so they counted in its peak. Each case records the memory live at fit start
(`baseline_mib`: the CUDA allocator's, on CPU the tensor storages Python reaches) beside its
peak. `--carry-over` checks that hypothesis for the 58.3 -> 77.9 GB above, the bench's variants
in one process each: `fp8-te-swap-stats1` alone, then `fp8-te-swap` followed by it.

    PYTHONPATH=$PWD/.gpu-site python3 benchmarks/gpu/stats_memory.py --out $OUT [--carry-over]
    python benchmarks/gpu/stats_memory.py --tiny --out /tmp/mem   # CPU, about a minute
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import subprocess
import sys
import tempfile
import traceback
import weakref
from collections import Counter
from collections.abc import Iterable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from composer.core import Callback
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.stats_gpu_cost import device_slug  # noqa: E402
from foundry_fp8.tools import bench  # noqa: E402

CASES = ("none", "hooks", "forward", "gradient", "all")
# the bench's variants, each sequence in one process: the 77.9 GB was stats1 after others
CARRY_OVER = (("fp8-te-swap-stats1",), ("fp8-te-swap", "fp8-te-swap-stats1"))
TORCH_DIR = str(Path(torch.__file__).parent)
ENGINE = "autograd engine (no Python frame)"
TOP = 15  # sites listed per case

Frame = dict[str, Any]  # {"filename", "line", "name"}, innermost first as in torch's snapshots


def site(frames: Sequence[Frame]) -> str:
    """The innermost frame outside torch's own files, `package/file.py:line function`."""
    for frame in frames:
        filename = frame["filename"]
        if filename.startswith(TORCH_DIR) or filename.startswith("<"):
            continue
        short = filename.split("site-packages/")[-1].replace(str(REPO) + "/", "")
        return f"{short}:{frame['line']} {frame['name']}"
    return ENGINE


def live_at_peak(trace: Iterable[dict[str, Any]]) -> tuple[int, list[dict[str, Any]]]:
    """Replay an allocator trace (torch's TraceEntry dicts): the peak of the bytes its `alloc`s
    hold, and the entries alive at that peak. A block counts as freed at its first
    `free_requested` or `free_completed`; frees of blocks allocated before the trace began are
    ignored (the trace did not count them)."""
    entries = list(trace)
    live: dict[int, int] = {}  # addr -> size
    current = peak = peak_at = 0
    for i, entry in enumerate(entries):
        action = entry["action"]
        if action == "alloc":
            live[entry["addr"]] = entry["size"]
            current += entry["size"]
            if current > peak:
                peak, peak_at = current, i + 1
        elif action in ("free_requested", "free_completed"):
            current -= live.pop(entry["addr"], 0)
    alive: dict[int, dict[str, Any]] = {}
    for entry in entries[:peak_at]:
        if entry["action"] == "alloc":
            alive[entry["addr"]] = entry
        elif entry["action"] in ("free_requested", "free_completed"):
            alive.pop(entry["addr"], None)
    return peak, list(alive.values())


def by_site(entries: Iterable[dict[str, Any]]) -> dict[str, int]:
    """Bytes per allocation site, largest first."""
    sizes: Counter[str] = Counter()
    for entry in entries:
        sizes[site(entry.get("frames", []))] += entry["size"]
    return dict(sizes.most_common())


class StorageTrace(TorchDispatchMode):
    """A CPU stand-in for the CUDA allocator's history: one `alloc` per storage an op returns
    first (with the Python stack), one `free_completed` when that storage is collected."""

    def __init__(self) -> None:
        super().__init__()
        self.trace: list[dict[str, Any]] = []
        self._seen: set[int] = set()

    def __torch_dispatch__(self, func, _types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in tree_flatten(out)[0]:
            if isinstance(value, torch.Tensor) and not value.is_meta:
                self._track(value.untyped_storage())
        return out

    def _track(self, storage: torch.UntypedStorage) -> None:
        addr = storage.data_ptr()
        if addr in self._seen or storage.nbytes() == 0:
            return
        self._seen.add(addr)
        frames = [{"filename": f.filename, "line": f.lineno, "name": f.name}
                  for f in reversed(traceback.extract_stack()[:-2])]
        self.trace.append({"action": "alloc", "addr": addr, "size": storage.nbytes(),
                           "frames": frames})
        weakref.finalize(storage, self._free, addr)

    def _free(self, addr: int) -> None:
        self._seen.discard(addr)
        self.trace.append({"action": "free_completed", "addr": addr})


def _hook_output_gradient(module: torch.nn.Module, args: Any, output: Any) -> None:
    """A no-op hook on the output's gradient, where fp8_stats' forward hook puts its own
    (`FP8Monitor._hook_gradient`)."""
    out = output[0] if isinstance(output, (tuple, list)) else output
    if isinstance(out, torch.Tensor) and out.requires_grad:
        out.register_hook(lambda grad: None)


class Hooks(Callback):
    """No-op hooks where fp8_stats puts its own, on every batch."""

    def __init__(self) -> None:
        self.handles: list[Any] = []
        self.layers: list[torch.nn.Module] = []

    def fit_start(self, state, logger) -> None:
        from foundry_fp8.monitor import select_layers
        from foundry_fp8.options import MonitorConfig

        self.layers = list(select_layers(state.model, MonitorConfig()).values())

    def batch_start(self, state, logger) -> None:
        for module in self.layers:
            self.handles.append(module.register_forward_pre_hook(lambda *a, **k: None,
                                                                 with_kwargs=True))
            self.handles.append(module.register_forward_hook(_hook_output_gradient))

    def after_train_batch(self, state, logger) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def live_bytes(cuda: bool) -> int:
    """Bytes held now: the CUDA allocator's, or on CPU those of every tensor storage the garbage
    collector reaches (a tensor only C++ holds, such as one the autograd graph saved, is
    missed)."""
    if cuda:
        return torch.cuda.memory_allocated()
    storages: dict[int, int] = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and not obj.is_meta:
            try:
                storage = obj.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
            except (RuntimeError, NotImplementedError):  # no memory: a fake or traced tensor
                continue
    return sum(storages.values())


class Baseline(Callback):
    """The memory live at fit start: what the run inherits (its model, and any leftovers)."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.bytes = 0

    def fit_start(self, state, logger) -> None:
        self.bytes = live_bytes(self.cuda)


class Recorder(Baseline):
    """The baseline, then the allocator's history from fit start to fit end (CUDA), or the
    storage trace (CPU)."""

    def __init__(self, cuda: bool) -> None:
        super().__init__(cuda)
        self.mode: StorageTrace | None = None
        self.trace: list[dict[str, Any]] = []

    def fit_start(self, state, logger) -> None:
        super().fit_start(state, logger)
        if self.cuda:
            torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
        else:
            self.mode = StorageTrace()
            self.mode.__enter__()

    def fit_end(self, state, logger) -> None:
        if self.cuda:
            self.trace = torch.cuda.memory._snapshot()["device_traces"][0]
        self.stop()

    def stop(self) -> None:
        """Stop recording (also after a run that raised). Not `close`: that is Composer's
        `Callback.close(state, logger)`, which the engine calls at the Trainer's close."""
        if self.cuda:
            torch.cuda.memory._record_memory_history(enabled=None)
        elif self.mode is not None:
            self.mode.__exit__(None, None, None)
            self.trace, self.mode = self.mode.trace, None


def probes(case: str) -> list[Callback]:
    """The callback that makes `case` differ from `none`."""
    from foundry_fp8.composer.stats import FP8Stats

    return {"none": lambda: [], "hooks": lambda: [Hooks()],
            "forward": lambda: [FP8Stats(interval=1, tensors=["activation", "weight"])],
            "gradient": lambda: [FP8Stats(interval=1, tensors=["gradient"])],
            "all": lambda: [FP8Stats(interval=1)]}[case]()


class _Quiet:
    def set_postfix_str(self, text: str) -> None:
        print(text, flush=True)

    def update(self, n: int) -> None:
        pass


def run_case(case: str, config: bench.BenchConfig) -> dict[str, Any]:
    cuda = not config.tiny
    recorder = Recorder(cuda)
    variant = dataclasses.replace(bench.VARIANTS["fp8-te-swap"], name=f"fp8-te-swap-{case}")
    try:
        row = bench.run_variant(variant, config, _Quiet(), [*probes(case), recorder])
    finally:
        recorder.stop()
    traced_peak, alive = live_at_peak(recorder.trace)
    recorder.trace.clear()
    bench._release_memory(config.tiny)
    return {"case": case, "peak_mib": row["peak_mem_gb"] * 1024 if cuda else None,
            "baseline_mib": recorder.bytes / 2**20, "traced_peak_mib": traced_peak / 2**20,
            "sites_mib": {k: v / 2**20 for k, v in by_site(alive).items()},
            "loss": row["loss"]}


def run_sequence(names: Sequence[str], config: bench.BenchConfig) -> list[dict[str, Any]]:
    """The bench's variants one after another in this process, as the bench runs them: per
    variant the memory live at its fit start and its peak (CUDA: since that start)."""
    cuda = not config.tiny
    rows = []
    for name in names:  # the bench resets the CUDA peak at fit start, to the baseline
        baseline = Baseline(cuda)
        row = bench.run_variant(bench.VARIANTS[name], config, _Quiet(), [baseline])
        bench._release_memory(config.tiny)
        rows.append({"variant": name, "baseline_mib": baseline.bytes / 2**20,
                     "peak_mib": row["peak_mem_gb"] * 1024 if cuda else None})
    return rows


def in_subprocess(args: Sequence[str]) -> dict[str, Any]:
    """This script with `args --in-process` in a fresh Python: its result, or its failure."""
    with tempfile.TemporaryDirectory() as out:
        done = subprocess.run([sys.executable, __file__, *args, "--in-process", "--out", out],
                              capture_output=True, text=True)
        results = list(Path(out).glob("stats_memory_*.json"))
        if results:
            return json.loads(results[0].read_text())
    return {"failed": [{"case": " ".join(args), "error": f"exit {done.returncode}",
                        "traceback": done.stderr[-3000:]}]}


def markdown(result: dict[str, Any]) -> str:
    """The peaks, then each case's sites that differ most from `none` (MiB live at the peak)."""
    base = next((r["sites_mib"] for r in result["cases"] if r["case"] == "none"), {})
    lines = [f"# fp8_stats peak memory, by case ({result['gpu']}, {result['date']})", "",
             f"Command: `{result['command']}`", "",
             "Versions: " + ", ".join(f"{k} {v}" for k, v in result["versions"].items()), "",
             "| case | MiB live at fit start | peak MiB (allocator) | traced peak MiB |",
             "|---|---:|---:|---:|"]
    for r in result["cases"]:
        peak = "-" if r["peak_mib"] is None else f"{r['peak_mib']:.0f}"
        lines.append(f"| {r['case']} | {r['baseline_mib']:.1f} | {peak} | "
                     f"{r['traced_peak_mib']:.1f} |")
    lines += [f"| {f['case']} | failed: {f['error']} | | |" for f in result.get("failed", [])]
    if result.get("carry_over"):
        lines += ["", "## The bench's variants in one process (`--carry-over`)", "",
                  "| process runs | variant | MiB live at fit start | peak MiB |",
                  "|---|---|---:|---:|"]
        for run in result["carry_over"]:
            for r in run["rows"]:
                peak = "-" if r["peak_mib"] is None else f"{r['peak_mib']:.0f}"
                lines.append(f"| {' then '.join(run['variants'])} | {r['variant']} | "
                             f"{r['baseline_mib']:.1f} | {peak} |")
    for r in result["cases"]:
        sites = r["sites_mib"]
        if r["case"] == "none" or not base:
            order = list(sites)[:TOP]
            title = "largest"
        else:
            names = set(sites) | set(base)
            order = sorted(names, key=lambda k: -abs(sites.get(k, 0.0) - base.get(k, 0.0)))[:TOP]
            title = "most changed from `none`"
        lines += ["", f"## {r['case']}: live at the traced peak, by site ({title})", "",
                  "| site | MiB | vs none |", "|---|---:|---:|"]
        for where in order:
            mib = sites.get(where, 0.0)
            lines.append(f"| `{where}` | {mib:.1f} | {mib - base.get(where, 0.0):+.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--tiny", action="store_true", help="CPU: the bench's tiny MPT")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--batches", type=int, default=3)
    parser.add_argument("--carry-over", action="store_true",
                        help="also: " + "; ".join(" then ".join(v) for v in CARRY_OVER)
                        + " (the bench's variants, each line in one process)")
    parser.add_argument("--variants", default="",
                        help="the bench's variants to run in one process instead of cases")
    parser.add_argument("--in-process", action="store_true",
                        help="run everything in this process (default: each case, and each "
                             "--carry-over line, in a fresh one)")
    args = parser.parse_args(argv)
    cases = [c for c in args.cases.split(",") if c]
    if unknown := sorted(set(cases) - set(CASES)):
        parser.error(f"--cases: unknown {', '.join(unknown)} (choose from {', '.join(CASES)})")
    variants = [v for v in args.variants.split(",") if v]
    if unknown := sorted(set(variants) - set(bench.VARIANTS)):
        parser.error(f"--variants: unknown {', '.join(unknown)}")
    tiny = args.tiny or not torch.cuda.is_available()
    config = bench.BenchConfig(tiny=tiny, warmup=1, steps=args.batches, profile_steps=0,
                               micro_batch=args.micro_batch,
                               **({"seq_len": 128, "batch": 8} if tiny else {}))
    passed = [*(["--tiny"] if args.tiny else []), "--micro-batch", str(args.micro_batch),
              "--batches", str(args.batches)]
    result = {**bench.environment(tiny), "date": datetime.now(timezone.utc).isoformat(),
              "command": " ".join(["python3", "benchmarks/gpu/stats_memory.py",
                                   *(argv if argv is not None else sys.argv[1:])]),
              "cases": [], "carry_over": []}
    stem = "stats_memory_" + device_slug(torch.device("cpu" if tiny else "cuda"))
    args.out.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        (args.out / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
        (args.out / f"{stem}.md").write_text(markdown(result))

    def failed(what: str, err: Exception) -> None:
        result.setdefault("failed", []).append({"case": what, "error": repr(err)[:300],
                                                "traceback": traceback.format_exc()})

    if variants:  # one --carry-over line, in this process
        cases = []
        try:
            result["carry_over"].append({"variants": variants,
                                         "rows": run_sequence(variants, config)})
        except Exception as err:
            failed(" then ".join(variants), err)
    for case in cases:
        if not args.in_process:
            child = in_subprocess([*passed, "--cases", case])
            result["cases"] += child.get("cases", [])
            result.setdefault("failed", []).extend(child.get("failed", []))
        else:
            try:  # one broken case must not lose the others' numbers
                result["cases"].append(run_case(case, config))
            except Exception as err:
                failed(case, err)
        save()
    for line in CARRY_OVER if args.carry_over else ():
        child = in_subprocess([*passed, "--variants", ",".join(line)])
        result["carry_over"] += child.get("carry_over", [])
        result.setdefault("failed", []).extend(child.get("failed", []))
    save()
    print(markdown(result))
    return 1 if result.get("failed") else 0


if __name__ == "__main__":
    sys.exit(main())
