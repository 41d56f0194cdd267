"""Shared fixtures: the tiny local data set, a one-rank process group, one MLflow logging
thread, the `gpu` marker's auto-skip, streaming's shared memory released per test file and its
download threads stopped per test."""

from __future__ import annotations

import atexit
import gc
import os
import sys
import threading
import warnings
from pathlib import Path

import pytest

# The `fake_te` fixture (a stand-in transformer_engine), for every test module.
pytest_plugins = ["tests.fake_te"]

REPO_ROOT = Path(__file__).resolve().parents[1]

# Nothing in the test suite may reach the network: W&B stays offline, HF hub lookups are off.
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish() -> None:
    """Close the Composer engines a test left open now, not whenever the collector next runs:
    an engine closes in its `__del__`, and one collected inside a `compile()` (pytest rewriting
    hypothesis as it loads at the session's end) made CPython 3.11.7 raise "AST constructor
    recursion depth mismatch" after every test had passed (cpython gh-106905, fixed in 3.11.8)."""
    gc.collect()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """After a test file's last test (its module fixtures torn down), release the shared memory
    of the MosaicML streaming datasets its LLM-Foundry runs built. Each segment keeps a file
    descriptor open until the process exits (streaming/base/shared/memory.py registers every
    `SharedMemory.cleanup` with atexit, so even a collected dataset holds it): about 48 per
    train run, which ran the whole suite out of descriptors ("Too many open files") in CI."""
    yield
    stop_streaming_threads()
    if nextitem is None or nextitem.module is not item.module:
        release_streaming_shared_memory()


def stop_streaming_threads() -> int:
    """Tell every streaming epoch iterator still running to exit, as its exit hook would at
    process exit, and drop that hook. A run that stops mid-epoch (every `max_duration` in `ba`)
    leaves its train loader's download and ready threads polling every 7 ms (streaming's TICK)
    until the process ends: after a few hundred runs in one pytest their GIL wake-ups slowed
    every later test (108 such threads by 80 % of the suite; the W&B tests near its end took up
    to 15 times as long as alone). Returns how many were told."""
    dataset = sys.modules.get("streaming.base.dataset")
    if dataset is None:
        return 0
    hooks = threading._threading_atexits  # type: ignore[attr-defined]  # streaming's registry
    # threading._register_atexit keeps each as functools.partial(iterator.non_blocking_exit)
    ours = [hook for hook in hooks if isinstance(
        getattr(getattr(hook, "func", None), "__self__", None), dataset._Iterator)]
    for hook in ours:
        hook()  # non_blocking_exit: ITERATING -> EXITING, which both threads check each TICK
        hooks.remove(hook)
    return len(ours)


def release_streaming_shared_memory() -> int:
    """Close (and unlink, where this process made them) every live streaming `SharedMemory`,
    as its atexit hook would, and drop that hook. Returns how many there were."""
    memory = sys.modules.get("streaming.base.shared.memory")
    if memory is None:  # no run in this process built a streaming dataset
        return 0
    segments = [o for o in gc.get_objects() if type(o) is memory.SharedMemory]
    for segment in segments:
        atexit.unregister(segment.cleanup)
        try:
            segment.cleanup()
        except (BufferError, OSError) as error:  # a view still on it: a warning, not an
            warnings.warn(f"streaming shared memory not released: {error!r}", stacklevel=1)
        segment.created_shms.clear()  # INTERNALERROR ending the session; never unlink twice
        segment.opened_shms.clear()
    return len(segments)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (never run on this CPU-only machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def tiny_data():
    """The tiny tokenizer and MDS dataset, built once into the repo's git-ignored data/."""
    from foundry_fp8.tools.tiny_data import prepare_tiny_data

    return prepare_tiny_data(REPO_ROOT / "data")


@pytest.fixture
def one_rank_group(tmp_path):
    """A one-rank gloo group (FSDP needs one): the one an earlier test's Composer Trainer left in
    this process (composer/utils/dist.py initialize_dist, a HashStore, never destroyed), else
    our own, meeting through a file (no port another test could take), destroyed after."""
    import torch.distributed as dist

    if dist.is_initialized():
        assert dist.get_world_size() == 1
        yield
        return
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def one_mlflow_thread(monkeypatch):
    """One MLflow logging thread: with its default 10, the file store's unguarded folder
    creation (mlflow/utils/file_utils.py make_containing_dirs) now and then drops a whole
    batch of metrics ([Errno 17] File exists), which a test would read as ours
    (docs/fp8_stats.md; fp8_stats warns users of it)."""
    from foundry_fp8.mlflow_facts import THREADPOOL_ENV

    monkeypatch.setenv(THREADPOOL_ENV, "1")


@pytest.fixture
def plain_warnings():
    """`capture(run)`: `run()` and the messages foundry_fp8.composer.plain logged at WARNING
    meanwhile, by a handler on that logger itself (LLM-Foundry's train reconfigures the root's,
    which pytest's caplog listens on)."""
    import logging

    def capture(run):
        records: list[logging.LogRecord] = []
        handler = logging.Handler(logging.WARNING)
        handler.emit = records.append  # type: ignore[method-assign]
        logger = logging.getLogger("foundry_fp8.composer.plain")
        logger.addHandler(handler)
        try:
            result = run()
        finally:
            logger.removeHandler(handler)
        return result, [r.getMessage() for r in records]

    return capture
