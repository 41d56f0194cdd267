"""Numbers a YAML can hold that no rule expects (an integer past any float, `.nan`, `.inf`) never
crash a rule, and a rule that does raise costs only its own findings: it becomes one finding
naming it, and every other rule's findings stand (in `foundry-fp8 lint` and in `fp8_lint`)."""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from foundry_fp8.environment import Snapshot
from foundry_fp8.lint import registry
from foundry_fp8.lint.cli import exit_code, lint_file
from foundry_fp8.lint.known import MPT_NUMBER_KEYS
from foundry_fp8.lint.registry import LintContext
from foundry_fp8.lint.rules import lint_config

#: An integer no float holds (float(HUGE) raises OverflowError), its negative, NaN, infinities.
HUGE = 10 ** 309
ODD_NUMBERS = [HUGE, -HUGE, float("nan"), float("inf"), float("-inf")]
#: A config most train rules have something to judge in: MPT, TE layers in FP8, te_swap, FSDP
#: recompute, the generate callback, our callbacks.
BUSY = {
    "precision": "amp_fp8", "max_seq_len": 64, "global_train_batch_size": 8,
    "device_train_microbatch_size": 2, "device_eval_batch_size": 2, "max_duration": "10ba",
    "model": {"name": "mpt_causal_lm", "d_model": 64, "n_heads": 4, "n_layers": 2,
              "expansion_ratio": 4, "max_seq_len": 64, "vocab_size": 512, "fc_type": "te",
              "attn_config": {"attn_type": "grouped_query_attention", "kv_n_heads": 2},
              "ffn_config": {"ffn_type": "mptmlp"}},
    "train_loader": {"name": "text", "num_workers": 0, "dataset": {"max_seq_len": 64}},
    "fsdp_config": {"activation_checkpointing": True},
    "algorithms": {"te_swap": {"min_gemm_size": 16, "keep_first_blocks": 1}},
    "callbacks": {"fp8_stats": {"start": 0, "end": 10}, "fp8_guard": {}, "fp8_state": {},
                  "generate_callback": {"prompts": ["a"], "interval": "1ba",
                                        "batch_size": 8}},
}
NUMBER_KEYS = [f"model.{k}" for k in MPT_NUMBER_KEYS] + [
    "max_seq_len", "global_train_batch_size", "device_train_microbatch_size",
    "device_eval_batch_size", "train_loader.dataset.max_seq_len",
    "algorithms.te_swap.min_gemm_size", "algorithms.te_swap.keep_first_blocks",
    "callbacks.fp8_stats.start", "callbacks.fp8_stats.end",
    "callbacks.generate_callback.batch_size"]


def _with(key: str, value: object) -> dict:
    config = copy.deepcopy(BUSY)
    *parents, leaf = key.split(".")
    node = config
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value
    return config


@pytest.mark.parametrize("value", ODD_NUMBERS, ids=["huge", "-huge", "nan", "inf", "-inf"])
@pytest.mark.parametrize("scope", ["file", "run"])
def test_odd_numbers_at_any_number_key_crash_no_rule(value, scope):
    """Before: `model.expansion_ratio: 1e309 as an integer` raised OverflowError in
    math.isfinite (FP8005, FP8032, FP8034), and `foundry-fp8 lint` printed a traceback."""
    for key in NUMBER_KEYS:
        findings = lint_config(_with(key, value), LintContext(scope=scope))
        assert not [f for f in findings if f.crashed], (key, findings)


def test_a_huge_integer_expansion_ratio_lints_in_the_cli(tmp_path):
    path = tmp_path / "big.yaml"
    path.write_text(yaml.safe_dump(_with("model.expansion_ratio", 1)).replace(
        "expansion_ratio: 1\n", f"expansion_ratio: {HUGE}\n"))
    entry = lint_file(path, 1, Snapshot(python="3"))
    assert entry["error"] is None and not [f for f in entry["findings"]
                                           if "failed" in f["message"]], entry


def _break(monkeypatch: pytest.MonkeyPatch, rule_id: str) -> None:
    """Rule `rule_id`'s check raises after its first hit, as a bug in it would."""
    def broken(config, ctx):
        yield registry.Hit("precision", "a hit before the bug")
        raise OverflowError("int too large to convert to float")

    monkeypatch.setitem(registry._REGISTRY, rule_id,
                        replace(registry._REGISTRY[rule_id], check=broken))


def test_a_rule_that_raises_is_one_finding_and_the_others_stand(monkeypatch):
    """Before: the exception left lint_config, and every rule's findings were lost."""
    _break(monkeypatch, "FP8005")
    findings = lint_config({"precision": "amp_fp8", "model": {}})
    assert "FP8001" in {f.rule for f in findings}  # another rule's finding stands
    own = [f for f in findings if f.rule == "FP8005"]
    assert [f.message for f in own[:1]] == ["a hit before the bug"]
    crash, = [f for f in own if f.crashed]
    assert (crash.severity, crash.key) == ("error", "")
    assert crash.message.startswith("FP8005's check failed on this config (OverflowError at ")
    assert "int too large to convert to float" in crash.message


def test_a_rule_that_raises_is_one_error_line_in_the_cli(monkeypatch, tmp_path):
    _break(monkeypatch, "FP8005")
    path = tmp_path / "t.yaml"
    path.write_text("precision: amp_fp8\nmodel: {}\n")
    entry = lint_file(Path(path), 1, Snapshot(python="3"))
    assert entry["error"] is None and exit_code({"files": [entry]}) == 1
    assert "FP8001" in {f["rule"] for f in entry["findings"]}
    crash, = [f for f in entry["findings"] if "check failed" in f["message"]]
    assert (crash["rule"], crash["severity"], crash["line"]) == ("FP8005", "error", None)


# -- FP8043: the sizes make_dataclass_and_log_config refuses -------------------------------------

_SIZE_SAMPLES = [float("nan"), float("inf"), float("-inf"), 0, 0.0, -1, 2.5, 8.0, 10 ** 20, "8",
                 " 8", "auto", "AUTO", "1e3", True, False, None, [], {}, 3, 16]


@pytest.mark.parametrize("key", ["max_seq_len", "global_train_batch_size",
                                 "device_train_microbatch_size"])
def test_fp8043_flags_exactly_the_sizes_llmfoundry_refuses(key):
    """Each sample in a whole train config: LLM-Foundry's make_dataclass_and_log_config (with
    its update_batch_size_info transform, as `llmfoundry train` runs it) refuses it iff FP8043
    names the key. Before: `max_seq_len: .nan`, `global_train_batch_size: .inf`,
    `device_train_microbatch_size: .nan` linted with no error."""
    from tests.test_lint_known import _WHOLE, _train_config_refused

    for value in _SIZE_SAMPLES:
        config = {**_WHOLE, key: value}
        flagged = [f.key for f in lint_config(config) if f.rule == "FP8043"]
        assert _train_config_refused(config) == (flagged == [key]), (key, value, flagged)


@pytest.mark.parametrize(("global_size", "micro"), [(0, 4), (0, 2.5), (8, 0), (8, 0.0), (0, 0),
                                                    (0, "auto"), (-8, 0), (8, float("nan"))])
def test_fp8043_zero_sizes_as_llmfoundry_divides_by_them(global_size, micro):
    from tests.test_lint_known import _WHOLE, _train_config_refused

    config = {**_WHOLE, "global_train_batch_size": global_size,
              "device_train_microbatch_size": micro}
    flagged = {f.key for f in lint_config(config) if f.rule == "FP8043"}
    assert _train_config_refused(config) == bool(flagged), (global_size, micro, flagged)


def test_fp8043_is_named_at_its_key_and_line(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_text("max_seq_len: .nan\nglobal_train_batch_size: .inf\n"
                    "device_train_microbatch_size: -.inf\n")
    found = [(f["rule"], f["key"], f["line"]) for f in lint_file(path)["findings"]
             if f["rule"] == "FP8043"]
    assert found == [("FP8043", "max_seq_len", 1), ("FP8043", "global_train_batch_size", 2)]
