"""benchmarks/gpu/stats_memory.py, the diagnostic of fp8_stats' peak memory: its trace replay on
hand-made traces, its CPU storage trace on tensors of known sizes, a tiny run, where
fp8_stats every batch must not raise the peak (the hooks hold no activation), and the bench's
variants in one process, where a finished run must leave nothing to the next."""

from __future__ import annotations

import json

import torch

from benchmarks.gpu.stats_memory import (
    ENGINE,
    Recorder,
    StorageTrace,
    by_site,
    in_subprocess,
    live_at_peak,
    main,
)


def _alloc(addr: int, size: int, filename: str = "/x/site-packages/pkg/a.py") -> dict:
    return {"action": "alloc", "addr": addr, "size": size,
            "frames": [{"filename": filename, "line": addr, "name": "f"}]}


def test_replay_finds_the_peak_and_what_was_alive_then():
    trace = [_alloc(1, 100), _alloc(2, 50),
             {"action": "free_requested", "addr": 1}, {"action": "free_completed", "addr": 1},
             {"action": "free_completed", "addr": 99},  # allocated before the trace: ignored
             _alloc(3, 200), {"action": "free_requested", "addr": 3}, _alloc(4, 10)]
    peak, alive = live_at_peak(trace)
    assert peak == 250
    assert sorted(e["addr"] for e in alive) == [2, 3]
    assert by_site(alive) == {"pkg/a.py:3 f": 200, "pkg/a.py:2 f": 50}
    assert by_site([{"action": "alloc", "addr": 5, "size": 8, "frames": []}]) == {ENGINE: 8}


def test_storage_trace_counts_storages_until_they_are_freed():
    with StorageTrace() as mode:
        x = torch.empty(1000)
        y = x * 2
        view = y[:10]  # a view: no new storage
        del x
        z = torch.empty(3000)
    peak, alive = live_at_peak(mode.trace)
    assert peak == (1000 + 3000) * 4  # y and z; x was freed before z existed
    assert sorted(e["size"] for e in alive) == [4000, 12000]
    assert all(site.startswith("tests/test_stats_memory.py:") for site in by_site(alive))
    del y, z, view


def test_tiny_run_fp8_stats_every_batch_keeps_the_peak(tmp_path):
    assert main(["--tiny", "--cases", "none,all", "--batches", "2", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "stats_memory_cpu.json").read_text())
    peaks = {r["case"]: r["traced_peak_mib"] for r in result["cases"]}
    assert peaks["none"] > 1  # the tiny MPT's activations and optimizer state
    assert peaks["all"] <= peaks["none"] * 1.1
    assert "| all |" in (tmp_path / "stats_memory_cpu.md").read_text()
    baselines = {r["case"]: r["baseline_mib"] for r in result["cases"]}
    assert baselines["none"] > 0.1  # the model about to train
    assert abs(baselines["all"] - baselines["none"]) < 0.05 * baselines["none"]


def test_a_variant_after_fp8_stats_every_batch_inherits_nothing():
    """fp8-te-swap-stats1's last batch logs; its hooks used to keep its whole State (model,
    Adam state, gradients, logits) alive into the next variant run in the process."""
    # a fresh process: this one holds other tests' leftovers, which can go in between
    result = in_subprocess(["--tiny", "--variants", "fp8-te-swap-stats1,fp8-te-swap",
                            "--batches", "1"])
    assert not result.get("failed"), result["failed"]
    rows = result["carry_over"][0]["rows"]
    first, second = (r["baseline_mib"] for r in rows)
    assert first > 0.1  # the model about to train
    assert abs(second - first) < 0.05 * first


def test_the_recorder_closes_as_a_composer_callback():
    """Composer's engine calls every callback's `close(state, logger)` when the Trainer
    closes; the recorder's own `close(self)` made that a TypeError in each case's log."""
    Recorder(cuda=False).close(None, None)  # type: ignore[arg-type]
