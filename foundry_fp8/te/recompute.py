"""The TE #1190 activation-recompute policy: which FSDP settings make Composer recompute FP8
layers under FP8, or why none can. Pure Python (no torch, no TE); `fp8_state` applies it at
INIT and the linter's recompute rules describe the same facts (`te.facts.MIN_TE_FOR_RECOMPUTE`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from foundry_fp8.te.facts import MIN_TE_FOR_RECOMPUTE, Version, dotted

#: What Composer's TE-aware recompute needs (composer/distributed/dist_strategy.py asserts
#: non-reentrant checkpointing with te_checkpoint_wrapper).
SAFE_FSDP1 = {"te_checkpoint_wrapper": True, "activation_checkpointing_reentrant": False}


@dataclass(frozen=True)
class RecomputePlan:
    """`settings`: FSDP config fields to set; `refusal`: why no setting is safe (one line)."""

    settings: dict[str, Any] = field(default_factory=dict)
    refusal: str | None = None


def recompute_plan(precision: str, fsdp: Mapping[str, Any] | None, fsdp_version: int,
                   te_version: Version | None, emulated: bool) -> RecomputePlan:
    """The FSDP config fields to set so that activation recompute runs under FP8.

    Composer 0.32 (`distributed/dist_strategy.py`) recomputes TE modules under FP8 only with
    its `te_checkpoint_wrapper` (FSDP1, read only when precision is `amp_fp8`, asserted
    non-reentrant), which wraps blocks in `te.distributed.checkpoint`; its default is reentrant
    torch checkpointing, and FSDP2's is non-reentrant torch checkpointing, both recomputing
    outside TE's autocast. `activation_cpu_offload` alone recomputes nothing (offload_wrapper
    only moves saved tensors), so only `activation_checkpointing` matters.
    """
    if not fsdp or not fsdp.get("activation_checkpointing"):
        return RecomputePlan()
    if emulated:
        return RecomputePlan(refusal=(
            "fp8_state: fsdp_config.activation_checkpointing would recompute te_swap's emulated "
            "FP8 layers outside FP8 (TE #1190 class); turn it off, or checkpoint with "
            "foundry_fp8.emulate.fp8_checkpoint in your own model"))
    if precision != "amp_fp8" or te_version is None:
        return RecomputePlan()
    if tuple(te_version) < MIN_TE_FOR_RECOMPUTE:
        return RecomputePlan(refusal=(
            f"fp8_state: TransformerEngine {dotted(te_version)} recomputes FP8 activations "
            f"wrongly (TE #1190); use TransformerEngine >= {dotted(MIN_TE_FOR_RECOMPUTE)} or "
            "turn off fsdp_config.activation_checkpointing"))
    if fsdp_version != 1:
        return RecomputePlan(refusal=(
            "fp8_state: with amp_fp8, fsdp_config.activation_checkpointing needs Composer's "
            "te_checkpoint_wrapper, which only FSDP1 has; use FSDP1 or turn activation "
            "checkpointing off"))
    return RecomputePlan({k: v for k, v in SAFE_FSDP1.items() if fsdp.get(k) != v})
