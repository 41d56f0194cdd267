"""The `fp8_lint` callback: config rules on LLM-Foundry's logged config (key paths, no lines),
and the model check once te_swap has converted the model.

Composer refuses `amp_fp8` on CPU when the Trainer is built (composer/core/precision.py,
`_validate_precision`), so the model check is called here with a minimal state object holding
a real tiny LLM-Foundry MPT, before and after te_swap's emulated conversion.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from types import SimpleNamespace

import pytest
from composer.core import Event, Precision

from foundry_fp8.composer.lint import FP8Lint
from foundry_fp8.environment import Snapshot
from foundry_fp8.swap import SwapConfig, apply_swap, fp8_module_counts, plan_swap


def _tiny_mpt():
    from llmfoundry.models.mpt import MPTConfig, MPTForCausalLM

    config = MPTConfig(d_model=64, n_heads=4, n_layers=2, expansion_ratio=2, max_seq_len=32,
                       vocab_size=128, attn_config={"attn_impl": "torch"})
    return MPTForCausalLM(config)


def _state(precision: Precision, model) -> SimpleNamespace:
    return SimpleNamespace(precision=precision, model=model)


def test_config_errors_stop_the_run_at_construction():
    with pytest.raises(ValueError, match="FP8001 precision"):
        FP8Lint(train_config={"precision": "amp_fp8", "model": {}})
    lint = FP8Lint(train_config={"precision": "amp_fp8"}, fail_on="never")
    assert [f.rule for f in lint.findings] == ["FP8001"]


def test_logged_config_extras_are_not_unknown_keys():
    # LLM-Foundry's logged config carries flattened metadata keys and more: no FP8009 there
    lint = FP8Lint(train_config={"precision": "amp_bf16", "my_metadata": 1, "merge": True,
                                 "n_params": 10})
    assert lint.findings == []


def test_amp_fp8_model_without_fp8_modules_fails_after_te_swap_had_its_chance(caplog,
                                                                               monkeypatch):
    import foundry_fp8.composer.lint as lint_module

    # an H100 with TE, where amp_fp8 with the emulated backend is allowed (FP8028 a warning)
    h100 = Snapshot(python="3", capability=(9, 0), te="2.8.0")
    monkeypatch.setattr(lint_module, "gather_snapshot", lambda probe_te_import: h100)
    model = _tiny_mpt()
    # a config that passes (te_swap will convert), whose model has no FP8 module yet
    lint = FP8Lint(train_config={"precision": "amp_fp8",
                                 "algorithms": {"te_swap": {"backend": "emulate"}},
                                 "callbacks": {"fp8_state": {}}})
    assert [(f.rule, f.severity) for f in lint.findings] == [("FP8028", "warning")]
    with pytest.raises(ValueError, match="no FP8 module"):
        lint.run_event(Event.BEFORE_LOAD, _state(Precision.AMP_FP8, model), logger=None)

    lenient = FP8Lint(train_config={}, fail_on="never")
    with caplog.at_level(logging.WARNING, logger="foundry_fp8.composer.lint"):
        lenient.run_event(Event.BEFORE_LOAD, _state(Precision.AMP_FP8, model), logger=None)
    assert "no FP8 module" in caplog.text
    lenient.run_event(Event.BEFORE_LOAD, _state(Precision.AMP_BF16, model), logger=None)  # not amp_fp8: nothing to say

    converted = apply_swap(model, plan_swap(model, SwapConfig(backend="emulate")))
    assert converted > 0 and fp8_module_counts(model) == (0, converted)
    lint.run_event(Event.BEFORE_LOAD, _state(Precision.AMP_FP8, model), logger=None)  # now it would run FP8: no error


@pytest.mark.parametrize(("fail_on", "snippet"), [
    ("warn", "must be one of 'error', 'never', got 'warn' (fix: use one of"),
    (None, "takes str, got null"), (False, "takes str, got bool False"),
])
def test_bad_fail_on_is_refused(fail_on, snippet):
    with pytest.raises(ValueError) as error:
        FP8Lint(train_config={}, fail_on=fail_on)
    assert str(error.value).startswith(f"callbacks.fp8_lint.fail_on: {snippet}")
    assert "\n" not in str(error.value)


def test_version_rules_judge_this_machine_for_te_runs_only():
    """This CPU machine has no GPU and no TE: a run that needs real TE stops at construction,
    naming the environment rule; an emulated run is not judged on hardware."""
    te_run = {"precision": "amp_fp8", "model": {"name": "mpt_causal_lm", "fc_type": "te",
                                                "loss_fn": "torch_crossentropy"}}
    with pytest.raises(ValueError, match=r"FP8201 gpu: no GPU"):
        FP8Lint(train_config=te_run)
    emulated = FP8Lint(train_config={"precision": "fp32",
                                     "algorithms": {"te_swap": {"backend": "emulate"}}})
    assert not [f for f in emulated.findings if f.rule.startswith("FP82")]


def test_mpt_default_loss_needs_flash_attn_on_the_training_machine():
    """MPT's default loss is flash-attn's cross entropy; this machine has no flash-attn, so
    LLM-Foundry would raise building the model: fp8_lint stops the run first."""
    from foundry_fp8.environment import gather_snapshot

    assert not gather_snapshot(probe_te_import=False).flash_attn_cross_entropy
    with pytest.raises(ValueError, match="FP8029 model: no loss_fn"):
        FP8Lint(train_config={"model": {"name": "mpt_causal_lm"}})
    with pytest.raises(ValueError) as built:  # the reference: LLM-Foundry's own refusal
        from llmfoundry.models.mpt import ComposerMPTCausalLM

        ComposerMPTCausalLM(d_model=64, n_heads=4, n_layers=1, max_seq_len=16, vocab_size=64,
                            attn_config={"attn_impl": "torch"})
    assert "Fused Cross Entropy is not installed" in str(built.value)
    assert FP8Lint(train_config={"model": {"name": "mpt_causal_lm",
                                           "loss_fn": "torch_crossentropy",
                                           "attn_config": {"attn_impl": "torch"}}}).findings == []


def test_our_own_bug_never_stops_the_run(monkeypatch, caplog):
    """A crash inside the linter or the model check is logged; the run goes on."""
    import foundry_fp8.composer.lint as lint_module

    def broken(*args, **kwargs):
        raise RuntimeError("injected linter bug")

    monkeypatch.setattr(lint_module, "lint_config", broken)
    monkeypatch.setattr(lint_module, "model_problem", broken)
    with caplog.at_level(logging.ERROR, logger="foundry_fp8.composer.lint"):
        lint = FP8Lint(train_config={"precision": "amp_fp8"})  # would be FP8001 when working
        lint.run_event(Event.BEFORE_LOAD, _state(Precision.AMP_FP8, _tiny_mpt()), logger=None)
    assert lint.findings == []
    failures = [r for r in caplog.records if r.exc_info and "injected" in str(r.exc_info[1])]
    assert [r.getMessage() for r in failures] == [
        "fp8_lint: the linter failed on this config; the run is not linted",
        "fp8_lint: checking the model failed; skipped"]


def test_te_ln_mlp_stops_the_run_before_llmfoundry_builds_the_model(monkeypatch):
    """This machine's LLM-Foundry (0.22.0; 0.21.0 in the oldest set) carries FP8030's bug, so
    fp8_lint, built with the callbacks before the model, stops the run in one line naming the
    key, the upstream line that would raise and the fix. On an H100 with TE (on this CPU
    machine the machine's errors, no GPU and no TE, come first)."""
    import foundry_fp8.composer.lint as lint_module
    from foundry_fp8.environment import gather_snapshot

    here = gather_snapshot(probe_te_import=False, probe_gpu=False)
    h100 = replace(here, gpu_name="NVIDIA H100", capability=(9, 0), torch_cuda="12.6",
                   te="2.8.0", te_torch="2.8.0", te_core="2.8.0",
                   te_core_package="transformer-engine-cu12")
    monkeypatch.setattr(lint_module, "gather_snapshot", lambda probe_te_import: h100)
    run = {"model": {"name": "mpt_causal_lm", "loss_fn": "torch_crossentropy",
                     "attn_config": {"attn_impl": "torch"},
                     "ffn_config": {"ffn_type": "te_ln_mlp"}}}
    with pytest.raises(ValueError) as stopped:
        FP8Lint(train_config=run)
    line = str(stopped.value)
    assert "\n" not in line
    assert line.startswith("fp8_lint: FP8030 model.ffn_config.ffn_type: ffn_type te_ln_mlp ")
    assert "param_init_fns.py:466" in line and "(fix: drop ffn_type: te_ln_mlp" in line


def test_auto_microbatch_with_fsdp_judges_the_machines_composer_and_torch(monkeypatch):
    """Composer 0.32.1 with torch 2.7.0 (our pinned set) builds the Trainer; with the H200's
    torch 2.11 fp8_lint stops the run first."""
    import foundry_fp8.composer.lint as lint_module

    run = {"device_train_microbatch_size": "auto", "fsdp_config": {"sharding_strategy":
                                                                   "FULL_SHARD"}}
    pinned = Snapshot(python="3.11", torch="2.7.0", composer="0.32.1", llmfoundry="0.22.0")
    monkeypatch.setattr(lint_module, "gather_snapshot", lambda probe_te_import: pinned)
    assert FP8Lint(train_config=run).findings == []
    h200 = Snapshot(python="3.12", torch="2.11.0+cu130", composer="0.32.1", llmfoundry="0.22.0")
    monkeypatch.setattr(lint_module, "gather_snapshot", lambda probe_te_import: h200)
    with pytest.raises(ValueError, match=r"^fp8_lint: FP8031 device_train_microbatch_size: "
                                         r"Composer 0\.32\.1 defines unshard_with_sync"):
        FP8Lint(train_config=run)
    assert FP8Lint(train_config={**run, "fsdp_config": None}).findings == []  # one GPU


def test_a_rule_that_raises_is_logged_and_the_others_still_stop_the_run(monkeypatch, caplog):
    """Before: an integer expansion_ratio past any float raised OverflowError in one rule, the
    callback logged 'the linter failed ... not linted' and dropped every finding: FP8001's
    error here let the run go on."""
    config = {"precision": "amp_fp8", "model": {"name": "mpt_causal_lm", "d_model": 64,
                                                "n_heads": 4, "expansion_ratio": 10 ** 309,
                                                "loss_fn": "torch_crossentropy",
                                                "attn_config": {"attn_impl": "torch"}}}
    with pytest.raises(ValueError, match="FP8001 precision"):
        FP8Lint(train_config=config)
    from dataclasses import replace

    from foundry_fp8.lint import registry

    def broken(config, ctx):
        raise OverflowError("injected rule bug")

    monkeypatch.setitem(registry._REGISTRY, "FP8005",
                        replace(registry._REGISTRY["FP8005"], check=broken))
    with caplog.at_level(logging.ERROR, logger="foundry_fp8.composer.lint"):
        with pytest.raises(ValueError, match="FP8001 precision.*; 1 error"):
            FP8Lint(train_config=config)
        lint = FP8Lint(train_config=config, fail_on="never")
    assert [f.rule for f in lint.findings] == ["FP8001"]  # the failure is not a finding of the run
    failures = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert failures and all(m.startswith("fp8_lint: FP8005's check failed on this config "
                                         "(OverflowError at ") for m in failures), failures
