"""Shared fixtures: the tiny local data set, and the `gpu` marker's auto-skip."""

from __future__ import annotations

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
