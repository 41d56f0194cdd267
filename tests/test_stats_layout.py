"""fp8_stats' layout on Composer's Logger: the summary series on the console, the per-layer
series elsewhere, heatmaps and the per-layer table at `image_interval`, and how many series an
MPT-1B logs with the defaults (counted on LLM-Foundry's own MPT at 1B depth)."""

from __future__ import annotations

import io
import types

import numpy as np
import pytest
import torch
from composer.core import Event
from composer.loggers import ConsoleLogger

from foundry_fp8.composer.stats import IMAGE_PREFIX, TABLE_NAME, FP8Stats
from foundry_fp8.health import SUMMARIES, TENSORS, layer_key, parse_key, summary_key
from foundry_fp8.health.keys import HIGH_PRECISION
from foundry_fp8.numerics import STAT_KEYS
from tests.test_stats_callback import _fit, _Logger

SUMMARY_KEYS = {summary_key(t, name) for t in TENSORS for name in SUMMARIES} | {
    summary_key(None, "flagged_layers")}


@pytest.mark.parametrize("console_layers", [False, True])
def test_the_console_gets_the_summary_and_the_per_layer_series_only_when_asked(console_layers):
    console = ConsoleLogger(log_interval="1ba", stream=io.StringIO())
    _, logger = _fit(FP8Stats(interval="2ba", console_layers=console_layers), 3, _Logger([console]))
    # plain nn.Linear layers: what-if numbers, each row marked so (`HIGH_PRECISION`)
    per_layer = {layer_key(stat, tensor, layer) for layer in ("0", "1") for tensor in TENSORS
                 for stat in (*STAT_KEYS, HIGH_PRECISION)}
    assert set(logger.metrics[2]) == SUMMARY_KEYS | per_layer  # the other destinations: all
    # what Composer's console will print at its next line
    assert set(console.logged_metrics) == SUMMARY_KEYS | (per_layer if console_layers else set())
    assert not console.tables  # the per-layer table would be printed as JSON at every line


def test_images_and_table_at_the_image_interval_and_at_fit_end():
    _, logger = _fit(FP8Stats(interval="2ba", image_interval="4ba"), 10)
    assert sorted(logger.images) == [4, 8]  # logging steps 0..8; 8 is the last: nothing at end
    _, logger = _fit(FP8Stats(interval="2ba", image_interval="4ba"), 11)
    assert sorted(logger.images) == sorted(logger.tables) == [4, 8, 11]  # 11: fit end, for 10
    names = set(logger.images[4])
    assert {f"{IMAGE_PREFIX}{s}" for s in ("underflow_pct", "overflow_pct", "cos_sim")} <= names
    assert {name.removeprefix(IMAGE_PREFIX) for name in names} <= {
        parse_key(k)[0] for k in logger.metrics[4] if parse_key(k)}
    assert f"{IMAGE_PREFIX}nan_count" not in names  # no NaN anywhere: no empty picture
    for image in logger.images[4].values():
        assert image.dtype == np.uint8 and image.ndim == 3 and image.shape[2] == 3
        assert image.shape[0] > 100 and image.shape[1] > 100 and image.std() > 0
    columns, rows = logger.tables[11][TABLE_NAME]
    assert columns[:4] == ["step", "layer", "tensor", "numbers"] and columns[-1] == "flags"
    assert len(rows) == 2 * 3
    logged = logger.metrics[10]  # the table shows the last logging step's numbers
    for row in rows:
        assert row[0] == 10  # the logging step whose numbers these are, not W&B's step 11
        layer, tensor = row[1], row[2]
        assert row[3] == "what-if"  # plain nn.Linear layers: fp8_stats' recipe what-if
        for stat, value in zip(columns[4:-1], row[4:-1], strict=True):
            assert value == logged[layer_key(stat, tensor, layer)]
    _, logger = _fit(FP8Stats(interval="2ba", image_interval=None), 11)
    assert logger.images == logger.tables == {}


def test_the_table_names_a_broken_layer_and_the_yaml_key_to_change():
    """One weight scaled x1e4 just before a logging step, under delayed scaling: its overflow
    is flagged in the table (and counted by the summary) with the key that changes it."""

    def break_layer(model, step):
        if step == 4:
            with torch.no_grad():
                model[1].weight.mul_(1e4)

    _, logger = _fit(FP8Stats(interval="2ba", image_interval="2ba", recipe="delayed"), 5,
                     before_batch=break_layer)
    columns, rows = logger.tables[4][TABLE_NAME]
    flags = {(row[1], row[2]): row[-1] for row in rows}
    assert "algorithms.te_swap.fp8_recipe.scaling: current" in flags[("1", "weight")], flags
    # layer 0's output gradient passes through layer 1's weight: it jumps x1e4 too
    assert {key for key, flag in flags.items() if flag} == {("1", "weight"), ("0", "gradient")}
    assert logger.metrics[4][summary_key("weight", "flagged_layers")] == 1.0
    assert logger.metrics[2][summary_key("weight", "flagged_layers")] == 0.0


def test_series_of_an_mpt_1b_with_the_defaults():
    """LLM-Foundry's MPT at MPT-1B's depth (24 blocks, 4 linear layers each), narrow so that it
    runs here: the number of series depends on the layers, not their width."""
    from llmfoundry.models.mpt import MPTConfig, MPTForCausalLM

    config = MPTConfig(d_model=64, n_heads=4, n_layers=24, expansion_ratio=4, max_seq_len=16,
                       vocab_size=64, attn_config={"attn_impl": "torch"})
    model = MPTForCausalLM(config)
    console = ConsoleLogger(log_interval="1ba", stream=io.StringIO())
    logger = _Logger([console])
    callback = FP8Stats()  # the defaults
    state = types.SimpleNamespace(model=model, run_name="run", callbacks=[],
                                  timestamp=types.SimpleNamespace(batch=0))
    callback.run_event(Event.FIT_START, state, logger)
    callback.run_event(Event.BATCH_START, state, logger)  # step 0 logs (0 % 100 == 0)
    model(torch.randint(0, 64, (2, 16))).logits.float().pow(2).mean().backward()
    callback.run_event(Event.AFTER_TRAIN_BATCH, state, logger)
    keys = set(logger.metrics[0])
    layers = {parse_key(k)[2] for k in keys if parse_key(k)}
    assert len(layers) == 24 * 4 and "blocks.23.ffn.down_proj" in layers
    rows = {(parsed[1], parsed[2]) for k in keys if (parsed := parse_key(k))}
    # a plain MPT runs no layer in FP8: every row's numbers are what-if, each marked so once
    # (MPT-1B: 288 marker keys a logging step beside its 288 * len(STAT_KEYS) statistics)
    assert {k for k in keys if parse_key(k) and parse_key(k)[0] == HIGH_PRECISION} == {
        layer_key(HIGH_PRECISION, tensor, layer) for tensor, layer in rows}
    assert len([k for k in keys if parse_key(k)]) == 24 * 4 * 3 * (len(STAT_KEYS) + 1)
    assert set(console.logged_metrics) == SUMMARY_KEYS and len(SUMMARY_KEYS) == 16


@pytest.mark.parametrize(("offline", "allow", "hangs"), [
    (True, True, True), (True, False, False), (False, True, False)])
def test_a_table_is_not_sent_to_an_offline_wandb_that_would_wait_on_the_network(
        monkeypatch, offline, allow, hangs):
    """wandb 0.18 asks the server for its version before logging a table unless offline with
    allow_offline_artifacts off; without network it retries for ever (seen in a test run)."""
    import wandb
    from composer.loggers import WandBLogger

    from foundry_fp8.composer.stats import _wandb_table_hangs

    settings = types.SimpleNamespace(_offline=offline, allow_offline_artifacts=allow)
    monkeypatch.setattr(wandb, "run", types.SimpleNamespace(settings=settings))
    assert _wandb_table_hangs(WandBLogger()) is hangs
    assert _wandb_table_hangs(ConsoleLogger()) is False
