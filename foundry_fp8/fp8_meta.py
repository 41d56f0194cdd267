"""Read and write a module's delayed-scaling state without TE's pickled `_extra_state`.

Duck-typed on `module.fp8_meta["scaling_fwd"/"scaling_bwd"]` with `.scale` and `.amax_history`:
the layout of TE's modules and of our EmulatedFP8Linear. No TE import.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

_DIRECTIONS = (("fwd", "scaling_fwd"), ("bwd", "scaling_bwd"))


def read_fp8_meta(module: nn.Module) -> dict[str, torch.Tensor]:
    """`{fwd_scale, fwd_amax_history, bwd_scale, bwd_amax_history}` (copies); empty if none."""
    meta = getattr(module, "fp8_meta", None)
    tensors: dict[str, torch.Tensor] = {}
    if meta is None:
        return tensors
    for short, key in _DIRECTIONS:
        if key in meta and hasattr(meta[key], "scale"):
            tensors[f"{short}_scale"] = meta[key].scale.detach().cpu().clone()
            tensors[f"{short}_amax_history"] = meta[key].amax_history.detach().cpu().clone()
    return tensors


def write_fp8_meta(module: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Restore what `read_fp8_meta` returned, in place, on the module's device."""
    for short, key in _DIRECTIONS:
        if f"{short}_scale" not in tensors:
            continue
        target = module.fp8_meta[key]
        device = target.scale.device
        history = tensors[f"{short}_amax_history"].to(device)
        if target.amax_history.shape == history.shape:
            target.amax_history.copy_(history)
        else:  # the history length follows the checkpoint's recipe
            target.amax_history = history.clone()
        target.scale.copy_(tensors[f"{short}_scale"].to(device))


def fp8_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """`(name, module)` for every module that holds delayed-scaling state."""
    for name, module in model.named_modules():
        if read_fp8_meta(module):
            yield name, module
