"""`te_swap`: the Composer algorithm that puts a model's linear layers in FP8.

At INIT (before FSDP wraps the model, after LLM-Foundry built the optimizer) it plans and
converts, moving the optimizer to the new parameters, and prints the coverage table. With the
`emulate` backend it runs each training forward under `emulate.fp8_autocast` with the chosen
recipe; eval forwards stay in high precision, as Composer does for `amp_fp8`.
"""

from __future__ import annotations

import logging
from contextlib import ExitStack
from typing import Any

from composer.core import Algorithm, Event, State
from composer.loggers import Logger

from foundry_fp8.recipe import FP8Recipe
from foundry_fp8.swap import SwapConfig, apply_swap, coverage_table, fp8_share, plan_swap

log = logging.getLogger(__name__)


class TESwap(Algorithm):
    """`algorithms: {te_swap: {backend: emulate, keep_first_blocks: 1, fp8_recipe: {...}}}`."""

    def __init__(self, backend: str = "te", keep_first_blocks: int = 0, keep_last_blocks: int = 0,
                 include: str | None = None, exclude: str | None = None, min_features: int = 16,
                 fp8_recipe: dict[str, Any] | None = None):
        self.config = SwapConfig(backend=backend, keep_first_blocks=keep_first_blocks,
                                 keep_last_blocks=keep_last_blocks, include=include,
                                 exclude=exclude, min_features=min_features)
        self.recipe = FP8Recipe.from_options(fp8_recipe)
        if backend == "te":
            from foundry_fp8 import te_backend

            te_backend.require_te()
            raise NotImplementedError(
                "te_swap: backend 'te' is not wired to Composer's FP8 context yet (never run on a "
                "GPU); use backend: emulate")
        self._autocast = ExitStack()
        self.plan: list = []

    def match(self, event: Event, state: State) -> bool:
        del state
        return event in (Event.INIT, Event.BEFORE_FORWARD, Event.AFTER_FORWARD)

    def apply(self, event: Event, state: State, logger: Logger) -> None:
        if event == Event.INIT:
            self._convert(state, logger)
        elif event == Event.BEFORE_FORWARD:
            from foundry_fp8.emulate import fp8_autocast

            self._autocast.close()  # a forward that raised never reached AFTER_FORWARD
            self._autocast.enter_context(fp8_autocast(recipe=self.recipe))
        elif event == Event.AFTER_FORWARD:
            self._autocast.close()  # outermost exit: forward scales update, as in TE

    def _convert(self, state: State, logger: Logger) -> None:
        self.plan = plan_swap(state.model, self.config)
        if not any(d.convert for d in self.plan):
            raise ValueError("te_swap: no linear layer qualifies for FP8 (see the reasons: "
                             + "; ".join(sorted({d.reason for d in self.plan})) + ")")
        converted = apply_swap(state.model, self.plan, self.config.backend, state.optimizers)
        table = coverage_table(self.plan)
        share = fp8_share(self.plan)
        print(f"foundry_fp8 te_swap ({self.config.backend}): {converted} layers in FP8, "
              f"{100 * share:.1f}% of linear params; recipe {self.recipe.as_config()}\n{table}",
              flush=True)
        logger.log_hyperparameters({"fp8/backend": self.config.backend,
                                    "fp8/recipe": self.recipe.as_config(),
                                    "fp8/linear_param_share": share})
