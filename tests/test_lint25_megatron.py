"""FP8103 under Accelerate's MEGATRON_LM: `mixed_precision: fp8` reaches neither Megatron-LM
nor TE, so the run trains in FP32 without FP8 and without an error; read against the installed
Accelerate's own MegatronLMPlugin."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from foundry_fp8.lint.accelerate import lint_accelerate, lint_input
from foundry_fp8.lint.cli import lint_file

MEGATRON = """\
compute_environment: LOCAL_MACHINE
distributed_type: MEGATRON_LM
megatron_lm_config:
  megatron_lm_tp_degree: 2
  megatron_lm_pp_degree: 2
  megatron_lm_num_micro_batches: 4
  megatron_lm_sequence_parallelism: true
mixed_precision: {mp}
fp8_config:
  backend: TE
  fp8_format: HYBRID
  amax_history_len: 64
num_machines: 1
num_processes: 8
"""


def test_megatron_plugin_passes_no_precision_for_fp8():
    """The fact the rule rests on, from the real plugin: fp8 adds nothing to Megatron-LM's
    arguments (bf16 adds `bf16`), so Megatron-LM keeps its FP32 default and runs no FP8."""
    from accelerate.utils import MegatronLMPlugin

    def added(precision: str) -> set[str]:
        plugin = MegatronLMPlugin(tp_degree=2, pp_degree=2, num_micro_batches=4)
        before = dict(plugin.megatron_lm_default_args)
        plugin.set_mixed_precision(precision)
        return {k for k, v in plugin.megatron_lm_default_args.items() if before.get(k) != v}

    assert "bf16" in added("bf16")
    assert not {k for k in added("fp8") if "fp" in k or "bf16" in k}


def test_megatron_fp8_is_an_error_at_mixed_precision(tmp_path: Path):
    path = tmp_path / "accelerate.yaml"
    path.write_text(MEGATRON.format(mp="fp8"))
    entry = lint_file(path)
    assert entry["error"] is None
    hits = [f for f in entry["findings"] if f["rule"] == "FP8103"]
    assert [(f["key"], f["line"], f["severity"]) for f in hits] == \
        [("mixed_precision", 8, "error")]
    assert "FP32 without FP8" in hits[0]["message"]
    # the backend warning's advice (upgrade to 1.9) does not apply: no release runs FP8 here
    assert not [f for f in entry["findings"] if f["rule"] == "FP8115"]


@pytest.mark.parametrize("version", [None, (1, 3, 0), (1, 8, 1), (1, 11, 0), (1, 14, 0)])
def test_megatron_fp8_in_every_release(version):
    config = {"distributed_type": "MEGATRON_LM", "mixed_precision": "fp8"}
    hits = [f for f in lint_accelerate(lint_input(config, version=version))
            if f.rule == "FP8103"]
    assert [(f.key, f.severity) for f in hits] == [("mixed_precision", "error")]


@pytest.mark.parametrize("body", [
    MEGATRON.format(mp="bf16").replace("fp8_config:\n  backend: TE\n", "fp8_config:\n"),
    MEGATRON.format(mp="fp8").replace("MEGATRON_LM", "MULTI_GPU"),
])
def test_not_reported_without_megatron_fp8(tmp_path: Path, body: str):
    path = tmp_path / "accelerate.yaml"
    path.write_text(textwrap.dedent(body))
    entry = lint_file(path)
    assert entry["error"] is None
    assert not [f for f in entry["findings"] if f["rule"] == "FP8103"]
