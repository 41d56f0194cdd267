"""Reading a resolved train config without ever crashing on odd input: the questions several
rule files ask (is this run FP8, which layers run in FP8, what does te_swap get)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from foundry_fp8.lint.entries import NO_DEFAULT, UNREADABLE, our_entries
from foundry_fp8.lint.registry import section


def fsdp_version_from_env(environ: Mapping[str, str]) -> int:
    """The FSDP version Composer's Trainer will use (trainer.py, `_parse_parallelism_config`)."""
    return 2 if environ.get("FSDP_VERSION", "1") == "2" else 1


def wandb_mode_from_env(environ: Mapping[str, str]) -> str | None:
    """W&B's mode as `wandb.init` reads it from the environment (wandb 0.18 sdk/wandb_settings.py
    `_apply_env_vars`): WANDB_MODE, else `disabled` for a true WANDB_DISABLED; None: not set."""
    mode = environ.get("WANDB_MODE", "").strip().lower()
    if mode:
        return mode
    disabled = environ.get("WANDB_DISABLED", "").strip().lower()
    return "disabled" if disabled in ("true", "1", "yes") else None


def get(config: Any, path: str) -> Any:
    node: Any = config
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


def as_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def as_number(value: Any) -> int | float | None:
    """A number the rules may do arithmetic with: an int of any size (exact; math.isfinite or a
    float() of one past 1.8e308 raises OverflowError) or a finite float; None for NaN, the
    infinities, booleans and what is no number."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    return as_int(value)


def precision(config: Mapping[str, Any]) -> str:
    value = config.get("precision", "amp_bf16")  # TrainConfig's default
    return value.lower() if isinstance(value, str) else ""


def is_fp8(config: Mapping[str, Any]) -> bool:
    return precision(config) == "amp_fp8"


def fc_type_name(model: Mapping[str, Any]) -> Any:
    fc_type = model.get("fc_type")
    return fc_type.get("name") if isinstance(fc_type, Mapping) else fc_type


def native_te_layers(config: Mapping[str, Any]) -> bool:
    """The model itself builds TE layers: `fc_type: te` (either form) or `te_ln_mlp`."""
    model = section(config, "model")
    return fc_type_name(model) == "te" or get(model, "ffn_config.ffn_type") == "te_ln_mlp"


def te_swap(config: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """te_swap's options (defaults filled in from its signature), None when not used."""
    algorithms = section(config, "algorithms")
    if "te_swap" not in algorithms:
        return None
    entry = our_entries().get(("algorithms", "te_swap"))
    defaults = {n: o.default for n, o in entry.options.items()
                if o.default not in (NO_DEFAULT, UNREADABLE)} if entry else {}
    given = algorithms["te_swap"]
    return {**defaults, **(given if isinstance(given, Mapping) else {})}


def uses_te(config: Mapping[str, Any]) -> bool:
    """Does this run need real TE (TE layers, or te_swap with its default `te` backend)?"""
    swap = te_swap(config)
    return native_te_layers(config) or (swap is not None and swap.get("backend") == "te")


def has_fp8_layers(config: Mapping[str, Any]) -> bool:
    return native_te_layers(config) or te_swap(config) is not None


def fsdp(config: Mapping[str, Any]) -> Mapping[str, Any]:
    return section(config, "fsdp_config")


def wraps_blocks(fsdp_config: Mapping[str, Any]) -> bool:
    """Composer wraps blocks with either setting, and then asserts te_checkpoint_wrapper's
    non-reentrant checkpointing (dist_strategy.py); only `activation_checkpointing` recomputes
    (`activation_cpu_offload` alone wraps them in offload_wrapper, which only moves saved
    activations to the CPU)."""
    return bool(fsdp_config.get("activation_checkpointing")
                or fsdp_config.get("activation_cpu_offload"))


def has_fp8_state(config: Mapping[str, Any]) -> bool:
    """fp8_state sets te_checkpoint_wrapper and non-reentrant recompute at INIT (FSDP1, TE) and
    keeps FP8 scales across resumes."""
    return "fp8_state" in section(config, "callbacks")
