"""fp8_stats in a real LLM-Foundry run, the callback's event handling on a hand-built model,
and FP8Monitor on a hand-built model."""

from __future__ import annotations

import logging
import types

import pytest
import torch
from composer.core import Event
from safetensors.torch import load_file
from torch import nn

from foundry_fp8.composer.jsonl_logger import JSONLLogger
from foundry_fp8.composer.stats import FP8Stats
from foundry_fp8.emulate import EmulatedFP8Linear, fp8_autocast
from foundry_fp8.filters import filter_reason
from foundry_fp8.health import SUMMARIES, HealthTracker, collect, layer_key, parse_key, summary_key
from foundry_fp8.health.keys import HIGH_PRECISION, LAYER_ORDER
from foundry_fp8.health.rules import NONFINITE_CHANGE
from foundry_fp8.jsonl import read_jsonl
from foundry_fp8.monitor import FP8Monitor, FP8MonitorError, MonitorConfig, Schedule
from foundry_fp8.numerics import STAT_KEYS, tensor_stats
from foundry_fp8.options import SwapConfig
from foundry_fp8.recipe import FP8Recipe
from tests.tiny_run import run_folder, run_tiny

#: The advised exclude's start: a key's name is te_swap's with or without these fronts.
FRONTS = r"^(?:model\.)?(?:transformer\.)?"
ADVISED_0 = FRONTS + r"0(?:\..+)?$"  # the exclude advised for layer '0', and no other layer


def test_monitor_matches_tensor_stats_and_flags_the_outlier_layer():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
    with torch.no_grad():  # one huge weight: current scaling crushes the rest to zero
        model[1].weight[0, 0] = 1e6
    warnings_seen: list[str] = []
    monitor = FP8Monitor(model, MonitorConfig(), on_warning=warnings_seen.append)
    x = torch.randn(8, 32)
    monitor.start_step()
    model(x).sum().backward()
    metrics = monitor.finish_step()
    assert metrics[layer_key("amax", "activation", "0")] == pytest.approx(tensor_stats(x)["amax"])
    assert metrics[layer_key("underflow_pct", "weight", "1")] == pytest.approx(
        tensor_stats(model[1].weight)["underflow_pct"])
    assert metrics[layer_key("amax", "gradient", "1")] == pytest.approx(1.0)  # d(sum)/d(out) = 1
    assert any("'1'" in w and "weight" in w for w in warnings_seen)
    assert not any("'0'" in w and "weight" in w for w in warnings_seen)
    # after the logging step no hook remains: non-logging steps cost nothing
    for layer in model:
        assert not (layer._forward_pre_hooks or layer._forward_hooks
                    or layer._backward_pre_hooks or layer._backward_hooks)


def test_a_tensor_with_nan_or_inf_gets_one_warning_as_the_report_flags_it():
    """fp8_stats warns where `foundry-fp8 report` flags: NaN/Inf too, whatever the thresholds
    (the statistics are of the finite values, so no threshold would catch them)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32))  # its weight and output gradient stay finite
    warned: list[str] = []
    monitor = FP8Monitor(model, MonitorConfig(), on_warning=warned.append,
                         schedule=Schedule(interval=1))
    records = []
    for step in range(3):
        x = torch.randn(8, 32)
        if step > 0:
            x[0, 0], x[1, 1], x[2, 2] = float("nan"), float("inf"), float("nan")
        monitor.start_step(step)
        model(x).sum().backward()
        records.append((step, monitor.finish_step()))
    assert records[1][1][layer_key("nan_count", "activation", "0")] == 2.0
    assert records[1][1][layer_key("inf_count", "activation", "0")] == 1.0
    [message] = warned  # once, though steps 1 and 2 both have them
    assert message.startswith("FP8 activation of layer '0' at step 1: nan_count 2 (2 NaN and 1 "
                              "Inf elements, before any FP8 cast).")
    assert message.endswith(f"Change: {NONFINITE_CHANGE}")
    tracker = HealthTracker()  # the report replays the logged steps through the same rules
    for step, table in collect(records).tables():
        tracker.update(step, table)
    assert {(f.layer, f.tensor) for f in tracker.flags} == {("0", "activation")}


def test_a_warning_on_what_if_numbers_says_so_and_advises_accordingly():
    """Three layers with one huge weight each: one runs in FP8 (emulated, current scaling), one
    is a plain nn.Linear (fp8_stats' what-if), one is a plain nn.Linear fp8_guard has moved to
    high precision. Only the first one's warning reads as its own FP8 numbers; the what-if
    ones say so, and the fallback's advises no change."""
    torch.manual_seed(0)
    model = nn.Sequential(EmulatedFP8Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16))
    with torch.no_grad():
        for layer in model:
            layer.weight[0, 0] = 1e6  # current scaling flushes the rest of the weight to 0
    warned: list[str] = []
    monitor = FP8Monitor(model, MonitorConfig(tensors=("weight",)), on_warning=warned.append)
    monitor.start_step()
    with fp8_autocast(recipe=FP8Recipe(scaling="current")):
        model(torch.randn(4, 16)).sum().backward()
    metrics = monitor.finish_step(fallbacks={"2"})
    assert monitor.whatif_rows == {("1", "weight"), ("2", "weight")}
    underflow = {layer: metrics[layer_key("underflow_pct", "weight", layer)] for layer in "012"}
    assert all(value > 90 for value in underflow.values())
    own, whatif, fallback = warned
    # no layer of an nn.Sequential lies in a block te_swap counts (`blocks.<i>.`...), so
    # keep_first_blocks would leave layer '0' in FP8: its own exclude keeps it out
    assert own == (f"FP8 weight of layer '0' at step 0: underflow_pct {underflow['0']:.3g} % "
                   "(> 5 %). Likely cause: the tensor's range is wider than FP8 holds at this "
                   "layer. Change: algorithms.te_swap.exclude: '" + ADVISED_0 + "'")
    assert filter_reason("0", SwapConfig(exclude=ADVISED_0), 0) is not None
    assert filter_reason("0", SwapConfig(keep_first_blocks=1), 0) is None
    assert filter_reason("1", SwapConfig(exclude=ADVISED_0), 0) is None
    assert filter_reason("10", SwapConfig(exclude=ADVISED_0), 0) is None  # `0$` matched it
    assert whatif == (
        f"FP8 what-if for the weight of layer '1' at step 0 (it does not run in FP8; these "
        f"numbers are what fp8_stats' recipe (current scaling) would do to it): underflow_pct "
        f"{underflow['1']:.3g} % (> 5 %). Likely cause: the tensor's range is wider than FP8 "
        f"holds at this layer. Keep it out of FP8 (where te_swap would convert it: "
        f"algorithms.te_swap.exclude: '{FRONTS}1(?:\\..+)?$')")
    assert fallback.startswith("FP8 what-if for the weight of layer '2' at step 0 (fp8_guard "
                               "runs it in high precision; these numbers are what fp8_stats' "
                               "recipe (current scaling) would do to it)")
    assert fallback.endswith("No change: it stays in high precision while fp8_guard keeps it "
                             "there")
    assert "Change:" not in whatif + fallback


def test_a_threshold_warning_does_not_hide_a_later_nan():
    model = nn.Linear(16, 16)
    with torch.no_grad():
        model.weight[0, 0] = 1e6  # underflow: a threshold warning at step 0
    warned: list[str] = []
    monitor = FP8Monitor(model, MonitorConfig(tensors=("weight",)), on_warning=warned.append,
                         schedule=Schedule(interval=1))
    for step in range(3):
        if step == 1:
            with torch.no_grad():
                model.weight[1, 1] = float("nan")
        monitor.start_step(step)
        model(torch.randn(2, 16))
        monitor.finish_step()
    assert len(warned) == 2 and "underflow" in warned[0] and "1 NaN and 0 Inf" in warned[1]


#: The audit's values: (options, key path in the message).
BAD_OPTIONS = [
    ({"interval": "1ep"}, "interval"), ({"interval": "abc"}, "interval"),
    ({"interval": 10.0}, "interval"), ({"interval": None}, "interval"),
    ({"interval": 0}, "interval"), ({"layers": 5}, "layers"), ({"exclude": 5}, "exclude"),
    ({"dump_layers": "("}, "dump_layers"), ({"tensors": "activation"}, "tensors"),
    ({"tensors": ["activations"]}, "tensors.0"), ({"dump_steps": "1000"}, "dump_steps"),
    ({"dump_steps": [-1]}, "dump_steps.0"), ({"dump_steps": [1, 1.5]}, "dump_steps.1"),
    ({"dump_steps": -2}, "dump_steps"), ({"start": "10ba"}, "start"), ({"start": -1}, "start"),
    ({"start": 10, "end": 5}, "end"), ({"end": 0}, "end"),
    ({"max_underflow_pct": -1}, "max_underflow_pct"),
    ({"max_underflow_pct": "5"}, "max_underflow_pct"),
    ({"max_overflow_pct": 101}, "max_overflow_pct"), ({"min_cos_sim": 2}, "min_cos_sim"),
    ({"min_cos_sim": "0.99"}, "min_cos_sim"), ({"strict": "false"}, "strict"),
    ({"dump_max_mb": -1}, "dump_max_mb"), ({"dump_folder": "{run}/d"}, "dump_folder"),
    ({"te_debug": "dleayed"}, "te_debug"), ({"te_debug_folder": 3}, "te_debug_folder"),
    ({"recipe": "delyaed"}, "recipe"),
    ({"recipe": {"scaling": "current", "margin": 1}}, "recipe.margin"),
]


@pytest.mark.parametrize(("options", "key"), BAD_OPTIONS, ids=[k for _, k in BAD_OPTIONS])
def test_bad_options_fail_with_the_key_path(options, key):
    with pytest.raises(ValueError) as error:
        FP8Stats(**options)
    message = str(error.value)
    assert message.startswith(f"callbacks.fp8_stats.{key}: ") and "\n" not in message
    assert "(fix: " in message


def test_near_misses_are_accepted():
    callback = FP8Stats(interval="10BA", start=5, end=6, dump_steps=1000, layers="attn|ffn",
                        max_underflow_pct=100, max_overflow_pct=0, min_cos_sim=-1,
                        dump_folder="{run_name}/dumps", strict=False)
    assert callback.schedule == Schedule(interval=10, start=5, end=6, dump_steps=(1000,))
    assert FP8Stats(interval=3, dump_steps=(0, 7), tensors=("weight",), end=None).schedule == \
        Schedule(interval=3, dump_steps=(0, 7))
    assert FP8Stats(recipe=None).config.recipe.scaling == "current"  # null: current


@pytest.mark.parametrize("interval", ["100ba", "5BA", " 5ba", "5 ba", "1e2ba", "1_0ba", "+3ba",
                                      "1.0ba", "2.5ba", "0ba", "-1ba", "ba", "0x10ba", "infba",
                                      "nanba", "1h2m3s", "5ep", "10tok", "5ba "])
def test_intervals_read_as_composer_reads_them(interval):
    """Our reading of a batch interval (options.Batches) is Composer's Time.from_timestring."""
    from composer.core import Time, TimeUnit

    from foundry_fp8.options import Batches

    try:
        time = Time.from_timestring(interval)
        composer = time.value if time.unit == TimeUnit.BATCH and time.value >= 1 else None
    except (ValueError, TypeError, OverflowError):
        composer = None
    ours = None if Batches(1).problems(interval) else Batches(1).normal(interval)
    assert ours == composer


def test_python_callers_keep_working():
    """Tuples, an FP8Recipe, Schedule and MonitorConfig built directly are checked too."""
    from foundry_fp8.recipe import FP8Recipe

    recipe = FP8Recipe(scaling="delayed", amax_history_len=4)
    assert FP8Stats(recipe=recipe, tensors=("weight",)).config.recipe is recipe
    assert MonitorConfig(recipe=recipe).recipe is recipe
    with pytest.raises(ValueError, match=r"^callbacks\.fp8_stats\.layers: is not a valid"):
        MonitorConfig(layers="(")
    with pytest.raises(ValueError, match=r"^callbacks\.fp8_stats\.min_cos_sim: "):
        MonitorConfig(min_cos_sim=1.5)
    with pytest.raises(ValueError, match=r"^callbacks\.fp8_stats\.end: must be greater"):
        Schedule(start=4, end=2)
    with pytest.raises(ValueError, match=r"^callbacks\.fp8_stats\.interval: "):
        Schedule(interval=0)


class _Logger:
    """What the callback uses of Composer's Logger, and a destination recording what it got."""

    def __init__(self, destinations=()):
        self.destinations = [self, *destinations]
        self.metrics: dict[int, dict] = {}
        self.hparams: dict = {}
        self.images: dict[int, dict] = {}
        self.tables: dict[int, dict] = {}

    def log_metrics(self, metrics, step):
        self.metrics.setdefault(step, {}).update(metrics)

    def log_images(self, images, name, channels_last, step, use_table=True):
        assert channels_last and not use_table
        self.images.setdefault(step, {})[name] = images

    def log_table(self, columns, rows, name, step):
        self.tables.setdefault(step, {})[name] = (columns, rows)

    def log_hyperparameters(self, hparams):
        self.hparams.update(hparams)


def _fit(callback: FP8Stats, steps: int, logger: _Logger | None = None,
         before_batch=lambda model, step: None) -> tuple[nn.Module, _Logger]:
    """Drive the callback through Composer's events around a hand-written training loop."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    state = types.SimpleNamespace(model=model, run_name="run", callbacks=[],
                                  timestamp=types.SimpleNamespace(batch=0))
    logger = logger or _Logger()
    callback.run_event(Event.FIT_START, state, logger)
    for batch in range(steps):
        state.timestamp.batch = batch
        callback.run_event(Event.BATCH_START, state, logger)
        before_batch(model, batch)
        model(torch.randn(4, 8)).sum().backward()  # training goes on whatever the hooks do
        callback.run_event(Event.AFTER_TRAIN_BATCH, state, logger)  # before the batch counts
        state.timestamp.batch = batch + 1  # Composer counts the batch before BATCH_END
        callback.run_event(Event.BATCH_END, state, logger)
    callback.run_event(Event.FIT_END, state, logger)
    return model, logger


@pytest.mark.parametrize(("options", "duration", "silent"), [
    ({"interval": "100ba", "start": 5}, "12ba", False), ({"interval": 2, "start": 12}, "12ba", False),
    ({"interval": 5, "end": 1}, "1ep", True), ({"interval": 5, "start": 1}, "2ep", True),
    ({"interval": 8, "start": 1}, "1ep", False), ({"interval": 100, "start": 5}, "48sp", True)])
def test_a_schedule_that_never_logs_in_the_run_says_so_at_the_start(options, duration, silent,
                                                                    caplog):
    """`interval: 100ba, start: 5` in a 12-batch run (a smoke test of a real config) logged
    nothing and said nothing; a real Composer run of 6 batches an epoch. Durations Composer does
    not count in batches (samples here) are not judged."""
    from composer import Trainer
    from composer.models import ComposerClassifier
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(48, 8), torch.randint(0, 2, (48,)))
    model = ComposerClassifier(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)), num_classes=2)
    with caplog.at_level(logging.WARNING):
        Trainer(model=model, train_dataloader=DataLoader(data, batch_size=8), max_duration=duration,
                callbacks=[FP8Stats(image_interval=None, **options)], device="cpu",
                progress_bar=False).fit()
    said = [r.getMessage() for r in caplog.records if "no logging step" in r.getMessage()]
    assert said == ([] if silent else [said[0]])
    if not silent:
        assert said[0].startswith("fp8_stats: no logging step in this run (it ends after batch ")


def test_callback_logs_on_schedule_and_prints_the_summary(capsys):
    _, logger = _fit(FP8Stats(interval="2ba", end=4), 6)
    assert sorted(logger.metrics) == [0, 2]
    assert {k for k in logger.metrics[2] if parse_key(k)} == {
        layer_key(stat, tensor, layer) for layer in ("0", "1")  # plain nn.Linear: what-if rows
        for tensor in ("activation", "weight", "gradient") for stat in (*STAT_KEYS, HIGH_PRECISION)}
    assert {k for k in logger.metrics[2] if not parse_key(k)} == {
        summary_key(tensor, name) for tensor in ("activation", "weight", "gradient")
        for name in SUMMARIES} | {summary_key(None, "flagged_layers")}
    summary = logger.hparams["fp8/stats_summary"]
    # plain nn.Linear layers: every number is fp8_stats' what-if, and the summary says so
    assert "| 1 | gradient (what-if) |" in summary and summary in capsys.readouterr().out


def test_only_rank_zero_logs(monkeypatch, capsys):
    monkeypatch.setattr("foundry_fp8.composer.stats.dist.get_global_rank", lambda: 1)
    callback = FP8Stats(interval=1)
    _, logger = _fit(callback, 2)
    assert logger.metrics == {} and logger.hparams == {} and capsys.readouterr().out == ""
    assert callback.monitor is not None and callback.monitor.tracker.worst  # it still computed them


def test_hook_failure_disables_the_callback_without_stopping_training(monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise ZeroDivisionError("our bug")

    monkeypatch.setattr("foundry_fp8.monitor.sufficient_stats", broken)
    callback = FP8Stats(interval=1)
    model, logger = _fit(callback, 3)
    assert callback.disabled and logger.metrics == {}
    assert "fp8_stats failed; disabling it" in caplog.text and "our bug" in caplog.text
    for layer in model:
        assert not (layer._forward_pre_hooks or layer._backward_pre_hooks)
    with pytest.raises(FP8MonitorError, match="our bug"):
        _fit(FP8Stats(interval=1, strict=True), 1)


def test_dumps_go_under_the_jsonl_loggers_run_folder(tmp_path):
    jsonl = JSONLLogger(path=str(tmp_path / "{run_name}" / "metrics.jsonl"))
    jsonl.init(types.SimpleNamespace(run_name="run"), None)
    _fit(FP8Stats(interval=10, dump_steps=[1], dump_layers="^1$"), 2, _Logger([jsonl]))
    dump = load_file(tmp_path / "run" / "fp8_dumps" / "step0000001-rank0.safetensors")
    assert sorted(dump) == [f"1/{t}{s}" for t in ("activation", "gradient", "weight")
                            for s in ("", "/scale")]
    _fit(FP8Stats(interval=10, dump_steps=[1], dump_folder=str(tmp_path / "{run_name}-dumps")), 2)
    assert (tmp_path / "run-dumps" / "step0000001-rank0.safetensors").exists()


@pytest.mark.slow
def test_fp8_stats_logs_every_selected_layer_in_a_real_run(tmp_path, tiny_data, capsys):
    overrides = {"max_duration": "6ba", "save_interval": "6ba",
                 "callbacks": {"fp8_stats": {"interval": "3ba", "layers": r"blocks\.0\.",
                                             "dump_steps": [3], "dump_layers": r"ffn\.up_proj"}}}
    run_tiny(tmp_path, tiny_data, overrides)
    logged: dict[int, dict] = {}
    for step, metrics in read_jsonl(run_folder(tmp_path) / "metrics.jsonl"):
        fp8 = {k: v for k, v in metrics.items() if parse_key(k)}
        if fp8:
            logged.setdefault(step, {}).update(fp8)
    assert sorted(logged) == [0, 3]
    layers = {parse_key(k)[2] for k in logged[3]}  # short names: no `model.transformer.`
    assert layers == {"blocks.0.attn.Wqkv", "blocks.0.attn.out_proj", "blocks.0.ffn.up_proj",
                      "blocks.0.ffn.down_proj"}
    for layer in layers:
        for tensor in ("activation", "weight", "gradient"):
            assert 0 < logged[3][layer_key("amax", tensor, layer)] < float("inf")
            assert 0.9 < logged[3][layer_key("cos_sim", tensor, layer)] <= 1.0
            for step in (0, 3):
                assert {layer_key(k, tensor, layer) for k in STAT_KEYS} <= logged[step].keys()
    # te_swap's emulated layers run delayed scaling: the scale they cast with is the real,
    # lagging one (step 0: TE's initial 1; step 3: from steps 0-2's amaxes), not the current one
    ratios = [v for step in (0, 3) for k, v in logged[step].items()
              if k.startswith("fp8_scale_ratio/")]
    assert len(ratios) == 2 * 4 * 3 and all(0 < r < float("inf") for r in ratios)
    assert any(abs(r - 1.0) > 1e-3 for r in ratios)
    assert all(logged[0][k] == 1.0 for k in logged[0] if k.startswith("fp8_scale/"))
    dump = load_file(run_folder(tmp_path) / "fp8_dumps" / "step0000003-rank0.safetensors")
    up = "model.transformer.blocks.0.ffn.up_proj"
    assert sorted(dump) == sorted(f"{up}/{t}{s}" for t in ("activation", "weight", "gradient")
                                  for s in ("", "/scale"))
    assert dump[f"{up}/activation/scale"].item() == logged[3][
        layer_key("scale", "activation", up.removeprefix("model.transformer."))]
    assert dump[f"{up}/weight"].shape == (256, 64)
    assert "| blocks.0.ffn.up_proj | gradient |" in capsys.readouterr().out  # fit-end summary


def test_a_failing_logger_on_rank_zero_does_not_switch_the_callback_off(caplog):
    """Only rank 0 logs: switching the callback off there alone would leave the other ranks in
    the next logging step's all_reduce for ever, so the failure is logged and the stats go on."""

    class FlakyLogger(_Logger):
        def log_metrics(self, metrics, step):
            if not self.metrics and step == 0:
                self.metrics[-1] = {}  # fail once, on the first logging step
                raise OSError("disk full")
            super().log_metrics(metrics, step)

    callback = FP8Stats(interval=2)
    after = _Logger()  # a destination after the failing one still gets everything
    _, logger = _fit(callback, 4, FlakyLogger([after]))
    assert not callback.disabled and "disk full" in caplog.text
    assert sorted(logger.metrics) == [-1, 2] and layer_key("amax", "activation", "0") in logger.metrics[2]
    assert sorted(after.metrics) == [0, 2] and after.hparams.keys() == {"fp8/stats_summary",
                                                                           LAYER_ORDER}
    [warning] = [r.getMessage() for r in caplog.records if "failed to log" in r.getMessage()]
    assert warning.startswith("fp8_stats: the logger FlakyLogger failed to log metrics "
                              "(OSError: disk full)")
    after = _Logger()
    with pytest.raises(OSError, match="disk full"):  # strict: raised once all were tried
        _fit(FP8Stats(interval=2, strict=True), 1, FlakyLogger([after]))
    assert sorted(after.metrics) == [0]


def test_an_unhashable_failing_destination_is_warned_once(caplog):
    """A destination written as an `eq=True` dataclass has no hash: still one warning per
    kind, not one per logging step."""
    from dataclasses import dataclass

    from composer.loggers import LoggerDestination

    from foundry_fp8.composer.destinations import deliver

    @dataclass
    class Refusing(LoggerDestination):
        calls: int = 0

        def log_metrics(self, metrics, step=None):
            self.calls += 1
            raise RuntimeError("refused")

    refusing, after = Refusing(), _Logger()
    for step in range(5):
        deliver([refusing, after], "metrics", lambda d, s=step: d.log_metrics({"x": 1.0}, s),
                "fp8_stats")
    assert refusing.calls == 5 and sorted(after.metrics) == [0, 1, 2, 3, 4]
    assert sum("failed to log metrics" in r.getMessage() for r in caplog.records) == 1


def test_the_interval_default_is_one_fact_for_the_callback_the_monitor_and_the_linter():
    """The README's `interval: 100ba`, from `options.Schedule` alone: what fp8_stats runs, what
    a plain-PyTorch FP8Monitor logs, and what the linter reads as the default."""
    from foundry_fp8.lint.entries import our_entries

    assert FP8Stats().schedule.interval == 100
    monitor = FP8Monitor(nn.Linear(4, 4), MonitorConfig())
    assert [step for step in range(250) if monitor.schedule.logs(step)] == [0, 100, 200]
    assert our_entries()[("callbacks", "fp8_stats")].options["interval"].default == 100


def test_layers_matching_nothing_warn_in_one_line_and_training_goes_on(caplog):
    callback = FP8Stats(interval=1, layers="^attn")
    with caplog.at_level("WARNING", logger="foundry_fp8.composer.stats"):
        _, logger = _fit(callback, 2)
    assert callback.disabled and logger.metrics == {}
    [record] = [r for r in caplog.records if "matches none" in r.getMessage()]
    assert record.levelname == "WARNING" and record.exc_info is None
    assert record.getMessage() == (
        "callbacks.fp8_stats.layers: '^attn' matches none of the model's 2 linear layers (fix: a "
        "regex that re.search finds in their names, e.g. 0, 1); fp8_stats is off for this run "
        "(strict: true makes this an error)")


@pytest.mark.slow
def test_strict_layers_matching_nothing_end_the_run_on_the_one_line(tmp_path, tiny_data):
    """Through LLM-Foundry's own `train_from_yaml` and Composer's Trainer, as `fp8_lint`'s and
    `fp8_state`'s errors do: a raised ValueError, the run exits non-zero, and the traceback's
    last line is the one line naming the key and real module names."""
    import os
    import re
    import subprocess
    import sys

    from omegaconf import OmegaConf

    from tests.conftest import REPO_ROOT
    from tests.tiny_run import tiny_config

    cfg = tiny_config(tmp_path, tiny_data, {"max_duration": "2ba", "callbacks": {
        "fp8_stats": {"strict": True, "layers": "^attn"}}})
    del cfg.callbacks["fp8_lint"]  # its FP8048 stops this run first (test_lint_stats_layers.py)
    yaml = tmp_path / "strict.yaml"
    OmegaConf.save(cfg, yaml)
    code = f"from llmfoundry.command_utils import train_from_yaml; train_from_yaml({str(yaml)!r}, [])"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
                          timeout=600)
    assert done.returncode == 1
    # torch's excepthook for distributed runs prefixes each line with the rank
    lines = [re.sub(r"^\[rank\d+\]: ", "", line) for line in done.stderr.splitlines()]
    start = lines.index("Traceback (most recent call last):")
    last = next(line for line in lines[start + 1:] if not line.startswith(" "))
    assert last == (
        "foundry_fp8.monitor.NoLayersError: callbacks.fp8_stats.layers: '^attn' matches none of "
        "the model's 8 linear layers (fix: a regex that re.search finds in their names, e.g. "
        "model.transformer.blocks.0.attn.Wqkv, model.transformer.blocks.0.attn.out_proj, "
        "model.transformer.blocks.0.ffn.up_proj, model.transformer.blocks.0.ffn.down_proj, ...)")


def test_a_second_fit_with_reset_time_logs_its_images_from_its_own_first_steps():
    """`fit(reset_time=True)` starts the steps at 0 again: the second fit's heatmaps and table
    are due at its steps 2 and 4 (image_interval 2) and at its end, as the first fit's. Before,
    the images waited for the step after the first fit's last image (no image until fit end)."""
    callback = FP8Stats(interval=1, image_interval=2)
    _, first = _fit(callback, 6)
    _, second = _fit(callback, 6)  # the same callback, its steps from 0 again
    assert sorted(first.tables) == sorted(first.images) == [2, 4, 6]
    assert sorted(second.tables) == sorted(second.images) == [2, 4, 6]
    # the fit-end table is the second fit's last logging step's, none of the first fit's
    assert {row[0] for row in second.tables[6]["fp8_table"][1]} == {5}


def test_a_fit_that_raised_in_a_logging_step_leaves_no_hooks_once_the_trainer_closes():
    """fit() raised mid-step (here in the backward of a logging step): Composer runs no event
    after it, so fp8_stats' hooks stayed armed on the model and, the Trainer closed, went on
    computing statistics at every forward of whatever trained the model next (a notebook's new
    Trainer). `Trainer.close` now takes them off."""
    from composer import Trainer
    from composer.core import Callback
    from composer.models import ComposerClassifier
    from torch.utils.data import DataLoader, TensorDataset

    class Raises(Callback):
        def before_backward(self, state, logger) -> None:
            if int(state.timestamp.batch) == 2:
                raise RuntimeError("the user's bug")

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(48, 8), torch.randint(0, 2, (48,)))
    model = ComposerClassifier(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)), num_classes=2)
    trainer = Trainer(model=model, train_dataloader=DataLoader(data, batch_size=8),
                      max_duration="6ba", callbacks=[FP8Stats(interval=2, image_interval=None),
                                                     Raises()],
                      device="cpu", progress_bar=False)
    with pytest.raises(RuntimeError, match="the user's bug"):
        trainer.fit()
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert all(m._forward_pre_hooks for m in linears)  # armed for the logging step 2
    trainer.close()
    assert [(len(m._forward_pre_hooks), len(m._backward_pre_hooks)) for m in linears] == [
        (0, 0), (0, 0)]
