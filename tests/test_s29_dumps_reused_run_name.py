"""A fresh run that reuses a run name (same run folder, not a resume) keeps the earlier run's
fp8_stats dumps with its records. The jsonl logger moved the earlier metrics.jsonl aside
(metrics.1.jsonl, hparams.1.json) but not its dumps: the new run replaced
fp8_dumps/step0000001-rank0.safetensors without a word, and the earlier run's report then
pointed at the new run's file. Now they go to fp8_dumps/1/, hparams.1.json's `fp8/dump_folder`
names that folder, and the report of metrics.1.jsonl finds them there; without the jsonl logger
nothing is moved, and the run says which dumps it replaces."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

from llmfoundry.command_utils import train
from safetensors import safe_open

from foundry_fp8.monitor import FP8Monitor
from foundry_fp8.paths import DUMP_FOLDER_KEY
from foundry_fp8.report.cli import load
from foundry_fp8.report.read import dump_of, dump_places
from tests.tiny_run import tiny_config

LAYER, TENSOR = "blocks.1.ffn.up_proj", "activation"
DUMP = Path("runs/mpt-tiny-cpu/fp8_dumps/step0000001-rank0.safetensors")


class _Said(logging.Handler):
    """Warnings of ours (LLM-Foundry's train() sets the root logger's handlers anew, pytest's
    caplog among them)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _run(tmp_path, tiny_data, seed: int, jsonl: bool = True) -> list[str]:
    """Two batches of the tiny run, fresh (no checkpoint: its run folder is runs/<run_name> in
    the working directory), dumping one layer at step 1; our warnings."""
    cfg = tiny_config(tmp_path, tiny_data, {
        "seed": seed, "max_duration": "2ba", "eval_interval": "2ba", "save_folder": None,
        "callbacks": {"fp8_stats": {"interval": "1ba", "dump_steps": [1],
                                    "dump_layers": r"blocks\.1\.ffn\.up_proj"}}})
    if not jsonl:
        del cfg.loggers["jsonl"]
    said, ours = _Said(), logging.getLogger("foundry_fp8")
    ours.addHandler(said)
    try:
        train(cfg).close()
    finally:
        ours.removeHandler(said)
    return said.lines


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _report_dump(metrics_file: Path) -> Path | None:
    """The dump `foundry-fp8 report` names for the layer's activation at step 1."""
    loaded = load(metrics_file)
    places = dump_places(loaded.run_folder or loaded.folder, loaded.hparams, loaded.dumps)
    return dump_of(places, 1, LAYER, TENSOR)


def test_a_fresh_run_of_the_same_name_keeps_the_earlier_runs_dumps_with_its_records(
        tmp_path, tiny_data, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _run(tmp_path, tiny_data, seed=17)
    first = _digest(DUMP)
    with safe_open(DUMP, "pt") as f:
        first_keys = set(f.keys())
    said = _run(tmp_path, tiny_data, seed=18)
    folder = DUMP.parent.parent
    kept = DUMP.parent / "1" / DUMP.name
    # the earlier run's file, byte for byte, beside its records; the new run's in place
    assert _digest(kept) == first and _digest(DUMP) != first
    with safe_open(DUMP, "pt") as f:
        assert set(f.keys()) == first_keys  # the same layer's tensors, from the other seed
    assert [line for line in said if f"hparams.1.json, its 1 fp8_stats dump to {kept.parent})"
            in line], said
    assert not [line for line in said if "will be replaced" in line], said
    assert load(folder / "metrics.1.jsonl").hparams[DUMP_FOLDER_KEY] == "fp8_dumps/1"
    # each run's report names its own run's dump
    assert _report_dump(folder / "metrics.1.jsonl").resolve() == kept.resolve()
    assert _report_dump(folder / "metrics.jsonl").resolve() == DUMP.resolve()


def test_without_the_jsonl_logger_the_run_says_which_earlier_dumps_it_replaces(
        tmp_path, tiny_data, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert not [line for line in _run(tmp_path, tiny_data, 17, jsonl=False)
                if "will be replaced" in line]
    first = _digest(DUMP)
    said = [line for line in _run(tmp_path, tiny_data, 18, jsonl=False)
            if "will be replaced" in line]
    assert len(said) == 1 and str(DUMP.parent) in said[0] and "1 dump " in said[0]
    assert DUMP.name in said[0] and "it will be replaced" in said[0]
    assert _digest(DUMP) != first and not (DUMP.parent / "1").exists()


def test_dumps_moved_after_this_ranks_first_batch_start_are_not_said_replaced(
        tmp_path, tiny_data, monkeypatch):
    """Composer runs no barrier between FIT_START and BATCH_START: a rank may start its first
    batch before rank 0's jsonl logger has moved the dumps on their shared file system. The
    check waits for the first dump's write, after the batch's collectives; before, it ran at
    BATCH_START and said "will be replaced" of dumps then moved aside."""
    monkeypatch.chdir(tmp_path)
    _run(tmp_path, tiny_data, 17, jsonl=False)
    late = DUMP.parent / "moved-late"
    next_microbatch = FP8Monitor.next_microbatch

    def move_then_go_on(self: FP8Monitor) -> None:  # at BEFORE_FORWARD, after BATCH_START
        if DUMP.is_file() and not late.exists():
            late.mkdir()
            DUMP.rename(late / DUMP.name)
        next_microbatch(self)

    monkeypatch.setattr(FP8Monitor, "next_microbatch", move_then_go_on)
    said = _run(tmp_path, tiny_data, 18, jsonl=False)
    assert (late / DUMP.name).is_file() and DUMP.is_file()  # moved, then written anew
    assert not [line for line in said if "will be replaced" in line], said
