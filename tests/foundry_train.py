"""LLM-Foundry's own train path for a YAML file, the reference lint tests compare with."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _refusal(path: Path, check: Callable[[Any], object]) -> Exception | None:
    """What `check` raises on the file omegaconf loads (LLM-Foundry's warnings silenced);
    None: it takes the file."""
    from omegaconf import OmegaConf

    with open(path) as f:
        loaded = OmegaConf.load(f)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            check(loaded)
    except Exception as e:  # the caller judges the kind
        return e
    return None


def train_refusal(path: Path) -> Exception | None:
    """What LLM-Foundry's train raises on the file before building anything (omegaconf's load,
    `make_dataclass_and_log_config` with every transform, `validate_config`); None: it takes
    the file."""
    from llmfoundry.command_utils.train import validate_config
    from llmfoundry.utils.config_utils import (
        TRAIN_CONFIG_KEYS,
        TrainConfig,
        make_dataclass_and_log_config,
    )

    def check(loaded: Any) -> None:
        _, train_config = make_dataclass_and_log_config(loaded, TrainConfig, TRAIN_CONFIG_KEYS,
                                                        transforms="all")
        validate_config(train_config)

    return _refusal(path, check)


def train_refuses(path: Path, kind: type[Exception]) -> bool:
    """Whether LLM-Foundry's train refuses the file with a `kind` error before building anything
    (`train_refusal`); an error of another kind is raised, as the test did not expect it."""
    error = train_refusal(path)
    if error is not None and not isinstance(error, kind):
        raise error
    return error is not None


def eval_refusal(path: Path) -> Exception | None:
    """What LLM-Foundry's evaluate raises on the file before building anything (omegaconf's
    load, then `make_dataclass_and_log_config` with EvalConfig and the allow_toplevel_keys
    transform, as llmfoundry/command_utils/eval.py evaluate calls it); None: it takes the file."""
    from llmfoundry.command_utils.eval import allow_toplevel_keys
    from llmfoundry.utils.config_utils import (
        EVAL_CONFIG_KEYS,
        EvalConfig,
        make_dataclass_and_log_config,
    )

    return _refusal(path, lambda loaded: make_dataclass_and_log_config(
        loaded, EvalConfig, EVAL_CONFIG_KEYS, transforms=[allow_toplevel_keys],
        icl_tasks_required=False))
