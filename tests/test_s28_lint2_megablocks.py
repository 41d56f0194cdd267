"""FP8029: megablocks' FFNs (`ffn_type: mb_moe` / `mb_dmoe`, LLM-Foundry's MoE YAMLs) where
megablocks is not installed. LLM-Foundry registers them only where `import megablocks` succeeds,
so building the model raises RegistryError after the tokenizer and the loaders; before, the
linter only asked for `moe_world_size` (FP8042) and, once given, said nothing."""

from __future__ import annotations

from typing import Any

import pytest

from foundry_fp8.environment import Snapshot
from foundry_fp8.lint.registry import LintContext
from foundry_fp8.lint.rules import lint_config
from foundry_fp8.lint.rules import model as model_rules

MPT: dict[str, Any] = {
    "name": "mpt_causal_lm",
    "d_model": 64,
    "n_heads": 4,
    "n_layers": 1,
    "max_seq_len": 16,
    "vocab_size": 64,
    "loss_fn": "torch_crossentropy",
    "attn_config": {"attn_impl": "torch"},
}

needs_no_megablocks = pytest.mark.skipif(
    model_rules.megablocks_importable(), reason="megablocks is installed here"
)


def _ffn(ffn_type: str) -> dict[str, Any]:
    moe = {"moe_num_experts": 4, "moe_top_k": 2, "moe_world_size": 1}
    return {"ffn_type": ffn_type, **(moe if ffn_type.startswith("mb_") else {})}


def _hits(ffn_type: str, scope: str) -> list[tuple[str, str, str]]:
    snapshot = Snapshot(python="3.11", flash_attn="2.7.4", flash_attn_cross_entropy=True)
    context = LintContext(scope=scope, snapshot=snapshot)  # type: ignore[arg-type]
    config = {"model": {**MPT, "ffn_config": _ffn(ffn_type)}}
    return [(f.rule, f.key, f.severity) for f in lint_config(config, context)
            if f.severity != "info"]


@needs_no_megablocks
@pytest.mark.parametrize("ffn_type", ["mb_moe", "mb_dmoe"])
def test_llmfoundry_refuses_and_the_linter_says_so(ffn_type):
    """The installed LLM-Foundry builds no MPT with megablocks' FFN here (RegistryError naming
    the `ffns` registry); the linter's one finding is at ffn_type: an error in a run (the
    training machine), a warning in files, naming the install of setup.py's extra."""
    from catalogue import RegistryError
    from llmfoundry.models.mpt import MPTConfig, MPTForCausalLM

    with pytest.raises(RegistryError, match=f"'{ffn_type}'.*Available names: mptglu, mptmlp, "
                       "torch_dmoe"):
        MPTForCausalLM(MPTConfig(**{k: v for k, v in MPT.items() if k != "name"},
                                 ffn_config=_ffn(ffn_type)))
    assert _hits(ffn_type, "run") == [("FP8029", "model.ffn_config.ffn_type", "error")]
    assert _hits(ffn_type, "file") == [("FP8029", "model.ffn_config.ffn_type", "warning")]
    snapshot = Snapshot(python="3.11", flash_attn="2.7.4", flash_attn_cross_entropy=True)
    [finding] = [f for f in lint_config({"model": {**MPT, "ffn_config": _ffn(ffn_type)}},
                                        LintContext(scope="run", snapshot=snapshot))
                 if f.rule == "FP8029"]
    assert "pip install 'megablocks<1.0' grouped-gemm==0.3.0" in finding.fix


def test_installed_megablocks_is_quiet(monkeypatch):
    monkeypatch.setattr(model_rules, "megablocks_importable", lambda: True)
    assert _hits("mb_moe", "run") == []


@needs_no_megablocks
def test_other_ffns_are_quiet():
    assert _hits("mptglu", "run") == []
    assert _hits("mb_moe", "file")  # the same config with megablocks' FFN is judged


#: The model of LLM-Foundry's own MoE YAML (scripts/train/yamls/pretrain/testing-moe.yaml).
TESTING_MOE = {
    "name": "mpt_causal_lm", "init_device": "meta", "d_model": 128, "n_heads": 2,
    "n_layers": 2, "expansion_ratio": 1, "max_seq_len": 128, "vocab_size": 50368,
    "attn_config": {"attn_impl": "torch"}, "loss_fn": "torch_crossentropy",
    "ffn_config": {"ffn_type": "mb_dmoe", "memory_optimized_mlp": True, "mlp_impl": "grouped",
                   "moe_lbl_in_fp32": False, "moe_loss_weight": 0.01, "moe_num_experts": 4,
                   "moe_top_k": 2, "moe_world_size": 1, "uniform_expert_assignment": False},
}


@needs_no_megablocks
def test_fp8_lint_in_a_run_names_it(caplog):
    """fp8_lint, built with LLM-Foundry's MoE YAML's model before the tokenizer, loaders and
    model: FP8029 is one of its errors (`fail_on: never` so the TE-less machine's own errors
    do not stop the test)."""
    from foundry_fp8.composer.lint import FP8Lint

    callback = FP8Lint({"model": TESTING_MOE, "precision": "amp_bf16"}, fail_on="never")
    assert [(f.key, f.severity) for f in callback.findings if f.rule == "FP8029"] == [
        ("model.ffn_config.ffn_type", "error")]
    assert "FP8029 model.ffn_config.ffn_type: ffn_type mb_dmoe is megablocks' MoE" in caplog.text


def _expert_parallel(config: dict[str, Any], gpus: int | None) -> list[tuple[str, str]]:
    model = {**MPT, "ffn_config": {**_ffn("mb_moe"), "moe_world_size": 2}}
    context = LintContext(gpus=gpus, gpus_said=f"--gpus {gpus}")
    return [(f.rule, f.key) for f in lint_config({**config, "model": model}, context)
            if f.severity == "error"]


def test_expert_parallelism_without_use_orig_params(monkeypatch):
    """LLM-Foundry's own validate_config (with mb_moe registered, as megablocks' import does)
    refuses moe_world_size 2 with use_orig_params false, and accepts it with true."""
    import catalogue
    from llmfoundry.command_utils.train import validate_config
    from llmfoundry.layers_registry import ffns_with_megablocks
    from llmfoundry.utils.config_utils import TrainConfig

    key = (*ffns_with_megablocks.namespace, "mb_moe")
    monkeypatch.setitem(catalogue.REGISTRY, key, lambda **kwargs: None)
    refused = {"fsdp_config": {"use_orig_params": False}}
    for fsdp, raises in ((refused, True), ({"fsdp_config": {"use_orig_params": True}}, False)):
        config = TrainConfig(model={"name": "mpt_causal_lm", "ffn_config": {
            "ffn_type": "mb_moe", "moe_world_size": 2}}, train_loader={"name": "text"},
            optimizer={}, scheduler={}, tokenizer={}, max_duration="1ba", max_seq_len=16,
            global_train_batch_size=2, **fsdp)
        if raises:
            with pytest.raises(ValueError, match="require `use_orig_params=True`"):
                validate_config(config)
        else:
            validate_config(config)
    assert _expert_parallel(refused, None) == [("FP8042", "fsdp_config.use_orig_params")]
    assert _expert_parallel({"fsdp_config": {"use_orig_params": True}}, None) == []


@pytest.mark.parametrize(("gpus", "refused"), [(1, True), (3, True), (2, False), (8, False)])
def test_expert_parallelism_world_size(monkeypatch, tmp_path, gpus, refused):
    """LLM-Foundry's config_megablocks_moe_args (megablocks' module stood in for: the check
    comes before it is used) refuses moe_world_size 2 in one process; the linter, told the GPU
    count, refuses what does not divide it."""
    import sys
    import types

    from llmfoundry.models.utils.config_moe_args import config_megablocks_moe_args

    if gpus == 1:
        import torch.distributed as torch_dist

        monkeypatch.setitem(sys.modules, "megablocks", types.ModuleType("megablocks"))
        # as Composer's, one process (an earlier test in this process may have left its own)
        ours = not torch_dist.is_initialized()
        if ours:
            torch_dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous",
                                          rank=0, world_size=1)
        assert torch_dist.get_world_size() == 1
        try:
            with pytest.raises(ValueError, match="Invalid world size configuration: "
                               "world_size=1 and moe_world_size=2"):
                config_megablocks_moe_args({"ffn_type": "mb_moe", "fc_type": "torch",
                                            "moe_world_size": 2}, 64, 4, 1, lambda **k: None)
        finally:
            if ours:
                torch_dist.destroy_process_group()
    found = _expert_parallel({}, gpus)
    assert found == ([("FP8042", "model.ffn_config.moe_world_size")] if refused else [])
    if refused:
        [message] = [f.message for f in lint_config(
            {"model": {**MPT, "ffn_config": {**_ffn("mb_moe"), "moe_world_size": 2}}},
            LintContext(gpus=gpus, gpus_said=f"--gpus {gpus}")) if f.rule == "FP8042"]
        assert f"world_size={gpus} and moe_world_size=2" in message
