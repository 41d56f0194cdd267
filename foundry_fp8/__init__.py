"""foundry-fp8: safe, observable FP8 training with TransformerEngine for Composer and LLM-Foundry.

Importing this package is cheap: it imports neither torch nor TransformerEngine. The public
names below load on first use, so `foundry-fp8 lint` stays torch-free.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "TESwap": "foundry_fp8.composer.te_swap",
    "FP8Stats": "foundry_fp8.composer.stats",
    "FP8State": "foundry_fp8.composer.state",
    "FP8Lint": "foundry_fp8.composer.lint",
    "FP8Guard": "foundry_fp8.composer.guard",
    "FP8Recipe": "foundry_fp8.recipe",
    # layers in FP8 for any PyTorch model (te_swap's core, torchao's convert style)
    "convert_to_fp8": "foundry_fp8.swap",
    "SwapConfig": "foundry_fp8.options",
    # its FP8 scaling state for a plain loop's checkpoints (fp8_state's, without Composer)
    "fp8_state_dict": "foundry_fp8.plain_state",
    "load_fp8_state_dict": "foundry_fp8.plain_state",
    "tensor_stats": "foundry_fp8.numerics",
    # the emulated FP8 backend: stable names, whatever the file layout
    "EmulatedFP8Linear": "foundry_fp8.emulate",
    "fp8_autocast": "foundry_fp8.emulate",
    "fp8_checkpoint": "foundry_fp8.emulate",
    "quantize_dequantize": "foundry_fp8.numerics",
    "current_scale": "foundry_fp8.numerics",
    "delayed_scale_update": "foundry_fp8.numerics",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'foundry_fp8' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
