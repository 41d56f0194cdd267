"""Run `yamls/mpt-tiny-cpu.yaml` through LLM-Foundry's real `train` entry point in a test."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig
from omegaconf import OmegaConf as om

from foundry_fp8.tools.tiny_data import TinyData

TINY_YAML = Path(__file__).resolve().parents[1] / "yamls" / "mpt-tiny-cpu.yaml"


def own_wandb_env(**extra: str) -> dict[str, str]:
    """This environment for an attempt run in a child process, less W&B's service token: a
    process that started W&B exports it (wandb/sdk/lib/service_token.py), and a child that
    inherits it logs through the parent's service, which outlives a killed child and left the
    resumed attempt's run file unfinished for minutes (the W&B resume tests failed only after an
    in-process W&B test had run in the same pytest). A user's attempts are separate launches."""
    return {**{k: v for k, v in os.environ.items() if k != "WANDB_SERVICE"}, **extra}


def tiny_config(tmp_path: Path, tiny_data: TinyData, overrides: dict[str, Any] | None = None,
                wandb: bool = False) -> DictConfig:
    """The tiny YAML pointed at `tiny_data` and `tmp_path`, with `overrides` merged in.

    W&B is dropped unless asked for (it starts a service process, seconds per run); the JSONL
    logger stays, at `tmp_path/<run_name>/metrics.jsonl`.
    """
    cfg = om.load(TINY_YAML)
    cfg.variables.data_root = str(tiny_data.root)
    cfg.variables.run_root = str(tmp_path)
    if not wandb:
        del cfg.loggers["wandb"]
    cfg = om.merge(cfg, om.create(overrides or {}))
    assert isinstance(cfg, DictConfig)
    return cfg


def run_tiny(tmp_path: Path, tiny_data: TinyData, overrides: dict[str, Any] | None = None,
             wandb: bool = False):
    """Train the tiny MPT with LLM-Foundry's `train(cfg)`; returns the finished Trainer."""
    from llmfoundry.command_utils import train

    cfg = tiny_config(tmp_path, tiny_data, overrides, wandb=wandb)
    # W&B writes into `init_kwargs.dir` only when that folder already exists.
    (tmp_path / cfg.variables.run_name).mkdir(parents=True, exist_ok=True)
    return train(cfg)


def run_plain(tmp_path: Path, tiny_data: TinyData, overrides: dict[str, Any] | None = None):
    """`run_tiny` without te_swap and the callbacks that need FP8 layers: the plain MPT run."""
    from llmfoundry.command_utils import train

    cfg = tiny_config(tmp_path, tiny_data, overrides)
    for section, key in (("algorithms", "te_swap"), ("callbacks", "fp8_stats"),
                         ("callbacks", "fp8_state")):
        del cfg[section][key]
    (tmp_path / cfg.variables.run_name).mkdir(parents=True, exist_ok=True)
    return train(cfg)


def run_folder(tmp_path: Path, cfg_or_name: DictConfig | str = "mpt-tiny-cpu") -> Path:
    name = cfg_or_name if isinstance(cfg_or_name, str) else cfg_or_name.variables.run_name
    return tmp_path / name
