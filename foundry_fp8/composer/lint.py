"""`fp8_lint`: the linter's rules on the run's resolved config, before any GPU time is spent."""

from __future__ import annotations

import logging
from typing import Any

from composer.core import Callback, State
from composer.loggers import Logger

from foundry_fp8.lint.rules import lint_config

log = logging.getLogger(__name__)


class FP8Lint(Callback):
    """LLM-Foundry passes the train config (`callbacks_with_config`), and builds callbacks before
    the Trainer, so errors stop the run at construction. `fail_on: never` only warns."""

    def __init__(self, train_config: Any, fail_on: str = "error"):
        if fail_on not in ("error", "never"):
            raise ValueError(f"fp8_lint.fail_on: use 'error' or 'never', got {fail_on!r}")
        from omegaconf import DictConfig, OmegaConf

        if isinstance(train_config, DictConfig):
            train_config = OmegaConf.to_container(train_config, resolve=True)
        self.findings = lint_config(train_config or {})
        for f in self.findings:
            log.warning("fp8_lint %s %s %s: %s (fix: %s)", f.severity, f.rule, f.key, f.message,
                        f.fix)
        errors = [f for f in self.findings if f.severity == "error"]
        if errors and fail_on == "error":
            first = errors[0]
            raise ValueError(f"fp8_lint: {first.rule} {first.key}: {first.message} "
                             f"(fix: {first.fix}); {len(errors)} error(s) in total")

    def fit_start(self, state: State, logger: Logger) -> None:
        del state
        logger.log_hyperparameters({"fp8_lint/findings": len(self.findings)})
