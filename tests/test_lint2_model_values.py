"""Model values that build and then crash, or never build, which the linter did not name before:
an ffn_act_fn resolve_ffn_act_fn refuses, an explicit head_dim that breaks MPT's fused QKV split
at the first forward, dropouts and embedding_fraction outside MPTConfig's bounds (or NaN),
attention settings that need flash-attn where it is not installed, and an HF MoE override
`num_experts_per_tok` its router cannot use. Each verdict is checked against LLM-Foundry's own
function where that is cheap (resolve_ffn_act_fn, MPTConfig; one tiny MPT for head_dim)."""

from __future__ import annotations

import importlib.util
import math
import warnings
from pathlib import Path
from typing import Any

import pytest

from foundry_fp8.environment import Snapshot
from foundry_fp8.lint.cli import lint_file
from foundry_fp8.lint.known import TORCH_FUNCTIONAL_CALLABLES
from foundry_fp8.lint.rules import LintContext, lint_config

MPT = {"name": "mpt_causal_lm", "d_model": 64, "n_heads": 4, "n_layers": 1, "max_seq_len": 16,
       "vocab_size": 64, "loss_fn": "torch_crossentropy"}


def _found(model: dict[str, Any], rule: str, ctx: LintContext | None = None,
           **extra: Any) -> list[tuple[str, str]]:
    return [(f.key, f.severity) for f in lint_config({"model": model, **extra}, ctx)
            if f.rule == rule]


def _mpt_config(section: dict[str, Any]) -> Exception | None:
    """What LLM-Foundry's MPTConfig raises for a model section (None: it builds)."""
    from llmfoundry.models.mpt import MPTConfig

    kwargs = {k: v for k, v in section.items() if k not in ("name", "loss_fn")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            MPTConfig(**kwargs)
        except Exception as error:  # noqa: BLE001  (any refusal is the verdict)
            return error
    return None


# -- ffn_act_fn ------------------------------------------------------------------------------

def test_torch_functional_names_are_the_installed_torchs():
    import torch.nn.functional as functional

    assert TORCH_FUNCTIONAL_CALLABLES == {n for n in dir(functional) if not n.startswith("_")
                                          and callable(getattr(functional, n))}


@pytest.mark.parametrize("act", [
    {"name": "swiglu"}, {"name": "swish"}, {"name": "gelu_new"}, {"name": "GELU"},
    {"name": "math"}, {"name": "torch"}, {"name": 3}, "gelu", {"approximate": "tanh"},
    {"name": "gelu", "approximate": "tanh"}, {"name": "silu"}, {"name": "quick_gelu"},
    {"name": "relu"}, {"name": "leaky_relu", "negative_slope": 0.1},
])
def test_ffn_act_fn_verdict_is_resolve_ffn_act_fns(act):
    """Before: nothing said; the model build raised ValueError 'Unrecognized activation
    function name (swiglu).' (or KeyError, AttributeError, TypeError) after the tokenizer and
    the loaders."""
    from llmfoundry.models.layers.ffn import resolve_ffn_act_fn

    try:
        resolve_ffn_act_fn(act)
        raises = False
    except (ValueError, KeyError, AttributeError, TypeError):
        raises = True
    for ffn_type in ("mptmlp", "mptglu"):
        found = _found({**MPT, "ffn_config": {"ffn_type": ffn_type, "ffn_act_fn": act}},
                       "FP8042")
        assert bool(found) == raises, (act, found)
        assert all(key.startswith("model.ffn_config.ffn_act_fn") and severity == "error"
                   for key, severity in found)


def test_ffn_act_fn_messages_name_the_equivalent():
    def message(name: str) -> str:
        return next(f for f in lint_config({"model": {**MPT, "ffn_config": {
            "ffn_act_fn": {"name": name}}}}) if f.rule == "FP8042").message

    assert "{name: silu}" in message("swish")
    assert "{name: gelu, approximate: tanh}" in message("gelu_pytorch_tanh")
    assert "ffn_type: mptglu" in message("swiglu")
    assert "did you mean `gelu`?" in message("GELU")
    # te_ln_mlp refuses any ffn_act_fn (FP8004); FP8042 does not say it twice
    assert _found({**MPT, "ffn_config": {"ffn_type": "te_ln_mlp", "ffn_act_fn": {"name": "x"}}},
                  "FP8042") == []


# -- dropouts and embedding_fraction ---------------------------------------------------------

@pytest.mark.parametrize("path", ["resid_pdrop", "emb_pdrop", "attn_config.attn_pdrop",
                                  "embedding_fraction"])
@pytest.mark.parametrize("value", [-0.1, 0, 0.5, 1, 1.5, None, math.inf])
def test_fraction_verdict_is_mpt_configs(path, value):
    """Before: nothing said; MPTConfig raised ValueError ('... are probabilities and must be
    between 0 and 1', 'embedding_fraction must be between 0 (exclusive) and 1 (inclusive)')
    or TypeError (null)."""
    parent, _, leaf = path.rpartition(".")
    section = {**MPT, "attn_config": {"attn_impl": "torch"}}
    (section[parent] if parent else section)[leaf] = value
    refused = _mpt_config(section) is not None
    assert _found(section, "FP8035") == ([(f"model.{path}", "error")] if refused else [])


@pytest.mark.parametrize("path", ["resid_pdrop", "attn_config.attn_pdrop", "embedding_fraction"])
def test_a_nan_fraction_passes_mpt_config_and_is_named(path):
    parent, _, leaf = path.rpartition(".")
    section = {**MPT, "attn_config": {"attn_impl": "torch"}}
    (section[parent] if parent else section)[leaf] = math.nan
    assert _mpt_config(section) is None  # MPTConfig lets it through
    assert _found(section, "FP8035") == [(f"model.{path}", "error")]


# -- head_dim --------------------------------------------------------------------------------

def test_head_dim_verdict_is_the_first_forwards():
    """Before: nothing said; with fused_qkv (MPT's default) a head_dim whose heads are not
    d_model wide builds, and the first forward raises RuntimeError (split_with_sizes);
    unfused it trains. One tiny MPT per case, attn_impl torch, on the CPU."""
    import torch
    from llmfoundry.models.mpt import MPTConfig, MPTForCausalLM

    cases = [(32, True), (32, False), (16, True), (8, True)]
    for head_dim, fused in cases:
        section = {**MPT, "head_dim": head_dim,
                   "attn_config": {"attn_impl": "torch", "fused_qkv": fused}}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = MPTForCausalLM(MPTConfig(**{k: v for k, v in section.items()
                                                if k not in ("name", "loss_fn")}))
        try:
            model(torch.randint(0, 64, (2, 8))).logits.sum().backward()
            raises = False
        except RuntimeError as error:
            raises = "split_with_sizes" in str(error)
        found = _found(section, "FP8035")
        assert found == ([("model.head_dim", "error")] if raises else []), (head_dim, fused)
        assert raises == (fused and head_dim != 16)


# -- flash-attn ------------------------------------------------------------------------------

FLASH_CASES = [
    {"alibi": True}, {"alibi": True, "attn_impl": "flash"}, {"alibi": True, "attn_impl": "torch"},
    {"rope": True}, {"rope": True, "rope_impl": "dail", "attn_impl": "torch"},
    {"rope": True, "rope_impl": "hf"}, {"rope": False, "rope_impl": "dail"},
    {"sliding_window_size": 4}, {"sliding_window_size": 4, "attn_impl": "torch"},
    {"attn_logit_softcapping": 30.0}, {"attn_uses_sequence_id": True},
    {"attn_uses_sequence_id": True, "attn_impl": "torch"},
]


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None,
                    reason="compares with MPTConfig where flash-attn is not installed")
@pytest.mark.parametrize("attn", FLASH_CASES)
def test_flash_attn_verdict_is_mpt_configs_without_flash_attn(attn):
    """Before: nothing said; MPTConfig raised NotImplementedError or ImportError building the
    model. A warning in files (the training machine may have flash-attn), an error in a run."""
    section = {**MPT, "attn_config": attn}
    refused = _mpt_config(section) is not None
    here = Snapshot(python="3.11")
    # in a run, attn_impl flash (MPT's default) without flash-attn fails the first forward too
    forward = attn.get("attn_impl", "flash") == "flash"
    for scope, severity, said in (("file", "warning", refused),
                                  ("run", "error", refused or forward)):
        found = _found(section, "FP8029", LintContext(snapshot=here, scope=scope))
        assert len(found) == said and all(s == severity for _, s in found), (attn, found)


@pytest.mark.parametrize(("installed", "attn", "said"), [
    ("2.4.1", {"alibi": True}, True), ("2.4.2", {"alibi": True}, False),
    ("2.0.0.post1", {"rope": True}, True), ("2.0.1", {"rope": True}, False),
    ("1.0.9", {"rope": True, "rope_impl": "hf"}, False),
    ("2.6.1", {"attn_logit_softcapping": 30.0}, True),
    ("2.7.4.post1", {"attn_logit_softcapping": 30.0}, False),
    ("2.2.0", {"sliding_window_size": 128}, True), ("2.3.0", {"sliding_window_size": 128}, False),
])
def test_flash_attn_versions_as_mpt_reads_them(installed, attn, said):
    snapshot = Snapshot(python="3.11", flash_attn=installed, flash_attn_cross_entropy=True)
    found = _found({**MPT, "attn_config": attn}, "FP8029", LintContext(snapshot=snapshot))
    assert bool(found) == said, found


# -- HF MoE overrides ------------------------------------------------------------------------

@pytest.mark.parametrize(("overrides", "said"), [
    ({"num_experts_per_tok": 0}, True), ({"num_experts_per_tok": -1}, True),
    ({"num_experts_per_tok": 2.0}, True), ({"num_experts_per_tok": None}, True),
    ({"num_experts_per_tok": 9, "num_local_experts": 8}, True),
    ({"num_experts_per_tok": 5, "num_experts": 4}, True),
    ({"num_experts_per_tok": 2}, False), ({"num_experts_per_tok": 8, "num_local_experts": 8}, False),
    ({"num_experts_per_tok": "${oc.env:TOPK}"}, False), ({"num_hidden_layers": 2}, False),
])
def test_hf_moe_top_k_override(overrides, said):
    """transformers 4.51's Mixtral and Qwen-MoE routers take torch.topk(weights,
    num_experts_per_tok) (modeling_mixtral.py:125, modeling_qwen2_moe.py:604): 0 trains with
    every expert unused (no error, no gradient), negative or above the experts RuntimeError,
    a float or null TypeError, at the first forward."""
    model = {"name": "hf_causal_lm", "pretrained_model_name_or_path": "mistralai/Mixtral-8x7B-v0.1",
             "config_overrides": overrides}
    found = _found(model, "FP8046")
    assert found == ([("model.config_overrides.num_experts_per_tok", "error")] if said else [])


# -- where the findings sit ------------------------------------------------------------------

def test_new_findings_sit_on_their_keys_through_interpolation_and_merges(tmp_path: Path):
    text = """\
variables:
  drop: 1.5
  act: swiglu
  hd: 32
  attn: &attn
    attn_impl: torch
    alibi: true
    attn_pdrop: -0.5
max_seq_len: 128
model:
  name: mpt_causal_lm
  d_model: 64
  n_heads: 4
  head_dim: ${variables.hd}
  resid_pdrop: ${variables.drop}
  loss_fn: torch_crossentropy
  attn_config:
    <<: *attn
    attn_impl: flash
  ffn_config:
    ffn_act_fn:
      name: ${variables.act}
"""
    path = tmp_path / "train.yaml"
    path.write_text(text)
    lines = text.splitlines()
    found = {(f["rule"], f["key"], f["line"]) for f in
             lint_file(path, 1, Snapshot(python="3.11"))["findings"]}
    assert found >= {
        ("FP8029", "model.attn_config.alibi", lines.index("    alibi: true") + 1),
        ("FP8035", "model.attn_config.attn_pdrop", lines.index("    attn_pdrop: -0.5") + 1),
        ("FP8035", "model.resid_pdrop", lines.index("  resid_pdrop: ${variables.drop}") + 1),
        ("FP8035", "model.head_dim", lines.index("  head_dim: ${variables.hd}") + 1),
        ("FP8042", "model.ffn_config.ffn_act_fn.name",
         lines.index("      name: ${variables.act}") + 1),
    }, found
