"""`fp8_lint`: the linter's rules on the run's resolved config, before any GPU time is spent,
and a check of the built model that `precision: amp_fp8` has something to run in FP8."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from composer.core import Callback, State
from composer.loggers import Logger

from foundry_fp8.composer.destinations import deliver
from foundry_fp8.environment import gather_snapshot
from foundry_fp8.lint.registry import Finding, LintContext, section
from foundry_fp8.lint.rules import fsdp_version_from_env, lint_config, wandb_mode_from_env
from foundry_fp8.lint.rules.environment import environment_findings
from foundry_fp8.lint.rules.fsdp import (
    FLOAT32_OUTSIDE_TE,
    FLOAT32_OUTSIDE_TE_FIX,
    float32_outside_te,
)
from foundry_fp8.mlflow_facts import THREADPOOL_ENV, threadpool_size
from foundry_fp8.options import build

log = logging.getLogger(__name__)

#: Rules whose finding the run warns of itself where it applies, once: FP8052 by the jsonl
#: logger at INIT and fp8_stats at FIT_START (`paths.say_repeated`), FP8051 by fp8_stats at
#: FIT_START (`composer.stats.mlflow_races`, judged as the rule judges it in a run), FP8055 by
#: te_swap at INIT (`swap._warn_exclude_unmatched`, on the layers it really decides on). fp8_lint
#: counts them and leaves the saying to the run, which would otherwise print each twice.
SAID_BY_THE_RUN = frozenset({"FP8051", "FP8052", "FP8055"})


def mlflow_pool_problem(config: Mapping[str, Any], environ: Mapping[str, str]) -> str | None:
    """Why MLflow would stop this run at its first asynchronous log, None when it would not: an
    MLflow logger without `synchronous: true` under a MLFLOW_ASYNC_LOGGING_THREADPOOL_SIZE that
    MLflow's int() or its ThreadPoolExecutor refuses ('abc', '-1'; `mlflow_facts.threadpool_size`),
    which raises ValueError in the Trainer's constructor (Composer logs its hyperparameters
    there) with a traceback through MLflow."""
    loggers = section(config, "loggers")
    if "mlflow" not in loggers or section(loggers, "mlflow").get("synchronous") \
            or threadpool_size(environ) is not None:
        return None
    return (f"fp8_lint: {THREADPOOL_ENV}={environ.get(THREADPOOL_ENV)!r} is no thread count "
            "MLflow takes (a whole number, at least 1; 0 is its default, 10), and loggers.mlflow "
            "logs asynchronously, so MLflow would raise ValueError at the run's first log, in the "
            f"Trainer's constructor (fix: {THREADPOOL_ENV}=1, which also avoids its file store's "
            "race, or unset it, or loggers.mlflow.synchronous: true)")


def model_problem(precision: str, model: Any) -> str | None:
    """Why an `amp_fp8` run's model would compute nothing in FP8; None when it would."""
    from foundry_fp8.swap import fp8_module_counts, would_run_fp8

    if precision != "amp_fp8":
        return None
    te_modules, emulated = fp8_module_counts(model)
    if would_run_fp8(precision, te_modules, emulated):
        return None
    return ("fp8_lint: precision amp_fp8, but the model has no FP8 module (no TE layer, none "
            "converted by te_swap), so nothing would run in FP8; add `algorithms: {te_swap: "
            "{}}` or `model.fc_type: te`, or do not ask for amp_fp8")


def precision_problem(state: Any) -> str | None:
    """FP8044 at run time: why an amp_fp8 run computes outside TE's layers in float32 (amp_fp8
    adds no torch autocast), None when FSDP's mixed precision or the parameters themselves are
    bf16/fp16. `state`: Composer's State after the Trainer's FSDP wrapping (LLM-Foundry has
    already dropped fsdp_config on one GPU); FSDP's param_dtype comes from Composer's own
    get_mixed_precision, as its FSDP1 and FSDP2 wrapping read it."""
    import torch
    from composer.core import Precision
    from composer.distributed.mosaic_parallelism import get_mixed_precision
    from composer.utils import dist

    if Precision(state.precision) != Precision.AMP_FP8:
        return None
    low = (torch.bfloat16, torch.float16)
    config = state.fsdp_config
    if config is not None and state.fsdp_enabled:
        mixed = getattr(config, "mixed_precision", None)
        if mixed is None:  # Composer 0.31's FSDP2 has none: fully_shard casts to bf16 (fsdp2.py)
            return None
        param_dtype = get_mixed_precision(state.precision, mixed)[1]
        if param_dtype in low:
            return None
        kept = param_dtype or "None (the parameters' own dtype, float32 here)"
        cause = (f"fsdp_config.mixed_precision FULL, which leaves FSDP's param_dtype {kept}"
                 if isinstance(mixed, str) else f"fsdp_config.mixed_precision {dict(mixed)!r}, "
                 f"whose FSDP param_dtype is {kept}")
    elif dist.get_world_size() == 1:
        cause = ("no FSDP on one GPU (LLM-Foundry drops fsdp_config there: 'FSDP is not "
                 "applicable for single-GPU training. Reverting to DDP.')")
    else:
        cause = "no FSDP (no fsdp_config)"
    sizes: dict[torch.dtype, int] = {}
    for p in state.model.parameters():
        if p.is_floating_point():
            sizes[p.dtype] = sizes.get(p.dtype, 0) + p.numel()
    if not sizes or max(sizes, key=sizes.__getitem__) != torch.float32:
        return None  # the parameters themselves are low precision
    return (f"fp8_lint {FLOAT32_OUTSIDE_TE}: {float32_outside_te(cause)} (fix: "
            f"{FLOAT32_OUTSIDE_TE_FIX})")


def _describe(f: Finding) -> str:
    return f"{f.rule} {f.key}: {f.message} (fix: {f.fix})"


class FP8Lint(Callback):
    """`callbacks: {fp8_lint: {fail_on: error}}`.

    LLM-Foundry passes its logged train config (`callbacks_with_config`) and builds callbacks
    before the Trainer, so config errors, and version rules for this machine (TE too old for
    activation checkpointing, a GPU without FP8), stop the run at construction; findings name
    key paths (the config has no lines). Then, once the model exists (BEFORE_LOAD: Composer runs
    callbacks before algorithms at INIT, so te_swap has converted only after INIT), an
    `amp_fp8` run whose model has no FP8 module fails too. `fail_on: never` only warns. At
    FIT_START (after FSDP wrapping) an `amp_fp8` run that computes outside TE's layers in
    float32 gets one warning (FP8044's twin, `precision_problem`). Inside the run the
    environment is known and goes to the rules (`LintContext.environ`): FP8051 (MLflow's
    file-store race) judges the URI Composer takes and MLflow's pool there, as fp8_stats does;
    an MLflow pool size MLflow refuses stops the run here (`mlflow_pool_problem`). FP8051 and
    FP8052 are counted, not printed: the run says them (`SAID_BY_THE_RUN`).

    Logs (as a hyperparameter, at FIT_START): `fp8_lint/findings`, the number of findings (that
    warning included).
    """

    def __init__(self, train_config: Any, **options: Any):
        self.options = build("fp8_lint", options)  # one line naming callbacks.fp8_lint.<key>
        self.fail_on: str = self.options.fail_on
        #: `fp8_lint/findings` as last sent: a later fit() sends it again only if it changed
        #: (MLflow's asynchronous queue drops a batch naming one key twice, losses included)
        self._sent: dict[str, int] | None = None
        from omegaconf import DictConfig, OmegaConf

        if isinstance(train_config, DictConfig):
            train_config = OmegaConf.to_container(train_config, resolve=True)
        self.findings = _run_findings(train_config or {})
        for f in self.findings:
            if f.rule not in SAID_BY_THE_RUN:
                log.warning("fp8_lint %s %s", f.severity, _describe(f))
        errors = [f for f in self.findings if f.severity == "error"]
        if errors:
            self._fail(f"fp8_lint: {_describe(errors[0])}; {len(errors)} error(s) in total")
        try:
            problem = mlflow_pool_problem(train_config or {}, os.environ)
        except Exception:  # our bug: the run goes on, with the error in its log
            log.exception("fp8_lint: checking MLflow's thread pool setting failed; skipped")
            problem = None
        if problem:
            self._fail(problem)

    def _fail(self, message: str) -> None:
        if self.fail_on == "error":
            raise ValueError(message)
        log.warning("%s (fail_on: never, continuing)", message)

    def init(self, state: State, logger: Logger) -> None:
        self._sent = None  # a new Trainer's loggers have not had `fp8_lint/findings`

    def before_load(self, state: State, logger: Logger) -> None:
        try:
            problem = model_problem(state.precision.value, state.model)
        except Exception:  # our bug: the run goes on, with the error in its log
            log.exception("fp8_lint: checking the model failed; skipped")
            return
        if problem:
            self._fail(problem)

    def fit_start(self, state: State, logger: Logger) -> None:
        try:
            problem = precision_problem(state)
        except Exception:  # our bug: the run goes on, with the error in its log
            log.warning("fp8_lint: checking the compute dtype failed; skipped", exc_info=True)
            problem = None
        if problem:
            log.warning(problem)
        findings = {"fp8_lint/findings": len(self.findings) + bool(problem)}
        if findings == self._sent:  # a second fit(): MLflow's queue refuses a key sent twice
            return
        self._sent = findings
        deliver(logger.destinations, "hyperparameters",  # a logger's failure: warned
                lambda d: d.log_hyperparameters(findings), "fp8_lint")


def _run_findings(config: Any) -> list[Finding]:
    """The file rules and this machine's version rules for a run's config (the environment
    probe, without the TE import subprocess: the run imports TE itself moments later). A
    failure inside them is our bug, not the run's: a rule whose check raised is logged and the
    others' findings stand; a failure around the rules is logged and the run goes on unlinted."""
    try:
        snapshot = gather_snapshot(probe_te_import=False)
        context = LintContext(scope="run", fsdp_version=fsdp_version_from_env(os.environ),
                              snapshot=snapshot, wandb_mode=wandb_mode_from_env(os.environ),
                              environ=dict(os.environ))
        # the machine's first: where it cannot run the config (no TE), that is the
        # cause, and the first error is the one that stops the run
        findings = environment_findings(snapshot, config) + lint_config(config, context)
    except Exception:
        log.exception("fp8_lint: the linter failed on this config; the run is not linted")
        return []
    for f in findings:
        if f.crashed:
            log.error("fp8_lint: %s (fix: %s)", f.message, f.fix)
    return [f for f in findings if not f.crashed]
