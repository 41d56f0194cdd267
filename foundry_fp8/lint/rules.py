"""Lint rules for LLM-Foundry train configs: pure Python over a resolved dict, no torch.

Each rule is a function `(config) -> findings`, registered in RULES with its id and rationale.
Recipe checks reuse `foundry_fp8.recipe.recipe_problems`, so the linter and `te_swap` agree.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from foundry_fp8.recipe import recipe_problems
from foundry_fp8.shapes import dim_fits_fp8, tokens_fit_fp8


@dataclass(frozen=True)
class Finding:
    rule: str
    severity: str  # "error" | "warning" | "info"
    key: str  # dotted key path
    message: str
    fix: str


@dataclass(frozen=True)
class Rule:
    id: str
    check: Callable[[Mapping[str, Any]], Iterator[Finding]]
    rationale: str


def _get(config: Mapping[str, Any], path: str) -> Any:
    node: Any = config
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


def _section(config: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    """A sub-mapping, or an empty one when absent or of the wrong type (never crash on input)."""
    value = config.get(key)
    return value if isinstance(value, Mapping) else {}


def _is_fp8(config: Mapping[str, Any]) -> bool:
    return config.get("precision") == "amp_fp8"


def _has_te_layers(config: Mapping[str, Any]) -> bool:
    model = _section(config, "model")
    return (_get(model, "fc_type") == "te" or _get(model, "fc_type.name") == "te"
            or _get(model, "ffn_config.ffn_type") == "te_ln_mlp"
            or "te_swap" in _section(config, "algorithms"))


def fp8_without_fp8_layers(config: Mapping[str, Any]) -> Iterator[Finding]:
    if _is_fp8(config) and not _has_te_layers(config):
        yield Finding("FP8001", "error", "precision",
                      "precision amp_fp8, but no layer would run in FP8 (no fc_type: te, no "
                      "ffn_type: te_ln_mlp, no te_swap algorithm)",
                      "add `algorithms: {te_swap: {}}` or `model.fc_type: te`")


def recompute_without_te_checkpoint(config: Mapping[str, Any]) -> Iterator[Finding]:
    fsdp = _section(config, "fsdp_config")
    if (_is_fp8(config) and fsdp.get("activation_checkpointing")
            and not fsdp.get("te_checkpoint_wrapper")):
        yield Finding("FP8002", "error", "fsdp_config.activation_checkpointing",
                      "activation checkpointing with FP8 recomputes TE layers outside the FP8 "
                      "autocast (the recompute differs from the forward)",
                      "set fsdp_config.te_checkpoint_wrapper: true and "
                      "activation_checkpointing_reentrant: false")


def te_wrapper_reentrant(config: Mapping[str, Any]) -> Iterator[Finding]:
    fsdp = _section(config, "fsdp_config")
    if fsdp.get("te_checkpoint_wrapper") and fsdp.get("activation_checkpointing_reentrant", True):
        yield Finding("FP8003", "error", "fsdp_config.te_checkpoint_wrapper",
                      "te_checkpoint_wrapper needs non-reentrant checkpointing, and Composer "
                      "defaults activation_checkpointing_reentrant to true",
                      "set fsdp_config.activation_checkpointing_reentrant: false")


def te_ln_mlp_with_act_fn(config: Mapping[str, Any]) -> Iterator[Finding]:
    ffn = _section(_section(config, "model"), "ffn_config")
    if ffn.get("ffn_type") == "te_ln_mlp" and "ffn_act_fn" in ffn:
        yield Finding("FP8004", "error", "model.ffn_config.ffn_act_fn",
                      "te_ln_mlp takes its activation as `activation`, not ffn_act_fn",
                      "remove ffn_act_fn (TE's LayerNormMLP uses its own gelu, tanh approx)")


def gemm_dims(config: Mapping[str, Any]) -> Iterator[Finding]:
    if not (_is_fp8(config) or _has_te_layers(config)):
        return
    model = _section(config, "model")
    d_model = model.get("d_model")
    if isinstance(d_model, int) and not dim_fits_fp8(d_model):
        yield Finding("FP8005", "error", "model.d_model",
                      f"d_model {d_model} is not divisible by 16, as TE's FP8 GEMMs require",
                      "use a multiple of 16")
    ratio = model.get("expansion_ratio")
    if isinstance(d_model, int) and isinstance(ratio, (int, float)):
        hidden = int(d_model * ratio)
        if not dim_fits_fp8(hidden):
            yield Finding("FP8005", "error", "model.expansion_ratio",
                          f"FFN hidden size {hidden} is not divisible by 16", "adjust expansion_ratio")
    micro = config.get("device_train_microbatch_size")
    seq = config.get("max_seq_len")
    if isinstance(micro, int) and isinstance(seq, int) and not tokens_fit_fp8(micro * seq):
        yield Finding("FP8006", "error", "device_train_microbatch_size",
                      f"{micro} x {seq} tokens per micro-batch is not divisible by 8, as TE's FP8 "
                      "GEMMs require", "choose a micro-batch size or max_seq_len that fixes it")


def precision_config_key(config: Mapping[str, Any]) -> Iterator[Finding]:
    if "precision_config" in config:
        yield Finding("FP8007", "error", "precision_config",
                      "LLM-Foundry 0.22's train config has no precision_config key",
                      "set the recipe with `algorithms: {te_swap: {fp8_recipe: {...}}}`")


def recipe_keys(config: Mapping[str, Any]) -> Iterator[Finding]:
    recipe = _get(config, "algorithms.te_swap.fp8_recipe")
    if recipe is None:
        return
    for problem in recipe_problems(recipe):
        key = "algorithms.te_swap.fp8_recipe" + (f".{problem.key}" if problem.key else "")
        yield Finding("FP8008", "error", key, problem.message, problem.fix)


RULES = [
    Rule("FP8001", fp8_without_fp8_layers, "Composer runs amp_fp8 with no TE layer without FP8 "
         "at all, behind one warning (LLM-Foundry: 'fp8 only supported for te.Linear layers')."),
    Rule("FP8002", recompute_without_te_checkpoint, "torch.utils.checkpoint (FSDP's default "
         "wrapper) recomputes TE modules outside fp8_autocast; TE issue #1190."),
    Rule("FP8003", te_wrapper_reentrant, "Composer's te_checkpoint_wrapper is non-reentrant only; "
         "FSDPConfig.activation_checkpointing_reentrant defaults to True."),
    Rule("FP8004", te_ln_mlp_with_act_fn, "LLM-Foundry's te_ln_mlp builds te.LayerNormMLP, "
         "which has no ffn_act_fn argument."),
    Rule("FP8005", gemm_dims, "TE FP8 GEMMs need the last dim divisible by 16 and the product "
         "of leading dims divisible by 8."),
    Rule("FP8007", precision_config_key, "LLM-Foundry 0.22's TrainConfig rejects unknown keys."),
    Rule("FP8008", recipe_keys, "TE's recipes reject pure E5M2 and removed keys."),
]


def lint_config(config: Mapping[str, Any]) -> list[Finding]:
    """All findings for a resolved train config."""
    return [finding for rule in RULES for finding in rule.check(config)]
