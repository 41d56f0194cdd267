"""The lint corpus (tests/lint_corpus): train, eval, MCLI, Accelerate and DeepSpeed configs in
the shapes LLM-Foundry's and Accelerate's repositories use, each with its expected findings
(expected.yaml), the seed's MPT-1B config among them. Configs we call clean are checked against
LLM-Foundry's own loaders; a train config with an unknown top-level key is refused by them too.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from foundry_fp8.environment import Snapshot
from foundry_fp8.lint import accelerate
from foundry_fp8.lint.cli import lint_file
from tests.test_doctor_training_stack import RANGES

CORPUS = Path(__file__).resolve().parent / "lint_corpus"
EXPECTED: dict[str, list[list[str]]] = yaml.safe_load((CORPUS / "expected.yaml").read_text())
#: The machine the expectations are written for: no flash-attn, TE or GPU; foundry-fp8 installed
#: (its metadata's ranges are setup.cfg's).
BARE = Snapshot(python="3.11", stack_ranges=RANGES)


@pytest.fixture(autouse=True)
def _accelerate_1_8_1(monkeypatch):
    """Version-dependent Accelerate rules judge the version the expectations name."""
    monkeypatch.setattr(accelerate, "installed_accelerate", lambda: (1, 8, 1))


def test_every_corpus_file_has_expectations():
    files = {str(p.relative_to(CORPUS)) for p in CORPUS.rglob("*")
             if p.is_file() and p.name != "expected.yaml"}
    assert files == set(EXPECTED)
    kinds = {name.split("/")[0] for name in EXPECTED}
    assert kinds == {"train", "eval", "mcli", "accelerate", "deepspeed"}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_corpus_file_gives_exactly_its_expected_findings(name):
    entry = lint_file(CORPUS / name, 1, BARE)
    assert entry["error"] is None, entry["error"]
    found = sorted([f["rule"], f["key"], f["severity"], f["line"]][:len(want)]
                   for f, want in zip(sorted(entry["findings"], key=_rule_and_key),
                                      sorted(EXPECTED[name]), strict=False))
    assert len(entry["findings"]) == len(EXPECTED[name]), entry["findings"]
    assert found == sorted(EXPECTED[name]), entry["findings"]
    for f in entry["findings"]:
        assert f["line"] is not None and f["message"] and f["fix"]


def _rule_and_key(finding: dict[str, Any]) -> tuple[str, str]:
    return finding["rule"], finding["key"]


def test_an_mcli_run_without_parameters_is_skipped_with_a_note():
    entry = lint_file(CORPUS / "mcli" / "mcli-convert-checkpoint.yaml", 1, BARE)
    assert entry["findings"] == [] and "without `parameters:` whose command" in entry["skipped"]


def test_the_seed_config_names_the_key_mpt_reads():
    entry = lint_file(CORPUS / "train" / "mpt-1b-seed-te-ln-mlp.yaml", 1, BARE)
    message, = [f["message"] for f in entry["findings"] if f["rule"] == "FP8024"]
    assert "did you mean `ffn_config`?" in message


def test_mpt_really_ignores_the_seed_configs_key():
    """The reference for FP8024: LLM-Foundry's own MPT builds the default MLP, not TE's fused
    one, from `ffn_config_defaults`, and keeps the key as an attribute."""
    from llmfoundry.models.mpt import MPTConfig, MPTForCausalLM

    config = MPTConfig(d_model=64, n_heads=4, n_layers=1, max_seq_len=16, vocab_size=64,
                       attn_config={"attn_impl": "torch"},
                       ffn_config_defaults={"ffn_type": "te_ln_mlp"})
    assert config.ffn_config_defaults == {"ffn_type": "te_ln_mlp"}
    assert config.ffn_config["ffn_type"] == "mptmlp"
    block = MPTForCausalLM(config).transformer.blocks[0]
    assert type(block.ffn).__name__ == "MPTMLP"


#: The files whose configs build and train elsewhere but crash with the installed upstream
#: versions (FP8030: LLM-Foundry's init of te.LayerNormMLP; FP8031: Composer's auto micro-batching
#: under FSDP with torch past its range), each with what an affected and an unaffected machine get.
UPSTREAM_CRASHES = {
    "train/mpt-1b-te-ln-mlp.yaml": "FP8030",
    "train/te-swap-fuse-ln-mlp-meta.yaml": "FP8030",
    "mcli/mcli-auto-microbatch-fsdp.yaml": "FP8031",
}
#: Of those, the one that does not crash: te_swap declines to fuse on meta weights where
#: LLM-Foundry's init would raise (swap._meta_init_reason), so an affected machine gets a warning.
DECLINED = {"train/te-swap-fuse-ln-mlp-meta.yaml"}
#: The H200 of the first GPU run (benchmarks/results/mpt-1b-nvidia-h200-te-native.json).
H200_SET = Snapshot(python="3.12.3", torch="2.11.0+cu130", composer="0.32.1",
                    llmfoundry="0.22.0")


@pytest.mark.parametrize(("snapshot", "severity"), [
    (H200_SET, {"FP8030": "error", "FP8031": "error"}),
    # our oldest supported set (constraints/oldest.txt): LLM-Foundry's bug, Composer's torch range
    (Snapshot(python="3.11", torch="2.7.0", composer="0.31.0", llmfoundry="0.21.0"),
     {"FP8030": "error", "FP8031": None}),
    (Snapshot(python="3.11", torch="2.7.1", composer="0.31.0", llmfoundry="0.7.0"),
     {"FP8030": None, "FP8031": "error"}),
])
@pytest.mark.parametrize("name", sorted(UPSTREAM_CRASHES))
def test_upstream_crashes_follow_the_installed_versions(name, snapshot, severity):
    rule = UPSTREAM_CRASHES[name]
    found = [[f["rule"], f["key"], f["severity"]] for f in lint_file(CORPUS / name, 1,
                                                                     snapshot)["findings"]]
    if name in IMAGE_TORCH:  # the run's torch is its image's (2.7.0), in Composer's range
        assert found == []
        return
    (_, key, _), = EXPECTED[name]
    want = "warning" if name in DECLINED and severity[rule] == "error" else severity[rule]
    assert found == ([] if want is None else [[rule, key, want]])


#: MCLI files whose image names the torch the run gets (mosaicml/llm-foundry:<torch>_...), and
#: the key FP8031 names where another torch runs the same parameters.
IMAGE_TORCH = {"mcli/mcli-auto-microbatch-fsdp.yaml": ("2.7.0", "device_train_microbatch_size")}


@pytest.mark.parametrize("name", sorted(IMAGE_TORCH))
def test_the_same_parameters_as_a_train_config_judge_the_local_torch(name, tmp_path):
    """Without the MCLI wrapper (no image), FP8031 judges the torch where the linter runs."""
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(_resolved(name)))
    torch, key = IMAGE_TORCH[name]
    found = [[f["rule"], f["key"], f["severity"]] for f in lint_file(path, 1, H200_SET)["findings"]]
    assert found == [[UPSTREAM_CRASHES[name], key, "error"]]
    pinned = replace(H200_SET, torch=torch)
    assert lint_file(path, 1, pinned)["findings"] == []


@pytest.mark.parametrize("name", sorted(UPSTREAM_CRASHES))
def test_llmfoundrys_loader_accepts_what_then_crashes(name):
    """LLM-Foundry's own loader passes these configs: the crash comes later, when the model is
    initialised (FP8030) or the Trainer is built (FP8031), after data and tokenizer setup."""
    _train_loader_accepts(_resolved(name))


def test_the_seed_configs_ignored_key_is_not_double_reported():
    """ffn_config_defaults asks for te_ln_mlp under a key MPT ignores: FP8024's, not FP8030's."""
    entry = lint_file(CORPUS / "train" / "mpt-1b-seed-te-ln-mlp.yaml", 1, H200_SET)
    assert [f["rule"] for f in entry["findings"]] == ["FP8024"]


def test_fp8103_names_the_precision_the_deepspeed_file_sets():
    entry = lint_file(CORPUS / "accelerate" / "deepspeed-fp16-file.yaml", 1, BARE)
    message, = [f["message"] for f in entry["findings"] if f["rule"] == "FP8103"]
    assert "config's fp16 as the mixed precision" in message and "trains in FP16" in message
    assert "bf16" not in message


def _resolved(name: str) -> dict[str, Any]:
    data = yaml.safe_load((CORPUS / name).read_text())
    return data["parameters"] if name.startswith("mcli/") else data


def _train_loader_accepts(config: dict[str, Any]) -> None:
    from llmfoundry.utils.config_utils import (
        TRAIN_CONFIG_KEYS,
        TrainConfig,
        make_dataclass_and_log_config,
    )
    from omegaconf import OmegaConf

    make_dataclass_and_log_config(OmegaConf.create(config), TrainConfig, TRAIN_CONFIG_KEYS,
                                  transforms="all")


def _trains(name: str) -> bool:
    """A train config, or an MCLI run config that trains from its `parameters`."""
    kind = name.split("/")[0]
    return kind == "train" or (kind == "mcli" and "parameters" in yaml.safe_load(
        (CORPUS / name).read_text()))


@pytest.mark.parametrize("name", sorted(n for n, found in EXPECTED.items()
                                        if not found and _trains(n)))
def test_clean_train_configs_pass_llmfoundrys_loader(name):
    _train_loader_accepts(_resolved(name))


@pytest.mark.parametrize("name", sorted(n for n, found in EXPECTED.items() if not found
                                        and n.startswith("eval/")))
def test_clean_eval_configs_pass_llmfoundrys_eval_loader(name):
    from llmfoundry.command_utils.eval import allow_toplevel_keys
    from llmfoundry.utils.config_utils import (
        EVAL_CONFIG_KEYS,
        EvalConfig,
        make_dataclass_and_log_config,
    )
    from omegaconf import OmegaConf

    # as evaluate() calls it (llmfoundry/command_utils/eval.py)
    _, config = make_dataclass_and_log_config(
        OmegaConf.create(_resolved(name)), EvalConfig, EVAL_CONFIG_KEYS,
        transforms=[allow_toplevel_keys], icl_tasks_required=False)
    assert config.models and all(isinstance(m, dict) for m in config.models)


@pytest.mark.parametrize(("name", "key"), [("train/unknown-top-level.yaml", "precison"),
                                           ("mcli/mcli-typo.yaml", "precison")])
def test_unknown_top_level_keys_are_refused_by_llmfoundry_too(name, key):
    clean = _resolved("train/mpt-125m-te-swap.yaml")
    with pytest.raises(ValueError, match=f"Unused parameters.*{key}"):
        _train_loader_accepts({**clean, key: _resolved(name)[key]})


@pytest.mark.parametrize("name", sorted(n for n, found in EXPECTED.items() if _trains(n)
                                        and any(f[0] == "FP8009" for f in found)))
def test_llmfoundry_refuses_exactly_the_unknown_top_level_keys(name, tmp_path):
    """The file as train_from_yaml reads it (omegaconf, interpolations resolved), completed
    with a clean config's keys where it lacks them (LLM-Foundry's transforms read some before
    its check): the keys in its 'Unused parameters [...]' are our FP8009 keys, no more."""
    from omegaconf import OmegaConf

    text = (CORPUS / name).read_text()
    if name.startswith("mcli/"):
        text = yaml.safe_dump(yaml.safe_load(text)["parameters"])
    own = OmegaConf.to_container(OmegaConf.create(text), resolve=True)
    ours = sorted(f[1].removeprefix("parameters.") for f in EXPECTED[name] if f[0] == "FP8009")
    with pytest.raises(ValueError, match="Unused parameters") as refused:
        _train_loader_accepts({**_resolved("train/mpt-125m-te-swap.yaml"), **own})
    listed = str(refused.value).split("[", 1)[1].split("]", 1)[0]
    assert sorted(k.strip(" '") for k in listed.split(",")) == ours


def test_a_top_level_value_read_by_interpolation_is_told_to_move_under_variables():
    """Before: 'did you mean `max_seq_len`?' for `seq_len`, which the file reads as `${seq_len}`
    (renaming it would break those reads); LLM-Foundry's own refusal says to use `variables`."""
    entry = lint_file(CORPUS / "mcli" / "mcli-legacy-top-level-variables.yaml", 1, BARE)
    found = {f["key"]: f for f in entry["findings"] if f["rule"] == "FP8009"}
    seq = found["parameters.seq_len"]
    assert "did you mean" not in seq["message"] and "reads as `${seq_len}`" in seq["message"]
    assert seq["fix"] == "move `seq_len` under `variables:` and read it as `${variables.seq_len}`"
    # a key the file does not read still gets its spelling hint
    entry = lint_file(CORPUS / "train" / "unknown-top-level.yaml", 1, BARE)
    [typo] = [f["message"] for f in entry["findings"] if f["rule"] == "FP8009"]
    assert "did you mean `precision`?" in typo


def test_eval_config_with_a_train_key_is_refused_by_llmfoundry_too():
    from llmfoundry.utils.config_utils import (
        EVAL_CONFIG_KEYS,
        EvalConfig,
        make_dataclass_and_log_config,
    )
    from omegaconf import OmegaConf

    config = {**_resolved("eval/hf-eval.yaml"), "algorithms": {"te_swap": {}}}
    with pytest.raises(ValueError, match="Unused parameters.*algorithms"):
        make_dataclass_and_log_config(OmegaConf.create(config), EvalConfig, EVAL_CONFIG_KEYS,
                                      icl_tasks_required=False)


@pytest.mark.parametrize(("name", "refused"), [
    ("accelerate/fp8-backend-top-level.yaml", "had unknown keys"),  # FP8111
    ("accelerate/fp8-docs-snippet.yaml", "distributed_type` must be specified"),  # FP8114
    ("accelerate/fp8-single-process.yaml", None),  # loads; FP8113 fails at launch
    ("accelerate/bf16-with-fp8-config.yaml", None),
])
def test_accelerate_configs_against_accelerates_own_loader(name, refused):
    from accelerate.commands.config.config_args import ClusterConfig

    if refused is None:
        ClusterConfig.from_yaml_file(str(CORPUS / name))
    else:
        with pytest.raises(ValueError, match=refused):
            ClusterConfig.from_yaml_file(str(CORPUS / name))


def test_a_string_override_reaches_te_recipe_kwargs_as_characters(monkeypatch):
    """FP8110's reference: Accelerate's launcher exports a string override_linear_precision
    character by character, and TERecipeKwargs then fails reading the flags."""
    import argparse

    from accelerate.utils.environment import parse_flag_from_env
    from accelerate.utils.launch import setup_fp8_env

    fp8_config = yaml.safe_load((CORPUS / "accelerate/fp8-docs-snippet.yaml").read_text())
    value = fp8_config["fp8_config"]["override_linear_precision"]
    env = setup_fp8_env(argparse.Namespace(fp8_override_linear_precision=value), {})
    keys = [f"ACCELERATE_FP8_OVERRIDE_{k}" for k in ("FPROP", "DGRAD", "WGRAD")]
    assert [env[k] for k in keys] == ["(", "f", "a"]
    # TERecipeKwargs.__post_init__ reads FPROP first (it needs TE, absent here: read it alike)
    monkeypatch.setenv(keys[0], env[keys[0]])
    with pytest.raises(ValueError, match="invalid truth value"):
        parse_flag_from_env(keys[0])


def test_accelerate_1_8_puts_booleans_in_the_single_process_env():
    """FP8113's reference: accelerate 1.8.1's setup_fp8_env exports the default override as
    Python booleans, which subprocess refuses as environment values."""
    import argparse
    import subprocess
    import sys

    from accelerate.utils.launch import setup_fp8_env

    env = setup_fp8_env(argparse.Namespace(fp8_override_linear_precision=(False, False, False)),
                        {})
    assert env["ACCELERATE_FP8_OVERRIDE_FPROP"] is False
    with pytest.raises(TypeError):
        subprocess.run([sys.executable, "-c", "pass"], env=env, check=False)
