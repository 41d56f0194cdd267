"""Building TE modules and recipes and entering TE's autocast; TE is imported lazily inside
functions.

Everything else (swap planning, the emulated backend, CI) runs without TE. Facts used below were
read in TE's Python sources (2.20, and the tags back to 1.12 where noted):
- `te.Linear`/`te.LayerNormMLP` take `params_dtype` and `device`, and defer parameter init only
  when `device == "meta"` compares true, which a `torch.device("meta")` never does: given one,
  TE materialises the parameters on CUDA (`module/base.py`, `reset_parameters`). So `"meta"` is
  passed as a string.
- `te.LayerNorm` (a `te.ops` op since TE 1.13) takes `normalized_shape`, `eps`, `dtype`,
  `device` and always has a bias; TE 1.12's takes `hidden_size` (an int) and `params_dtype`.
- `te.autocast(recipe=...)` exists from TE 2.9 and replaces `te.fp8_autocast(fp8_recipe=...)`,
  which TE 2.20 still has but deprecates; `FP8GlobalStateManager` moved from
  `pytorch/fp8.py` to `pytorch/quantization.py` in TE 2.9.
- `Float8CurrentScaling` exists from TE 2.2; its `use_power_2_scales` field from TE 2.8, while
  TE's Linear/LayerNormLinear/LayerNormMLP read power-of-2 from the class-level QParams
  `fp8_quant_fwd_inp`/`fp8_quant_fwd_weight`/`fp8_quant_bwd_grad`, fixed at import from
  NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES (`_customize_quantizers_float8_current_scaling`).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn

from foundry_fp8.options import TESwapOptions
from foundry_fp8.recipe import TE_CURRENT_SCALING_QPARAMS, FP8Recipe, RecipeError
from foundry_fp8.te import probe
from foundry_fp8.te.facts import (
    LN_MLP_SOURCES,
    MIN_TE,
    MIN_TE_CURRENT_SCALING,
    PLAIN_LN_MLP,
    POWER_2_SCALES_ENV,
    POWER_2_SCALES_ENV_FROM,
    TE_INSTALL_HINT,
    TE_LAYERNORM_AS_OP,
    Version,
    backward_override_problems,
    dotted,
)


def require_te() -> None:
    """Fail clearly where TE cannot be imported or is older than checked: never fall back."""
    if not probe.te_available():
        raise RuntimeError(f"{TESwapOptions.PATH}.backend: 'te' needs TransformerEngine "
                           f"({TE_INSTALL_HINT} on a GPU machine); for FP8 numerics "
                           "without TE use te_swap: {backend: emulate}")
    version = probe.te_version()
    if version is not None and version < MIN_TE:
        raise RuntimeError(f"{TESwapOptions.PATH}.backend: 'te' needs TransformerEngine >= "
                           f"{dotted(MIN_TE)}, found {dotted(version)}; upgrade it, "
                           "or use te_swap: {backend: emulate}")


def require_cuda() -> None:
    """Fail in one line where TE can build no layer (torch sees no CUDA device: a GPU-less login
    node with TE installed): TE's own refusal (`probe.te_builds_without_cuda`) would come from
    inside the swap, after the model was built."""
    if not torch.cuda.is_available() and not probe.te_builds_without_cuda():
        raise RuntimeError(f"{TESwapOptions.PATH}.backend: 'te' needs a CUDA GPU, and torch sees "
                           "none here (torch.cuda.is_available() is False; `foundry-fp8 doctor` "
                           "says why): TransformerEngine builds no layer without one; for FP8 "
                           "numerics without a GPU use te_swap: {backend: emulate}")


def te_device(tensor: torch.Tensor) -> torch.device | str:
    """The `device` argument for a TE module built like `tensor`: the string "meta" on the meta
    device (TE tests `device == "meta"`), else the tensor's device."""
    return "meta" if tensor.device.type == "meta" else tensor.device


def _copy(dst: torch.Tensor | None, src: torch.Tensor | None) -> None:
    """Bit-exact copy unless the destination is on the meta device (FSDP initialises it)."""
    if dst is None or src is None or dst.device.type == "meta":
        return
    with torch.no_grad():
        dst.copy_(src)


def make_te_linear(src: nn.Linear,
                   init_method: Callable[[torch.Tensor], Any] | None = None) -> nn.Module:
    """A `te.Linear` with `src`'s shapes, dtype and device; weight and bias copied exactly.
    `init_method` (TE's keyword, 1.12-2.20; None: TE's N(0, 0.023)) initialises the weight
    when TE's `reset_parameters` runs on a layer built on the meta device; TE zeroes the bias
    (module/linear.py, `register_parameter`'s `init_fn`)."""
    require_cuda()
    import transformer_engine.pytorch as te

    new = te.Linear(src.in_features, src.out_features, bias=src.bias is not None,
                    params_dtype=src.weight.dtype, device=te_device(src.weight),
                    init_method=init_method)
    _copy(new.weight, src.weight)
    _copy(new.bias, src.bias)
    return new


def make_te_layernorm(src: nn.LayerNorm) -> nn.Module:
    """A `te.LayerNorm` (same `weight`/`bias` names) with `src`'s eps; parameters copied."""
    require_cuda()
    import transformer_engine.pytorch as te

    version = probe.te_version()
    if version is not None and version < TE_LAYERNORM_AS_OP:
        if len(src.normalized_shape) != 1:
            raise ValueError(f"TransformerEngine {dotted(version)}'s LayerNorm normalises one "
                             f"dimension, not {tuple(src.normalized_shape)}")
        new = te.LayerNorm(src.normalized_shape[0], eps=src.eps, params_dtype=src.weight.dtype,
                           device=te_device(src.weight))
    else:
        new = te.LayerNorm(tuple(src.normalized_shape), eps=src.eps, dtype=src.weight.dtype,
                           device=te_device(src.weight))
    _copy(new.weight, src.weight)
    _copy(new.bias, src.bias)
    return new


#: torch checkpoint's keyword that TE's checkpoint does not take: TE 1.12-2.20.2 (and main
#: d0067d0) pop use_reentrant, distribute_saved_activations, tp_group, get_rng_state_tracker,
#: context_fn, determinism_check and debug (pytorch/distributed.py:609-637 at v1.12, 700-728 at
#: v2.18, 710-738 in the 2.20.2 wheel) and pass every other keyword to the checkpointed
#: function, which would receive this
#: one; TE always restores the CPU and CUDA RNG states, as this keyword's default asks.
TORCH_ONLY_CHECKPOINT_KWARG = "preserve_rng_state"


def te_checkpoint(kwargs: dict[str, Any]) -> functools.partial:
    """TE's activation checkpoint (`te.checkpoint`, exported from pytorch/__init__.py at v1.12
    l. 82, v2.18 l. 62, 2.20.2 l. 66) with the keywords a torch checkpoint was given. It recomputes under the
    forward's FP8 recipe (TE #1190, fixed from `facts.MIN_TE_FOR_RECOMPUTE`); like torch's,
    `use_reentrant` defaults to True, and a callable that is not a module counts as holding TE
    modules, as transformers' `partial(layer.__call__)` is."""
    require_te()  # te_swap builds it before converting any layer
    import transformer_engine.pytorch as te

    kept = {k: v for k, v in kwargs.items() if k != TORCH_ONLY_CHECKPOINT_KWARG}
    return functools.partial(te.checkpoint, **kept)


def make_te_layernorm_mlp(block: nn.Module, normalization: str, activation: str) -> nn.Module:
    """`te.LayerNormMLP` computing the MPT block's `ffn.down(act(ffn.up(norm_2(x))))`, its
    norm_2 a `normalization` (`swap.te_normalization`) with norm_2's eps, its act TE's
    `activation` (`swap.te_activation`); parameters copied exactly (an RMSNorm has no
    `layer_norm_bias`).

    TE's `gelu` is the tanh approximation, so with it this is not the same function as MPT's
    exact GELU (swap.plan_swap reports the size of the difference); TE's `relu` is MPT's.
    """
    require_cuda()
    import transformer_engine.pytorch as te

    norm, up = block.norm_2, block.ffn.up_proj
    new = te.LayerNormMLP(hidden_size=up.in_features, ffn_hidden_size=up.out_features,
                          eps=norm.eps, bias=up.bias is not None,
                          **{**PLAIN_LN_MLP, "normalization": normalization,
                             "activation": activation},
                          params_dtype=up.weight.dtype, device=te_device(up.weight))
    for src, dst in ln_mlp_sources(block, new):
        _copy(dst, src)
    return new


def ln_mlp_sources(block: nn.Module, fused: nn.Module) -> list[tuple[nn.Parameter,
                                                                     nn.Parameter]]:
    """(MPT block parameter, the te.LayerNormMLP parameter made from it), by LN_MLP_SOURCES;
    a bias-free MLP has fewer."""
    pairs = [(_dotted_attr(block, src), getattr(fused, dst, None))
             for dst, src in LN_MLP_SOURCES.items()]
    return [(src, dst) for src, dst in pairs if src is not None and dst is not None]


def _dotted_attr(root: Any, dotted: str) -> Any:
    """`root.a.b.c` for "a.b.c", None where any part is missing or None (a bias-free layer)."""
    for part in dotted.split("."):
        root = getattr(root, part, None)
    return root


def _check_backward_override(te_class: Any, recipe: FP8Recipe) -> None:
    """Raise `RecipeError` (one line naming NVTE_BACKWARD_OVERRIDE) where TE would fail to build
    `recipe` on the variable, rather than TE's bare 'Assertion failed' (a pydantic
    ValidationError; Composer's on every batch).
    TE read the variable once, when it was imported, into the recipe classes' `backward_override`
    default (`te.facts`), so that default is what is judged; a TE without the field ignores it."""
    field = next((f for f in dataclasses.fields(te_class) if f.name == "backward_override"), None)
    value = None if field is None else field.default
    problems = backward_override_problems(value, probe.te_version(), recipe.scaling)
    if problems:
        raise RecipeError(problems[0])


def delayed_scaling_kwargs(recipe: FP8Recipe) -> dict[str, Any]:
    """`DelayedScaling(**kwargs)` for a delayed recipe: the dict Composer's `precision_config`
    takes (Composer builds `DelayedScaling(**precision_config)` on every batch, so `fp8_format`
    must be TE's `Format` member: TE compares it with `Format.HYBRID`, a string never matches)."""
    from transformer_engine.common.recipe import DelayedScaling, Format

    if recipe.scaling != "delayed":
        raise ValueError(f"fp8_recipe.scaling: {recipe.scaling!r} has no DelayedScaling form")
    _check_backward_override(DelayedScaling, recipe)
    return {"fp8_format": Format[recipe.fp8_format], "amax_history_len": recipe.amax_history_len,
            "amax_compute_algo": recipe.amax_compute_algo, "margin": recipe.margin,
            "reduce_amax": recipe.reduce_amax}


def composer_delayed_kwargs(current: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The precision_config that keeps Composer's own amp_fp8 recipe buildable around te_swap's
    current-scaling autocast, or None where Composer's needs nothing.

    Composer builds `DelayedScaling(**precision_config)` on every batch, its defaults when the
    Trainer has none (composer/core/precision.py:91-97, Composer 0.31 and 0.32). With
    NVTE_BACKWARD_OVERRIDE set, TE >= 2.15's DelayedScaling takes the variable as its
    `backward_override` default and asserts it is None (common/recipe/__init__.py:226-228 at
    v2.15), so every batch would raise. That outer recipe scales nothing of ours (te_swap's
    autocast, the innermost, gives TE's modules their recipe): it gets `backward_override=None`.
    """
    from transformer_engine.common.recipe import DelayedScaling, Format

    field = next((f for f in dataclasses.fields(DelayedScaling)
                  if f.name == "backward_override"), None)
    if field is None or field.default is None:
        return None
    kwargs = dict(current) if current is not None else {
        "fp8_format": Format.HYBRID, "amax_history_len": 16, "amax_compute_algo": "max"}
    return {**kwargs, "backward_override": None}


def _current_scaling(te_recipe: Any, recipe: FP8Recipe) -> Any:
    """`Float8CurrentScaling` whose GEMM-input quantizers really use `use_power_2_scales`.

    The constructor field (TE >= 2.8) alone does not reach te.Linear's quantizers: they read the
    QParams class attributes, so this instance gets its own copies with `power_2_scale` set.
    """
    cls = te_recipe.Float8CurrentScaling
    _check_backward_override(cls, recipe)
    kwargs: dict[str, Any] = {"fp8_format": te_recipe.Format[recipe.fp8_format]}
    if "use_power_2_scales" in {f.name for f in dataclasses.fields(cls)}:
        kwargs["use_power_2_scales"] = recipe.use_power_2_scales
    new = cls(**kwargs)
    for name in TE_CURRENT_SCALING_QPARAMS:
        setattr(new, name, dataclasses.replace(getattr(new, name),
                                               power_2_scale=recipe.use_power_2_scales))
    return new


def power_2_env_conflict(recipe: FP8Recipe, te_version: Version | None) -> str | None:
    """The line to warn where POWER_2_SCALES_ENV, set, asks TE for other current-scaling
    scales than the recipe's `use_power_2_scales`, which `_current_scaling` applies. None
    under a TE known not to read the variable (older than POWER_2_SCALES_ENV_FROM)."""
    value = os.environ.get(POWER_2_SCALES_ENV)
    if (recipe.scaling != "current" or value is None
            or (te_version is not None and te_version < POWER_2_SCALES_ENV_FROM)):
        return None
    wanted = value == "1"  # TE's reading
    if wanted == recipe.use_power_2_scales:
        return None
    return (f"te_swap: {POWER_2_SCALES_ENV}={value!r} asks TE for "
            f"{'power-of-2' if wanted else 'exact'} scales, but fp8_recipe.use_power_2_scales "
            f"is {str(recipe.use_power_2_scales).lower()}, and the recipe's is used; write "
            f"fp8_recipe.use_power_2_scales: {str(wanted).lower()} for the variable's")


def to_te_recipe(recipe: FP8Recipe) -> Any:
    """The TE recipe object for `recipe`: `DelayedScaling` or `Float8CurrentScaling`."""
    from transformer_engine.common import recipe as te_recipe

    if recipe.scaling == "delayed":
        return te_recipe.DelayedScaling(**delayed_scaling_kwargs(recipe))
    if not hasattr(te_recipe, "Float8CurrentScaling"):
        raise RuntimeError(f"fp8_recipe.scaling: 'current' needs TransformerEngine >= "
                           f"{dotted(MIN_TE_CURRENT_SCALING)}, found {dotted(probe.te_version())}"
                           "; use scaling: delayed")
    return _current_scaling(te_recipe, recipe)


def te_fp8_autocast(recipe: FP8Recipe) -> AbstractContextManager:
    """Enter TE's FP8 autocast with `recipe` (`te.autocast` where it exists, else the older
    `te.fp8_autocast`). Nested inside another TE autocast, TE modules use this recipe (the
    innermost, `FP8GlobalStateManager.get_fp8_recipe()`); amax reduction and the delayed-scaling
    update run when the outermost autocast exits."""
    import transformer_engine.pytorch as te

    te_recipe = to_te_recipe(recipe)
    if hasattr(te, "autocast"):
        return te.autocast(enabled=True, recipe=te_recipe)
    return te.fp8_autocast(enabled=True, fp8_recipe=te_recipe)


def init_fp8_state(module: nn.Module, num_gemms: int) -> bool:
    """Create a TE module's FP8 scaling state for the autocast in force, as its first FP8
    forward would; whether this forward runs in FP8.

    TE 1.12-2.20 (`module/base.py`): `prepare_forward` calls `init_fp8_metadata(num_gemms)`,
    which sets the module's `fp8` flag from the global FP8 state and, when it is on, builds the
    recipe's state (3 forward tensors per GEMM for delayed scaling; current scaling's holds no
    scale). Outside an enabled autocast it builds nothing."""
    module.init_fp8_metadata(num_gemms=num_gemms)
    return bool(getattr(module, "fp8", False))


def te_high_precision(module: nn.Module) -> AbstractContextManager:
    """A region where TE's modules run in high precision, for fp8_guard's fallbacks.

    TE 2.20.2 (`pytorch/quantization.py`): entering saves the global FP8 state and sets FP8 off
    (`autocast.__enter__`, `autocast_enter`); a module then sees `fp8=False` in
    `init_fp8_metadata` (`module/base.py`), so it neither casts nor adds its amaxes to the
    reduction buffers, and its backward follows the forward (`ctx.fp8`). A nested region does not
    reset `is_first_fp8_module` (only depth 0 does) and its exit restores the saved state, so the
    backward amax reduction stays with the first module that does run in FP8; a disabled exit
    updates no scales. The layer's own delayed state, registered in TE's buffers by its earlier
    FP8 forwards, then sees zero amaxes, which the fused update leaves alone (no roll, scale kept:
    `common/recipe/delayed_scaling.cu`, `kernel_bulk`). Not run on a GPU yet.

    The region carries the enclosing autocast's recipe, or outside an enabled one (a recompute
    in the backward, a nested disabled region) the one `module` last ran FP8 under (TE keeps it
    in `fp8_meta["recipe"]`): TE stores even a disabled region's
    recipe (its default when given none) under a key made from the recipe's text, which leaves
    out `amax_compute_algo` (and `reduce_amax` before 2.8: `DelayedScaling.__repr__`,
    common/recipe/__init__.py, v2.7 vs v2.8), and the outermost exit updates every
    layer with the recipe stored last under that key (`autocast_enter`/`autocast_exit`,
    pytorch/quantization.py:675, 740-745 in TE 2.20; fp8.py:409-411 in 1.12), so a run with
    `most_recent` and history 1024 would be updated with `max` whenever a fallback ran.

    With neither (FP8 is off here and `module` never ran in FP8: an eval forward of a layer
    resumed in fallback) no region is entered: the layer already runs in high precision, and
    handed no recipe TE would build its default one (`DelayedScaling()` on Hopper,
    quantization.py:740, 249-254 in 2.20.2), which fails its assert under
    NVTE_BACKWARD_OVERRIDE (common/recipe/__init__.py:268-270).
    """
    import transformer_engine.pytorch as te

    recipe = probe.active_recipe() or getattr(module, "fp8_meta", {}).get("recipe")
    if recipe is None:
        return nullcontext()
    if hasattr(te, "autocast"):
        return te.autocast(enabled=False, recipe=recipe)
    return te.fp8_autocast(enabled=False, fp8_recipe=recipe)
