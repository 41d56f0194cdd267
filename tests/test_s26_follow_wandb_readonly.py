"""`foundry-fp8 report` on a W&B run file that W&B's reader may not open read-write: another
user's run on a shared cluster (EACCES) or a read-only mount (EROFS). W&B's reader opens run
files with open(fname, "r+b") (wandb 0.18 sdk/internal/datastore.py `DataStore.open_for_scan`),
so the report refused them ("copy the run folder somewhere you may write"). It reads a private
copy with W&B's own reader instead, removed once opened. Both cases on the real thing: a
read-only bind mount (`unshare -m`, as root) and the report run as user nobody."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from foundry_fp8 import wandb_history
from foundry_fp8.cli import main
from foundry_fp8.health import layer_key
from tests.wandb_runs import write_wandb_run

STEPS = range(0, 20, 2)
LAYER = "blocks.0.fc"
ROOT = Path(__file__).resolve().parent.parent
REPORT = [sys.executable, "-m", "foundry_fp8", "report"]

NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]

needs_root = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"),
                                reason="needs root and unshare (a read-only bind mount)")


def _nobody_runs_python() -> bool:
    """Whether user nobody may run this Python (not where it lives under root's 0700 home)."""
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        return False
    return subprocess.run([*NOBODY, sys.executable, "-c", ""], capture_output=True,
                          timeout=60).returncode == 0


def _run(folder: Path) -> Path:
    """A finished offline run as W&B's own writer leaves it: per-layer FP8 rows, the loss."""
    return write_wandb_run(
        folder / "wandb" / "offline-run-20261130_010000-abc" / "run-abc.wandb", STEPS,
        lambda step: {layer_key("underflow_pct", "weight", LAYER): 0.01 * step,
                      layer_key("amax", "weight", LAYER): 1.0 + step,
                      "loss/train/total": 3.0 - 0.1 * step})


@pytest.fixture(scope="module")
def reported(tmp_path_factory) -> tuple[Path, str]:
    """A run folder (0644 files, as W&B writes them) and its report where W&B's reader may open
    it read-write (OUT for where it was written)."""
    folder = tmp_path_factory.mktemp("reported")
    run, out = folder / "run", folder / "out"
    _run(run)
    with contextlib.redirect_stdout(io.StringIO()) as said:
        assert main(["report", str(run), "--out", str(out)]) == 0
    return run, said.getvalue().replace(str(out), "OUT")


@needs_root
def test_a_run_on_a_read_only_mount_is_reported_as_a_writable_one(tmp_path, reported):
    run, expected = reported
    [path] = wandb_history.run_files(run)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    script = (f'mount --bind "{run}" "{run}" && mount -o remount,ro,bind "{run}" "{run}" || '
              f'exit 9\nif true 2>/dev/null >> "{path}"; then exit 8; fi\n'
              f'exec "$@"')  # W&B's own open (r+b) would meet EROFS, as `>>` did
    done = subprocess.run(["unshare", "-m", "sh", "-c", script, "sh", *REPORT, str(run),
                           "--out", str(tmp_path / "ro")], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env={**os.environ, "TMPDIR": str(tmp)})
    assert (done.returncode, done.stderr) == (0, ""), done
    assert done.stdout.replace(str(tmp_path / "ro"), "OUT") == expected
    assert f"| {LAYER} | weight | 0.18 | 19 |" in expected
    assert list(tmp.iterdir()) == []  # the private copy is gone


def test_another_user_s_run_is_reported_and_one_they_may_not_read_is_one_line(
        tmp_path, reported):
    """As user nobody: a run folder of root's, readable by all (0644 files, as W&B writes
    them), is reported as root's own report says; one readable by root alone is one line."""
    if not _nobody_runs_python():
        pytest.skip("needs root, setpriv, and a Python user nobody may run")
    run, expected = reported
    unreadable, tmp, out = tmp_path / "private", tmp_path / "tmp", tmp_path / "nobody"
    locked = _run(unreadable)
    locked.chmod(0o600)
    for folder in (tmp, out):
        folder.mkdir()
        folder.chmod(0o777)
    for folder in (tmp_path, run, *tmp_path.parents, *run.parents):  # pytest's are 0700: let nobody through
        info = folder.stat()
        if info.st_uid == os.geteuid() and not info.st_mode & 0o001:
            folder.chmod(info.st_mode | 0o001)  # search only, not listing
    env = {**os.environ, "TMPDIR": str(tmp), "HOME": str(tmp), "MPLCONFIGDIR": str(tmp / "mpl")}
    both = ("import sys\nfrom foundry_fp8.cli import main\n"
            f"print('rc', main(['report', {str(run)!r}, '--out', {str(out)!r}]))\n"
            f"sys.exit(main(['report', {str(unreadable)!r}]))")
    done = subprocess.run([*NOBODY, sys.executable, "-c", both], capture_output=True,
                          text=True, timeout=120, cwd=ROOT, env=env)
    report, _, code = done.stdout.rpartition("rc ")
    assert report.replace(str(out), "OUT") == expected and code == "0\n", done
    assert (done.returncode, done.stderr) == (2, (
        f"error: {locked}: W&B's own reader (`wandb sync` too) stops with PermissionError: "
        "Permission denied: you may not read it either (ask the run's owner to make it readable "
        "to you), having read no history row\n")), done
    assert sorted(p.name for p in tmp.iterdir()) in ([], ["mpl"])  # no copy left


def _refuse_read_write(monkeypatch) -> list[str]:
    """W&B's reader's own open(fname, "r+b") refused as on a read-only mount (for what the
    real mount cannot stage cheaply); the names it was asked to open."""
    import builtins

    from wandb.sdk.internal import datastore

    opened: list[str] = []

    def refuse(name, mode="r", *args, **kwargs):
        opened.append(str(name))
        if mode == "r+b" and not Path(name).name.startswith("foundry-fp8-"):
            raise OSError(30, os.strerror(30), str(name))
        return builtins.open(name, mode, *args, **kwargs)

    monkeypatch.setattr(datastore, "open", refuse, raising=False)
    return opened


def test_the_copy_is_gone_however_the_read_ends(tmp_path, monkeypatch):
    """Read to the end, stopped early by its reader (one row taken), or raising in W&B's
    parser (bytes after the last record): no copy is left in TMPDIR, and the copy is what
    W&B's reader read."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr("tempfile.tempdir", None)  # gettempdir reads TMPDIR again
    path = _run(tmp_path / "run")
    opened = _refuse_read_write(monkeypatch)
    run = wandb_history.read_run(path)
    assert [row["_step"] for row in run.rows] == list(STEPS) and run.complete
    assert opened[0] == str(path) and Path(opened[1]).parent == tmp
    assert list(tmp.iterdir()) == []
    rows = wandb_history.scan(wandb_history.WandbRun(path))
    assert next(rows)["_step"] == 0 and list(tmp.iterdir()) == []  # open, yet gone
    rows.close()
    with path.open("ab") as f:
        f.write(b"xyz" * 1000)  # a record of type 122: W&B's reader raises IndexError
    with pytest.raises(IndexError):
        wandb_history.read_run(path)
    assert list(tmp.iterdir()) == []


def test_no_room_for_the_copy_says_so_and_leaves_nothing(tmp_path, monkeypatch):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr("tempfile.tempdir", None)
    path = _run(tmp_path / "run")
    _refuse_read_write(monkeypatch)
    free = shutil.disk_usage(tmp).free
    with path.open("r+b") as f:  # a sparse file bigger than TMPDIR's free space
        f.truncate(free + 2**30)
    with pytest.raises(OSError) as e:
        wandb_history.read_run(path)
    assert str(e.value.strerror).startswith(
        f"Read-only file system opening it read-write, as W&B's reader does, and a private copy "
        f"in TMPDIR ({tmp}) failed: it needs "), e.value
    assert str(e.value.strerror).endswith("set TMPDIR to a folder you may write, with room for it")
    assert list(tmp.iterdir()) == []
