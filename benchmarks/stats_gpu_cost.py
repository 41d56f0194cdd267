"""What one fp8_stats logging step's statistics cost on the device: `sufficient_stats` over every
tensor FP8Monitor watches in MPT-1B, timed alone, without a model, TE or Composer.

Per block (24), for Wqkv, out_proj, up_proj and down_proj: the GEMM input X (e4m3), the weight
(e4m3) and the output gradient dY (e5m2), at micro-batch 8 x seq 2048: about 14 G elements per
micro-batch (a logging step reads every micro-batch's: multiply by the micro-batches per device). X, dY and the weights are bf16
(LLM-Foundry's MPT-1B YAML trains with FSDP `mixed_precision: PURE`). Two cases: `delayed`, the
scale given as a device tensor (TE's delayed scaling, the H200 bench's case), and `current`,
the scale computed from each tensor's amax (the default `recipe: current` what-if). The rows stay
on the device until the step's end, then are finalized and moved to the host once, as the
monitor does.

Reported per case: milliseconds per logging step (CUDA events on a GPU, median over repeats),
GB/s against the bytes of the tensors read, and the peak extra memory above the inputs
(`torch.cuda.max_memory_allocated`; on CPU the growth of the peak RSS of a process that runs that
case alone, coarser).
Without CUDA (or with `--tiny`) the shapes shrink to d_model 256, 2 blocks, 4096 tokens.

    python benchmarks/stats_gpu_cost.py [--out DIR] [--tiny] [--repeats 3] [--threads N]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import platform
import re
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from foundry_fp8.cli import missing_dependency_is_one_line  # noqa: E402  (no dependency)

with missing_dependency_is_one_line():
    import torch

    from foundry_fp8.numerics import FP8_MAX, finalize_stats, sufficient_stats

RESULTS = REPO / "benchmarks" / "results"


@dataclass(frozen=True)
class Shapes:
    """The watched tensors of one logging step: `layers` blocks of MPT's four linear layers."""

    d_model: int
    layers: int
    tokens: int  # micro-batch x sequence length

    def linears(self) -> list[tuple[str, int, int]]:
        """(name, in_features, out_features) of each block's linear layers (expansion 4)."""
        d = self.d_model
        return [("Wqkv", d, 3 * d), ("out_proj", d, d), ("up_proj", d, 4 * d),
                ("down_proj", 4 * d, d)]


MPT_1B = Shapes(d_model=2048, layers=24, tokens=8 * 2048)
TINY = Shapes(d_model=256, layers=2, tokens=4096)


def block_tensors(shapes: Shapes, device: torch.device) -> list[tuple[torch.Tensor, str]]:
    """One block's watched tensors with their FP8 format, bf16, roughly training-like magnitudes;
    every block of a step reuses them (the cost does not depend on the values' identity)."""
    gen = torch.Generator(device=device).manual_seed(0)
    out = []
    for _, fan_in, fan_out in shapes.linears():
        def randn(*size: int, std: float) -> torch.Tensor:
            t = torch.randn(*size, generator=gen, device=device, dtype=torch.bfloat16)
            return t.mul_(std)
        out += [(randn(shapes.tokens, fan_in, std=1.0), "e4m3"),
                (randn(fan_out, fan_in, std=0.02), "e4m3"),
                (randn(shapes.tokens, fan_out, std=1e-6), "e5m2")]
    return out


def logging_step(shapes: Shapes, tensors: list[tuple[torch.Tensor, str]],
                 scales: list[torch.Tensor | None]) -> torch.Tensor:
    """The statistics work of one logging step: every block's rows, finalized, on the host."""
    rows = [sufficient_stats(t, fmt, scale)
            for _ in range(shapes.layers) for (t, fmt), scale in zip(tensors, scales, strict=True)]
    return finalize_stats(torch.stack(rows)).cpu()


def time_ms(fn: Callable[[], Any], device: torch.device) -> float:
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    begin = time.perf_counter()
    fn()
    return 1000 * (time.perf_counter() - begin)


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def measure(case: str, shapes: Shapes, device: torch.device, repeats: int,
            threads: int | None) -> dict[str, Any]:
    if threads:
        torch.set_num_threads(threads)
    tensors = block_tensors(shapes, device)
    if case == "delayed":  # a scale from an older amax 1.25x this one: nothing overflows
        scales = [torch.as_tensor(FP8_MAX[fmt], device=device) / (1.25 * t.abs().max().float())
                  for t, fmt in tensors]
    else:
        scales = [None] * len(tensors)
    elements = shapes.layers * sum(t.numel() for t, _ in tensors)
    read = shapes.layers * sum(t.numel() * t.element_size() for t, _ in tensors)
    step = lambda: logging_step(shapes, tensors, scales)  # noqa: E731
    base = peak_rss_bytes()  # CPU: before the warm-up, whose peak the RSS high-water mark keeps
    step()  # warm-up: allocator, kernels
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    times = [time_ms(step, device) for _ in range(repeats)]
    peak = (torch.cuda.max_memory_allocated() - base if device.type == "cuda"
            else max(0, peak_rss_bytes() - base))
    ms = statistics.median(times)
    row = {"case": case, "ms_per_logging_step": ms, "ms_min": min(times), "ms_max": max(times),
           "elements": elements, "bytes_read": read, "GB_per_s": read / ms / 1e6,
           "ns_per_element": 1e6 * ms / elements, "peak_extra_MiB": peak / 2**20,
           "peak_extra_measure": ("torch.cuda.max_memory_allocated delta"
                                  if device.type == "cuda" else "peak RSS growth")}
    print(f"{case:8s} {ms:10.1f} ms/step ({min(times):.1f}-{max(times):.1f})  "
          f"{row['GB_per_s']:7.1f} GB/s  {row['ns_per_element']:.3f} ns/element  "
          f"peak +{row['peak_extra_MiB']:.0f} MiB", flush=True)
    return row


def cpu_name() -> str:
    info = Path("/proc/cpuinfo")
    names = [line.split(":", 1)[1].strip() for line in
             (info.read_text().splitlines() if info.exists() else []) if line.startswith("model name")]
    return f"{names[0] if names else platform.machine()}, {len(names) or '?'} cores"


def isolated(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` in a fresh process: the peak RSS is per process and never goes down."""
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def environment(device: torch.device) -> dict[str, str]:
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True,
                                  timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    dirty = " + uncommitted changes" if git("status", "--porcelain", "foundry_fp8") else ""
    env = {"python": platform.python_version(), "torch": torch.__version__,
           "foundry-fp8 git": (git("rev-parse", "--short", "HEAD") or "unknown") + dirty,
           # which sufficient_stats ran, where the copy has no .git
           "numerics.py sha256": hashlib.sha256(
               (REPO / "foundry_fp8" / "numerics.py").read_bytes()).hexdigest()[:12],
           "device": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name(),
           "torch_threads": str(torch.get_num_threads())}
    if device.type == "cuda":
        env["cuda"] = str(torch.version.cuda)
    return env


def device_slug(device: torch.device) -> str:
    if device.type != "cuda":
        return "cpu"
    return re.sub(r"[^a-z0-9]+", "_", torch.cuda.get_device_name(device).lower()).strip("_")


def render_markdown(report: dict[str, Any]) -> str:
    s = report["shapes"]
    rows = "\n".join(
        f"| {r['case']} | **{r['ms_per_logging_step']:.1f}** ({r['ms_min']:.1f}-{r['ms_max']:.1f}) "
        f"| {r['GB_per_s']:.1f} | {r['ns_per_element']:.3f} | {r['peak_extra_MiB']:.0f} |"
        for r in report["results"])
    env = ", ".join(f"{k} {v}" for k, v in report["environment"].items())
    return f"""# fp8_stats statistics cost per logging step ({report['date']})

Command: `{report['command']}`
Environment: {env}.

`sufficient_stats` over every tensor the monitor watches on a logging step: {s['layers']} blocks
x (Wqkv, out_proj, up_proj, down_proj) x (X e4m3, weight e4m3, dY e5m2), d_model
{s['d_model']}, {s['tokens']} tokens (one micro-batch; a logging step reads each of its micro-batches), bf16: {report['elements'] / 1e9:.2f} G
elements, {report['bytes_read'] / 1e9:.2f} GB read. Then the rows are finalized and moved to the
host once. Median of {report['repeats']} logging steps after a warm-up (min-max).
`delayed`: scales given (TE's delayed scaling); `current`: each tensor's own amax.

| case | ms per logging step | GB/s read | ns per element | peak extra MiB |
|---|---|---:|---:|---:|
{rows}

Peak extra memory: {report['results'][0]['peak_extra_measure']}.
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for the JSON and markdown")
    parser.add_argument("--tiny", action="store_true", help="small shapes (the default without CUDA)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    shapes = TINY if args.tiny or device.type == "cpu" else MPT_1B
    started = time.monotonic()
    print(f"{device_slug(device)}: {shapes}", flush=True)
    if args.threads:
        torch.set_num_threads(args.threads)
    cases = [(case, shapes, device, args.repeats, args.threads) for case in ("delayed", "current")]
    results = [isolated(measure, *case) if device.type == "cpu" else measure(*case) for case in cases]
    report = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join(["python", "benchmarks/stats_gpu_cost.py",
                                   *(argv if argv is not None else sys.argv[1:])]),
              "duration_s": round(time.monotonic() - started), "environment": environment(device),
              "shapes": asdict(shapes), "repeats": args.repeats,
              "elements": results[0]["elements"], "bytes_read": results[0]["bytes_read"],
              "results": results}
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"stats_gpu_cost_{device_slug(device)}"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    stem.with_suffix(".md").write_text(render_markdown(report))
    print(f"wrote {stem}.json and .md", flush=True)
    return 0


if __name__ == "__main__":
    with missing_dependency_is_one_line():
        raise SystemExit(main())
