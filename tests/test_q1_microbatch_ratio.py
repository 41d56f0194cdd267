"""Gradient accumulation under delayed scaling: TE (and the emulation) update the scale after
each micro-batch, so one step's micro-batches cast with different scales. A loss spike's first
micro-batch then overflows at a scale its amax outgrew, and the later ones cast with the scale
that spike set. The pooled `scale_ratio` was the smallest scale over the pooled amax: 1.0 beside
14 % overflow in the tiny MPT (QA session 22, 4 micro-batches, the first at ratio 7.9 with 57 %
saturated), so the amax-spike rule could not fire and the flag fell to `cos_low`, blaming FP8
rounding and advising to exclude the layer. Now the ratio is the largest of the micro-batches'
own, and the spike is named as one."""

from __future__ import annotations

import torch

from foundry_fp8.health import HealthTracker
from foundry_fp8.health.rules import SPIKE_CHANGE
from foundry_fp8.numerics import (
    STAT_KEYS,
    finalize_stats,
    pool_sufficient_stats,
    sufficient_stats,
)

E5M2_MAX = 57344.0  # torch.finfo(torch.float8_e5m2).max


def _stats(rows: torch.Tensor) -> dict[str, float]:
    return dict(zip(STAT_KEYS, finalize_stats(rows).tolist(), strict=True))


def test_the_micro_batch_that_outgrew_its_scale_sets_the_ratio_and_the_flag():
    torch.manual_seed(0)
    spiked = torch.randn(4096) * 8e-3  # dY of the spiked micro-batch
    later = torch.randn(4096) * 8e-3
    old_scale = torch.tensor(5.4e7)  # set by the healthy steps' amax history
    new_scale = torch.tensor(E5M2_MAX) / later.abs().max()  # after the update on the spike
    pooled = pool_sufficient_stats(sufficient_stats(spiked, "e5m2", old_scale),
                                   sufficient_stats(later, "e5m2", new_scale))
    stats = _stats(pooled)
    # independently: torch's own cast bound and each cast's ratio
    first_ratio = (old_scale * spiked.abs().max() / E5M2_MAX).item()
    saturated = (spiked * old_scale).abs() > E5M2_MAX
    assert first_ratio > 7
    assert stats["overflow_pct"] == saturated.sum().item() * 100 / 8192
    assert abs(stats["scale_ratio"] / first_ratio - 1) < 1e-6
    assert stats["scale"] == new_scale.item()  # the smallest in force, as documented
    flags = HealthTracker().update(8, {("blocks.1.ffn.down_proj", "gradient"): stats})
    [flag] = flags[("blocks.1.ffn.down_proj", "gradient")]
    assert (flag.rule, flag.yaml_key) == ("overflow_spike", SPIKE_CHANGE)


def test_one_scale_keeps_scale_over_current_scale_bit_for_bit():
    """One cast, or several with one scale (ranks under `reduce_amax`): as before."""
    torch.manual_seed(1)
    a, b = torch.randn(1000) * 3, torch.randn(1000) * 5
    for scale in (torch.tensor(90.0), None):
        rows = pool_sufficient_stats(sufficient_stats(a, "e4m3", scale),
                                     sufficient_stats(b, "e4m3", scale))
        for one in (sufficient_stats(a, "e4m3", scale), rows):
            s = _stats(one)
            assert s["scale_ratio"] == s["scale"] / s["current_scale"]


def test_a_piece_at_a_stale_scale_still_names_the_history_length():
    """The other side (QA F2 s22): a micro-batch still at a stale scale (an old amax spike in
    the history) pooled with one at the updated scale; the largest ratio reads 1, the stale
    rule judges the smallest scale over the tensor's current scale."""
    torch.manual_seed(0)
    x = torch.randn(4096) * 1e-3
    stale = torch.tensor(3.0)  # 448 / amax is about 1.1e5
    pooled = _stats(pool_sufficient_stats(sufficient_stats(x, "e4m3", stale),
                                          sufficient_stats(x, "e4m3", None)))
    # independently: torch's own cast of the stale piece flushes a quarter of x to 0
    flushed = ((x * stale).to(torch.float8_e4m3fn).float() == 0) & (x != 0)
    assert flushed.sum().item() * 100 / 8192 == pooled["underflow_pct"] > 5
    assert pooled["scale_ratio"] == 1.0  # the overflow side's ratio: the updated piece's
    own = (stale * x.abs().max() / 448.0).item()
    assert abs(pooled["scale"] / pooled["current_scale"] / own - 1) < 1e-6
    flags = HealthTracker().update(3, {("blocks.0.attn.Wqkv", "activation"): pooled})
    [flag] = flags[("blocks.0.attn.Wqkv", "activation")]
    assert flag.rule == "underflow_stale", flag
    assert flag.yaml_key.startswith("algorithms.te_swap.fp8_recipe.amax_history_len")
