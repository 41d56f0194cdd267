"""FP8044 and its run-time twin, FP8307: under `precision: amp_fp8` Composer enters TE's
fp8_autocast and no torch autocast, so what runs outside TE's layers (and, in eval, every layer)
computes in the parameters' dtype, float32 unless FSDP's mixed precision lowers it. The
reference for what FSDP lowers is Composer's own get_mixed_precision, never our table."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import yaml
from composer.core import Event, Precision
from composer.distributed.mosaic_parallelism import get_mixed_precision
from composer.utils import FSDPConfig

from foundry_fp8.composer.lint import FP8Lint, precision_problem
from foundry_fp8.environment import Snapshot
from foundry_fp8.lint.cli import lint_file

BARE = Snapshot(python="3.11")

#: A pretraining config in the shape of LLM-Foundry's scripts/train/yamls/pretrain/mpt-*.yaml,
#: with TE linears; FSDP as those files set it (PURE here).
PRETRAIN = """\
variables:
  data_local: ./my-copy-c4
  max_seq_len: 2048
  global_seed: 17
max_seq_len: ${variables.max_seq_len}
run_name: mpt-350m-fp8
model:
  name: mpt_causal_lm
  init_device: meta
  d_model: 1024
  n_heads: 16
  n_layers: 24
  expansion_ratio: 4
  max_seq_len: ${variables.max_seq_len}
  vocab_size: 50368
  fc_type: te
  loss_fn: torch_crossentropy
  attn_config:
    attn_impl: torch
tokenizer:
  name: EleutherAI/gpt-neox-20b
  kwargs:
    model_max_length: ${variables.max_seq_len}
train_loader:
  name: text
  dataset:
    local: ${variables.data_local}
    split: train
    shuffle: true
    max_seq_len: ${variables.max_seq_len}
    shuffle_seed: ${variables.global_seed}
  drop_last: true
  num_workers: 8
scheduler:
  name: cosine_with_warmup
  t_warmup: 100ba
  alpha_f: 0.1
optimizer:
  name: decoupled_adamw
  lr: 3.0e-4
  betas: [0.9, 0.95]
  eps: 1.0e-08
  weight_decay: 0.0
max_duration: 13400ba
global_train_batch_size: 256
seed: ${variables.global_seed}
device_eval_batch_size: 8
device_train_microbatch_size: 8
precision: amp_fp8
fsdp_config:
  sharding_strategy: FULL_SHARD
  mixed_precision: PURE
  activation_checkpointing: false
  limit_all_gathers: true
"""


def _lint(tmp_path: Path, text: str, name: str = "train.yaml") -> list[dict[str, Any]]:
    path = tmp_path / name
    path.write_text(text)
    entry = lint_file(path, 1, BARE)
    assert entry["error"] is None, entry["error"]
    return entry["findings"]


def _only(findings: list[dict[str, Any]], rule: str) -> list[tuple[str, int]]:
    return [(f["key"], f["line"]) for f in findings if f["rule"] == rule]


def _line_of(text: str, start: str) -> int:
    return next(n for n, line in enumerate(text.splitlines(), 1) if line.startswith(start))


def test_the_pure_pretrain_config_stays_clean(tmp_path):
    assert _lint(tmp_path, PRETRAIN) == []


@pytest.mark.parametrize("mixed", ["PURE", "DEFAULT", "pure", "FULL", "{param_dtype: float32}",
                                   "{param_dtype: bf16}", "{param_dtype: float16}",
                                   "{param_dtype: amp_fp8}", "{reduce_dtype: bf16}"])
def test_fires_exactly_where_composers_fsdp_keeps_float32(tmp_path, mixed):
    text = PRETRAIN.replace("mixed_precision: PURE", f"mixed_precision: {mixed}")
    value = yaml.safe_load(f"v: {mixed}")["v"]
    with warnings.catch_warnings():  # amp_fp8's "We use torch.bfloat16 by default" warning
        warnings.simplefilter("ignore")
        param_dtype = get_mixed_precision(Precision.AMP_FP8, value)[1]
    lowered = param_dtype in (torch.bfloat16, torch.float16)
    found = _only(_lint(tmp_path, text), "FP8044")
    assert found == ([] if lowered else
                     [("fsdp_config.mixed_precision", _line_of(text, "  mixed_precision"))])


def test_no_fsdp_config_fires_at_precision_with_the_flash_note_for_mpts_default(tmp_path):
    no_fsdp = PRETRAIN[:PRETRAIN.index("fsdp_config:")]
    findings = _lint(tmp_path, no_fsdp)
    assert _only(findings, "FP8044") == [("precision", _line_of(no_fsdp, "precision:"))]
    assert findings[0]["severity"] == "warning" and "flash" not in findings[0]["message"]
    assert "no fsdp_config" in findings[0]["message"]
    flash = no_fsdp.replace("  attn_config:\n    attn_impl: torch\n", "")  # MPT's default: flash
    message = _lint(tmp_path, flash)[0]["message"]
    assert "FlashAttention only support fp16 and bf16 data type" in message


@pytest.mark.parametrize("edit", [
    ("precision: amp_fp8", "precision: amp_bf16"),  # torch autocast lowers it
    ("  fc_type: te\n", ""),  # nothing in FP8: FP8001's finding, not this one
])
def test_quiet_where_amp_fp8_is_not_what_runs(tmp_path, edit):
    text = PRETRAIN[:PRETRAIN.index("fsdp_config:")].replace(*edit)
    assert _only(_lint(tmp_path, text), "FP8044") == []


def test_te_swaps_emulated_backend_gets_fp8028_not_this(tmp_path):
    text = PRETRAIN[:PRETRAIN.index("fsdp_config:")].replace("  fc_type: te\n", "") \
        + "algorithms:\n  te_swap:\n    backend: emulate\n"
    rules = [f["rule"] for f in _lint(tmp_path, text)]
    assert "FP8028" in rules and "FP8044" not in rules
    assert _only(_lint(tmp_path, text.replace("amp_fp8", "fp32")), "FP8044") == []


def _mcli(gpus: int) -> str:
    body = "".join(f"  {line}\n" if line else "\n" for line in PRETRAIN.splitlines())
    return ("name: mpt-350m-fp8\nimage: mosaicml/llm-foundry:2.7.0_cu128-latest\n"
            f"compute:\n  gpus: {gpus}\ncommand: |\n  cd llm-foundry/scripts\n"
            "  composer train/train.py /mnt/config/parameters.yaml\nparameters:\n" + body)


def test_an_mcli_run_on_one_gpu_loses_its_fsdp_config(tmp_path):
    one = _mcli(1)
    findings = _lint(tmp_path, one, "mcli.yaml")
    assert _only(findings, "FP8044") == [("parameters.precision", _line_of(one, "  precision:"))]
    assert "LLM-Foundry drops this fsdp_config" in findings[0]["message"]
    assert _lint(tmp_path, _mcli(8), "mcli.yaml") == []


def _eval(fsdp: str) -> str:
    return ("max_seq_len: 2048\nprecision: amp_fp8\n" + fsdp + "models:\n- model_name: mpt-te\n"
            "  model:\n    name: mpt_causal_lm\n    d_model: 1024\n    n_heads: 16\n"
            "    n_layers: 24\n    max_seq_len: 2048\n    vocab_size: 50368\n    fc_type: te\n"
            "    loss_fn: torch_crossentropy\n    attn_config:\n      attn_impl: torch\n"
            "  tokenizer:\n    name: EleutherAI/gpt-neox-20b\n"
            "  load_path: s3://bucket/ckpt/latest-rank0.pt\n"
            "device_eval_batch_size: 8\nicl_tasks: eval/yamls/tasks_v0.3.yaml\n")


@pytest.mark.parametrize(("fsdp", "dtype"), [
    ("", "float32"),
    ("fsdp_config:\n  mixed_precision: FULL\n", "float32"),
    ("fsdp_config:\n  mixed_precision: PURE\n", "bfloat16"),
])
def test_eval_with_amp_fp8_scores_te_models_in_the_activation_dtype(tmp_path, fsdp, dtype):
    text = _eval(fsdp)
    findings = _lint(tmp_path, text, "eval.yaml")
    assert [(f["rule"], f["key"], f["severity"], f["line"]) for f in findings] == [
        ("FP8307", "models.0.model", "warning", _line_of(text, "  model:"))]
    assert f"computes in {dtype} (" in findings[0]["message"]
    assert _lint(tmp_path, text.replace("amp_fp8", "amp_bf16"), "eval.yaml") == []


# The run-time twin. Composer refuses amp_fp8 on CPU when the Trainer is built, so the judge
# reads a State built with fp32 and switched to amp_fp8, as it stands at FIT_START on a GPU.

def _model(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)).to(dtype)


@pytest.mark.parametrize("mixed", ["DEFAULT", "PURE", "FULL", {"param_dtype": "float32"},
                                   {"param_dtype": "bf16"}, {"reduce_dtype": "bf16"}])
def test_the_run_judge_follows_composers_param_dtype(mixed):
    state = SimpleNamespace(precision=Precision.AMP_FP8, fsdp_config=FSDPConfig(
        mixed_precision=mixed), fsdp_enabled=True, model=_model())
    lowered = get_mixed_precision(Precision.AMP_FP8, mixed)[1] in (torch.bfloat16, torch.float16)
    problem = precision_problem(state)
    assert (problem is None) == lowered, problem
    if not lowered:
        assert problem.startswith("fp8_lint FP8044: precision amp_fp8 with fsdp_config.")
        # the param_dtype the message names is Composer's own (None: the parameters' dtype)
        named = get_mixed_precision(Precision.AMP_FP8, mixed)[1]
        assert f"param_dtype {named}" in problem or f"param_dtype is {named}" in problem, problem


def test_without_fsdp_the_parameters_own_dtype_decides():
    state = SimpleNamespace(precision=Precision.AMP_FP8, fsdp_config=None, fsdp_enabled=False,
                            model=_model())
    assert "no FSDP on one GPU" in precision_problem(state)  # world size 1 here
    state.model = _model(torch.bfloat16)
    assert precision_problem(state) is None
    state.precision, state.model = Precision.AMP_BF16, _model()
    assert precision_problem(state) is None



def test_a_real_state_with_a_real_fsdp_module(one_rank_group):
    from composer.core import State
    from composer.devices import DeviceCPU
    from composer.models import ComposerClassifier
    from composer.utils import ParallelismConfig
    from torch.distributed.fsdp import FullyShardedDataParallel

    for mixed, warned in (("FULL", True), ("DEFAULT", False)):
        model = ComposerClassifier(_model(), num_classes=8)
        state = State(model=model, rank_zero_seed=0, run_name="r", device=DeviceCPU(),
                      precision="fp32", parallelism_config=ParallelismConfig(
                          fsdp=FSDPConfig(mixed_precision=mixed)))
        assert not state.fsdp_enabled
        with pytest.warns(UserWarning, match="NO_SHARD"):  # one rank: FSDP does not shard
            model.module = FullyShardedDataParallel(model.module, device_id=torch.device("cpu"))
        state.precision = Precision.AMP_FP8
        assert state.fsdp_enabled
        assert (precision_problem(state) is not None) == warned


def test_the_callback_warns_once_at_fit_start_of_a_real_trainer(caplog):
    from composer import Trainer
    from composer.models import ComposerClassifier

    lint = FP8Lint(train_config={})
    data = torch.utils.data.TensorDataset(torch.randn(4, 8), torch.randint(0, 8, (4,)))
    trainer = Trainer(model=ComposerClassifier(_model(), num_classes=8), callbacks=[lint],
                      train_dataloader=torch.utils.data.DataLoader(data, batch_size=2),
                      device="cpu", precision="fp32", max_duration="1ba")
    trainer.state.precision = Precision.AMP_FP8  # as on a GPU, where Composer allows it
    with caplog.at_level(logging.WARNING, logger="foundry_fp8.composer.lint"):
        trainer.engine.run_event(Event.FIT_START)
    said = [r.getMessage() for r in caplog.records if "FP8044" in r.getMessage()]
    assert len(said) == 1 and "no FSDP on one GPU" in said[0]


def test_our_bug_in_the_judge_is_a_warning_not_a_crash(caplog, monkeypatch):
    import foundry_fp8.composer.lint as lint_module

    def broken(state: Any) -> str:
        raise KeyError("oops")

    monkeypatch.setattr(lint_module, "precision_problem", broken)
    lint = FP8Lint(train_config={})
    logger = SimpleNamespace(destinations=[])
    with caplog.at_level(logging.WARNING, logger="foundry_fp8.composer.lint"):
        lint.fit_start(SimpleNamespace(), logger)
    assert "checking the compute dtype failed" in caplog.text


# model.master_weights_dtype: LLM-Foundry's train builds the model in it. The references are
# LLM-Foundry's own build_composer_model and process_init_device, run on every dtype name.

_DTYPE_NAMES = sorted({"f16", "fp32", "float32", "fp16", "float16", "half", "bf16", "bfloat16",
                       "amp_fp16", "amp_bf16", "amp_fp8", "fp8", "int8"})


def _foundry_master_dtype(name: str) -> torch.dtype | None:
    """The dtype of the parameters LLM-Foundry's build_composer_model gives for
    master_weights_dtype `name` (None: it refuses the name)."""
    from composer.models import ComposerClassifier
    from llmfoundry import registry
    from llmfoundry.utils.builders import build_composer_model

    class Tiny(ComposerClassifier):
        def __init__(self, tokenizer: Any = None) -> None:
            super().__init__(_model(), num_classes=8)

    registry.models.register("lintfix_tiny", func=Tiny)
    try:
        model = build_composer_model("lintfix_tiny", {}, None, master_weights_dtype=name)
    except ValueError as error:
        assert "Invalid master_weights_dtype" in str(error)
        return None
    return next(model.parameters()).dtype


def _foundry_keeps_own_dtype(name: str) -> bool:
    """Does LLM-Foundry's process_init_device make FSDP keep the parameters' own dtype?"""
    from llmfoundry.utils.config_utils import process_init_device

    fsdp_config: dict[str, Any] = {"mixed_precision": "FULL"}
    process_init_device({"master_weights_dtype": name}, fsdp_config)
    mixed = fsdp_config["mixed_precision"]
    return isinstance(mixed, dict) and mixed["param_dtype"] is None


def test_the_master_weights_dtype_tables_are_llm_foundrys():
    from foundry_fp8.lint.known import (
        FOUNDRY_FSDP_KEEPS_MASTER_DTYPES,
        FOUNDRY_MASTER_WEIGHTS_DTYPES,
    )

    built = {name: _foundry_master_dtype(name) for name in _DTYPE_NAMES}
    assert {n for n, d in built.items() if d is not None} == FOUNDRY_MASTER_WEIGHTS_DTYPES
    assert {d for d in built.values() if d is not None} == {torch.float16, torch.bfloat16}
    kept = {name for name in _DTYPE_NAMES if _foundry_keeps_own_dtype(name)}
    assert kept == FOUNDRY_FSDP_KEEPS_MASTER_DTYPES & set(_DTYPE_NAMES)
    assert len(FOUNDRY_FSDP_KEEPS_MASTER_DTYPES - set(_DTYPE_NAMES)) == 0


@pytest.mark.parametrize("master", _DTYPE_NAMES)
@pytest.mark.parametrize("fsdp", ["", "fsdp_config:\n  mixed_precision: FULL\n",
                                  "fsdp_config:\n  mixed_precision: PURE\n",
                                  "fsdp_config:\n  mixed_precision: {reduce_dtype: bf16}\n",
                                  "fsdp_config:\n  mixed_precision: {param_dtype: fp32}\n"])
def test_master_weights_in_16_bits_need_no_fsdp(tmp_path, master, fsdp):
    text = PRETRAIN[:PRETRAIN.index("fsdp_config:")].replace(
        "  fc_type: te\n", f"  fc_type: te\n  master_weights_dtype: {master}\n") + fsdp
    built = _foundry_master_dtype(master)
    findings = _lint(tmp_path, text)
    refused = _only(findings, "FP8045")
    if built is None:  # LLM-Foundry refuses the name: the run stops before any dtype matters
        assert refused == [("model.master_weights_dtype", _line_of(text, "  master_weights_dtype"))]
        assert _only(findings, "FP8044") == []
        return
    assert refused == []
    mixed = yaml.safe_load(text).get("fsdp_config", {}).get("mixed_precision")
    if mixed is None:
        compute = built  # no FSDP: the parameters' own dtype
    else:
        fsdp_config = {"mixed_precision": mixed}
        from llmfoundry.utils.config_utils import process_init_device
        process_init_device({"master_weights_dtype": master}, fsdp_config)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            compute = get_mixed_precision(Precision.AMP_FP8,
                                          fsdp_config["mixed_precision"])[1] or built
    found = _only(findings, "FP8044")
    assert (found != []) == (compute == torch.float32), (compute, found)


@pytest.mark.parametrize("master", ["fp16", "amp_bf16", "bfloat", "float"])
def test_a_refused_master_weights_dtype_suggests_one_llm_foundry_builds(tmp_path, master):
    text = PRETRAIN.replace("  fc_type: te\n", f"  fc_type: te\n  master_weights_dtype: {master}\n")
    [finding] = [f for f in _lint(tmp_path, text) if f["rule"] == "FP8045"]
    assert finding["severity"] == "error"
    suggested = finding["message"].rsplit("(did you mean `", 1)[1].split("`")[0]
    assert _foundry_master_dtype(master) is None
    assert _foundry_master_dtype(suggested) is not None


def test_full_says_composer_leaves_fsdps_param_dtype_none(tmp_path):
    text = PRETRAIN.replace("mixed_precision: PURE", "mixed_precision: FULL")
    [message] = [f["message"] for f in _lint(tmp_path, text) if f["rule"] == "FP8044"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        param_dtype = get_mixed_precision(Precision.AMP_FP8, "FULL")[1]
    assert f"param_dtype {param_dtype}:" in message
    assert "param_dtype float32" not in message


# Eval: evaluate_model builds the model without master_weights_dtype (it stays in the model's
# cfg), but process_init_device still rewrites the eval's one fsdp_config for it. The
# references are LLM-Foundry's build_composer_model called as evaluate_model calls it,
# process_init_device on one fsdp_config dict for every model, and Composer's get_mixed_precision.

def _eval_built_dtype(master: str) -> torch.dtype:
    """The parameters' dtype when LLM-Foundry's eval builds a model whose cfg holds
    master_weights_dtype `master` (llmfoundry/command_utils/eval.py evaluate_model)."""
    from composer.models import ComposerClassifier
    from llmfoundry import registry
    from llmfoundry.utils.builders import build_composer_model

    class TinyTakingAll(ComposerClassifier):
        def __init__(self, tokenizer: Any = None, **kwargs: Any) -> None:
            super().__init__(_model(), num_classes=8)

    registry.models.register("lintfix_tiny_any", func=TinyTakingAll)
    model = build_composer_model(name="lintfix_tiny_any", tokenizer=None,
                                 cfg={"master_weights_dtype": master})
    return next(model.parameters()).dtype


@pytest.mark.parametrize("master", ["bf16", "amp_bf16", "f16", "fp32"])
@pytest.mark.parametrize("fsdp", ["", "fsdp_config:\n  mixed_precision: FULL\n",
                                  "fsdp_config:\n  mixed_precision: PURE\n",
                                  "fsdp_config:\n  mixed_precision: {param_dtype: bf16}\n"])
def test_eval_names_the_dtype_llm_foundrys_eval_computes_in(tmp_path, master, fsdp):
    from llmfoundry.utils.config_utils import process_init_device

    one = _eval(fsdp)
    entry = one[one.index("- model_name"):one.index("device_eval_batch_size")]
    # the first model asks for master weights, the second does not; both share fsdp_config
    text = one.replace("    fc_type: te\n", f"    fc_type: te\n    master_weights_dtype: {master}\n",
                       1).replace(entry, entry + entry.replace("mpt-te", "mpt-te-2"), 1)
    config = yaml.safe_load(text)
    fsdp_config = config.get("fsdp_config")
    expected = []
    for item in config["models"]:
        model = dict(item["model"])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            process_init_device(model, fsdp_config)
            built = _eval_built_dtype(model["master_weights_dtype"]) \
                if "master_weights_dtype" in model else torch.float32
            compute = built if fsdp_config is None else \
                get_mixed_precision(Precision.AMP_FP8, fsdp_config["mixed_precision"])[1] or built
        expected.append(str(compute).removeprefix("torch."))
    messages = [f["message"] for f in _lint(tmp_path, text, "eval.yaml") if f["rule"] == "FP8307"]
    assert [m.split("computes in ", 1)[1].split(" ", 1)[0] for m in messages] == expected
