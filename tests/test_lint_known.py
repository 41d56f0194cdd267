"""The linter's copies of what Composer / LLM-Foundry accept equal the installed packages, and
the option lists it reads from our classes' source equal their real signatures. An upgrade
or a new option that changes them fails here instead of silently drifting."""

from __future__ import annotations

import dataclasses
import inspect
import warnings

import pytest

from foundry_fp8.lint import known
from foundry_fp8.lint.entries import NO_DEFAULT, UNREADABLE, our_entries
from foundry_fp8.lint.rules import lint_config


def test_mapping_sections_are_trainconfigs_dict_fields():
    from llmfoundry.utils.config_utils import TrainConfig

    dict_fields = {f.name for f in dataclasses.fields(TrainConfig)
                   if str(f.type).replace("typing.", "").removeprefix("Optional[").startswith("dict[")}
    assert known.MAPPING_SECTIONS == dict_fields


def test_train_config_keys_match_llmfoundry():
    from llmfoundry.utils.config_utils import TRAIN_CONFIG_KEYS, TrainConfig

    assert known.TRAIN_CONFIG_KEYS == {f.name for f in dataclasses.fields(TrainConfig)}
    assert known.TRAIN_CONFIG_KEYS == TRAIN_CONFIG_KEYS


@pytest.mark.parametrize("key", ["precison", "dataset", "precision_config", "deepspeed_config",
                                 "icl_max_seq_len", "seed", "fsdp_config", "variables"])
def test_unknown_top_level_key_rule_agrees_with_llmfoundry(key):
    from llmfoundry.utils.config_utils import (
        TRAIN_CONFIG_KEYS,
        TrainConfig,
        make_dataclass_and_log_config,
    )
    from omegaconf import OmegaConf

    config = {"global_train_batch_size": 8, "device_train_microbatch_size": 1, key: {}}
    try:
        make_dataclass_and_log_config(OmegaConf.create(config), TrainConfig, TRAIN_CONFIG_KEYS,
                                      transforms="all")
        refused = False
    except ValueError as e:
        refused = "Unused parameters" in str(e)
    except Exception:  # missing mandatory values come after the unknown-key check
        refused = False
    flagged = {f.key for f in lint_config(config) if f.rule in ("FP8007", "FP8009")}
    assert refused == (key in flagged)


def test_fsdp_keys_match_composer():
    from composer.utils.parallelism import FSDP2Config, FSDPConfig

    fields = {f.name for f in dataclasses.fields(FSDPConfig)}
    assert known.FSDP_CONFIG_KEYS == fields - {"_device_mesh"}
    assert known.FSDP2_CONFIG_KEYS == FSDP2Config.settable_attrs()
    assert FSDPConfig().activation_checkpointing_reentrant is known.REENTRANT_DEFAULT
    assert not hasattr(FSDP2Config(), "te_checkpoint_wrapper")
    with pytest.raises(ValueError, match="deprecated"):
        FSDPConfig(device_mesh=[2])
    # an unknown key is accepted silently: why FP8010 exists
    assert FSDPConfig(activation_checkpointing_reentrnt=False).activation_checkpointing_reentrant


def test_fsdp2_drops_te_flags_with_a_warning():
    from composer.utils.parallelism import FSDP2Config

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = FSDP2Config.from_compatible_attrs({"te_checkpoint_wrapper": True,
                                                    "activation_checkpointing": True})
    assert config.activation_checkpointing
    assert any("te_checkpoint_wrapper" in str(w.message) for w in caught)


def test_precisions_match_composer():
    from composer.core.precision import Precision

    assert known.PRECISIONS == tuple(p.value for p in Precision)
    assert Precision("AMP_FP8") is Precision.AMP_FP8  # case-insensitive, as FP8011 assumes


def test_mixed_precision_matches_composer():
    import torch
    from composer.distributed.mosaic_parallelism import _get_torch_dtype, get_mixed_precision

    for mode in known.MIXED_PRECISION_MODES:
        get_mixed_precision("amp_fp8", mode.lower())
    with pytest.raises(ValueError):
        get_mixed_precision("amp_fp8", "PUER")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, dtype in known.TORCH_DTYPE_NAMES.items():
            assert _get_torch_dtype(name) == getattr(torch, dtype), name
        for name in known.FP8_DTYPE_NAMES:
            assert _get_torch_dtype(name) == torch.bfloat16
    with pytest.raises(ValueError):
        _get_torch_dtype("int8")
    source = inspect.getsource(get_mixed_precision)
    assert all(f"'{key}'" in source for key in known.MIXED_PRECISION_DTYPE_KEYS)


def test_mpt_and_text_loader_defaults_match_llmfoundry():
    from llmfoundry.data.text_data import build_text_dataloader
    from llmfoundry.models.mpt import MPTConfig

    mpt = inspect.signature(MPTConfig.__init__).parameters
    assert {k: mpt[k].default for k in known.MPT_DEFAULTS} == known.MPT_DEFAULTS
    loader = inspect.signature(build_text_dataloader).parameters
    assert {k: loader[k].default for k in known.TEXT_LOADER_DEFAULTS} == \
        known.TEXT_LOADER_DEFAULTS


def test_torch_dataloader_refuses_the_text_loader_defaults_without_workers():
    from torch.utils.data import DataLoader

    for option, default in known.TEXT_LOADER_DEFAULTS.items():
        with pytest.raises(ValueError, match=option):
            DataLoader([1, 2], num_workers=0, **{option: default})


def test_train_from_yaml_clears_oc_env():
    from llmfoundry.command_utils.train import train_from_yaml

    assert "om.clear_resolver('oc.env')" in inspect.getsource(train_from_yaml)


def test_te_ln_mlp_refuses_ffn_act_fn():
    from llmfoundry.models.mpt import MPTConfig

    with pytest.raises((ValueError, ImportError)):  # ImportError: no TE on this machine
        MPTConfig(d_model=64, n_heads=4, n_layers=1,
                  ffn_config={"ffn_type": "te_ln_mlp", "ffn_act_fn": {"name": "gelu"}})
    source = inspect.getsource(MPTConfig._validate_config)
    assert "'ffn_act_fn' in self.ffn_config.keys()" in source


def test_entry_options_equal_the_real_signatures():
    import importlib

    entries = our_entries()
    assert {("algorithms", "te_swap"), ("callbacks", "fp8_stats"), ("callbacks", "fp8_state"),
            ("callbacks", "fp8_lint")} <= set(entries)
    for entry in entries.values():
        module, _, name = entry.target.partition(":")
        params = dict(inspect.signature(getattr(importlib.import_module(module), name))
                      .parameters)
        for reserved in entry.reserved:
            params.pop(reserved)
        assert set(entry.options) == {n for n, p in params.items()
                                      if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
        for option in entry.options.values():
            real = params[option.name].default
            if option.default is NO_DEFAULT:
                assert real is inspect.Parameter.empty
            elif option.default is not UNREADABLE:
                assert option.default == real, (entry.name, option.name)
