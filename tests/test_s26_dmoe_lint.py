"""The linter on an MPT whose FFN is LLM-Foundry's `torch_dmoe`.

FP8042: build_torch_dmoe reads six ffn_config keys with no default (KeyError building the
model when one is missing) and refuses any other key (ValueError); the linter said 0 errors.
FP8034: the linter did not model the dMoE block, so te_swap options that convert nothing on it
(`include: ffn`: its router is always kept and its experts are weight tensors) went unsaid
until te_swap refused the run at INIT.

Reference: LLM-Foundry 0.22 building the model (its own errors), the source of its builder, and
te_swap's plan (`plan_swap`, `convert_to_fp8`) on the model LLM-Foundry builds."""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

from foundry_fp8.lint.known import TORCH_DMOE_REQUIRED_KEYS
from foundry_fp8.lint.rules import lint_config
from foundry_fp8.lint.rules.model import mpt_modules
from foundry_fp8.lint.rules.ours import _kept
from foundry_fp8.options import SwapConfig
from foundry_fp8.swap import convert_to_fp8, plan_swap

REPO = Path(__file__).resolve().parents[1]
#: A torch_dmoe FFN as LLM-Foundry's tests give it (16 experts: the router's 64x16 weight
#: passes TE's shape rule, so only the MoE rule keeps it).
DMOE = {"ffn_type": "torch_dmoe", "moe_num_experts": 16, "moe_top_k": 2, "mlp_type": "mlp",
        "moe_jitter_eps": None, "moe_normalize_expert_weights": None,
        "uniform_expert_assignment": False}
SECTION = {"name": "mpt_causal_lm", "d_model": 64, "n_heads": 4, "n_layers": 3,
           "max_seq_len": 16, "vocab_size": 128, "loss_fn": "torch_crossentropy",
           "attn_config": {"attn_impl": "torch"}}


def _section(**edit: object) -> dict:
    ffn = edit.pop("ffn_config", DMOE)
    return {**SECTION, **edit, "ffn_config": dict(ffn)}  # MPTConfig writes into ffn_config


def _build(section: dict, device: str = "meta") -> torch.nn.Module:
    """Composer's model as LLM-Foundry's train builds it (build_composer_model)."""
    from llmfoundry.models.mpt import ComposerMPTCausalLM

    torch.manual_seed(0)
    kwargs = {k: v for k, v in section.items() if k != "name"}
    return ComposerMPTCausalLM(tokenizer=None, init_device=device, **kwargs)


def _hits(config: dict, rule: str) -> list[tuple[str, str]]:
    return [(f.key, f.severity) for f in lint_config(config) if f.rule == rule]


# -- FP8042: the keys torch_dmoe needs and refuses --------------------------------------------

def test_the_required_keys_are_those_build_torch_dmoe_pops_with_no_default():
    from llmfoundry.models.layers.ffn import build_torch_dmoe

    tree = ast.parse(textwrap.dedent(inspect.getsource(build_torch_dmoe)))
    pops = [c.args[0].value for c in ast.walk(tree) if isinstance(c, ast.Call)
            and isinstance(c.func, ast.Attribute) and c.func.attr == "pop"
            and isinstance(c.func.value, ast.Name) and c.func.value.id == "kwargs"
            and len(c.args) == 1]
    assert sorted(pops) == sorted(TORCH_DMOE_REQUIRED_KEYS)


@pytest.mark.parametrize("key", TORCH_DMOE_REQUIRED_KEYS)
def test_a_missing_torch_dmoe_key_is_the_keyerror_llmfoundry_raises(key):
    section = _section(ffn_config={k: v for k, v in DMOE.items() if k != key})
    with pytest.raises(KeyError, match=key):
        _build(section)
    assert _hits({"model": section}, "FP8042") == [(f"model.ffn_config.{key}", "error")]


@pytest.mark.parametrize(("extra", "key", "error"), [
    ({"moe_topk": 2}, "moe_topk", "Invalid arguments to torch dmoe"),
    ({"moe_world_size": 1}, "moe_world_size", "Invalid arguments to torch dmoe"),  # megablocks'
    ({"mlp_type": "swiglu"}, "mlp_type", "unknown mlp_type"),
])
def test_a_key_or_mlp_type_torch_dmoe_refuses_is_the_valueerror_llmfoundry_raises(extra, key,
                                                                                     error):
    section = _section(ffn_config={**DMOE, **extra})
    with pytest.raises(ValueError, match=error):
        _build(section)
    assert _hits({"model": section}, "FP8042") == [(f"model.ffn_config.{key}", "error")]


def test_a_complete_torch_dmoe_builds_and_is_quiet():
    section = _section(ffn_config={**DMOE, "ffn_hidden_size": 96, "ffn_act_fn": {"name": "silu"},
                                   "mlp_type": "glu", "bias": False})
    _build(section)
    assert _hits({"model": section}, "FP8042") == []


def test_megablocks_moe_world_size(monkeypatch):
    """mb_moe/mb_dmoe: LLM-Foundry's config_moe_args reads moe_world_size with no default.
    megablocks is not installed here: an empty module stands in for its import only, and
    LLM-Foundry's own function raises before it reads megablocks."""
    from llmfoundry.models.utils.config_moe_args import config_megablocks_moe_args

    monkeypatch.setitem(sys.modules, "megablocks", types.ModuleType("megablocks"))
    for ffn_type in ("mb_moe", "mb_dmoe"):
        with pytest.raises(KeyError, match="moe_world_size"):
            config_megablocks_moe_args({"ffn_type": ffn_type, "fc_type": {"name": "torch"}},
                                       d_model=64, expansion_ratio=4, n_layers=2,
                                       get_device_mesh=lambda **_: None)
        model = {**SECTION, "ffn_config": {"ffn_type": ffn_type}}
        assert ("model.ffn_config.moe_world_size", "error") in _hits({"model": model}, "FP8042")
        model["ffn_config"]["moe_world_size"] = 1
        assert ("model.ffn_config.moe_world_size", "error") not in _hits({"model": model},
                                                                          "FP8042")


def test_the_cli_names_file_line_and_key(tmp_path):
    path = tmp_path / "dmoe.yaml"
    path.write_text(textwrap.dedent("""\
        model:
          name: mpt_causal_lm
          d_model: 64
          n_heads: 4
          n_layers: 2
          ffn_config:
            ffn_type: torch_dmoe
            moe_num_experts: 4
            moe_top_k: 2
            mlp_type: mlp
        """))
    run = subprocess.run([sys.executable, "-m", "foundry_fp8", "lint", str(path)],
                         capture_output=True, text=True, cwd=REPO, timeout=300)
    assert run.returncode != 0 and "Traceback" not in run.stdout + run.stderr
    assert run.stdout.splitlines()[0] == str(path)
    lines = [line.split() for line in run.stdout.splitlines() if "FP8042" in line]
    assert [line[:4] for line in lines] == [  # at ffn_config's line, the keys it lacks
        ["6:3", "error", "FP8042", f"model.ffn_config.{key}"]
        for key in TORCH_DMOE_REQUIRED_KEYS[3:]]


# -- FP8034: the linter's dMoE block is te_swap's plan -----------------------------------------

@pytest.fixture(scope="module")
def built() -> dict[str, torch.nn.Module]:
    """The models LLM-Foundry builds (initialised: te_swap declines LayerNorms on meta)."""
    return {name: _build(section, "cpu") for name, section in SECTIONS.items()}


SECTIONS = {
    "dmoe": _section(),
    "glu, 4 experts, untied": _section(  # router 64x4: te_swap's shape rule keeps it first
        ffn_config={**DMOE, "moe_num_experts": 4, "mlp_type": "glu"},
        tie_word_embeddings=False),
}
SWAP_CASES = [
    ({}, "dmoe"), ({"include": "nomatch_xyz"}, "dmoe"), ({"include": "ffn"}, "dmoe"),
    ({"include": "router"}, "dmoe"), ({"include": "experts"}, "dmoe"),
    ({"exclude": "attn"}, "dmoe"), ({"keep_first_blocks": 2}, "dmoe"),
    ({"include": "norm", "convert_layernorm": True}, "dmoe"),
    ({"include": "ffn$", "fuse_ln_mlp": True}, "dmoe"),
    ({"min_gemm_size": 64 * 192 + 1}, "dmoe"),
    ({"exclude": "attn"}, "glu, 4 experts, untied"),
    ({"include": "lm_head", "keep_lm_head": False}, "glu, 4 experts, untied"),
]


@pytest.mark.parametrize(("options", "name"), SWAP_CASES)
def test_the_linters_dmoe_modules_and_decisions_are_plan_swaps(built, options, name):
    section, config = SECTIONS[name], SwapConfig(**options)
    plan = plan_swap(built[name], config)
    kinds = {"linear", "moe_experts"} | ({"layernorm"} if config.convert_layernorm else set())
    planned = {d.name: d.convert for d in plan.decisions if d.kind in kinds}
    modules = [m for m in mpt_modules(section) if m.kind in kinds]
    static = {m.name: _kept(m, config, section["n_layers"]) is None for m in modules}
    assert static == planned
    reasons = {d.name: d.reason for d in plan.decisions}
    for m in modules:  # the MoE's words are te_swap's where its rule is the one that keeps
        if _kept(m, config, section["n_layers"]) == m.kept is not None:
            assert reasons[m.name].startswith(m.kept)
    assert any(n.endswith("ffn.router.layer") for n in static)


@pytest.mark.parametrize("include", ["nomatch_xyz", "ffn"])
def test_te_swap_refuses_what_fp8034_says_it_refuses(include):
    config = {"precision": "amp_fp8", "model": SECTIONS["dmoe"],
              "algorithms": {"te_swap": {"backend": "emulate", "include": include}}}
    assert _hits(config, "FP8034") == [("algorithms.te_swap.include", "error")]
    with pytest.raises(Exception, match="no module would run in FP8"):
        convert_to_fp8(_build(SECTIONS["dmoe"], "cpu"), SwapConfig(backend="emulate",
                                                                   include=include))
    config["algorithms"]["te_swap"]["include"] = "attn"
    assert _hits(config, "FP8034") == []


def test_a_torch_dmoe_key_at_the_models_top_level_is_moved_under_ffn_config():
    found = [f for f in lint_config({"model": {**SECTION, "moe_top_k": 2}}) if f.rule == "FP8024"]
    assert [(f.key, f.fix) for f in found] == [
        ("model.moe_top_k", "move `moe_top_k` under `model.ffn_config:`")]


@pytest.mark.parametrize("edit", [{"fc_type": "te"}, {}])
def test_a_dmoe_ffn_hidden_size_off_tes_rule_is_no_gemm_dim_error(edit):
    """The experts are weight tensors whatever fc_type says (build_torch_dmoe drops it; the
    plan above keeps them as one moe_experts row): before, fc_type te made FP8005 an error."""
    config = {"precision": "amp_fp8", "model": {**_section(expansion_ratio=1.125), **edit}}
    if not edit:
        config["algorithms"] = {"te_swap": {}}
    assert _hits(config, "FP8005") == []
    dense = {**config, "model": {**SECTION, "expansion_ratio": 1.125, **edit}}  # 72 wide
    assert _hits(dense, "FP8005") == [("model.expansion_ratio", "error" if edit else "warning")]


@pytest.mark.parametrize("layers", ["experts", "router", "ffn"])
def test_fp8_stats_layers_on_a_dmoe_are_those_fp8_stats_selects(built, layers):
    """FP8048: fp8_stats watches the router (a torch Linear), never the experts' tensors."""
    from foundry_fp8.lint.values import built_options
    from foundry_fp8.monitor import select_layers

    selected = select_layers(built["dmoe"], built_options("fp8_stats", {"layers": layers}).monitor)
    config = {"model": SECTIONS["dmoe"], "callbacks": {"fp8_stats": {"layers": layers}}}
    assert bool(_hits(config, "FP8048")) is not bool(selected), (selected, layers)


@pytest.mark.parametrize(("top_k", "crashes"), [(5, True), (4, False)])
def test_moe_top_k_above_the_experts_is_the_first_forwards_error(top_k, crashes):
    section = _section(ffn_config={**DMOE, "moe_num_experts": 4, "moe_top_k": top_k})
    model = _build(section, "cpu").model
    ids = torch.randint(0, SECTION["vocab_size"], (1, 8))
    if crashes:
        with pytest.raises(RuntimeError, match="selected index k out of range"):
            model(ids)
    else:
        model(ids)
    assert _hits({"model": section}, "FP8042") == (
        [("model.ffn_config.moe_top_k", "error")] if crashes else [])
