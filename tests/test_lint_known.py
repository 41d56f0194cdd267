"""The linter's copies of what Composer / LLM-Foundry accept equal the installed packages, and
the option lists it reads from our classes' source equal their real signatures. An upgrade
or a new option that changes them fails here instead of silently drifting."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from foundry_fp8.lint import known
from foundry_fp8.lint.entries import our_entries
from foundry_fp8.lint.registry import LintContext, run_rules
from foundry_fp8.lint.rules import lint_config
from foundry_fp8.te import facts

_MANDATORY = {"model": {}, "tokenizer": {}, "optimizer": {}, "scheduler": {}, "train_loader": {},
              "device_train_batch_size": 1, "device_eval_batch_size": 1, "max_duration": "1ba",
              "max_seq_len": 8, "global_train_batch_size": 8, "device_train_microbatch_size": 1}


def _llmfoundry_accepts(config: dict) -> bool:
    """Whether `llmfoundry train` gets past building its TrainConfig from this config."""
    from llmfoundry.utils.config_utils import (
        TRAIN_CONFIG_KEYS,
        TrainConfig,
        make_dataclass_and_log_config,
    )
    from omegaconf import OmegaConf

    try:
        make_dataclass_and_log_config(OmegaConf.create({**_MANDATORY, **config}), TrainConfig,
                                      TRAIN_CONFIG_KEYS, transforms="all")
    except Exception:  # omegaconf's ValidationError, forbid_config_key's ValueError, an assert
        return False
    return True


def test_section_shapes_cover_trainconfigs_container_fields():
    from llmfoundry.utils.config_utils import TrainConfig

    containers = {f.name for f in dataclasses.fields(TrainConfig)
                  if "dict[" in str(f.type) or "list[" in str(f.type)}
    assert set(known.SECTION_SHAPES) == containers
    assert set(known.FILLED_KEYS) <= containers | {"icl_tasks_str", "eval_gauntlet_str"}


_SHAPE_SAMPLES = [{"a": {}}, {}, [{"a": 1}], [], "x.yaml", "", ["a", 1, True], None, 3, True,
                  [None], ["a", {"b": 1}], [[1]], [{"a": 1}, "b"], {1: 2}, [{1: 2}]]


@pytest.mark.parametrize("key", sorted(known.SECTION_SHAPES))
def test_section_shapes_agree_with_llmfoundry(key):
    for sample in _SHAPE_SAMPLES:
        flagged = any(f.rule == "FP8022" for f in lint_config({key: sample}))
        assert _llmfoundry_accepts({key: sample}) != flagged, (key, sample)


@pytest.mark.parametrize("config", [
    {1: 2}, {True: 2},
    {"eval_loader": {}, "eval_loaders": []}, {"eval_loader": None, "eval_loaders": []},
    {"eval_loader": [{}], "eval_loaders": []},
    {"icl_tasks": "a", "icl_tasks_str": "b"}, {"icl_tasks": None, "icl_tasks_str": "b"},
    {"icl_tasks_str": "b"}, {"eval_gauntlet": None, "eval_gauntlet_str": "b"},
    {"eval_gauntlet_str": "b"}, {"model": {"a": {1: 2}}},
])
def test_keys_rule_agrees_with_llmfoundry(config):
    flagged = any(f.rule == "FP8022" for f in lint_config(config))
    assert _llmfoundry_accepts(config) != flagged


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


def test_mpt_attention_and_ffn_defaults_match_llmfoundry():
    from llmfoundry.models.utils.config_defaults import attn_config_defaults, ffn_config_defaults

    assert {k: attn_config_defaults[k] for k in known.MPT_ATTN_DEFAULTS} == \
        known.MPT_ATTN_DEFAULTS
    assert ffn_config_defaults == known.MPT_FFN_DEFAULTS


def _build_mpt(**edits: Any) -> None:
    """Build a tiny MPT as LLM-Foundry does from a model section (MPTConfig, then the model)."""
    from llmfoundry.models.mpt import MPTConfig, MPTForCausalLM

    section: dict = {"d_model": 64, "n_heads": 4, "n_layers": 1, "max_seq_len": 16,
                     "vocab_size": 64, "init_device": "meta", "attn_config": {"attn_impl": "torch"}}
    for path, value in edits.items():
        *parents, leaf = path.split("__")
        node = section
        for parent in parents:
            node = node.setdefault(parent, {})
        node[leaf] = value
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        MPTForCausalLM(MPTConfig(**section))


@pytest.mark.parametrize("path", known.MPT_NUMBER_KEYS)
def test_mpt_refuses_each_number_written_as_a_string(path):
    """FP8035's keys: the number a YAML would quote (or a fraction, read as a string) stops
    LLM-Foundry building the model; the same number unquoted builds."""
    number = {"max_seq_len": 16, "n_layers": 1, "head_dim": 16, "kv_n_heads": 2,
              "ffn_hidden_size": 256, "logit_scale": 0.5}.get(path.rpartition(".")[2], 64)
    if path.endswith(("pdrop", "embedding_fraction")):
        number = 0.5
    extra = {"attn_config__attn_type": "grouped_query_attention"} \
        if path.endswith("kv_n_heads") else {}
    if path == "expansion_ratio":
        number = 4
    key = path.replace(".", "__")
    _build_mpt(**{key: number}, **extra)
    with pytest.raises((TypeError, ValueError)):
        _build_mpt(**{key: str(number)}, **extra)


#: Companions a least value needs to build (d_model 1 needs one head).
_LEAST_WITH = {"d_model": {"n_heads": 1},
               "attn_config.kv_n_heads": {"attn_config__attn_type": "grouped_query_attention"}}
_GOOD = {"d_model": 64, "n_heads": 4, "n_layers": 1, "max_seq_len": 16, "vocab_size": 64,
         "head_dim": 16, "expansion_ratio": 4, "attn_config.kv_n_heads": 2,
         "ffn_config.ffn_hidden_size": 256}
_REFUSED = (TypeError, ValueError, ZeroDivisionError, RuntimeError, OverflowError)


def _refused_values(path: str) -> list[Any]:
    kind, least, nullable = known.MPT_WHOLE_NUMBERS[path]
    values: list[Any] = [float("nan"), float("inf")]
    values += {"int": [float(_GOOD[path])], "integral": [_GOOD[path] + 0.5]}.get(kind, [])
    values += [least - 1] if least is not None else []
    return values + ([] if nullable else [None])


@pytest.mark.parametrize("path", sorted(known.MPT_WHOLE_NUMBERS))
def test_mpt_refuses_each_size_fp8035_flags_and_builds_its_least(path):
    """MPT_WHOLE_NUMBERS, FP8035's table: each value it calls refused stops LLM-Foundry building
    the model, and FP8035 flags it; the least value it allows builds, unflagged."""
    key = path.replace(".", "__")
    extra = _LEAST_WITH.get(path, {}) if path != "d_model" else {}
    gqa = {"attn_config__attn_type": "grouped_query_attention"} if "kv_n_heads" in path else {}

    def flagged(value: Any, **more: Any) -> bool:
        model: dict[str, Any] = {"name": "mpt_causal_lm", "loss_fn": "torch_crossentropy"}
        for dotted_key, v in {key: value, **gqa, **more}.items():
            *parents, leaf = dotted_key.split("__")
            node = model
            for parent in parents:
                node = node.setdefault(parent, {})
            node[leaf] = v
        return any(f.rule == "FP8035" and f.key == f"model.{path}"
                   for f in lint_config({"model": model}))

    for value in _refused_values(path):
        with pytest.raises(_REFUSED):
            _build_mpt(**{key: value}, **extra, **gqa)
        assert flagged(value), (path, value)
    least = known.MPT_WHOLE_NUMBERS[path][1]
    if least is not None:
        companions = _LEAST_WITH.get(path, {})
        _build_mpt(**{key: least}, **companions)
        assert not flagged(least, **{k: v for k, v in companions.items() if k not in gqa})
    if known.MPT_WHOLE_NUMBERS[path][0] == "integral":
        _build_mpt(**{key: float(_GOOD[path])})
        assert not flagged(float(_GOOD[path]))


def test_llmfoundry_refuses_a_top_level_mandatory_value_and_passes_a_nested_one_on():
    """FP8036's two severities: make_dataclass_and_log_config raises MissingMandatoryValue for a
    `???` TrainConfig field, and hands a `???` below the top level on as the text '???'."""
    from llmfoundry.utils.config_utils import (
        TRAIN_CONFIG_KEYS,
        TrainConfig,
        make_dataclass_and_log_config,
    )
    from omegaconf import OmegaConf
    from omegaconf.errors import MissingMandatoryValue

    base = ("model:\n  name: mpt_causal_lm\n  d_model: ???\ntokenizer: {name: gpt2}\n"
            "optimizer: {name: adamw}\nscheduler: {name: cosine}\ntrain_loader: {name: text}\n"
            "device_train_batch_size: 1\nglobal_train_batch_size: 1\n"
            "device_train_microbatch_size: 1\nmax_seq_len: 64\nvariables:\n  unused: ???\n"
            "loggers:\n  wandb:\n    project: ???\n")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, config = make_dataclass_and_log_config(OmegaConf.create(base + "max_duration: 1ba\n"),
                                                  TrainConfig, TRAIN_CONFIG_KEYS, "all")
        assert config.model["d_model"] == "???" and config.loggers["wandb"]["project"] == "???"
        with pytest.raises(MissingMandatoryValue, match="max_duration"):
            make_dataclass_and_log_config(OmegaConf.create(base + "max_duration: ???\n"),
                                          TrainConfig, TRAIN_CONFIG_KEYS, "all")


def test_composers_autoresume_download_crashes_on_an_offline_wandb_logger():
    """FP8037's facts in the installed Composer: WandBLogger.download_file raises RuntimeError
    without an entity or project (offline wandb.run.entity is ''), and the Trainer's autoresume
    download catches only NotImplementedError and FileNotFoundError (Composer #2680)."""
    from composer.loggers.wandb_logger import WandBLogger
    from composer.trainer.trainer import Trainer

    download = inspect.getsource(WandBLogger.download_file)
    assert "if not self.entity or not self.project:" in download
    assert "raise RuntimeError('get_file_artifact can only be called after running init()')" \
        in download
    assert "entity_and_project = [str(wandb.run.entity), str(wandb.run.project)]" in \
        inspect.getsource(WandBLogger.init)
    attempt = inspect.getsource(Trainer._try_checkpoint_download)
    assert "except (NotImplementedError, FileNotFoundError):" in attempt
    assert "self._try_checkpoint_download(" in inspect.getsource(
        Trainer._get_autoresume_checkpoint)


def test_mpt_builds_the_strings_the_rule_lets_through():
    _build_mpt(norm_eps="1e-5")  # torch reads it only in the forward
    for path, words in known.MPT_NUMBER_WORDS.items():
        for word in words:
            _build_mpt(**{path.replace(".", "__"): word})
    with pytest.raises(TypeError):  # only GroupedQueryAttention takes kv_n_heads
        _build_mpt(attn_config__kv_n_heads=2)


def test_mpt_needs_n_heads_to_divide_d_model_even_with_a_head_dim():
    with pytest.raises(ValueError, match="d_model must be divisible by n_heads"):
        _build_mpt(n_heads=3, head_dim=16)
    _build_mpt(n_heads=2, head_dim=16)


def test_torch_dataloader_refuses_the_text_loader_defaults_without_workers():
    from torch.utils.data import DataLoader

    for option, default in known.TEXT_LOADER_DEFAULTS.items():
        with pytest.raises(ValueError, match=option):
            DataLoader([1, 2], num_workers=0, **{option: default})


def test_train_and_eval_from_yaml_clear_oc_env():
    from llmfoundry.command_utils.eval import eval_from_yaml
    from llmfoundry.command_utils.train import train_from_yaml

    for read in (train_from_yaml, eval_from_yaml):
        assert "om.clear_resolver('oc.env')" in inspect.getsource(read)


def test_te_ln_mlp_refuses_ffn_act_fn():
    from llmfoundry.models.mpt import MPTConfig

    with pytest.raises((ValueError, ImportError)):  # ImportError: no TE on this machine
        MPTConfig(d_model=64, n_heads=4, n_layers=1,
                  ffn_config={"ffn_type": "te_ln_mlp", "ffn_act_fn": {"name": "gelu"}})
    source = inspect.getsource(MPTConfig._validate_config)
    assert "'ffn_act_fn' in self.ffn_config.keys()" in source


#: Our registry entries' classes, as setup.cfg's entry points name them.
CLASSES = {"te_swap": "foundry_fp8.composer.te_swap:TESwap",
           "fp8_stats": "foundry_fp8.composer.stats:FP8Stats",
           "fp8_state": "foundry_fp8.composer.state:FP8State",
           "fp8_lint": "foundry_fp8.composer.lint:FP8Lint",
           "jsonl": "foundry_fp8.composer.jsonl_logger:JSONLLogger",
           "fp8_guard": "foundry_fp8.composer.guard:FP8Guard"}


def _class(name: str) -> type:
    import importlib

    module, _, cls = CLASSES[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def test_entry_points_name_the_classes_the_linter_knows():
    from importlib import metadata

    points = {p.name: p.value for group in ("llmfoundry_algorithms", "llmfoundry_callbacks",
                                            "llmfoundry_callbacks_with_config",
                                            "llmfoundry_loggers")
              for p in metadata.entry_points(group=group) if p.value.startswith("foundry_fp8")}
    assert {n: v for n, v in points.items() if n in CLASSES} == CLASSES
    assert {n for (_, n) in our_entries()} == set(CLASSES)


# -- our entries' option values: the linter's verdict is the constructor's ------------------

#: (entry, options): values the constructors refuse, and near misses they accept.
CONSTRUCTOR_CASES = [
    ("te_swap", {"keep_first_blocks": -1}), ("te_swap", {"keep_last_blocks": 2}),
    ("te_swap", {"min_gemm_size": -16}), ("te_swap", {"tokens_per_microbatch": 0}),
    ("te_swap", {"tokens_per_microbatch": 8}), ("te_swap", {"include": "("}),
    ("te_swap", {"exclude": r"lm_head|blocks\.0\."}), ("te_swap", {"backend": "emualte"}),
    ("te_swap", {"fp8_recipe": {"fp8_format": "E5M2"}}), ("te_swap", {"fp8_recipe": {"margin": 1}}),
    ("fp8_state", {"watch_batches": -1}), ("fp8_state", {"watch_batches": 0}),
    ("fp8_lint", {"fail_on": "warning"}), ("fp8_lint", {"fail_on": "never"}),
    ("jsonl", {"path": "{runname}/m.jsonl"}), ("jsonl", {"path": "{run_name}/m.jsonl"}),
    ("jsonl", {"path": "a{b"}), ("jsonl", {"path": ""}),
    ("fp8_stats", {"layers": "("}), ("fp8_stats", {"exclude": "[a"}),
    ("fp8_stats", {"dump_layers": "*"}), ("fp8_stats", {"layers": "attn|ffn"}),
    ("fp8_stats", {"tensors": ["activations"]}), ("fp8_stats", {"tensors": ["weight"]}),
    ("fp8_stats", {"dump_max_mb": -1}), ("fp8_stats", {"dump_max_mb": 0.5}),
    ("fp8_stats", {"recipe": {"scaling": "delayed", "interval": 1}}),
    ("fp8_stats", {"recipe": "delyaed"}), ("fp8_stats", {"recipe": "delayed"}),
    ("fp8_stats", {"recipe": {"scaling": "current", "use_power_2_scales": True}}),
    ("fp8_stats", {"te_debug": "dleayed"}),
    # the audit's values: each refused with a message naming its key, near misses accepted
    ("te_swap", {"fp8_recipe": "delayed"}), ("te_swap", {"include": 5}),
    ("te_swap", {"tokens_per_microbatch": True}), ("te_swap", {"strict": "false"}),
    ("te_swap", {"strict": False}), ("te_swap", {"module_filter_fn": "my.fn"}),
    ("fp8_state", {"watch_batches": "8"}), ("fp8_state", {"strict": "false"}),
    ("fp8_lint", {"fail_on": None}), ("jsonl", {"strict": "true"}),
    ("fp8_stats", {"layers": 5}), ("fp8_stats", {"interval": "abc"}),
    ("fp8_stats", {"interval": 10.0}), ("fp8_stats", {"interval": None}),
    ("fp8_stats", {"dump_steps": 1000}), ("fp8_stats", {"dump_steps": "1000"}),
    ("fp8_stats", {"dump_steps": [0, 1000]}), ("fp8_stats", {"dump_steps": [-1]}),
    ("fp8_stats", {"tensors": "activation"}), ("fp8_stats", {"start": "10ba"}),
    ("fp8_stats", {"start": 10, "end": 5}), ("fp8_stats", {"start": 10, "end": 11}),
    ("fp8_stats", {"end": 0}), ("fp8_stats", {"start": -1}),
    ("fp8_stats", {"max_underflow_pct": -1}), ("fp8_stats", {"max_underflow_pct": 100}),
    ("fp8_stats", {"max_overflow_pct": "0.01"}), ("fp8_stats", {"min_cos_sim": 2}),
    ("fp8_stats", {"min_cos_sim": -1}), ("fp8_stats", {"strict": "false"}),
    ("fp8_stats", {"dump_folder": "{run}/dumps"}), ("fp8_stats", {"dump_folder": "{run_name}/d"}),
    *[("fp8_stats", {"interval": i}) for i in (
        0, 1, 7, "100ba", "5BA", " 5ba", "5 ba", "1e2ba", "1_0ba", "+3ba", "2.5ba", "0ba",
        "-1ba", "ba", "0x10ba", "infba", "nanba", "1h2m3s", "5ep", "10tok")],
]


def _build(name: str, options: dict) -> bool:
    """Whether our class for entry `name` accepts these options."""
    extra: dict = {"train_config": {}} if name == "fp8_lint" else {}
    extra.update({"backend": "emulate"} if name == "te_swap" and "backend" not in options else {})
    try:
        _class(name)(**extra, **options)
    except Exception:
        return False
    return True


@pytest.mark.parametrize(("name", "options"), CONSTRUCTOR_CASES,
                         ids=[f"{n}-{o}" for n, o in CONSTRUCTOR_CASES])
def test_option_verdicts_agree_with_the_constructors(name, options):
    from foundry_fp8.options import OptionError, build

    section = next(s for (s, n) in our_entries() if n == name)
    given = {**options, **({"backend": "emulate"} if name == "te_swap" and "backend" not in
                           options else {})}
    flagged = [f for f in lint_config({section: {name: given}})
               if f.rule in ("FP8008", "FP8019", "FP8020", "FP8023")]
    built = _build(name, options)
    assert built == (not flagged), flagged
    try:
        build(name, given)
        checked = True
    except OptionError:
        checked = False
    assert checked == built


def test_dump_folder_is_formatted_with_the_jsonl_placeholders():
    """FP8023 checks fp8_stats' dump_folder with the jsonl logger's placeholders: what
    FP8Stats fills it with at FIT_START (and checks when built)."""
    from foundry_fp8.composer import stats
    from foundry_fp8.options import PLACEHOLDERS
    from foundry_fp8.paths import in_run_folder

    # what FP8Stats does with it at FIT_START: {run_name} filled in, inside the run folder
    assert "in_run_folder(self.dump_folder" in inspect.getsource(stats)
    assert in_run_folder("{run_name}/dumps", Path("/r"), "a", "k") == Path("/r/a/dumps")
    assert PLACEHOLDERS == ("run_name",)
    with pytest.raises(ValueError, match=r"^callbacks\.fp8_stats\.dump_folder: has unknown "):
        stats.FP8Stats(dump_folder="{run}/dumps")


def test_constructors_build_their_options_once():
    """No constructor keeps a copy of a check: each builds its options dataclass first, and an
    unknown keyword is our one-line error with did-you-mean, not Python's TypeError (19.11)."""
    from foundry_fp8.options import OptionError

    for name in CLASSES:
        init = inspect.getsource(_class(name).__init__)
        function = ast.parse(textwrap.dedent(init)).body[0]
        assert isinstance(function, ast.FunctionDef)
        body = function.body[1:] if ast.get_docstring(function) else function.body
        first = body[0]
        assert isinstance(first, (ast.Assign, ast.AnnAssign)), name
        call = first.value
        assert isinstance(call, ast.Call) and ast.unparse(call.func) == "build", name
        assert ast.unparse(call.args[0]) == repr(name) and "options" in ast.unparse(call), name
        extra = {"train_config": {}} if name == "fp8_lint" else {}
        typo, option = ("fail_onn", "fail_on") if name == "fp8_lint" else ("strictt", "strict")
        with pytest.raises(OptionError, match=rf"\.{name}\.{typo}: is not an option \(did you "
                                              rf"mean `{option}`\?\)"):
            _class(name)(**extra, **{typo: True})


def test_mpt_model_keys_match_llmfoundry_and_transformers():
    import inspect

    from llmfoundry.models.mpt import ComposerMPTCausalLM, MPTConfig
    from transformers import PretrainedConfig

    mpt = set(inspect.signature(MPTConfig.__init__).parameters) - {"self", "kwargs"}
    assert known.MPT_CONFIG_KEYS == mpt
    composer = set(inspect.signature(ComposerMPTCausalLM.__init__).parameters) - {
        "self", "kwargs", "tokenizer"}  # the tokenizer comes from the `tokenizer:` section
    assert composer <= known.FOUNDRY_MODEL_KEYS
    assert known.FOUNDRY_MODEL_KEYS - composer == {"name", "master_weights_dtype"}
    assert known.HF_CONFIG_KEYS == set(vars(PretrainedConfig())) | {"num_labels"}


def test_the_mpt_attributes_read_are_those_mpts_code_reads():
    """Keys MPT keeps as attributes and reads back: `kwargs.get('x')` in MPTBlock and
    `getattr(self.config, 'x')` in modeling_mpt.py, read from the installed sources."""
    import inspect
    import re

    from llmfoundry.models.layers import blocks
    from llmfoundry.models.mpt import modeling_mpt

    read = set(re.findall(r"kwargs\.get\(\s*'(\w+)'", inspect.getsource(blocks.MPTBlock)))
    read |= set(re.findall(r"getattr\(\s*self\.config,\s*'(\w+)'",
                           inspect.getsource(modeling_mpt)))
    assert known.MPT_ATTRIBUTES_READ == read - known.MPT_CONFIG_KEYS


def test_registry_names_match_llmfoundrys_registries():
    """In a fresh interpreter: other tests register test-only callbacks in the same registry."""
    from foundry_fp8.lint.rules.ours import registered_names

    code = ("import json; from llmfoundry import registry as r; print(json.dumps({"
            "'callbacks': sorted(set(r.callbacks.get_all()) | set(r.callbacks_with_config.get_all())),"
            "'algorithms': sorted(r.algorithms.get_all()), 'loggers': sorted(r.loggers.get_all())}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         timeout=300).stdout
    live = {section: set(names) for section, names in json.loads(out.splitlines()[-1]).items()}
    for section, names in live.items():
        assert registered_names(section) == names, section  # built-ins + entry points, ours too
        assert known.FOUNDRY_REGISTRY[section] <= names


def test_eval_config_keys_match_llmfoundry():
    from llmfoundry.utils.config_utils import EVAL_CONFIG_KEYS

    assert known.EVAL_CONFIG_KEYS == EVAL_CONFIG_KEYS


def test_eval_model_keys_are_what_evaluate_model_takes_from_an_entry():
    """evaluate() calls evaluate_model(<keywords>, **model_cfg): an entry may hold the
    parameters it does not pass itself, and must hold those without a default."""
    import ast
    import inspect

    from llmfoundry.command_utils import eval as foundry_eval

    tree = ast.parse(inspect.getsource(foundry_eval.evaluate))
    call, = [n for n in ast.walk(tree) if isinstance(n, ast.Call)
             and getattr(n.func, "id", None) == "evaluate_model"]
    passed = {k.arg for k in call.keywords if k.arg is not None}
    params = inspect.signature(foundry_eval.evaluate_model).parameters
    assert known.EVAL_MODEL_KEYS == set(params) - passed
    assert set(known.EVAL_MODEL_REQUIRED_KEYS) == {
        n for n in known.EVAL_MODEL_KEYS if params[n].default is inspect.Parameter.empty}


def _source_line(where: str) -> tuple[str, int]:
    """('path', line) from a known.*_SOURCE ('pkg/mod.py:466 in 0.21.0-0.22.0')."""
    path, _, rest = where.partition(":")
    return path, int(rest.split()[0])


def _installed_line(path: str, line: int) -> str:
    import importlib.util

    spec = importlib.util.find_spec(path.removesuffix(".py").replace("/", "."))
    return Path(spec.origin).read_text().splitlines()[line - 1]


def test_llmfoundrys_param_init_raises_name_error_on_a_te_layernorm_mlp(monkeypatch):
    """FP8030's reference: the installed LLM-Foundry's MPT param_init_fn, handed a
    te.LayerNormMLP (a stand-in with its parameters: TE is not installed here), raises NameError
    'div_is_residual' for every registered init scheme but the ones known to skip module inits;
    and the versions the rule judges say this LLM-Foundry fails."""
    from importlib import metadata

    import torch
    from llmfoundry.layers_registry import param_init_fns
    from llmfoundry.models.mpt import MPTConfig, MPTForCausalLM
    from llmfoundry.models.utils import config_defaults
    from llmfoundry.models.utils import param_init_fns as module_inits

    class LayerNormMLP(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            for name, shape in (("layer_norm_weight", (8,)), ("layer_norm_bias", (8,)),
                                ("fc1_weight", (16, 8)), ("fc1_bias", (16,)),
                                ("fc2_weight", (8, 16)), ("fc2_bias", (8,))):
                self.register_parameter(name, torch.nn.Parameter(torch.empty(shape)))

    monkeypatch.setattr(module_inits, "te", SimpleNamespace(LayerNormMLP=LayerNormMLP))
    model = MPTForCausalLM(MPTConfig(d_model=64, n_heads=4, n_layers=1, max_seq_len=16,
                                     vocab_size=64, attn_config={"attn_impl": "torch"}))
    failing = set()
    for scheme in param_init_fns.get_all():
        model.config.init_config = {**model.config.init_config, "name": scheme, "init_std": 0.02}
        try:
            model.param_init_fn(LayerNormMLP())
        except NameError as e:
            assert "'div_is_residual' is not defined" in str(e)
            failing.add(scheme)
    skipping = set(param_init_fns.get_all()) - failing
    assert failing and skipping == facts.INIT_SCHEMES_WITHOUT_MODULE_INITS
    assert facts.MPT_DEFAULT_INIT_SCHEME == config_defaults.init_config_defaults["name"]
    assert facts.te_ln_mlp_init_fails(metadata.version("llm-foundry")) is True
    assert "fc2_weight.div_(div_is_residual)" in _installed_line(
        *_source_line(facts.TE_LN_MLP_INIT_SOURCE))


@pytest.mark.parametrize("torch_version", ["2.5.1", "2.6.0", "2.7.0+cu126", "2.7.1",
                                           "2.11.0+cu130"])
def test_composers_auto_microbatch_patch_needs_the_torch_range_we_know(monkeypatch,
                                                                        torch_version):
    """FP8031's reference: the installed Composer's _patch_pytorch, run as under
    `torch_version`, defines unshard_with_sync exactly where the rule's range says; elsewhere
    the patch auto micro-batching under FSDP applies raises NameError."""
    import importlib.util
    from importlib import metadata

    import torch

    spec = importlib.util.find_spec("composer.trainer._patch_pytorch")
    monkeypatch.setattr(torch, "__version__", torch_version)
    namespace: dict = {"__name__": "composer_patch_pytorch_copy"}
    exec(compile(Path(spec.origin).read_text(), spec.origin, "exec"), namespace)
    fails = known.auto_microbatch_fsdp_fails(metadata.version("mosaicml"), torch_version)
    assert fails is ("unshard_with_sync" not in namespace)
    if fails:
        with pytest.raises(NameError, match="name 'unshard_with_sync' is not defined"):
            namespace["patch_unshard_for_automicrobatching"](auto_microbatch_size_found=False)
    assert "FlatParamHandle.unshard = (unshard_with_sync)" in _installed_line(
        *_source_line(known.AUTO_MICROBATCH_SOURCE))


# -- version facts: messages say them from their one home, never as literals ------------------


def test_fp8002_says_fp8_states_te_floor_from_the_recompute_constant(monkeypatch):
    """FP8002's info wrote "TE >= 1.12" by hand: facts.MIN_TE_FOR_RECOMPUTE is what fp8_state
    (te.recompute) checks."""
    from foundry_fp8.lint.rules import fsdp

    config = {"precision": "amp_fp8", "model": {"fc_type": "te"}, "callbacks": {"fp8_state": {}},
              "fsdp_config": {"activation_checkpointing": True}}
    monkeypatch.setattr(fsdp, "MIN_TE_FOR_RECOMPUTE", (9, 7))
    [message] = [f.message for f in lint_config(config) if f.rule == "FP8002"]
    assert "TE >= 9.7" in message and "1.12" not in message


def test_bench_help_says_the_torch_range_from_lint_known(monkeypatch):
    """`--micro-batch`'s help wrote "torch < 2.7.1" by hand: FP8031's range (known.py)."""
    import argparse

    from foundry_fp8.tools import bench

    monkeypatch.setattr(bench, "UNSHARD_TORCH_RANGE", ">=9.1,<9.2")
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    [action] = [a for a in parser._actions if "--micro-batch" in a.option_strings]
    assert "torch>=9.1,<9.2" in action.help and "2.7.1" not in action.help
    assert known.UNSHARD_TORCH_RANGE == (f">={facts.dotted(known.UNSHARD_WITH_SYNC_TORCH[0])},"
                                         f"<{facts.dotted(known.UNSHARD_WITH_SYNC_TORCH[1])}")


def test_current_scalings_te_floor_has_one_home():
    """recipe.py wrote "TE >= 2.2" by hand; te.facts (which builds on recipe.py) re-uses the
    constant recipe.py's messages say."""
    from foundry_fp8 import recipe

    assert facts.MIN_TE_CURRENT_SCALING is recipe.MIN_TE_CURRENT_SCALING
    assert recipe.CURRENT_SCALING_TE == f"TE >= {facts.dotted(facts.MIN_TE_CURRENT_SCALING)}"
    [problem] = recipe.recipe_problems({"scaling": "curent"})
    assert recipe.CURRENT_SCALING_TE in problem.fix


# -- QA round: mandatory keys, MPT's sub-configs, sdpa, eval's FSDP Trainer ---------------------

def _train_config_refused(config: dict) -> bool:
    return bool(_first_refusal(config))


#: A train config with every key `llmfoundry train` needs, and no other.
_WHOLE = {"model": {"name": "mpt_causal_lm"}, "tokenizer": {"name": "gpt2"},
          "optimizer": {"name": "decoupled_adamw"}, "scheduler": {"name": "constant_with_warmup"},
          "train_loader": {"name": "text"}, "max_duration": "10ba", "max_seq_len": 64,
          "global_train_batch_size": 8, "device_train_microbatch_size": 4}


@pytest.mark.parametrize("key", sorted(set(_WHOLE) | {"device_train_batch_size",
                                                      "device_eval_batch_size"}))
def test_fp8038_names_exactly_the_keys_llmfoundry_cannot_do_without(key):
    """Each key dropped from a whole train config: LLM-Foundry refuses it iff FP8038 names it
    (device_train_batch_size and device_eval_batch_size are MISSING in TrainConfig too, but
    update_batch_size_info fills them)."""
    config = {**_WHOLE, "device_train_batch_size": 8, "device_eval_batch_size": 4}
    assert not _train_config_refused(config)
    dropped = {k: v for k, v in config.items() if k != key}
    flagged = [f.key for f in lint_config(dropped) if f.rule == "FP8038"]
    assert _train_config_refused(dropped) == (flagged == [key]) == (key in known.TRAIN_REQUIRED_KEYS)


def _first_refusal(config: dict) -> str:
    """What `llmfoundry train` raises first on `config`, as FP8038 quotes it."""
    from llmfoundry.utils.config_utils import (
        TRAIN_CONFIG_KEYS,
        TrainConfig,
        make_dataclass_and_log_config,
    )
    from omegaconf import OmegaConf
    from omegaconf.errors import MissingMandatoryValue

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            make_dataclass_and_log_config(OmegaConf.create(config), TrainConfig,
                                          TRAIN_CONFIG_KEYS, transforms="all")
    except KeyError as e:
        return f"KeyError {e} in update_batch_size_info"
    except MissingMandatoryValue as e:
        return f"MissingMandatoryValue: {str(e).splitlines()[0]}"
    except Exception as e:  # any other refusal of the config
        return f"{type(e).__name__}: {e}"
    return ""


@pytest.mark.parametrize(("config", "severity"), [
    # before: 0 findings, exit 0 (a file of one setting, or of every key but the two markers)
    ({"precision": "amp_bf16"}, "warning"),
    ({"precision": "amp_fp8", "seed": 1, "algorithms": {"te_swap": {}}}, "warning"),
    ({**{k: v for k, v in _WHOLE.items() if k not in ("train_loader", "max_duration")},
      "precision": "amp_bf16"}, "error"),
    ({"optimizer": {"name": "decoupled_adamw"}, "global_train_batch_size": 8}, "error"),
    # fragments of sections alone: LLM-Foundry refuses them too, but they are meant to be parts
    ({"model": {"name": "mpt_causal_lm"}, "tokenizer": {"name": "gpt2"}}, None),
    ({"icl_tasks": [{"label": "copa"}]}, None),
    ({"eval_gauntlet": {"weighting": "EQUAL"}}, None),
    # before: 7 errors, exit 1: `optimizer:`/`scheduler:`/`train_loader:` are sections too
    ({"optimizer": {"name": "decoupled_adamw", "lr": 6.0e-4},
      "scheduler": {"name": "cosine_with_warmup", "t_warmup": "100ba"}}, None),
    ({"optimizer": {"name": "decoupled_adamw"}, "scheduler": None}, None),
    ({"train_loader": {"name": "text"}}, None),
    # a train-only section next to a setting is a config meant to run
    ({"train_loader": {"name": "text"}, "precision": "amp_bf16"}, "error"),
])
def test_fp8038_on_a_file_without_a_train_only_key_quotes_llmfoundrys_refusal(config, severity):
    found = [f for f in lint_config(config) if f.rule == "FP8038"]
    refusal = _first_refusal(config)
    assert refusal  # LLM-Foundry refuses every one of these as a train config
    absent = [k for k in _WHOLE if k not in config]
    if severity is None:
        assert found == []
    elif severity == "warning":  # one finding naming every absent key and the first refusal
        finding, = found
        assert finding.severity == "warning" and refusal in finding.message
        assert all(f"`{k}`" in finding.message for k in absent)
    else:  # one error per absent key, the first of them the one LLM-Foundry names
        assert {f.severity for f in found} == {"error"}
        assert sorted(f.key for f in found) == sorted(absent)
        assert any(f.key in refusal for f in found)


def test_train_required_keys_are_trainconfigs_missing_fields_less_the_filled_ones():
    from llmfoundry.utils.config_utils import TrainConfig, update_batch_size_info
    from omegaconf import MISSING

    missing = {f.name for f in dataclasses.fields(TrainConfig) if f.default is MISSING}
    filled = set(update_batch_size_info({"global_train_batch_size": 8,
                                         "device_train_microbatch_size": 4})) - {
        "global_train_batch_size", "device_train_microbatch_size"}
    assert filled == {"n_gpus", "device_train_batch_size", "device_train_grad_accum",
                      "device_eval_batch_size"}
    assert set(known.TRAIN_REQUIRED_KEYS) == (missing - filled) | {
        "global_train_batch_size", "device_train_microbatch_size"}


def test_mpt_sub_config_keys_match_llmfoundrys_classes_and_builders():
    from llmfoundry.layers_registry import attention_classes, fcs, ffns
    from llmfoundry.models.layers.blocks import MPTBlock
    from llmfoundry.models.layers.ffn import build_mptglu, build_mptmlp
    from llmfoundry.models.utils.config_defaults import attn_config_defaults

    from foundry_fp8.lint.rules import model

    def keywords(fn: Any) -> set[str]:
        params = inspect.signature(fn).parameters
        assert all(p.kind != p.VAR_KEYWORD for p in params.values())  # TypeError for others
        return set(params) - {"self"}

    classes = {name: attention_classes.get(name) for name in model._ATTN_TYPES}
    assert set(attention_classes.get_all()) == set(classes)  # the built-ins, all judged
    taken = {name: keywords(cls.__init__) for name, cls in classes.items()}
    assert known.MPT_ATTN_CONFIG_KEYS == set(attn_config_defaults) | set.union(*taken.values())
    assert known.MPT_ATTN_NULL_ONLY_KEY not in known.MPT_ATTN_CONFIG_KEYS
    assert {name for name, keys in taken.items() if known.MPT_GQA_ONLY_KEY in keys} == {
        "grouped_query_attention"}
    # MPTBlock keeps back only these (position encoding), all MPTConfig defaults; it passes
    # every other attn_config key to the class
    assert MPTBlock.args_to_exclude_in_attn_class.fget(None) <= set(attn_config_defaults)
    assert known.MPT_FFN_CONFIG_KEYS == {"ffn_type"} | keywords(build_mptmlp) == \
        {"ffn_type"} | keywords(build_mptglu)
    assert {"mptmlp", "mptglu"} <= set(ffns.get_all())
    assert set(fcs.get_all()) <= set(known.MPT_FC_TYPES)  # te too where TE imports


@pytest.mark.parametrize(("edits", "error"), [
    # before: no finding for any of these (QA); each fails building the model
    ({"attn_config__attn_tpye": "grouped_query_attention"}, TypeError),
    ({"attn_config__kv_n_heads": 2}, TypeError),  # multihead_attention takes no kv_n_heads
    ({"ffn_config__ffn_typ": "mptglu"}, TypeError),
    ({"ffn_config__ffn_type": "mptglu", "ffn_config__act_fn": {"name": "silu"}}, TypeError),
    ({"fc_type": "TE"}, Exception),  # catalogue's RegistryError
    ({"fc_type": {"name": "Torch"}}, Exception),
    # before: no finding (QA s17, "other names may be a plugin's: not judged"); RegistryError
    ({"fc_type": "tee"}, Exception),
    ({"fc_type": "transformer_engine"}, Exception),
    ({"fc_type": {"name": "tee"}}, Exception),
    ({"ffn_config__ffn_type": "te_ln_mpl"}, Exception),
    ({"ffn_config__ffn_type": "mlp"}, Exception),
    ({"attn_config__seq_parallel_world_size": 1}, TypeError),  # only null is deleted
    ({"attn_config__seq_parallel_world_size": 2}, NotImplementedError),
    # near misses, which build
    ({"attn_config__seq_parallel_world_size": None}, None),
    ({"attn_config__attn_type": "grouped_query_attention", "attn_config__kv_n_heads": 2}, None),
    ({"attn_config__clip_qkv": 6.0, "attn_config__qk_ln": True}, None),
    ({"ffn_config__ffn_type": "mptglu", "ffn_config__ffn_act_fn": {"name": "silu"},
      "ffn_config__ffn_hidden_size": 128}, None),
    ({"fc_type": "torch"}, None),
])
def test_fp8042_errors_are_what_mpt_refuses_to_build(edits, error):
    section: dict = {"name": "mpt_causal_lm"}
    for path, value in edits.items():
        *parents, leaf = path.split("__")
        node = section
        for parent in parents:
            node = node.setdefault(parent, {})
        node[leaf] = value
    flagged = any(f.rule == "FP8042" and f.severity == "error"
                  for f in lint_config({"model": section}))
    assert flagged == (error is not None)
    if error is None:
        _build_mpt(**edits)
    else:
        with pytest.raises(error):
            _build_mpt(**edits)


@pytest.mark.parametrize("attn_config", [
    {"attn_impl": "sdpa", "attn_logit_softcapping": 30.0},
    {"attn_impl": "sdpa", "attn_logit_softcapping": None},
    {"attn_impl": "sdpa"},
    {"attn_impl": "torch", "attn_logit_softcapping": 30.0},
])
def test_fp8042_flags_what_our_sdpa_refuses_at_mptconfig(tmp_path, attn_config):
    """The YAML's FP8042 verdict agrees with MPTConfig built with foundry_fp8.attention
    registered; the flagged key is the refused one, the fix attn_impl torch."""
    import yaml
    from llmfoundry.models.mpt import MPTConfig

    import foundry_fp8.attention  # noqa: F401  (teaches MPTConfig 'sdpa', as our entries do)
    from foundry_fp8.environment import Snapshot
    from foundry_fp8.lint.cli import lint_file

    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump({"model": {"name": "mpt_causal_lm", "d_model": 64,
                                              "n_heads": 4, "attn_config": attn_config},
                                    "callbacks": {"fp8_lint": {}}}))
    entry = lint_file(path, 1, Snapshot(python="3.11"))
    found = [(f["key"], f["severity"], f["fix"]) for f in entry["findings"]
             if f["rule"] == "FP8042"]
    try:
        MPTConfig(d_model=64, n_heads=4, n_layers=1, max_seq_len=16, vocab_size=64,
                  attn_config=dict(attn_config))
    except NotImplementedError:
        assert found == [("model.attn_config.attn_logit_softcapping", "error",
                          "attn_impl: torch")]
    else:
        assert found == []


def test_layer_registry_names_match_llmfoundrys_registries():
    """MPT_LAYER_REGISTRIES' built-ins are what LLM-Foundry registers: here (no TE, no
    megablocks) all but te, te_ln_mlp, mb_moe and mb_dmoe, which register only where their
    package imports; and the fc_type/ffn_type RegistryError FP8042 names is catalogue's, raised
    for a name outside them. In a fresh interpreter, as other tests may register names."""
    code = ("import json; from llmfoundry import layers_registry as r; "
            "import llmfoundry.models.layers.ffn, llmfoundry.models.layers.fc; "
            "print(json.dumps({'fc_type': sorted(r.fcs.get_all()), 'ffn_config.ffn_type': "
            "sorted(set(r.ffns.get_all()) | set(r.ffns_with_norm.get_all()) | "
            "set(r.ffns_with_megablocks.get_all()))}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         timeout=300).stdout
    live = json.loads(out.splitlines()[-1])
    assert set(live) == set(known.MPT_LAYER_REGISTRIES)
    unavailable_here = {"te", "te_ln_mlp", "mb_moe", "mb_dmoe"}
    for key, (builtins, _) in known.MPT_LAYER_REGISTRIES.items():
        assert set(live[key]) <= builtins and builtins - set(live[key]) <= unavailable_here, key


def test_unregistered_layer_names_are_a_warning_where_code_paths_may_register_them():
    model = {"name": "mpt_causal_lm", "fc_type": "tee"}
    found = [(f.key, f.severity) for f in lint_config({"model": model}) if f.rule == "FP8042"]
    assert found == [("model.fc_type", "error")]
    found = [(f.key, f.severity) for f in lint_config({"model": model, "code_paths": ["fc.py"]})
             if f.rule == "FP8042"]
    assert found == [("model.fc_type", "warning")]
    # in a run the model was built already: its registry, with code_paths' names, answered
    run = LintContext(scope="run")
    assert not [f for f in lint_config({"model": model}, run) if f.rule == "FP8042"]


def test_mpt_replaces_ffn_config_fc_type_by_the_models():
    """FP8042's warning: `ffn_config: {fc_type: ...}` never reaches the FFN."""
    from llmfoundry.models.mpt import MPTConfig, MPTForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = MPTConfig(d_model=64, n_heads=4, n_layers=1, max_seq_len=16, vocab_size=64,
                           attn_config={"attn_impl": "torch"},
                           ffn_config={"fc_type": {"name": "torch", "bias": False}})
        ffn = MPTForCausalLM(config).transformer.blocks[0].ffn
    assert config.ffn_config["fc_type"] == {"name": "torch"} and ffn.up_proj.bias is not None
    found = lint_config({"model": {"name": "mpt_causal_lm",
                                   "ffn_config": {"fc_type": {"name": "torch", "bias": False}}}})
    assert not [f for f in found if f.rule == "FP8042"]  # the same class: nothing to say
    found = lint_config({"model": {"name": "mpt_causal_lm", "ffn_config": {"fc_type": "te"}}})
    assert [(f.key, f.severity) for f in found if f.rule == "FP8042"] == [
        ("model.ffn_config.fc_type", "warning")]


def test_sdpa_builds_only_after_one_of_our_entries_is_imported():
    """FP8041's facts, in a fresh interpreter (foundry_fp8.attention patches MPT once
    imported): MPTConfig refuses attn_impl sdpa; importing the module LLM-Foundry's registry
    loads for any entry of ours makes it build; every such entry lives in foundry_fp8.composer;
    and train() builds loggers, callbacks and algorithms before the model."""
    import importlib
    from importlib import metadata

    train = importlib.import_module("llmfoundry.command_utils.train")

    code = ("import importlib, sys, warnings; warnings.simplefilter('ignore')\n"
            "from llmfoundry.models.mpt import MPTConfig\n"
            "def build():\n"
            "    try:\n"
            "        MPTConfig(d_model=64, n_heads=4, n_layers=1, attn_config={'attn_impl': 'sdpa'})\n"
            "        return 'built'\n"
            "    except ValueError as e:\n"
            "        return str(e)\n"
            "print(build()); importlib.import_module(sys.argv[1]); print(build())\n")
    ours = [ep for group in known.REGISTRY_GROUPS.values() for g in group
            for ep in metadata.entry_points(group=g) if ep.value.startswith("foundry_fp8.")]
    assert {ep.name for ep in ours} == {name for _, name in our_entries()}
    assert all(ep.module.startswith("foundry_fp8.composer.") for ep in ours)
    out = subprocess.run([sys.executable, "-c", code, ours[0].module], capture_output=True,
                         text=True, timeout=300, check=True).stdout.splitlines()[-2:]
    assert out == ["Unknown attn_impl=sdpa", "built"]
    source = inspect.getsource(train.train)
    model_built = source.index("build_composer_model(")
    assert all(source.index(f"{what}(") < model_built
               for what in ("build_logger", "build_callback", "build_algorithm"))
    assert source.index("import_file(") < model_built  # code_paths, FP8041's warning
    sdpa = {"model": {"name": "mpt_causal_lm", "attn_config": {"attn_impl": "sdpa"}}}
    assert [f.severity for f in lint_config(sdpa) if f.rule == "FP8041"] == ["error"]
    for (where, name) in our_entries():
        assert not [f for f in lint_config({**sdpa, where: {name: {}}}) if f.rule == "FP8041"]
    assert [f.severity for f in lint_config({**sdpa, "code_paths": ["my_imports.py"]})
            if f.rule == "FP8041"] == ["warning"]


def test_llmfoundry_eval_hands_fsdp_config_and_precision_to_composers_trainer(monkeypatch):
    """FP8003 applies to eval configs: evaluate_model builds Composer's Trainer with the eval
    config's fsdp_config and precision, which is where Composer wraps blocks and asserts
    non-reentrant checkpointing for te_checkpoint_wrapper (prepare_fsdp_module); LLM-Foundry's
    eval, unlike train's validate_config, flips no reentrant setting."""
    from composer.distributed import dist_strategy
    from llmfoundry.command_utils import eval as foundry_eval

    class Built(Exception):
        pass

    def trainer(**kwargs: Any) -> None:
        raise Built(kwargs)

    monkeypatch.setattr(foundry_eval, "build_tokenizer", lambda *a, **k: None)
    monkeypatch.setattr(foundry_eval, "build_evaluators", lambda *a, **k: ([], [], None))
    monkeypatch.setattr(foundry_eval, "build_composer_model", lambda **k: object())
    monkeypatch.setattr(foundry_eval, "Trainer", trainer)
    fsdp = {"activation_checkpointing": True, "te_checkpoint_wrapper": True}
    with pytest.raises(Built) as built:
        foundry_eval.evaluate_model(
            tokenizer={"name": "gpt2"}, model_name="m", model={"name": "mpt_causal_lm"},
            dist_timeout=60, run_name="r", seed=1, icl_tasks=[], max_seq_len=64,
            device_eval_batch_size=1, eval_gauntlet_config=None, eval_loader_config=None,
            loggers=[], python_log_level=None, precision="amp_fp8", eval_gauntlet_df=None,
            eval_subset_num_batches=1, icl_subset_num_batches=None, callback_configs=None,
            metadata=None, logged_config={}, parallelism_config={"fsdp": fsdp}, load_path="x")
    kwargs = built.value.args[0]
    assert kwargs["parallelism_config"] == {"fsdp": fsdp} and kwargs["precision"] == "amp_fp8"
    assert "parallelism_config={'fsdp': eval_config.fsdp_config}" in \
        inspect.getsource(foundry_eval.evaluate)
    assert "validate_config" not in inspect.getsource(foundry_eval)
    assert "TE checkpoint only works with non-reentrant checkpointing" in \
        inspect.getsource(dist_strategy.prepare_fsdp_module)
    eval_config = {"models": [{"model_name": "m", "model": {"name": "mpt_causal_lm"}}],
                   "precision": "amp_fp8", "fsdp_config": fsdp}
    assert [f.key for f in run_rules("eval", eval_config, LintContext())
            if f.rule == "FP8003"] == ["fsdp_config.te_checkpoint_wrapper"]
