"""What TransformerEngine is installed, and what its modules and FP8 global state look like,
read without importing TE (and without torch): a TE module in a model means TE is loaded, so
its state manager is found in `sys.modules`.
"""

from __future__ import annotations

import importlib.util
import sys
from importlib import metadata
from typing import Any

from foundry_fp8.te.facts import Version, ln_mlp_grad_slot, parse_version

#: TE's GEMM modules, by class name (transformer_engine.pytorch).
TE_GEMM_MODULES = ("Linear", "LayerNormLinear", "LayerNormMLP")

#: LayerNormMLP's weight scale slots in its forward `fp8_meta` (TE 2.20 pytorch/csrc/common.h,
#: FP8FwdTensors GEMM1_WEIGHT and GEMM2_WEIGHT).
GEMM1_WEIGHT, GEMM2_WEIGHT = 1, 4

#: Where `FP8GlobalStateManager` lives: pytorch/quantization.py from TE 2.9, pytorch/fp8.py
#: before.
_STATE_MANAGER_MODULES = ("transformer_engine.pytorch.quantization",
                          "transformer_engine.pytorch.fp8")


def te_available() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def te_version() -> Version | None:
    """The installed TE's version as integers (e.g. (2, 20, 2)); None when TE is absent or has
    no package metadata (TE's own `__version__` reads the same metadata)."""
    if not te_available():
        return None
    try:
        return parse_version(metadata.version("transformer_engine"))
    except metadata.PackageNotFoundError:
        return None


def te_builds_without_cuda() -> bool:
    """False: no TE builds a module where torch sees no CUDA device
    (`TransformerEngineBaseModule.__init__`: an assert from 1.12, "RuntimeError: TransformerEngine
    needs CUDA." from 2.14, pytorch/module/base.py:895-896 in 2.20.2). The tests' stand-in TE,
    which computes on the CPU, answers True."""
    return False


def te_class_name(module: Any) -> str | None:
    """`Linear`, `LayerNormLinear` or `LayerNormMLP` for TE's modules (or subclasses), by class
    name and module prefix."""
    for cls in type(module).__mro__:
        if cls.__module__.startswith("transformer_engine") and cls.__name__ in TE_GEMM_MODULES:
            return cls.__name__
    return None


def is_te_module(module: Any) -> bool:
    """Any TE module, TE's ops (`te.LayerNorm`) included."""
    return type(module).__module__.startswith("transformer_engine")


def is_te_fp8_module(module: Any) -> bool:
    """A TE module that runs in FP8 under TE's autocast: it has `fp8_meta` and TE's
    `init_fp8_metadata` (pytorch/module/base.py), before its first FP8 forward too."""
    return getattr(module, "fp8_meta", None) is not None and hasattr(module, "init_fp8_metadata")


def ln_mlp_gradient_slot() -> int | None:
    """fc2's grad-output slot in the installed TE's LayerNormMLP (None: TE unknown)."""
    return ln_mlp_grad_slot(te_version())


def _state_manager() -> Any:
    for name in _STATE_MANAGER_MODULES:
        manager = getattr(sys.modules.get(name), "FP8GlobalStateManager", None)
        if manager is not None:
            return manager
    return None


def active_recipe() -> Any:
    """The TE recipe in force (the innermost TE autocast's), None outside TE's FP8 autocast or
    when TE is not loaded."""
    manager = _state_manager()
    if manager is None or not manager.is_fp8_enabled():
        return None
    return manager.get_fp8_recipe()


def active_cast_formats() -> tuple[bool, str, str] | None:
    """(delayed, forward format, backward format) of the TE recipe in force; None outside TE's
    autocast, and for block scaling (MXFP8, NVFP4: no per-tensor scale)."""
    recipe = active_recipe()
    if recipe is None:
        return None
    kind = type(recipe).__name__
    delayed = recipe.delayed() if hasattr(recipe, "delayed") else kind == "DelayedScaling"
    if not delayed and kind != "Float8CurrentScaling":
        return None
    fmt = getattr(getattr(recipe, "fp8_format", None), "name", "HYBRID")
    return delayed, "e5m2" if fmt == "E5M2" else "e4m3", "e4m3" if fmt == "E4M3" else "e5m2"
