"""TE's debug API through our TEDebugSession, on a real te.Linear (Hopper; passed on an H200
with TE 2.20.2, 2026-11-26)."""

from __future__ import annotations

import pytest
import torch

from foundry_fp8.numerics import FP8_MAX, tensor_stats
from foundry_fp8.te.debug import TEDebugSession, log_fp8_tensor_stats_config

pytestmark = pytest.mark.gpu


def test_te_underflow_stat_matches_ours_at_the_scale_te_used(tmp_path):
    te = pytest.importorskip("transformer_engine.pytorch")
    pytest.importorskip("nvdlfw_inspect")
    from transformer_engine.common.recipe import DelayedScaling, Format
    from transformer_engine.debug.pytorch.debug_state import TEDebugState

    got: dict[tuple[str, int], float] = {}
    config = log_fp8_tensor_stats_config(r"^lin$", ["activation", "weight", "gradient"], freq=1)
    session = TEDebugSession(config, tmp_path, lambda n, v, s: got.__setitem__((n, s), v))
    session.start()  # before the first TE module, as fp8_stats does
    try:
        layer = te.Linear(256, 256, params_dtype=torch.bfloat16, device="cuda")
        session.name_layers([("lin", layer)])
        torch.manual_seed(0)
        x = (torch.randn(128, 256, device="cuda") * torch.logspace(-4, 1, 256, device="cuda"))
        x = x.to(torch.bfloat16).requires_grad_()
        recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=4)
        for _ in range(2):
            with te.autocast(enabled=True, recipe=recipe):
                out = layer(x)
            out.float().sum().backward()
            session.step()
    finally:
        session.close()
        TEDebugState._reset()  # later tests build TE modules without the debug API

    names = {name for name, _ in got}
    for tensor in ("activation", "weight", "gradient"):
        assert f"fp8_te_underflow_pct/{tensor}/lin" in names, sorted(names)
    # step 1 casts x with the delayed scale from step 0's amax: fp8_max / amax(x)
    step1 = {name: value for (name, step), value in got.items() if step == 1}
    scale = FP8_MAX["e4m3"] / x.detach().float().abs().max().item()
    ours = tensor_stats(x.detach(), "e4m3", scale=scale)["underflow_pct"]
    assert step1["fp8_te_underflow_pct/activation/lin"] == pytest.approx(ours, abs=0.05)


def test_an_anchored_layer_choice_reaches_a_layernorm_mlps_gemms(tmp_path):
    """`layers: ffn$` selects the LayerNormMLP; TE names its GEMMs `ffn.fc1`/`ffn.fc2` for the
    debug API, logged under the module as `fc1_<tensor>` (written after a TE source review)."""
    te = pytest.importorskip("transformer_engine.pytorch")
    pytest.importorskip("nvdlfw_inspect")
    from transformer_engine.common.recipe import DelayedScaling
    from transformer_engine.debug.pytorch.debug_state import TEDebugState

    from foundry_fp8.te.debug import layer_pattern

    got: dict[str, float] = {}
    config = log_fp8_tensor_stats_config(layer_pattern(r"blocks\.0\.ffn$"), ["activation"],
                                         freq=1)
    session = TEDebugSession(config, tmp_path, lambda n, v, s: got.__setitem__(n, v))
    session.start()
    try:
        mlp = te.LayerNormMLP(256, 1024, params_dtype=torch.bfloat16, device="cuda")
        session.name_layers([("blocks.0.ffn", mlp)])
        x = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        with te.autocast(enabled=True, recipe=DelayedScaling()):
            out = mlp(x)
        out.float().sum().backward()
        session.step()
    finally:
        session.close()
        TEDebugState._reset()

    assert {"fp8_te_underflow_pct/fc1_activation/blocks.0.ffn",
            "fp8_te_underflow_pct/fc2_activation/blocks.0.ffn"} <= set(got), sorted(got)


def test_an_evaluation_forward_stays_out_of_tes_statistics_and_a_resume_keeps_the_step(tmp_path):
    """`pause` (fp8_stats' EVAL_START) keeps a no-grad forward out of TE's buffers, which TE
    feeds on any forward of a debug iteration; `start_at` (FIT_START) makes TE's iteration the
    batch count (written after a TE source review, not run)."""
    te = pytest.importorskip("transformer_engine.pytorch")
    pytest.importorskip("nvdlfw_inspect")
    from transformer_engine.common.recipe import Float8CurrentScaling
    from transformer_engine.debug.pytorch.debug_state import TEDebugState

    got: dict[tuple[str, int], float] = {}
    config = log_fp8_tensor_stats_config(r"^lin$", ["activation"], freq=1, scaling="current")
    session = TEDebugSession(config, tmp_path, lambda n, v, s: got.__setitem__((n, s), v))
    session.start()
    try:
        layer = te.Linear(256, 256, params_dtype=torch.bfloat16, device="cuda")
        session.name_layers([("lin", layer)])
        session.start_at(7)  # a run resumed at batch 7
        torch.manual_seed(0)
        x = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        # most of the evaluation's values underflow at its own scale: counted, they would show
        held_out = torch.randn(128, 256, device="cuda") * torch.logspace(-12, 2, 256,
                                                                          device="cuda")
        recipe = Float8CurrentScaling()
        session.pause()
        with torch.no_grad(), te.autocast(enabled=True, recipe=recipe):
            layer(held_out.to(torch.bfloat16))
        session.resume()
        with te.autocast(enabled=True, recipe=recipe):
            out = layer(x)
        out.float().sum().backward()
        session.step()
    finally:
        session.close()
        TEDebugState._reset()

    key = ("fp8_te_underflow_pct/activation/lin", 7)
    assert key in got, sorted(got)
    ours = tensor_stats(x.detach(), "e4m3")["underflow_pct"]  # current scaling: its own amax
    assert got[key] == pytest.approx(ours, abs=0.05)


def test_a_layer_built_before_the_session_is_logged(tmp_path):
    """A Composer script builds its model before fp8_stats: TE turns its debug flag on only for
    a module built during a session (module/base.py:922-923 in 2.20.2), so TE logged nothing for
    it until `name_layers` turned it on (written from TE 2.20.2's sources, not run)."""
    te = pytest.importorskip("transformer_engine.pytorch")
    pytest.importorskip("nvdlfw_inspect")
    from transformer_engine.common.recipe import DelayedScaling
    from transformer_engine.debug.pytorch.debug_state import TEDebugState

    layer = te.Linear(256, 256, params_dtype=torch.bfloat16, device="cuda")
    got: dict[str, float] = {}
    config = log_fp8_tensor_stats_config(r"^lin$", ["activation"], freq=1)
    session = TEDebugSession(config, tmp_path, lambda n, v, s: got.__setitem__(n, v))
    session.start()
    try:
        session.name_layers([("lin", layer)])
        x = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        with te.autocast(enabled=True, recipe=DelayedScaling()):
            out = layer(x)
        out.float().sum().backward()
        session.step()
    finally:
        session.close()
        TEDebugState._reset()

    assert "fp8_te_underflow_pct/activation/lin" in got, sorted(got)
