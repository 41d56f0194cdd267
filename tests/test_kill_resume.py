"""A run killed with SIGKILL, then restarted with Composer's `autoresume`: what survives.

Real processes (Composer Trainer, te_swap's emulated FP8, fp8_state, the jsonl logger; forked
from a server that imported torch and Composer once, tests/forked.py), each
killed by SIGKILL from inside at a chosen moment: between checkpoints, and halfway through
writing a checkpoint file (the process dies with half the bytes on disk, as a kill or a power
cut mid-write leaves it). The resumed losses and FP8 state are compared bit for bit with an
uninterrupted run's. Run as `python -m tests.test_kill_resume FOLDER KILL` for one process.
"""

from __future__ import annotations

import io
import os
import signal
import sys
from pathlib import Path

import pytest
import torch

from foundry_fp8.composer.state import FP8StateError, fp8_state_from_checkpoint
from foundry_fp8.jsonl import read_jsonl
from tests.forked import Finished, run_process

BATCHES, SAVE_EVERY = 6, 2


def _train(folder: Path, kill: str) -> None:
    """One process of the run in `folder`; `kill`: `none`, `batch:N` (SIGKILL as batch N
    starts) or `save:N` (SIGKILL halfway through writing the checkpoint of batch N)."""
    from composer import Callback, Trainer
    from composer.models import ComposerClassifier
    from composer.utils import checkpoint
    from torch.utils.data import DataLoader, TensorDataset

    from foundry_fp8.composer.jsonl_logger import JSONLLogger
    from foundry_fp8.composer.state import FP8State
    from foundry_fp8.composer.te_swap import TESwap
    from tests.test_state_restore import TwoBlocks

    what, _, at = kill.partition(":")

    class KillAtBatch(Callback):
        def batch_start(self, state, logger):
            if what == "batch" and int(state.timestamp.batch) == int(at):
                os.kill(os.getpid(), signal.SIGKILL)

    write = checkpoint._write_checkpoint_file

    def write_half_then_die(state_dict, filename):
        if what == "save" and f"-ba{at}-" in filename:
            buffer = io.BytesIO()
            torch.save(state_dict, buffer)
            with open(filename, "wb") as f:
                f.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
                f.flush()
                os.fsync(f.fileno())
            os.kill(os.getpid(), signal.SIGKILL)
        write(state_dict, filename)

    checkpoint._write_checkpoint_file = write_half_then_die

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(8 * BATCHES, 16) * 3, torch.randint(0, 16, (8 * BATCHES,)))
    trainer = Trainer(
        model=ComposerClassifier(TwoBlocks(), num_classes=16), seed=17, run_name="killed",
        train_dataloader=DataLoader(data, batch_size=8), max_duration=f"{BATCHES}ba",
        algorithms=[TESwap(backend="emulate", fp8_recipe={"amax_history_len": 4})],
        callbacks=[FP8State(), KillAtBatch()],
        loggers=[JSONLLogger(path=str(folder / "metrics.jsonl"))], device="cpu",
        progress_bar=False, save_folder=str(folder / "checkpoints"),
        save_interval=f"{SAVE_EVERY}ba", autoresume=True)
    trainer.fit()


def _run(folder: Path, kill: str = "none") -> Finished:
    attempts = len(list(folder.glob("attempt*.log")))
    return run_process(_train, folder, kill, output=folder / f"attempt{attempts}.log")


def _losses(folder: Path) -> dict[int, float]:
    """The last loss logged per step (a resumed run logs the steps after its checkpoint again)."""
    return {step: m["loss/train/total"] for step, m in read_jsonl(folder / "metrics.jsonl")
            if "loss/train/total" in m}


def _fp8_state(folder: Path) -> dict:
    return fp8_state_from_checkpoint(folder / "checkpoints" / f"ep0-ba{BATCHES}-rank0.pt")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("uninterrupted")
    assert _run(folder).returncode == 0
    return folder


def _assert_same_run(folder: Path, reference: Path) -> None:
    losses, expected = _losses(folder), _losses(reference)
    assert sorted(losses) == list(range(BATCHES)) and losses == expected  # bit for bit
    state, expected_state = _fp8_state(folder), _fp8_state(reference)
    assert len(state) == 2 and state.keys() == expected_state.keys()
    for name, tensors in expected_state.items():
        assert tensors["fwd_amax_history"].abs().sum() > 0
        for field, value in tensors.items():
            assert torch.equal(state[name][field], value), (name, field)


@pytest.mark.slow
# 1: before any checkpoint; 3: one batch past ba2's, which the resume trains again (a kill at
# 5, one past ba4's, took the same path); 4: as batch 4 starts, ba4's checkpoint just written
@pytest.mark.parametrize("batch", [1, 3, 4])
def test_a_kill_between_checkpoints_resumes_bit_identical(tmp_path, uninterrupted, batch):
    killed = _run(tmp_path, f"batch:{batch}")
    assert killed.returncode == -signal.SIGKILL
    resumed = _run(tmp_path)
    assert resumed.returncode == 0, resumed.output[-2000:]
    _assert_same_run(tmp_path, uninterrupted)


@pytest.mark.slow
def test_a_kill_mid_checkpoint_write_blocks_autoresume_until_the_partial_file_goes(
        tmp_path, uninterrupted):
    """Composer writes the checkpoint in place and moves `latest-rank0.pt` to it afterwards, so
    the symlink still names the previous checkpoint; but at the restart Composer refuses a
    checkpoint file later than the one it resumes from (FileExistsError, `save_overwrite`
    false, which autoresume runs use). Once the partial file is removed, the resume is exact."""
    killed = _run(tmp_path, "save:4")
    assert killed.returncode == -signal.SIGKILL
    partial = tmp_path / "checkpoints" / "ep0-ba4-rank0.pt"
    assert os.readlink(tmp_path / "checkpoints" / "latest-rank0.pt") == "ep0-ba2-rank0.pt"
    blocked = _run(tmp_path)
    assert blocked.returncode != 0
    assert "ep0-ba4-rank0.pt may conflict with a future checkpoint" in blocked.output
    again = _run(tmp_path)
    assert again.returncode != 0  # it stays blocked: nothing removes the partial file
    partial.unlink()
    resumed = _run(tmp_path)
    assert resumed.returncode == 0, resumed.output[-2000:]
    _assert_same_run(tmp_path, uninterrupted)


@pytest.mark.slow
def test_a_corrupt_checkpoint_stops_the_resume_with_an_error(tmp_path, uninterrupted):
    """A checkpoint truncated after it was written (disk trouble, a bad copy): autoresume
    loads it and fails in torch's loader; nothing trains on it."""
    assert _run(tmp_path, "batch:5").returncode == -signal.SIGKILL
    latest = tmp_path / "checkpoints" / "ep0-ba4-rank0.pt"
    data = latest.read_bytes()
    latest.write_bytes(data[: len(data) // 2])
    failed = _run(tmp_path)
    assert failed.returncode != 0
    # torch's zip reader gives up on the cut file: a traceback ending in
    # `OSError: [Errno 22] Invalid argument`, without the file's name
    assert "PyTorchFileReader" in failed.output and "OSError" in failed.output
    steps = [step for step, m in read_jsonl(tmp_path / "metrics.jsonl") if "loss/train/total" in m]
    assert max(steps) == 4  # the killed process's last batch; the failed resume logged none
    with pytest.raises(FP8StateError, match=r"ep0-ba4-rank0\.pt: not a readable checkpoint"):
        fp8_state_from_checkpoint(latest)  # ours says it in one line


if __name__ == "__main__":
    _train(Path(sys.argv[1]), sys.argv[2])
