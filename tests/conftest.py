"""Shared fixtures: the tiny local data set, and the `gpu` marker's auto-skip."""

from __future__ import annotations

import gc
import os
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
