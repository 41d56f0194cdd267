"""te_swap's coverage table said FP8 "yes" for the LayerNorms it converts to te.LayerNorm, in
the row whose reason says "not FP8": te.LayerNorm is a fused kernel computing in high precision
(TE's LayerNorm has no fp8 path; only LayerNormLinear/LayerNormMLP cast their GEMMs). A real
LLM-Foundry run of the tiny MPT with the `te` backend on tests/fake_te.py's stand-in."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf as om

from tests.tiny_run import run_tiny


@pytest.mark.filterwarnings("ignore")
def test_converted_layernorms_are_not_said_to_run_in_fp8(tmp_path, tiny_data, monkeypatch,
                                                         fake_te, capsys):
    from foundry_fp8 import swap
    from foundry_fp8.composer import te_swap

    fake_te("2.20.2")
    monkeypatch.setattr(te_swap, "_check_te_environment", lambda recipe: None)
    monkeypatch.setattr(swap, "would_run_fp8", lambda *args: True)
    trainer = run_tiny(tmp_path, tiny_data, om.to_container(om.create({
        "max_duration": "1ba", "eval_interval": "1ba", "save_interval": "1ba",
        "algorithms": {"te_swap": {"backend": "te", "convert_layernorm": True}},
        "callbacks": {"fp8_lint": {"fail_on": "never"}}})))
    printed = capsys.readouterr().out
    rows = [[cell.strip() for cell in line.strip("|").split("|")]
            for line in printed.splitlines() if line.startswith("| ") and "| layernorm |" in line]
    norms = [name for name, m in trainer.state.model.named_modules()
             if type(m).__name__ in ("_LayerNormOp", "LayerNorm")
             and type(m).__module__.startswith("transformer_engine")]
    assert norms  # converted: the model holds the stand-in's te.LayerNorm
    assert rows and sum(int(row[2]) for row in rows) >= len(norms)
    for fp8, _, _, _, share, reason in rows:
        assert (fp8, share) == ("no", "0.0%"), (fp8, reason)
    assert any(reason == "te.LayerNorm (fused kernel, not FP8)" for *_, reason in rows)
