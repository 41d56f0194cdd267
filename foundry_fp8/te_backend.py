"""The one module that touches TransformerEngine (imported lazily, GPU machines only)."""

from __future__ import annotations

import importlib.util

from torch import nn


def te_available() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def require_te() -> None:
    """Fail clearly where TE cannot be imported: never fall back silently."""
    if not te_available():
        raise RuntimeError("te_swap: backend 'te' needs TransformerEngine (pip install "
                           "'foundry-fp8[te]' on a GPU machine); for FP8 numerics without TE "
                           "use te_swap: {backend: emulate}")


def make_te_linear(src: nn.Linear) -> nn.Module:
    """A `te.Linear` with `src`'s shapes, dtype and device, weights copied exactly."""
    import torch
    import transformer_engine.pytorch as te

    new = te.Linear(src.in_features, src.out_features, bias=src.bias is not None,
                    params_dtype=src.weight.dtype, device=src.weight.device)
    if src.weight.device.type != "meta":
        with torch.no_grad():
            new.weight.copy_(src.weight)
            if src.bias is not None:
                new.bias.copy_(src.bias)
    return new
