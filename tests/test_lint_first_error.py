"""The error that stops a run is the first `fp8_lint` finds, so it must name the cause. Here:
LLM-Foundry's own TE layers (`model.fc_type: te`, llmfoundry/models/mpt/modeling_mpt.py) in the
tiny CPU run, on a machine with neither a GPU nor TransformerEngine. Reproduced with
`llmfoundry train` on yamls/mpt-tiny-cpu.yaml plus `fc_type: te`: before, the run stopped on
FP8034 with "relax keep_first/last_blocks, include/exclude, min_gemm_size", options that
convert nothing here since te_swap leaves a model's own TE modules alone
(foundry_fp8/swap.py), and "TE is not installed" came third."""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

from foundry_fp8.composer import lint
from foundry_fp8.environment import Snapshot

YAML = Path(__file__).resolve().parent.parent / "yamls" / "mpt-tiny-cpu.yaml"
CPU_NO_TE = Snapshot(python="3.11.7", torch="2.7.0")


def _errors(monkeypatch, **model: object) -> list:
    config = OmegaConf.to_container(OmegaConf.load(YAML), resolve=True)
    config["model"].update(model)
    monkeypatch.setattr(lint, "gather_snapshot", lambda **_: CPU_NO_TE)
    return [f for f in lint._run_findings(config) if f.severity == "error"]


def test_the_first_error_is_the_machine_and_its_fix_names_fc_type(monkeypatch):
    errors = _errors(monkeypatch, fc_type="te")
    assert [f.rule for f in errors] == ["FP8201", "FP8204", "FP8034"]
    for f in errors:  # te_swap's own options cannot help: every fix names fc_type
        assert "model.fc_type: torch" in f.fix, f
        assert "keep_first" not in f.fix
    assert errors[2].key == "model.fc_type"


def test_the_tiny_run_as_shipped_has_no_error(monkeypatch):
    assert _errors(monkeypatch) == []
