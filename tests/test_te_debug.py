"""The TE debug-API config and metric names, checked with nvdlfw-inspect's own config parser
(TE itself cannot run here; the session against real TE is a GPU test)."""

from __future__ import annotations

import re
import sys
from types import SimpleNamespace

import pytest

from foundry_fp8.te.debug import (
    CURRENT_STATS,
    DELAYED_STATS,
    FEATURE,
    NAMESPACE,
    layer_pattern,
    log_fp8_tensor_stats_config,
    metric_name,
)

LAYERS = [f"model.transformer.blocks.{b}.{p}" for b in range(12)
          for p in ("attn.Wqkv", "attn.out_proj", "ffn")]


@pytest.fixture
def config_manager(tmp_path):
    config_manager = pytest.importorskip("nvdlfw_inspect.config_manager")
    from nvdlfw_inspect.logging import initialize_logger

    initialize_logger(str(tmp_path))  # the parser logs what it reads
    manager = config_manager.ConfigManager
    manager.reset()
    yield manager
    manager.reset()


def _load(manager, config):
    registry = {NAMESPACE: SimpleNamespace(features={FEATURE: None}),
                "base": SimpleNamespace(features={})}
    manager._load_config(config, registry)


def test_config_selects_the_same_layers_as_our_regex(config_manager):
    pattern = r"blocks\.(0|11)\.attn"
    _load(config_manager, log_fp8_tensor_stats_config(pattern, ["activation", "gradient"], 100,
                                                      start_step=10))
    selected = [name for name in LAYERS if config_manager.get_config_for_layer(name)]
    assert selected == ["model.transformer.blocks.0.attn.Wqkv",
                        "model.transformer.blocks.0.attn.out_proj",
                        "model.transformer.blocks.11.attn.Wqkv",
                        "model.transformer.blocks.11.attn.out_proj"]
    feature = config_manager.get_config_for_layer(selected[0])[NAMESPACE][FEATURE]
    assert feature["enabled"] is True
    assert [s["tensor"] for s in feature["tensors_struct"]] == ["activation", "gradient"]
    assert all(s["freq"] == 100 and s["start_step"] == 10 and "end_step" not in s
               for s in feature["tensors_struct"])
    assert feature["tensors_struct"][0]["stats"] == list(DELAYED_STATS)


def test_current_scaling_asks_for_no_delayed_only_stat():
    config = log_fp8_tensor_stats_config(".*", ["weight"], 1, scaling="current")
    stats = config["foundry_fp8_stats"][NAMESPACE][FEATURE]["tensors_struct"][0]["stats"]
    assert stats == list(CURRENT_STATS) and "overflows%" not in stats


def test_bad_tensor_name_is_refused():
    with pytest.raises(ValueError, match="fp8_stats.tensors"):
        log_fp8_tensor_stats_config(".*", ["activations"], 1)


def test_metric_names_split_layers_that_contain_underscores():
    layers = ["blocks.0.attn.out_proj", "blocks.0.attn.out", "blocks.1.ffn"]
    assert (metric_name("blocks.0.attn.out_proj_activation_underflows%", layers)
            == "fp8_te_underflow_pct/activation/blocks.0.attn.out_proj")
    assert (metric_name("blocks.0.attn.out_gradient_fp8_current_scaling_mse", layers)
            == "fp8_te_fp8_current_scaling_mse/gradient/blocks.0.attn.out")
    assert metric_name("blocks.1.ffn_weight_scale_inv_max", layers) == \
        "fp8_te_scale_inv_max/weight/blocks.1.ffn"
    assert metric_name("Layer_7_activation_mse", layers) is None


def test_layernorm_mlp_gemms_keep_the_module_name():
    """TE names a LayerNormMLP's debug quantizers `<name>.fc1`/`<name>.fc2`
    (pytorch/module/layernorm_mlp.py, TE 2.7+): fc2's input is the inner activation the
    feature exists for, so it must not fall back to a raw `fp8/te_debug/...` name."""
    layers = ["blocks.0.ffn", "blocks.0.ffn.fc1x"]
    assert (metric_name("blocks.0.ffn.fc1_activation_underflows%", layers)
            == "fp8_te_underflow_pct/fc1_activation/blocks.0.ffn")
    assert (metric_name("blocks.0.ffn.fc2_gradient_mse", layers)
            == "fp8_te_mse/fc2_gradient/blocks.0.ffn")
    assert metric_name("blocks.0.ffn.fc3_activation_mse", layers) is None


def test_one_pattern_selects_like_include_and_exclude():
    include, exclude = r"blocks\.(0|11)\.", r"out_proj"
    pattern = re.compile(layer_pattern(include, exclude))
    ours = [n for n in LAYERS if re.search(include, n) and not re.search(exclude, n)]
    assert [n for n in LAYERS if pattern.search(n)] == ours
    assert len(ours) == 4 and layer_pattern(include) == include


def test_fp8_stats_te_debug_needs_te_and_says_so(monkeypatch):
    from foundry_fp8.composer.stats import FP8Stats

    # TE hidden from the import system, so `te_available()` is False even where TE is installed
    monkeypatch.setitem(sys.modules, "transformer_engine", None)
    with pytest.raises(ValueError, match=r"^callbacks\.fp8_stats\.te_debug: must be one of "
                                         "'delayed', 'current', null, got 'yes'"):
        FP8Stats(te_debug="yes")
    with pytest.raises(RuntimeError, match="fp8_stats.te_debug: needs TransformerEngine"):
        FP8Stats(te_debug="delayed")  # no TE importable


@pytest.mark.parametrize(("available", "version", "expected"), [
    (False, None, "needs TransformerEngine and nvdlfw-inspect"),
    (True, (2, 6, 0), "needs TransformerEngine >= 2.7, found 2.6.0"),
    (True, (2, 4), "needs TransformerEngine >= 2.7, found 2.4"),
    (True, (2, 7, 0), None), (True, (2, 20, 2), None),
])
def test_te_debug_needs_the_te_whose_feature_logs_its_statistics(monkeypatch, available,
                                                                 version, expected):
    """TE 2.4-2.6's LogFp8TensorStats supports only `underflows%`
    (debug/features/log_fp8_tensor_stats.py:86-88 at v2.6): the others fail in the forward."""
    from foundry_fp8.te import debug

    monkeypatch.setattr(debug, "te_available", lambda: available)
    monkeypatch.setattr(debug, "te_version", lambda: version)
    problem = debug.te_debug_problem()
    assert problem is None if expected is None else expected in problem


@pytest.mark.parametrize("include, exclude", [
    (r"ffn$", None), (r"blocks\.0\.(ffn|attn\.Wqkv)$", None), (r"ffn\Z", None),
    (r"blocks\.[0$]\.ffn$", None), (r"ffn\$", None), (r"[]$]ffn$", None),
    (r"blocks\.", r"1\.ffn$"), (r"ffn(?!$)", None), (r"(?=.*ffn$)blocks", None),
    (r"(?<=ffn)$", None),
])
def test_an_end_anchor_also_selects_a_layernorm_mlps_gemms(include, exclude):
    """`layers: ffn$` selects the LayerNormMLP `ffn` for our hooks; TE's debug API sees its
    GEMMs as `ffn.fc1`/`ffn.fc2`, which the same choice must select, and nothing else."""
    names = [f"blocks.{b}.{p}" for b in range(2) for p in ("attn.Wqkv", "ffn", "ffn.fc1",
                                                          "ffn.fc2", "ffn.fc3", "ffn$")]
    pattern = re.compile(layer_pattern(include, exclude))

    def ours(name: str) -> bool:
        layer = re.sub(r"\.fc[12]$", "", name)
        return bool(re.search(include, layer)) and not (exclude and re.search(exclude, layer))

    assert [n for n in names if pattern.search(n)] == [n for n in names if ours(n)]


@pytest.mark.parametrize("te_stat, ours", [
    ("underflows%", "te_underflow_pct"), ("overflows%", "te_overflow_pct"),
    ("fp8_current_scaling_underflows%", "te_fp8_current_scaling_underflow_pct"),
    ("underflows%_columnwise", "te_underflow_pct_columnwise"),  # stats_computation.py:303
    ("scale_inv_min", "te_scale_inv_min"), ("mse", "te_mse")])
def test_te_statistics_get_names_mlflow_takes(te_stat, ours):
    """TE's `%` names were refused by MLflow (its own check, `_validate_metric_name`): left out
    of MLflow whole. Now `%` reads `_pct`, as fp8_stats' own `underflow_pct`."""
    validation = pytest.importorskip("mlflow.utils.validation")
    layers = ["blocks.0.attn.out_proj"]
    for tensor in ("activation", "gradient"):
        name = metric_name(f"blocks.0.attn.out_proj_{tensor}_{te_stat}", layers)
        assert name == f"fp8_{ours}/{tensor}/blocks.0.attn.out_proj"
        validation._validate_metric_name(name)  # raises on a refused name
    if "%" in te_stat:  # TE's own name, as it was logged before
        with pytest.raises(Exception, match="Names may only contain"):
            validation._validate_metric_name(f"fp8_te_{te_stat}/activation/blocks.0")
    assert all(metric_name(f"b_weight_{s}", ["b"]) is not None for s in (*DELAYED_STATS,
                                                                       *CURRENT_STATS))
