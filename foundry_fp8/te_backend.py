"""The one module that touches TransformerEngine, imported lazily inside functions.

Everything else (swap planning, the emulated backend, CI) runs without TE. Facts used below are
from TE 2.20's Python sources: `te.Linear`/`te.LayerNormMLP` take `params_dtype` and `device`
(`"meta"` defers parameter init); `te.LayerNorm` (an op since TE 2.x) takes `dtype`/`device` and
always has a bias; `te.autocast(recipe=...)` replaces `te.fp8_autocast`, which TE 2.20 still
has but deprecates (DeprecationWarning); `Float8CurrentScaling` exists from TE 2.2.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from contextlib import AbstractContextManager
from importlib import metadata
from typing import Any

import torch
from torch import nn

from foundry_fp8.environment import parse_version
from foundry_fp8.recipe import FP8Recipe


def te_available() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def te_version() -> tuple[int, ...] | None:
    """The installed TE's version as integers (e.g. (2, 20, 2)), None when TE is absent."""
    if not te_available():
        return None
    try:
        text = metadata.version("transformer_engine")
    except metadata.PackageNotFoundError:
        import transformer_engine

        text = transformer_engine.__version__
    return parse_version(text)


def require_te() -> None:
    """Fail clearly where TE cannot be imported: never fall back silently."""
    if not te_available():
        raise RuntimeError("te_swap.backend: 'te' needs TransformerEngine (pip install "
                           "'foundry-fp8[te]' on a GPU machine); for FP8 numerics without TE "
                           "use te_swap: {backend: emulate}")


def _copy(dst: nn.Parameter | None, src: torch.Tensor | None) -> None:
    """Bit-exact copy unless the destination is on the meta device (FSDP initialises it)."""
    if dst is None or src is None or dst.device.type == "meta":
        return
    with torch.no_grad():
        dst.copy_(src)


def make_te_linear(src: nn.Linear) -> nn.Module:
    """A `te.Linear` with `src`'s shapes, dtype and device; weight and bias copied exactly."""
    import transformer_engine.pytorch as te

    new = te.Linear(src.in_features, src.out_features, bias=src.bias is not None,
                    params_dtype=src.weight.dtype, device=src.weight.device)
    _copy(new.weight, src.weight)
    _copy(new.bias, src.bias)
    return new


def make_te_layernorm(src: nn.LayerNorm) -> nn.Module:
    """A `te.LayerNorm` (same `weight`/`bias` names) with `src`'s eps; parameters copied."""
    import transformer_engine.pytorch as te

    new = te.LayerNorm(src.normalized_shape, eps=src.eps, dtype=src.weight.dtype,
                       device=src.weight.device)
    _copy(new.weight, src.weight)
    _copy(new.bias, src.bias)
    return new


def make_te_layernorm_mlp(norm: nn.LayerNorm, up: nn.Linear, down: nn.Linear) -> nn.Module:
    """`te.LayerNormMLP` computing `down(gelu(up(norm(x))))`, parameters copied exactly.

    TE's `gelu` is the tanh approximation, so this is not the same function as MPT's exact GELU
    (swap.plan_swap reports the size of the difference).
    """
    import transformer_engine.pytorch as te

    new = te.LayerNormMLP(hidden_size=up.in_features, ffn_hidden_size=up.out_features,
                          eps=norm.eps, bias=up.bias is not None, activation="gelu",
                          params_dtype=up.weight.dtype, device=up.weight.device)
    for dst, src in ((new.layer_norm_weight, norm.weight), (new.layer_norm_bias, norm.bias),
                     (new.fc1_weight, up.weight), (new.fc2_weight, down.weight)):
        _copy(dst, src)
    if up.bias is not None:
        _copy(new.fc1_bias, up.bias)
        _copy(new.fc2_bias, down.bias)
    return new


def delayed_scaling_kwargs(recipe: FP8Recipe) -> dict[str, Any]:
    """`DelayedScaling(**kwargs)` for a delayed recipe: the dict Composer's `precision_config`
    takes (Composer builds `DelayedScaling(**precision_config)` on every batch)."""
    from transformer_engine.common.recipe import Format

    if recipe.scaling != "delayed":
        raise ValueError(f"fp8_recipe.scaling: {recipe.scaling!r} has no DelayedScaling form")
    return {"fp8_format": Format[recipe.fp8_format], "amax_history_len": recipe.amax_history_len,
            "amax_compute_algo": recipe.amax_compute_algo, "margin": recipe.margin,
            "reduce_amax": recipe.reduce_amax}


def to_te_recipe(recipe: FP8Recipe) -> Any:
    """The TE recipe object for `recipe`: `DelayedScaling` or `Float8CurrentScaling`."""
    from transformer_engine.common import recipe as te_recipe

    if recipe.scaling == "delayed":
        return te_recipe.DelayedScaling(**delayed_scaling_kwargs(recipe))
    if not hasattr(te_recipe, "Float8CurrentScaling"):
        raise RuntimeError(f"fp8_recipe.scaling: 'current' needs TransformerEngine >= 2.2, found "
                           f"{te_version()}; use scaling: delayed")
    return te_recipe.Float8CurrentScaling(fp8_format=te_recipe.Format[recipe.fp8_format],
                                          use_power_2_scales=recipe.use_power_2_scales)


def te_fp8_autocast(recipe: FP8Recipe) -> AbstractContextManager:
    """Enter TE's FP8 autocast with `recipe` (`te.autocast` where it exists, else the older
    `te.fp8_autocast`)."""
    import transformer_engine.pytorch as te

    te_recipe = to_te_recipe(recipe)
    if hasattr(te, "autocast"):
        return te.autocast(enabled=True, recipe=te_recipe)
    return te.fp8_autocast(enabled=True, fp8_recipe=te_recipe)


def te_checkpoint(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """TE's activation checkpoint: the recompute runs under the forward's FP8 state."""
    import transformer_engine.pytorch as te

    return te.distributed.checkpoint(fn, *args, **kwargs)


def active_te_recipe() -> Any:
    """The recipe TE's FP8 global state holds right now (read inside a forward to verify)."""
    try:
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager
    except ImportError:  # TE before the quantization module (TE 1.x to early 2.x)
        from transformer_engine.pytorch.fp8 import FP8GlobalStateManager

    return FP8GlobalStateManager.get_fp8_recipe()
