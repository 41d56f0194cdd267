"""`foundry-fp8 report RUN --baseline BASE`: the training loss of both runs, read as the run
itself is (the `jsonl` logger's metrics.jsonl, a W&B offline run with W&B's reader, an MLflow run
with MLflow's client), for `health.loss.compare`. Bad input is one line (ReportError)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from foundry_fp8.health.keys import LOSS
from foundry_fp8.jsonl import JsonlError, hparams_of, read_jsonl
from foundry_fp8.report.mlflow_run import mlflow_history, mlflow_params, mlflow_run
from foundry_fp8.report.read import (
    ReportError,
    WandbRead,
    attempts_config,
    json_document,
    losses_of,
    metrics_file_of,
    read_hparams,
    wandb_files,
)

#: The config keys that make a step the same batch in both runs (LLM-Foundry's; a plain
#: Composer run logs its seed as `rank_zero_seed`): where they differ, a step's losses are of
#: different data and the comparison says less.
SAME_BATCH_KEYS = ("global_train_batch_size", "seed", "max_seq_len",
                   "train_loader.dataset.remote", "train_loader.dataset.local",
                   "train_loader.dataset.hf_name", "train_loader.dataset.split",
                   "train_loader.dataset.shuffle", "train_loader.dataset.shuffle_seed")
#: The config sections that make a step the same update in both runs, past its batch: the
#: optimizer (learning rate, betas, weight decay), the learning-rate schedule and the gradient
#: clipping, each setting of them. Where one differs, the runs are at other points of their training at a step, and
#: a loss gap is no FP8 effect (a sweep against one baseline got "check for a label leak").
SAME_UPDATE_SECTIONS = ("optimizer", "scheduler", "algorithms.gradient_clipping")
#: The run's length, which the schedule stretches over where one of its times is in `dur` units
#: (Composer's `_convert_time`, composer/optim/scheduler.py), as `t_max` is by default ('1dur').
DURATION = "max_duration"
#: The schedule whose rate after warmup is the same whatever its `t_max` (Composer's
#: ConstantWithWarmupScheduler: LinearWithWarmupScheduler with alpha_i == alpha_f).
CONSTANT_SCHEDULE = "constant_with_warmup"
#: Composer's own name for the seed (composer/trainer/trainer.py logs `rank_zero_seed`).
COMPOSER_SEED = "rank_zero_seed"


def _losses_and_config(given: Path) -> tuple[dict[int, float], Mapping[str, Any] | None]:
    """step -> training loss (`health.keys.LOSS`) of the run GIVEN names, however the report
    reads runs (ReportError, one line, where GIVEN is no run or logged no loss), and the run's
    config where the same read holds it (a W&B run's: its files read again for it took as long
    again); else None."""
    config = None
    if (ml := mlflow_run(given)) is not None:
        losses = losses_of(mlflow_history(ml, LOSS))
    elif (files := wandb_files(given)) is not None:
        read = WandbRead.of(files)
        losses = losses_of(read.rows())
        if read.failed:
            raise ReportError(next(iter(read.stopped() + read.unread())))
        config = attempts_config(read)
    else:
        metrics_file = metrics_file_of(given)
        try:
            losses = losses_of(read_jsonl(metrics_file))
        except JsonlError as e:
            raise ReportError(json_document(metrics_file) or str(e)) from None
        except OSError as e:
            raise ReportError(f"{metrics_file}: cannot read ({e.strerror or e})") from None
    if not losses:
        raise ReportError(no_loss(given))
    return losses, config


def no_loss(given: Path) -> str:
    """Why the run GIVEN names has nothing to compare."""
    return (f"{given}: no `{LOSS}` logged (the training loss Composer logs at every batch), "
            "nothing to compare")


#: What Composer logs at the start of each batch (composer/trainer/trainer.py:2449-2455).
BATCH_KEY = "time/batch"


def _spans(steps: list[int]) -> str:
    """`3-6, 9` for [3, 4, 5, 6, 9]."""
    spans: list[list[int]] = []
    for step in steps:
        if spans and step == spans[-1][1] + 1:
            spans[-1][1] = step
        else:
            spans.append([step, step])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)


def mlflow_holes(given: Path, losses: Mapping[int, float]) -> str | None:
    """The steps up to its last loss point where an MLflow run holds neither the loss nor
    `BATCH_KEY`, when any: MLflow's asynchronous logging drops a batch whose write fails
    (mlflow/utils/async_logging/async_logging_queue.py:197-207), every key of its steps alike.
    (A tail it dropped leaves no trace.) A step with `BATCH_KEY` but no loss is no hole: Composer's
    MLFlowLogger skips any value equal to the key's last (composer/loggers/mlflow_logger.py:424-428,
    `DUPLICATE_WINDOW`), while `BATCH_KEY` grows each batch. None where it logged no `BATCH_KEY`
    (not Composer's: nothing tells a skipped value from a dropped batch)."""
    if (ml := mlflow_run(given)) is None:
        return None
    started = {step for step, _ in mlflow_history(ml, BATCH_KEY)}
    if not started:
        return None
    first, last = min([*started, *losses]), max(losses)
    missing = [step for step in range(first, last) if step not in losses and step not in started]
    if not missing:
        return None
    return (f"{given}: MLflow holds no `{LOSS}` nor `{BATCH_KEY}` at steps {_spans(missing)} of "
            f"{first}-{last}, "
            "logged at each batch: batches MLflow's asynchronous logging dropped (on a file "
            "store, `[Errno 17] File exists` when threads write at once: "
            "MLFLOW_ASYNC_LOGGING_THREADPOOL_SIZE=1 or loggers.mlflow.synchronous: true); the "
            "run's metrics.jsonl holds them, where it logged one")


@dataclass
class Baseline:
    """`--baseline` as read once for all the runs of a sweep: its losses, and its config
    (`read_config`) and MLflow's holes in its loss (`mlflow_holes`) read at most once, when a
    run's check first asks (`config`, `holes`)."""

    given: Path
    losses: dict[int, float]
    _config: Mapping[str, Any] | None = None

    def config(self) -> Mapping[str, Any]:
        if self._config is None:
            self._config = read_config(self.given)
        return self._config

    @cached_property
    def holes(self) -> str | None:
        return mlflow_holes(self.given, self.losses)


def read_baseline(given: Path) -> Baseline:
    """The baseline's losses (`_losses_and_config`), one line naming `--baseline` where they do not
    read or none is finite (it diverged itself: nothing to compare with)."""
    try:
        losses, config = _losses_and_config(given)
    except ReportError as e:
        raise ReportError(f"--baseline {e}") from None
    if not any(map(math.isfinite, losses.values())):
        raise ReportError(f"--baseline {given}: `{LOSS}` is NaN/Inf at each of its "
                          f"{len(losses)} logged steps, nothing to compare with")
    return Baseline(given, losses, config)


def run_identity(given: Path) -> str:
    """What names the run GIVEN is, however it was given (a folder, its metrics.jsonl, its
    wandb/ or mlruns/ folder, mlflow:<id>): the MLflow run id or the resolved file read."""
    if (ml := mlflow_run(given)) is not None:
        return f"MLflow run {ml.run_id}"
    if (files := wandb_files(given)) is not None:
        return str(files[0].resolve())
    return str(metrics_file_of(given).resolve())


def same_run(run: Path, losses: Mapping[int, float], baseline: Path,
             base: Mapping[int, float]) -> str | None:
    """Why `--baseline` is the run itself (the same run given twice, or a copy: the same loss
    at every step), where it is; a comparison with itself says nothing."""
    if run_identity(run) == run_identity(baseline):
        return f"--baseline {baseline} is this run ({run_identity(run)})"
    if losses.keys() == base.keys() and all(
            a == b or not (math.isfinite(a) or math.isfinite(b))
            for a, b in ((losses[s], base[s]) for s in losses)):
        return (f"--baseline {baseline} logged this run's loss at each of its {len(base)} steps: "
                "the same run (or a copy)?")
    return None


def read_config(given: Path) -> Mapping[str, Any]:
    """The hyperparameters of the run GIVEN names, as the report reads them (MLflow's params,
    the W&B run's config, hparams.json); empty where none read (the report says why)."""
    if (ml := mlflow_run(given)) is not None:
        return mlflow_params(ml)
    if (files := wandb_files(given)) is not None:
        return WandbRead.of(files).config() or {}
    return read_hparams(hparams_of(metrics_file_of(given))) or {}


def _setting(config: Mapping[str, Any], key: str) -> Any:
    """`key`'s value (dotted: nested sections), None where not logged."""
    value: Any = config
    for part in key.split("."):
        value = value.get(part) if isinstance(value, Mapping) else None
    if value is None and key == "seed":
        return config.get(COMPOSER_SEED)
    return value


def _differ(ours: Mapping[str, Any], theirs: Mapping[str, Any], keys: Iterable[str]) -> str:
    """`key a vs b` for each of `keys` both logged with different values (compared as text, as
    MLflow keeps a param), or ''; DURATION says why it counts."""
    return ", ".join(f"{key} {a} vs {b}" + (" (the schedule runs over it)" if key == DURATION
                                             else "") for key in keys
                     if (a := _setting(ours, key)) is not None
                     and (b := _setting(theirs, key)) is not None and str(a) != str(b))


def _update_keys(ours: Mapping[str, Any], theirs: Mapping[str, Any]) -> list[str]:
    """Each setting of SAME_UPDATE_SECTIONS either run logged (dotted), and DURATION where
    both runs' schedules read it (`_reads_duration`)."""
    keys = [f"{section}.{key}" for section in SAME_UPDATE_SECTIONS
            for config in (ours, theirs) if isinstance(part := _setting(config, section), Mapping)
            for key in part]
    if all(_reads_duration(_setting(config, "scheduler")) for config in (ours, theirs)):
        keys.append(DURATION)
    return list(dict.fromkeys(keys))


def _reads_duration(schedule: Any) -> bool:
    """Whether a logged `scheduler` section's rate at a step depends on the run's length: one
    of its times in `dur` units, `t_max` left at its default '1dur' (not in CONSTANT_SCHEDULE,
    whose `t_max` changes no rate within the run)."""
    if not isinstance(schedule, Mapping):
        return False
    constant = schedule.get("name") == CONSTANT_SCHEDULE
    times = ("t_warmup",) if constant else [key for key in schedule if str(key).startswith("t_")]
    return (any(str(schedule.get(key)).endswith("dur") for key in times)
            or not (constant or "t_max" in schedule))


def other_batches(ours: Mapping[str, Any], baseline: Baseline) -> str | None:
    """Which of SAME_BATCH_KEYS both runs logged with different values, where any: a step may
    then not be the same batch in both; and which settings of the update (`_update_keys`): the
    runs are then at other points of training at a step, and a gap between them says nothing
    of FP8, nor of a label leak. `ours`: the run's hyperparameters as the report read them
    (`read_config`; not read again)."""
    theirs = baseline.config()
    batches, updates = (_differ(ours, theirs, SAME_BATCH_KEYS),
                        _differ(ours, theirs, _update_keys(ours, theirs)))
    said = [f"trained on other batches: {batches} (this run vs the baseline): a step's losses "
            "are not of the same data" if batches else "",
            f"trained with another optimizer or learning-rate schedule: {updates} (this run vs "
            "the baseline): at a step the runs are at other points of training, so the loss gap "
            "says nothing of FP8 (nor of a label or mask leak); compare with a baseline that differs in FP8 "
            "alone" if updates else ""]
    return f"--baseline {baseline.given} " + "; ".join(filter(None, said)) if any(said) else None
