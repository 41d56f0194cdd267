"""Test child processes forked from one forkserver that imported torch and Composer once per
pytest session: a fresh `python` (spawn, `subprocess`) imported them again each time, 5-10 s a
process. A child still starts from a process that never trained, with the caller's environment
and working directory, and is a real process: it can be killed, exit, or die on a signal."""

from __future__ import annotations

import atexit
import multiprocessing
import os
import sys
from collections.abc import Callable
from multiprocessing.context import BaseContext
from pathlib import Path
from typing import Any, NamedTuple

# imported once in the forkserver; a child imports anything else itself
PRELOAD = ["torch", "torch.distributed", "composer", "tests.ranks"]


def forkserver() -> BaseContext:
    """The forkserver context, preloading `PRELOAD` when it starts (the session's first child)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    return context


def as_spawned(index: int, target: Callable[..., Any], environ: dict[str, str], cwd: str,
               output: str, *args: Any) -> None:
    """`target(index, *args)` with the caller's environment and working directory (the
    forkserver's are those of the session's first child), its stdout and stderr into `output`
    (the forkserver's are a long-finished test's); at the end the exit handlers a finished
    interpreter runs (Composer's close among them), which a forked child's `os._exit` skips."""
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    try:
        target(index, *args)
    finally:
        atexit._run_exitfuncs()


class Finished(NamedTuple):
    returncode: int  # negative: the signal that ended it, as subprocess reports it
    output: str  # stdout and stderr, with the traceback of an exception that ended it


def _call(_index: int, target: Callable[..., Any], *args: Any) -> None:
    target(*args)


def run_process(target: Callable[..., Any], *args: Any, output: Path,
                timeout: float = 600.0) -> Finished:
    """`target(*args)` in a forked child; killed if still running after `timeout` seconds.
    `target` must be a module-level function (the child unpickles it by name)."""
    process = forkserver().Process(target=as_spawned, args=(
        0, _call, dict(os.environ), os.getcwd(), str(output), target, *args))
    process.start()
    process.join(timeout)
    if process.is_alive():
        process.kill()
        process.join()
    assert process.exitcode is not None
    return Finished(process.exitcode, output.read_text() if output.exists() else "")
