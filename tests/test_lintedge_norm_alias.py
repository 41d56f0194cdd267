"""A norm_type registered in LLM-Foundry's norms registry as an alias of torch's LayerNorm.

te_swap converts and fuses a norm by the class that defines its forward (`filters.te_norm`);
the linter read only LLM-Foundry's own names (`layernorm`, `low_precision_layernorm`), so for
`norms.register("my_ln", func=torch.nn.LayerNorm)` it modelled no LayerNorm: with
`include: norm` and `convert_layernorm`, FP8034 said te_swap would convert nothing, while te_swap
converts every one. Both now read the one table, the linter through the class the registry
holds for the name (registered in the process, or an installed package's entry point).

Reference: the model LLM-Foundry 0.22 builds with the registered norm, and te_swap's plan of it."""

from __future__ import annotations

import textwrap

import catalogue
import pytest
import torch

from foundry_fp8.lint import entries
from foundry_fp8.lint.rules import lint_config
from foundry_fp8.lint.rules.model import mpt_modules, norm_class
from foundry_fp8.lint.rules.ours import _kept
from foundry_fp8.options import SwapConfig
from foundry_fp8.swap import plan_swap

SECTION = {"name": "mpt_causal_lm", "d_model": 64, "n_heads": 4, "n_layers": 2,
           "max_seq_len": 16, "vocab_size": 128, "loss_fn": "torch_crossentropy",
           "attn_config": {"attn_impl": "torch"}}
SWAP = {"backend": "te", "include": "norm", "convert_layernorm": True}


class OwnForwardLN(torch.nn.LayerNorm):
    """A LayerNorm computing another function (TE's would not): te_swap keeps it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 2


class PlainLN(torch.nn.LayerNorm):
    """A LayerNorm subclass that keeps torch's forward: te_swap converts it."""


NORMS = {"lintedge_alias": torch.nn.LayerNorm, "lintedge_rms": torch.nn.RMSNorm,
         "lintedge_own": OwnForwardLN, "lintedge_plain": PlainLN}


@pytest.fixture(scope="module")
def registered():
    from llmfoundry.layers_registry import norms

    for name, cls in NORMS.items():
        norms.register(name, func=cls)
    yield
    for name in NORMS:
        catalogue._remove(("llmfoundry", "norms", name))


def _converted(model: torch.nn.Module, swap: SwapConfig) -> set[str]:
    return {d.name for d in plan_swap(model, swap).decisions
            if d.kind in ("layernorm", "ln_mlp") and d.convert}


def _predicted(section: dict, swap: SwapConfig) -> set[str]:
    return {m.name for m in mpt_modules(section) or ()
            if m.kind in ("layernorm", "ln_mlp") and _kept(m, swap, section["n_layers"]) is None}


@pytest.mark.parametrize("norm_type", [*NORMS, "layernorm", "low_precision_rmsnorm"])
@pytest.mark.parametrize("swap", [{"convert_layernorm": True}, {"fuse_ln_mlp": True}], ids=str)
def test_the_linters_norms_are_te_swaps(registered, norm_type, swap):
    from llmfoundry.models.mpt import ComposerMPTCausalLM

    section = {**SECTION, "norm_type": norm_type}
    torch.manual_seed(0)
    model = ComposerMPTCausalLM(tokenizer=None, init_device="cpu",
                                **{k: v for k, v in section.items() if k != "name"})
    config = SwapConfig(backend="te", **swap)
    converted = _converted(model, config)
    assert bool(converted) is (norm_type in ("lintedge_alias", "lintedge_plain", "layernorm")
                               or ("fuse_ln_mlp" in swap and "rms" in norm_type))
    assert _predicted(section, config) == converted


def test_fp8034_says_nothing_where_te_swap_converts_the_aliased_norms(registered):
    config = {"precision": "amp_fp8", "model": {**SECTION, "norm_type": "lintedge_alias"},
              "algorithms": {"te_swap": SWAP}}
    assert [f for f in lint_config(config) if f.rule == "FP8034"] == []
    config["model"]["norm_type"] = "lintedge_own"
    assert [f.key for f in lint_config(config) if f.rule == "FP8034"] == [
        "algorithms.te_swap.include"]


def test_an_entry_point_alias_is_read_from_package_metadata(tmp_path, monkeypatch):
    """A plugin's `llmfoundry_norms` entry point naming torch's class through torch.nn (as
    LLM-Foundry's registry would load it, without importing here)."""
    info = tmp_path / "lintedge_norms-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: lintedge-norms\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(textwrap.dedent("""\
        [llmfoundry_norms]
        lintedge_ep = torch.nn:LayerNorm
        lintedge_ep_rms = torch.nn.modules.normalization:RMSNorm
        lintedge_pkg = somepkg.norms:MyNorm
        """))
    monkeypatch.syspath_prepend(str(tmp_path))
    for cached in (entries._entry_points, entries.entry_point_value, entries.entry_point_names):
        cached.cache_clear()
    try:
        assert norm_class("LINTEDGE_EP") == ("torch.nn.modules.normalization", "LayerNorm")
        assert norm_class("lintedge_ep_rms") == ("torch.nn.modules.normalization", "RMSNorm")
        assert norm_class("lintedge_pkg") == ("somepkg.norms", "MyNorm")
        config = {"precision": "amp_fp8", "model": {**SECTION, "norm_type": "lintedge_ep"},
                  "algorithms": {"te_swap": SWAP}}
        assert [f for f in lint_config(config) if f.rule == "FP8034"] == []
    finally:
        for cached in (entries._entry_points, entries.entry_point_value,
                       entries.entry_point_names):
            cached.cache_clear()


@pytest.mark.parametrize("norm_type", ["layer_norm", "LayerNorm", "RMSNorm", "rms_norm",
                                       "Low_Precision_LayerNorm"])
def test_a_norm_type_no_registry_holds_is_the_error_mpt_raises(norm_type):
    from llmfoundry.models.mpt import ComposerMPTCausalLM

    section = {**SECTION, "norm_type": norm_type}
    try:
        ComposerMPTCausalLM(tokenizer=None, init_device="meta",
                            **{k: v for k, v in section.items() if k != "name"})
        raises = False
    except NotImplementedError as error:
        raises = "Requested norm type" in str(error)
    found = [(f.key, f.severity) for f in lint_config({"model": section}) if f.rule == "FP8042"]
    assert found == ([("model.norm_type", "error")] if raises else [])
    with_code = [(f.key, f.severity) for f in lint_config({"model": section, "code_paths": ["r.py"]})
                 if f.rule == "FP8042"]
    assert with_code == ([("model.norm_type", "warning")] if raises else [])
