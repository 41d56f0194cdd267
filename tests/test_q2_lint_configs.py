"""QA s22 (Q2), configs in the shapes users write: an MPT with grouped-query attention whose
kv_n_heads does not fit n_heads (built by LLM-Foundry's own MPT), and an Accelerate DeepSpeed
config whose `amax_compute_algo: max` is what TE runs anyway (read by Accelerate's own
launcher and apply_fp8_autowrap)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest

from foundry_fp8.lint.cli import lint_file
from tests.mpt_yaml import line_of, mpt_refuses, mpt_train


def _gqa(n_heads: int, kv: int) -> tuple[str, dict[str, Any]]:
    """An FP8 train YAML with grouped-query attention, and its attn_config."""
    attn = {"attn_type": "grouped_query_attention", "kv_n_heads": kv}
    return mpt_train(attn, n_heads=n_heads, fc_type="te", precision="amp_fp8"), attn


@pytest.mark.parametrize(("n_heads", "kv", "said"), [
    (16, 3, "n_heads must be divisible by kv_n_heads"),  # before: no finding
    (8, 16, "less than or equal to Q heads"),  # before: no finding
    (16, 4, None),
    (16, 16, None),
])
def test_gqa_kv_n_heads_that_mpt_refuses_is_fp8035(tmp_path, n_heads, kv, said):
    path = tmp_path / "mpt.yaml"
    text, attn = _gqa(n_heads, kv)
    path.write_text(text)
    refused = mpt_refuses(attn, n_heads)
    assert (refused is None) == (said is None), refused
    entry = lint_file(path)
    assert entry["error"] is None, entry["error"]
    hits = [f for f in entry["findings"] if f["key"] == "model.attn_config.kv_n_heads"]
    if said is None:
        assert hits == []
        return
    assert said in str(refused)
    assert [(f["rule"], f["severity"], f["line"]) for f in hits] == [("FP8035", "error",
                                                                 line_of(text, "kv_n_heads:"))]
    assert said in hits[0]["message"] and f"kv_n_heads {kv} with n_heads {n_heads}" in \
        hits[0]["message"]


ACC_DS = """\
compute_environment: LOCAL_MACHINE
deepspeed_config:
  gradient_accumulation_steps: 1
  zero_stage: 2
distributed_type: DEEPSPEED
mixed_precision: fp8
fp8_config:
  backend: TE
  fp8_format: HYBRID
{recipe}num_machines: 1
num_processes: 8
"""


def _asked_and_run(monkeypatch, fake_te, path: Path) -> tuple[dict[str, Any], Any]:
    """The recipe values the file asks for, as the installed launcher exports them
    (ACCELERATE_FP8_*), and the DelayedScaling TE gets under DeepSpeed: Accelerate's own
    apply_fp8_autowrap with the handler `_prepare_deepspeed` passes (`self.fp8_recipe_handler`,
    None without FP8RecipeKwargs in the code)."""
    import torch
    from accelerate.commands import launch
    from accelerate.utils import transformer_engine as acc_te
    from accelerate.utils.launch import setup_fp8_env

    args = launch.launch_command_parser().parse_args(["--config_file", str(path), "train.py"])
    args, _defaults, _mp = launch._validate_launch_command(args)
    env = setup_fp8_env(args, {})
    asked = {"amax_compute_algo": env["ACCELERATE_FP8_AMAX_COMPUTE_ALGO"].lower(),
             "amax_history_len": int(env["ACCELERATE_FP8_AMAX_HISTORY_LEN"])}
    fake_te("2.8.0")
    seen: list[Any] = []
    monkeypatch.setattr(acc_te, "is_transformer_engine_available", lambda: True)
    monkeypatch.setattr(acc_te, "contextual_fp8_autocast",
                        lambda forward, recipe, _eval: seen.append(recipe) or forward)
    acc_te.apply_fp8_autowrap(torch.nn.Linear(2, 2), None)
    return asked, seen[0]


@pytest.mark.parametrize(("recipe", "lost"), [
    ("  amax_compute_algo: max\n", []),  # before: FP8104 named amax_compute_algo
    ("  amax_compute_algo: MAX\n", []),
    ("  amax_compute_algo: max\n  amax_history_len: 16\n", ["amax_history_len"]),
])
def test_fp8104_names_only_what_te_does_not_run_under_deepspeed(tmp_path, monkeypatch, fake_te,
                                                                recipe, lost):
    path = tmp_path / "accelerate.yaml"
    path.write_text(ACC_DS.format(recipe=recipe))
    asked, ran = _asked_and_run(monkeypatch, fake_te, path)
    assert [k for k, v in asked.items() if getattr(ran, k) != v] == lost
    entry = lint_file(path)
    assert entry["error"] is None, entry["error"]
    hits = [f["message"] for f in entry["findings"] if f["rule"] == "FP8104"]
    assert len(hits) == (1 if lost else 0), hits
    if lost:
        assert f"this config's {', '.join(lost)} never reach TE" in hits[0]


EVAL = """\
max_seq_len: 128
seed: 1
precision: amp_bf16
models:
- model_name: mpt_test
  model:
    name: mpt_causal_lm
    init_device: meta
    d_model: 256
    n_heads: {n_heads}
    n_layers: 2
    expansion_ratio: {ratio}
    max_seq_len: ${{max_seq_len}}
    vocab_size: 50368
    attn_config:
      attn_impl: torch
  tokenizer:
    name: EleutherAI/gpt-neox-20b
device_eval_batch_size: 4
icl_tasks:
- label: jeopardy
  dataset_uri: eval/local_data/jeopardy_all.jsonl
  num_fewshot: [10]
  icl_task_type: language_modeling
"""


@pytest.mark.parametrize(("n_heads", "ratio", "key", "said"), [
    (3, 4, "n_heads", "d_model must be divisible by n_heads"),  # before: no finding
    (4, 2.67, "expansion_ratio", "must be an integer"),  # before: no finding
    (4, 4, None, None),
])
def test_eval_model_values_mpt_refuses_are_fp8311(tmp_path, n_heads, ratio, key, said):
    """An eval config's MPT is built as a train config's (evaluate_model's
    build_composer_model): LLM-Foundry's eval loader takes the file, MPT refuses the model."""
    from llmfoundry.models.mpt import MPTConfig, MPTForCausalLM
    from omegaconf import OmegaConf

    from tests.foundry_train import eval_refusal

    path = tmp_path / "eval.yaml"
    path.write_text(EVAL.format(n_heads=n_heads, ratio=ratio))
    assert eval_refusal(path) is None
    section = OmegaConf.to_container(OmegaConf.load(path), resolve=True)["models"][0]["model"]
    section.pop("name")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            MPTForCausalLM(MPTConfig(**section))
        refused = None
    except ValueError as e:
        refused = str(e)
    entry = lint_file(path)
    assert entry["error"] is None, entry["error"]
    hits = [(f["key"], f["severity"]) for f in entry["findings"] if f["rule"] == "FP8311"]
    if said is None:
        assert refused is None and hits == []
        return
    assert refused is not None and said in refused
    assert hits == [(f"models.0.model.{key}", "error")]
