"""The foundation: our entries reach LLM-Foundry through its entry-point registries, and the
tiny MPT really trains through LLM-Foundry's `train` on CPU, logging to W&B (offline) and JSONL."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import catalogue
import pytest

from foundry_fp8 import wandb_history
from foundry_fp8.jsonl import read_jsonl
from tests.tiny_run import run_folder, run_tiny

ENTRIES = [
    ("algorithms", "te_swap", "TESwap"),
    ("callbacks", "fp8_stats", "FP8Stats"),
    ("callbacks", "fp8_state", "FP8State"),
    ("callbacks", "fp8_guard", "FP8Guard"),
    ("callbacks_with_config", "fp8_lint", "FP8Lint"),
    ("loggers", "jsonl", "JSONLLogger"),
]


@pytest.mark.parametrize(("registry_name", "entry", "cls_name"), ENTRIES)
def test_llmfoundry_registry_finds_our_entries(registry_name: str, entry: str, cls_name: str):
    from llmfoundry import registry

    found = getattr(registry, registry_name).get(entry)
    assert found.__name__ == cls_name
    if cls_name != "JSONLLogger":
        import foundry_fp8

        assert getattr(foundry_fp8, cls_name) is found


def test_unknown_callback_name_fails_with_llmfoundrys_error(tmp_path, tiny_data):
    with pytest.raises(catalogue.RegistryError, match="fp8_statz"):
        run_tiny(tmp_path, tiny_data, {"callbacks": {"fp8_statz": {}}, "max_duration": "1ba"})


def test_importing_the_package_needs_neither_torch_nor_te():
    code = "import sys, foundry_fp8, foundry_fp8.recipe; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_cli_lists_subcommands_and_version():
    from foundry_fp8.cli import SUBCOMMANDS

    out = subprocess.run([sys.executable, "-m", "foundry_fp8.cli", "--help"], capture_output=True,
                         text=True, check=True).stdout
    description = set(re.findall(r"[\w-]+", out.split("\n\n")[1]))  # the line under usage
    listed = {line.split()[0] for line in out.split("COMMAND\n")[-1].splitlines()
              if line.startswith("    ") and not line.startswith("     ")}
    assert set(SUBCOMMANDS) == listed >= {"lint", "report", "bench", "doctor"}
    assert set(SUBCOMMANDS) <= description, description
    version = subprocess.run([sys.executable, "-m", "foundry_fp8.cli", "--version"],
                             capture_output=True, text=True, check=True).stdout
    assert version.startswith("foundry-fp8 ")


@pytest.mark.slow
def test_tiny_mpt_trains_on_cpu_through_llmfoundry(tmp_path, tiny_data):
    trainer = run_tiny(tmp_path, tiny_data, {"max_duration": "24ba", "save_interval": "24ba"},
                       wandb=True)
    folder = run_folder(tmp_path)
    records = list(read_jsonl(folder / "metrics.jsonl"))
    losses = [m["loss/train/total"] for _, m in records if "loss/train/total" in m]
    assert len(losses) == 24
    # learnable data: the loss must fall well below the uniform-guess loss ln(vocab)
    assert losses[0] > 0.9 * math.log(512)
    assert losses[-1] < 0.6 * math.log(512)
    assert int(trainer.state.timestamp.batch) == 24
    # what reached W&B, read back from the offline run file (not "the folder exists")
    trainer.close()  # as the CLI does at exit: finishes the W&B run
    [wandb_run] = wandb_history.read_runs(folder, wait=120)
    assert wandb_run.complete
    assert wandb_run.steps("loss/train/total") == list(range(24))
    assert [m["loss/train/total"] for m in wandb_run.rows if "loss/train/total" in m] == losses
    assert (folder / "checkpoints" / "latest-rank0.pt").exists()


def test_jsonl_logger_writes_on_rank_zero_only(tmp_path, monkeypatch):
    """Composer hands every rank's metrics to every destination: one file, one writer."""
    from types import SimpleNamespace

    from composer.utils import dist

    from foundry_fp8.composer.jsonl_logger import JSONLLogger

    for rank in (1, 0):
        monkeypatch.setattr(dist, "get_global_rank", lambda rank=rank: rank)
        logger = JSONLLogger(path=str(tmp_path / "{run_name}" / "metrics.jsonl"))
        logger.init(SimpleNamespace(run_name="r"), None)
        logger.log_metrics({"loss": 1.5 + rank}, step=3)
    assert list(read_jsonl(tmp_path / "r" / "metrics.jsonl")) == [(3, {"loss": 1.5})]


REPO_ROOT = Path(__file__).resolve().parents[1]


def _demo_module():
    """scripts/demo.py (`make run`'s job), loaded from its file: scripts/ is no package."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("demo", REPO_ROOT / "scripts" / "demo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _streaming_s_race_line(monkeypatch) -> str:
    """The last line of a traceback from streaming's own get_shm_prefix when another process
    created the prefix it picked between its check and its create (what broke a `make run`)."""
    from multiprocessing.shared_memory import SharedMemory

    from streaming.base.shared import prefix
    from streaming.base.world import World

    taken = 900000 + os.getpid() % 90000
    other = SharedMemory(prefix._get_path(taken, "locals"), create=True, size=8)
    monkeypatch.setattr(prefix, "_check_and_find_retrying", lambda *args, **kwargs: taken)
    try:
        with pytest.raises(FileExistsError) as raised:
            prefix.get_shm_prefix(["/tmp/qa-local"], [None], World.detect())
    finally:
        other.close()
        other.unlink()
    return f"[rank0]: {type(raised.value).__name__}: {raised.value}"


def test_make_run_trains_again_once_after_losing_streaming_s_shared_memory_race(
        monkeypatch, tmp_path):
    from foundry_fp8 import fault

    demo = _demo_module()
    race = _streaming_s_race_line(monkeypatch)
    calls = []

    def fake_run(cmd, stdout, stderr):
        calls.append(cmd)
        stdout.write("Building train loader...\n" + (race if len(calls) == 1 else "done") + "\n")
        return subprocess.CompletedProcess(cmd, 1 if len(calls) == 1 else 0)

    monkeypatch.setattr(fault.subprocess, "run", fake_run)  # imported: torch runs its own
    demo._train(tmp_path, tmp_path, "tiny")
    assert len(calls) == 2


def test_make_run_stops_at_any_other_failure(monkeypatch, tmp_path):
    from foundry_fp8 import fault

    demo = _demo_module()
    calls = []

    def fake_run(cmd, stdout, stderr):
        calls.append(cmd)
        # jsonl's own FileExistsError (foundry_fp8/jsonl.py): not the race, not retried
        stdout.write("[rank0]: FileExistsError: /tmp/x/metrics.jsonl.aside exists\n")
        return subprocess.CompletedProcess(cmd, 1)

    monkeypatch.setattr(fault.subprocess, "run", fake_run)  # imported: torch runs its own
    with pytest.raises(SystemExit, match="training failed"):
        demo._train(tmp_path, tmp_path, "tiny")
    assert len(calls) == 1


def test_ctrl_c_during_make_run_is_one_line_and_exit_130(tmp_path, tiny_data):
    """A real SIGINT to scripts/demo.py while its `llmfoundry train` trains. Sent once the log
    shows training (te_swap's coverage table or a batch line): the demo has imported Composer by
    then (it opens the log after), whose SIGINT handler raises SystemExit(130), the case 8b2a1ee
    fixed; a SIGINT right after the `$ ` line usually came before that import."""
    import signal
    import time

    run_root = tmp_path / "runs"
    log = run_root / "mpt-tiny-cpu.log"
    process = subprocess.Popen(
        [sys.executable, str(REPO_ROOT / "scripts" / "demo.py"), "--data-root",
         str(tiny_data.root), "--run-root", str(run_root)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 600  # never hangs: fails, naming what it waited for
        while not (log.exists() and ("[batch=" in (text := log.read_text())
                                     or "| FP8 | kind |" in text)):
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                pytest.fail(f"no training line in {log} (demo exit {process.poll()}): "
                            f"{process.communicate()[1][-2000:]}")
            time.sleep(0.2)
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert (process.returncode, stderr) == (130, "make run: interrupted\n")
