"""FP8030's fuse_ln_mlp warning on meta weights under FSDP named `init_device: cpu` as the fix
("te_swap then fuses initialised layers"); for an MPT with `fuse_norm_attn_norm: true` te_swap
never fuses (norm_2 lives in norm_attn_norm, which hands the MLP its output: swap's plan says
so per block, tests/test_s30_mpt_fuse_norm_attn_norm.py), so that fix changed nothing."""

from __future__ import annotations

from tests.test_lint import FUSED_ON_META, H200_SET, _found, _merge


def test_no_fusion_warning_where_te_swap_never_fuses():
    assert _found(FUSED_ON_META, H200_SET, "FP8030") == [
        ("algorithms.te_swap.fuse_ln_mlp", "warning")]
    fused_block = _merge(FUSED_ON_META, {"model": {"fuse_norm_attn_norm": True}})
    assert _found(fused_block, H200_SET, "FP8030") == []
