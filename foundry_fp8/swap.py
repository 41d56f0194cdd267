"""Plan which linear layers run in FP8, then convert them (torchao's convert style).

`plan_swap` is pure: it decides, for every `nn.Linear`, convert or keep and why. `apply_swap`
replaces the chosen modules in place, copying weights exactly, keeping attribute names (so
parameter names, optimizers and checkpoints line up) and LLM-Foundry's init attributes.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from torch import nn
from torch.optim import Optimizer

#: LLM-Foundry sets these on linear layers and its param_init_fns read them.
KEPT_ATTRIBUTES = ("_fused", "_is_residual")
_BLOCK = re.compile(r"\bblocks\.(\d+)\.")


@dataclass(frozen=True)
class SwapConfig:
    """Which linear layers to convert. Dims must suit TE's FP8 GEMMs (both % 16)."""

    backend: Literal["te", "emulate"] = "te"
    keep_first_blocks: int = 0
    keep_last_blocks: int = 0
    include: str | None = None
    exclude: str | None = None
    min_features: int = 16
    module_filter_fn: Callable[[nn.Module, str], bool] | None = None

    def __post_init__(self) -> None:
        if self.backend not in ("te", "emulate"):
            raise ValueError(f"te_swap.backend: use 'te' or 'emulate', got {self.backend!r}")
        for key in ("keep_first_blocks", "keep_last_blocks", "min_features"):
            if not isinstance(getattr(self, key), int) or getattr(self, key) < 0:
                raise ValueError(f"te_swap.{key}: must be a non-negative integer")
        for key in ("include", "exclude"):
            try:
                re.compile(getattr(self, key) or "")
            except re.error as e:
                raise ValueError(f"te_swap.{key}: bad regex: {e}") from None


@dataclass(frozen=True)
class Decision:
    name: str
    convert: bool
    reason: str
    params: int


def _keep_reason(name: str, module: nn.Linear, config: SwapConfig, n_blocks: int) -> str | None:
    match = _BLOCK.search(name)
    if match is None:
        return "outside the transformer blocks (embeddings / LM head stay high precision)"
    block = int(match.group(1))
    if block < config.keep_first_blocks or block >= n_blocks - config.keep_last_blocks:
        return f"block {block} kept in high precision (keep_first/last_blocks)"
    if config.include and not re.search(config.include, name):
        return "not matched by include"
    if config.exclude and re.search(config.exclude, name):
        return "matched by exclude"
    if config.module_filter_fn is not None and not config.module_filter_fn(module, name):
        return "rejected by module_filter_fn"
    if module.in_features % 16 or module.out_features % 16:
        return (f"shape {module.out_features}x{module.in_features} breaks TE's FP8 rule "
                "(dims divisible by 16)")
    if min(module.in_features, module.out_features) < config.min_features:
        return f"smaller than min_features {config.min_features}"
    return None


def plan_swap(model: nn.Module, config: SwapConfig) -> list[Decision]:
    """Convert-or-keep, with the reason, for every `nn.Linear` of `model`."""
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    blocks = {int(b.group(1)) for n, _ in linears if (b := _BLOCK.search(n))}
    n_blocks = max(blocks) + 1 if blocks else 0
    plan = []
    for name, module in linears:
        reason = _keep_reason(name, module, config, n_blocks)
        plan.append(Decision(name, reason is None, reason or "converted",
                             module.weight.numel()))
    return plan


def _converter(backend: str) -> Callable[[nn.Linear], nn.Module]:
    if backend == "emulate":
        from foundry_fp8.emulate import EmulatedFP8Linear

        return EmulatedFP8Linear.from_linear
    from foundry_fp8 import te_backend

    te_backend.require_te()
    return te_backend.make_te_linear


def apply_swap(model: nn.Module, plan: list[Decision], backend: str,
               optimizers: Optimizer | Sequence[Optimizer] | None = None) -> int:
    """Convert the planned modules in place; the optimizers follow the new parameters."""
    from composer.utils.module_surgery import replace_module_classes

    convert = _converter(backend)
    wanted = {d.name for d in plan if d.convert}
    targets = {id(m) for n, m in model.named_modules() if n in wanted}

    def policy(module: nn.Module, index: int) -> nn.Module | None:
        del index
        if id(module) not in targets:
            return None
        new = convert(module)
        for attr in KEPT_ATTRIBUTES:
            if hasattr(module, attr):
                setattr(new, attr, getattr(module, attr))
        return new

    return len(replace_module_classes(model, {nn.Linear: policy}, optimizers=optimizers))


def coverage_table(plan: list[Decision]) -> str:
    """Converted vs kept layers by reason, with the share of linear parameters in FP8."""
    total = sum(d.params for d in plan) or 1
    rows: dict[str, list[int]] = {}
    for d in plan:
        row = rows.setdefault(d.reason, [0, 0])
        row[0] += 1
        row[1] += d.params
    lines = ["| layers | linear params | share | decision |", "|---|---|---|---|"]
    for reason, (count, params) in sorted(rows.items(), key=lambda kv: kv[0] != "converted"):
        lines.append(f"| {count} | {params} | {100 * params / total:.1f}% | {reason} |")
    return "\n".join(lines)


def fp8_share(plan: list[Decision]) -> float:
    """Share of linear parameters (and so, per token, of linear FLOPs) that run in FP8."""
    total = sum(d.params for d in plan)
    return sum(d.params for d in plan if d.convert) / total if total else 0.0
