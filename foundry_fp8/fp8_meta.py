"""Read and write a module's delayed-scaling state without TE's pickled `_extra_state`.

Duck-typed on `module.fp8_meta["scaling_fwd"/"scaling_bwd"]` with `.scale` [n] and
`.amax_history` [history_len, n]: the layout of TE's modules and of our EmulatedFP8Linear. TE
(2.20: `module/base.py`, `set_meta_tensor`) creates it at a module's first forward under FP8
autocast, as a `DelayedScalingRecipeState` for delayed scaling, with n = 3 per GEMM forward
(input, weight, output) and 2 per GEMM backward (grad output, grad input); current scaling's
state has no `scale`, so it reads as no state. TE 1.x's `FP8TensorMeta` also holds `scale_inv`.
No TE import.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch
from torch import nn

from foundry_fp8.te.probe import is_te_fp8_module

_DIRECTIONS = (("fwd", "scaling_fwd"), ("bwd", "scaling_bwd"))

# Name segments that FSDP, activation checkpointing and torch.compile insert into module names.
_WRAPPER_SEGMENT = re.compile(r"(^|\.)(_fsdp_wrapped_module|_checkpoint_wrapped_module|_orig_mod)"
                              r"(?=\.|$)")


def canonical_name(name: str, ddp: bool = False) -> str:
    """A module name without the wrappers' segments, so FSDP, DDP and plain runs use the same
    keys. `ddp`: the name comes from a DistributedDataParallel's `named_modules()`, whose first
    segment is DDP's own `module` (a model may have a child named `module` too, as Composer's
    ComposerClassifier does: only the caller knows which one it is)."""
    if ddp and name.split(".")[0] == "module":
        name = name[len("module."):]
    return _WRAPPER_SEGMENT.sub("", name).lstrip(".")


def canonical_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """`model.named_modules()` under `canonical_name`s; a DDP wrapper itself is left out."""
    ddp = isinstance(model, nn.parallel.DistributedDataParallel)
    for name, module in model.named_modules():
        if not (ddp and module is model):
            yield canonical_name(name, ddp=ddp), module


def is_fp8_module(module: nn.Module) -> bool:
    """A module that can run in FP8: TE's Linear/LayerNormLinear/LayerNormMLP (an `fp8_meta`
    dict and TE's `init_fp8_metadata`) or our EmulatedFP8Linear. TE modules count before their
    first FP8 forward too, when they hold no scaling state yet."""
    return is_te_fp8_module(module) or bool(read_fp8_meta(module))


def read_fp8_meta(module: nn.Module) -> dict[str, torch.Tensor]:
    """`{fwd_scale, fwd_amax_history, bwd_scale, bwd_amax_history}` (copies); empty if none."""
    meta = getattr(module, "fp8_meta", None)
    tensors: dict[str, torch.Tensor] = {}
    if meta is None:
        return tensors
    for short, key in _DIRECTIONS:
        if key in meta and hasattr(meta[key], "scale") and hasattr(meta[key], "amax_history"):
            tensors[f"{short}_scale"] = meta[key].scale.detach().cpu().clone()
            tensors[f"{short}_amax_history"] = meta[key].amax_history.detach().cpu().clone()
    return tensors


def write_fp8_meta(module: nn.Module, tensors: dict[str, torch.Tensor], *,
                   check_only: bool = False) -> None:
    """Restore what `read_fp8_meta` returned, in place, on the module's device.

    In place: TE's quantizers hold views of `scale` and of `amax_history[0]`, and its global
    amax-reduction buffers reference the tensors themselves. So shapes must match, except that a
    history still empty (EmulatedFP8Linear before its first forward) takes the checkpoint's
    length. Otherwise a different history length means a different recipe, and raises
    ValueError. Both directions are checked and moved to the module's device before either is
    written, so a failure leaves the module as it was, never forward restored and backward not
    (a device error inside the copies aside). `check_only`: raise as a write would, write
    nothing (a caller writing several modules checks them all first). A `scale_inv` (TE 1.x's
    `FP8TensorMeta`) is set to 1 / scale, as TE's own scale update does, so no cast or GEMM
    sees a stale pair.
    """
    targets = {}
    for short, key in _DIRECTIONS:
        if f"{short}_scale" not in tensors:
            continue
        target = module.fp8_meta[key]
        for name in ("scale", "amax_history"):
            have, want = getattr(target, name).shape, tensors[f"{short}_{name}"].shape
            if have != want and not (name == "amax_history" and have[0] == 0):
                raise ValueError(f"{short}_{name} has shape {tuple(want)} in the checkpoint, "
                                 f"{tuple(have)} in the model")
        targets[short] = target
    if check_only:
        return
    moved = {short: (tensors[f"{short}_scale"].to(target.scale.device),
                     tensors[f"{short}_amax_history"].to(target.amax_history.device))
             for short, target in targets.items()}
    for short, target in targets.items():
        scale, history = moved[short]
        if target.amax_history.shape[0] == 0:
            target.amax_history = history.clone()
        else:
            target.amax_history.copy_(history)
        target.scale.copy_(scale)
        if isinstance(getattr(target, "scale_inv", None), torch.Tensor):
            target.scale_inv.copy_(target.scale.reciprocal())


def fp8_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """`(canonical name, module)` for every FP8 module of `model`, with or without state yet."""
    for name, module in canonical_modules(model):
        if is_fp8_module(module):
            yield name, module
