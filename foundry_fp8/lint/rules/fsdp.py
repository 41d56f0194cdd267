"""FSDP and activation recompute with FP8: which wrapper recomputes, whether reentrant, which
FSDP version reads which key; auto micro-batching under FSDP on this Composer and torch."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import replace
from typing import Any

from foundry_fp8.lint.config import (
    fsdp,
    get,
    has_fp8_layers,
    has_fp8_state,
    is_fp8,
    te_swap,
    uses_te,
    wraps_blocks,
)
from foundry_fp8.lint.known import (
    AUTO_MICROBATCH_CHECKED_FROM,
    AUTO_MICROBATCH_SOURCE,
    FOUNDRY_FSDP_KEEPS_MASTER_DTYPES,
    FOUNDRY_MASTER_WEIGHTS_DTYPES,
    FP8_DTYPE_NAMES,
    FSDP2_CONFIG_KEYS,
    FSDP_CONFIG_KEYS,
    MIXED_PRECISION_DTYPE_KEYS,
    MIXED_PRECISION_MODES,
    MPT_ATTN_IMPL_DEFAULT,
    MPT_MODEL_NAMES,
    REENTRANT_DEFAULT,
    TORCH_DTYPE_NAMES,
    UNSHARD_TORCH_RANGE,
    auto_microbatch_fsdp_fails,
    belongs_under,
    did_you_mean,
    move_fix,
)
from foundry_fp8.lint.registry import Hit, LintContext, join_key, rule, section
from foundry_fp8.lint.rules.environment import judged_version, what_runs
from foundry_fp8.lint.rules.train import COMPOSER, FOUNDRY, RETIRED_FSDP
from foundry_fp8.te.facts import MIN_TE_FOR_RECOMPUTE, dotted, parse_version

#: FSDPConfig flags Composer reads only under amp_fp8 and only in FSDP1 (dist_strategy.py).
TE_FSDP_FLAGS = ("te_checkpoint_wrapper", "te_shard_fp8_weight")
TE_1190 = "TE issue https://github.com/NVIDIA/TransformerEngine/issues/1190"


#: How a warning about a file of unknown world size says how to make it known.
GPUS_HINT = "`foundry-fp8 lint --gpus N` says how many GPUs it trains on"


@rule("FP8002", "error", "FSDP activation checkpointing with FP8 but no `te_checkpoint_wrapper`",
      why="Without te_checkpoint_wrapper Composer recomputes blocks with torch's checkpoint, "
      "which runs TE modules outside fp8_autocast: the recompute differs from the forward. "
      "Reported as info when fp8_state is in the callbacks, which sets it at INIT, or when the "
      "run is known to have one process (MCLI `compute.gpus: 1`, `--gpus 1`), where "
      "LLM-Foundry drops fsdp_config; not reported when nothing runs in FP8 (FP8001).",
      source=f"{COMPOSER} composer/distributed/dist_strategy.py prepare_fsdp_module; TE PR "
      f"https://github.com/NVIDIA/TransformerEngine/pull/24 (recompute outside fp8_autocast); "
      f"{TE_1190}; foundry_fp8/composer/state.py recompute_settings",
      fix="fsdp_config: {te_checkpoint_wrapper: true, activation_checkpointing_reentrant: false}")
def recompute_without_te_checkpoint(config: Mapping[str, Any], ctx: LintContext,
                                    ) -> Iterator[Hit]:
    settings = fsdp(config)
    if not (is_fp8(config) and has_fp8_layers(config) and ctx.fsdp_version == 1
            and settings.get("activation_checkpointing")
            and not settings.get("te_checkpoint_wrapper")):
        return
    if has_fp8_state(config):
        yield _in_one_process(ctx, Hit(
            "fsdp_config.activation_checkpointing", "fp8_state switches on "
            "te_checkpoint_wrapper with non-reentrant recompute at INIT (FSDP1 and TE >= "
            f"{dotted(MIN_TE_FOR_RECOMPUTE)}; otherwise it refuses the run)", severity="info"))
    else:
        yield _in_one_process(ctx, Hit("fsdp_config.activation_checkpointing", "activation "
                              "checkpointing with FP8 recomputes TE layers outside the FP8 "
                              "autocast (the recompute differs from the forward)"))


def _in_one_process(ctx: LintContext, hit: Hit) -> Hit:
    """`hit` about FSDP's wrapping, an info where a train run is known to have one process:
    LLM-Foundry's train drops fsdp_config there (llmfoundry/command_utils/train.py:319-331,
    'FSDP is not applicable for single-GPU training. Reverting to DDP.'), so nothing is
    wrapped or recomputed. Its eval (evaluate_model) keeps fsdp_config: `hit` as it is."""
    if ctx.gpus != 1 or ctx.family != "train":
        return hit
    return replace(hit, severity="info", message=f"{ctx.gpus_text()}: LLM-Foundry drops "
                   "fsdp_config in one process, so FSDP wraps nothing and nothing is "
                   "recomputed; on 2+ GPUs: " + hit.message)


def _foundry_flips_reentrant(config: Mapping[str, Any]) -> bool:
    """LLM-Foundry's validate_config turns an explicit `activation_checkpointing_reentrant:
    true` into false for `fc_type: te` (the string only) or a `te` ffn_type when
    activation_checkpointing is on."""
    settings = fsdp(config)
    model = section(config, "model")
    foundry_sees_te = (model.get("fc_type", "torch") == "te"
                       or "te" in str(get(model, "ffn_config.ffn_type") or "mptmlp"))
    return (settings.get("activation_checkpointing_reentrant") is True and foundry_sees_te
            and settings.get("activation_checkpointing") is True)


def _reentrant(config: Mapping[str, Any]) -> bool:
    """The reentrant setting Composer ends up with (its default is true)."""
    if _foundry_flips_reentrant(config):
        return False
    return bool(fsdp(config).get("activation_checkpointing_reentrant", REENTRANT_DEFAULT))


@rule("FP8003", "error", "`te_checkpoint_wrapper` with reentrant checkpointing "
      "(Composer's default)",
      why="Composer asserts 'TE checkpoint only works with non-reentrant checkpointing' when "
      "it wraps blocks under amp_fp8 (for activation_checkpointing or activation_cpu_offload), "
      "and FSDPConfig defaults activation_checkpointing_reentrant to true. LLM-Foundry's train "
      "flips an explicit true to false only for `fc_type: te` (string) or a te ffn_type "
      "(FP8025); its eval builds the same FSDP Trainer and flips nothing. Info when fp8_state "
      "is in the callbacks (it sets it at INIT), or for a train config known to have one "
      "process (MCLI `compute.gpus: 1`, `--gpus 1`), where LLM-Foundry's train drops "
      "fsdp_config (its eval does not).",
      source=f"{COMPOSER} composer/distributed/dist_strategy.py prepare_fsdp_module and "
      f"composer/utils/parallelism.py FSDPConfig; {FOUNDRY} llmfoundry/command_utils/train.py "
      "validate_config and :319-331 (one process: fsdp_config = None), "
      "llmfoundry/command_utils/eval.py evaluate_model (Trainer with "
      "parallelism_config {'fsdp': fsdp_config})",
      fix="fsdp_config.activation_checkpointing_reentrant: false", also=("eval",))
def te_wrapper_reentrant(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Hit]:
    settings = fsdp(config)
    if not (is_fp8(config) and ctx.fsdp_version == 1 and settings.get("te_checkpoint_wrapper")
            and wraps_blocks(settings) and _reentrant(config)):
        return
    if has_fp8_state(config):
        yield _in_one_process(ctx, Hit("fsdp_config.te_checkpoint_wrapper", "fp8_state sets "
                              "activation_checkpointing_reentrant: false at INIT",
                              severity="info"))
        return
    given = settings.get("activation_checkpointing_reentrant", REENTRANT_DEFAULT)
    said = ("Composer defaults activation_checkpointing_reentrant to true"
            if "activation_checkpointing_reentrant" not in settings else
            "this config sets activation_checkpointing_reentrant: true" if given is True else
            f"this config sets activation_checkpointing_reentrant to {given!r}, which Composer "
            "takes as true")
    yield _in_one_process(ctx, Hit("fsdp_config.te_checkpoint_wrapper", "te_checkpoint_wrapper "
                          f"needs non-reentrant checkpointing, and {said} (Composer asserts at "
                          "FSDP wrapping)"))


@rule("FP8025", "info", "`activation_checkpointing_reentrant: true` that LLM-Foundry turns off",
      why="With activation_checkpointing on and `fc_type: te` (the string) or a te ffn_type, "
      "LLM-Foundry's validate_config sets activation_checkpointing_reentrant to false with only "
      "a log line: the YAML says reentrant, the run is not.",
      source=f"{FOUNDRY} llmfoundry/command_utils/train.py validate_config",
      fix="write activation_checkpointing_reentrant: false, which is what runs")
def reentrant_switched_off(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Hit]:
    if ctx.fsdp_version == 1 and _foundry_flips_reentrant(config):
        yield Hit("fsdp_config.activation_checkpointing_reentrant", "LLM-Foundry switches "
                  "reentrant checkpointing off for TE layers (fc_type: te or a te ffn_type): "
                  "the run recomputes non-reentrant although this says true")


@rule("FP8010", "error", "unknown `fsdp_config` keys (did-you-mean, or where the key belongs)",
      why="FSDPConfig.__init__ sets every keyword as an attribute, so a misspelled key (say "
      "`activation_checkpointing_reentrnt`) is silently ignored. Keys only the other FSDP "
      "version reads are warnings. A key read in another section is told where it belongs "
      "(activation_checkpointing_target, which MPT reads under model:) instead of a spelling "
      "guess (foundry_fp8/lint/known.py home_of).",
      source=f"{COMPOSER} composer/utils/parallelism.py FSDPConfig, "
      "FSDP2Config.from_compatible_attrs",
      fix="fix the spelling or remove the key", also=("eval",), unresolved=True)
def unknown_fsdp_keys(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Hit]:
    known = FSDP_CONFIG_KEYS if ctx.fsdp_version == 1 else FSDP2_CONFIG_KEYS
    other = FSDP2_CONFIG_KEYS if ctx.fsdp_version == 1 else FSDP_CONFIG_KEYS
    retired = RETIRED_FSDP if ctx.fsdp_version == 1 else {}
    for key in fsdp(config):
        key = str(key)
        if key in known or key in retired or (ctx.fsdp_version == 2 and key in TE_FSDP_FLAGS):
            continue  # FP8015 reports te_* flags under FSDP2
        if key in other:
            yield Hit(join_key("fsdp_config", key), f"only FSDP{3 - ctx.fsdp_version} reads `{key}`; "
                      f"Composer ignores it under FSDP{ctx.fsdp_version}", severity="warning",
                      fix="remove it, or run the FSDP version that reads it (FSDP_VERSION)")
        else:
            yield Hit(join_key("fsdp_config", key), f"Composer's FSDP{ctx.fsdp_version} config has no "
                      f"`{key}`; it would be silently ignored"
                      + (belongs_under(key, "fsdp_config") or did_you_mean(key, known)),
                      fix=move_fix(key, "fsdp_config"))


_DTYPE_MAPPING = "use DEFAULT, PURE, FULL or a {param_dtype, reduce_dtype, buffer_dtype} mapping"


@rule("FP8012", "error", "FSDP `mixed_precision` Composer cannot interpret, or FP8 dtypes in it",
      why="get_mixed_precision accepts DEFAULT, PURE, FULL or a mapping of param_dtype, "
      "reduce_dtype and buffer_dtype (other keys are ignored) and raises on other values; "
      "FP8 dtype names become bfloat16 (warning).",
      source=f"{COMPOSER} composer/distributed/mosaic_parallelism.py get_mixed_precision, "
      "_get_torch_dtype",
      fix="DEFAULT (the usual choice with amp_fp8), PURE or FULL", also=("eval",))
def fsdp_mixed_precision(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Hit]:
    settings = fsdp(config)
    if "mixed_precision" not in settings:
        return
    value = settings["mixed_precision"]
    key = "fsdp_config.mixed_precision"
    if isinstance(value, str):
        if value.upper() not in MIXED_PRECISION_MODES:
            yield Hit(key, f"Composer cannot interpret mixed_precision {value!r}"
                      + did_you_mean(value.upper(), MIXED_PRECISION_MODES), fix=_DTYPE_MAPPING)
        return
    if not isinstance(value, Mapping):
        yield Hit(key, f"Composer cannot interpret mixed_precision {value!r}", fix=_DTYPE_MAPPING)
        return
    for name, dtype in value.items():
        sub = join_key(key, name)
        if name not in MIXED_PRECISION_DTYPE_KEYS:
            yield Hit(sub, f"Composer reads only {', '.join(MIXED_PRECISION_DTYPE_KEYS)}; "
                      f"`{name}` is ignored" + did_you_mean(str(name), MIXED_PRECISION_DTYPE_KEYS),
                      fix="fix the spelling or remove the key")
        elif dtype is not None and (not isinstance(dtype, str) or dtype not in TORCH_DTYPE_NAMES):
            yield Hit(sub, f"Composer does not know dtype {dtype!r}",
                      fix="use float32, bfloat16 or float16")
        elif dtype in FP8_DTYPE_NAMES:
            yield Hit(sub, f"{name} {dtype!r} means bfloat16: FSDP never keeps or communicates "
                      "parameters in FP8 (only TE layers compute in FP8)", severity="warning",
                      fix=f"write {name}: bfloat16 to say what happens")


@rule("FP8013", "error", "FSDP activation checkpointing with te_swap's emulated backend",
      why="The emulated FP8 autocast is entered around the model's forward, so a recompute in "
      "backward runs outside it, without FP8, unlike the forward it replays; fp8_state, when "
      "in the run, refuses such runs. activation_cpu_offload alone recomputes nothing "
      "(Composer wraps blocks in offload_wrapper only, which moves saved activations to the "
      "CPU). `llmfoundry train` in one process drops fsdp_config with a warning ('FSDP is not "
      "applicable for single-GPU training. Reverting to DDP.') and trains, so nothing is "
      "recomputed there: an info for an MCLI run config with `compute.gpus: 1`; an error where "
      "FSDP is known to run (`compute.gpus` of 2 or more; `fp8_lint`, which sees the config "
      "after train dropped it); a warning naming both cases for a file whose world size is "
      "unknown, since the emulated backend mostly runs in one process (on CPU), where the file "
      "trains as written.",
      source="foundry_fp8/composer/te_swap.py (_enter/_exit hooks), "
      "foundry_fp8/composer/state.py recompute_settings, foundry_fp8/te/recompute.py "
      f"recompute_plan; {COMPOSER} composer/distributed/dist_strategy.py prepare_fsdp_module; "
      f"{FOUNDRY} llmfoundry/command_utils/train.py:319-336 (one process: fsdp_config = None, "
      "also in the logged config the callbacks get)",
      fix="turn FSDP activation checkpointing off, or checkpoint blocks with "
      "foundry_fp8.emulate.fp8_checkpoint")
def emulated_recompute(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Hit]:
    swap = te_swap(config)
    settings = fsdp(config)
    if swap is not None and swap.get("backend") == "emulate" \
            and settings.get("activation_checkpointing"):
        if ctx.gpus == 1:
            yield Hit("fsdp_config.activation_checkpointing", f"{ctx.gpus_text()}: LLM-Foundry "
                      "drops fsdp_config in one process ('FSDP is not applicable for single-GPU "
                      "training. Reverting to DDP.'), so nothing is recomputed and te_swap's "
                      "emulated FP8 layers run as they are; on more GPUs FSDP would recompute "
                      "them without FP8", severity="info")
            return
        refusal = ("fp8_state refuses such a run" if has_fp8_state(config)
                   else "the recompute runs them without FP8, unlike their forward")
        known = ctx.scope == "run" or ctx.gpus is not None
        where = "" if known else \
            "; in one process (one GPU, or CPU) LLM-Foundry drops fsdp_config and nothing is " \
            f"recomputed: an error if this config trains on 2+ GPUs ({GPUS_HINT})"
        yield Hit("fsdp_config.activation_checkpointing", "FSDP activation checkpointing "
                  "recomputes te_swap's emulated FP8 layers outside te_swap's FP8 autocast "
                  f"on 2+ GPUs ({refusal}){where}", severity=None if known else "warning")


@rule("FP8014", "warning", "`te_checkpoint_wrapper` / `te_shard_fp8_weight` without amp_fp8",
      why="Composer reads both only when precision is amp_fp8; otherwise they do nothing.",
      source=f"{COMPOSER} composer/distributed/dist_strategy.py prepare_fsdp_module",
      fix="remove them, or set precision: amp_fp8")
def te_fsdp_flags_without_fp8(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Hit]:
    if is_fp8(config):
        return
    for key in TE_FSDP_FLAGS:
        if fsdp(config).get(key):
            yield Hit(f"fsdp_config.{key}", f"Composer ignores {key} unless precision is amp_fp8")


@rule("FP8015", "error", "FP8 FSDP settings under FSDP2 (FSDP_VERSION=2)",
      why="Only FSDPConfig (FSDP1) has te_checkpoint_wrapper and te_shard_fp8_weight; under "
      "FSDP_VERSION=2 Composer drops them with a warning and recomputes with torch's "
      "checkpoint wrapper. The CLI reads FSDP_VERSION from its environment, as Composer "
      "does, or for an MCLI run config from its `env_variables` and what its command exports "
      "before the train call (the run's environment).",
      source=f"{COMPOSER} composer/trainer/trainer.py _parse_parallelism_config, "
      "composer/utils/parallelism.py FSDP2Config, composer/distributed/prepare_distributed.py",
      fix="run FSDP1 (unset FSDP_VERSION), or turn activation_checkpointing off / remove the "
      "te_* flags")
def te_flags_need_fsdp1(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Hit]:
    if ctx.fsdp_version != 2:
        return
    settings = fsdp(config)
    if is_fp8(config) and has_fp8_layers(config) and settings.get("activation_checkpointing"):
        yield Hit("fsdp_config.activation_checkpointing", "FSDP_VERSION=2: Composer's FSDP2 "
                  "recompute is not TE-aware and it has no te_checkpoint_wrapper, so TE layers "
                  "are recomputed outside FP8")
    for key in TE_FSDP_FLAGS:
        if settings.get(key):
            yield Hit(f"fsdp_config.{key}", f"FSDP_VERSION=2: Composer drops {key} (FSDP1 only)",
                      severity="warning")


@rule("FP8031", "error", "`device_train_microbatch_size: auto` with FSDP on a Composer and torch "
      "whose Trainer raises NameError `unshard_with_sync`",
      why="For auto micro-batching with FSDP1 the Trainer calls "
      "patch_unshard_for_automicrobatching, which installs `unshard_with_sync`; Composer "
      f"defines that only for torch{UNSHARD_TORCH_RANGE} (its own torch pin), so with any other "
      "torch building the Trainer raises NameError. In every Composer from "
      f"{dotted(AUTO_MICROBATCH_CHECKED_FROM)} to 0.32.1 and on main (older ones, with other "
      "torch ranges, are not judged). `llmfoundry train` on one GPU drops fsdp_config and never "
      "meets it; on more it does. Judged against the Composer and torch installed where the "
      "linter runs; a warning when torch is unknown, or Composer is and torch is outside "
      "that range, or Composer is and the floor the installed foundry-fp8 sets on it "
      "(setup.cfg's, from its package metadata) is unknown or older than "
      f"{dotted(AUTO_MICROBATCH_CHECKED_FROM)} (with a torch inside the range and that floor "
      "checked, every Composer foundry-fp8 installs with defines it); a folder that shadows "
      "the installed torch or Composer (FP8215) makes its version unknown. FSDP2 refuses auto "
      "micro-batching before this (another error).",
      source=f"Composer {AUTO_MICROBATCH_SOURCE}: patch_unshard_for_automicrobatching, and "
      f"line 41 (unshard_with_sync under the torch check); {COMPOSER} composer/trainer/"
      "trainer.py Trainer.__init__; "
      "the same at tag v0.31.0 and main 64051888; H200 run (torch 2.11): "
      "benchmarks/results/gpu_tests_nvidia_h200.md (test_h100_bf16_and_te_variant)",
      fix="set device_train_microbatch_size to an integer (the largest that fits; MPT-1B at seq "
      f"2048 on an H200: 8), or install torch{UNSHARD_TORCH_RANGE}")
def auto_microbatch_with_fsdp(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Hit]:
    snapshot = ctx.snapshot
    if snapshot is None or ctx.fsdp_version != 1 \
            or config.get("device_train_microbatch_size") != "auto" \
            or not isinstance(config.get("fsdp_config"), Mapping):
        return
    composer, torch = judged_version(snapshot, "composer"), judged_version(snapshot, "torch")
    fails = auto_microbatch_fsdp_fails(composer, torch)
    floor = snapshot.stack_floor("mosaicml")
    if fails is None and parse_version(snapshot.composer) is None and floor is not None \
            and composer == snapshot.composer \
            and auto_microbatch_fsdp_fails(dotted(floor), torch) is False:
        return  # Composer unknown (not shadowed), but the oldest foundry-fp8 installs with was
    if fails:
        yield Hit("device_train_microbatch_size", f"Composer {snapshot.composer} defines "
                  f"unshard_with_sync only for torch{UNSHARD_TORCH_RANGE} "
                  f"({AUTO_MICROBATCH_SOURCE}): with torch {snapshot.torch}, auto "
                  "micro-batching under FSDP raises NameError: name 'unshard_with_sync' is not "
                  "defined when the Trainer is built")
    elif fails is None:
        yield Hit("device_train_microbatch_size", "auto micro-batching under FSDP raises "
                  f"NameError 'unshard_with_sync' with Composer "
                  f"{dotted(AUTO_MICROBATCH_CHECKED_FROM)}+ unless torch{UNSHARD_TORCH_RANGE} "
                  f"({AUTO_MICROBATCH_SOURCE}); here Composer "
                  f"{what_runs(snapshot, 'composer')}, torch {what_runs(snapshot, 'torch')}",
                  severity="warning")


#: FP8044's id: `fp8_lint` (composer/lint.py) names it in its run-time twin of the rule.
FLOAT32_OUTSIDE_TE = "FP8044"
#: FSDP param dtypes (TORCH_DTYPE_NAMES' names) that lower what runs outside TE's layers.
LOW_PARAM_DTYPES = frozenset({"bfloat16", "float16"})
#: Where amp_fp8 is seen to add no torch autocast and FSDP to set the compute dtype.
AMP_FP8_DTYPE_SOURCE = (
    f"{COMPOSER} composer/core/precision.py get_precision_context:87-99 (amp_fp8: te.fp8_autocast "
    "only; amp_bf16 above it: torch.autocast bf16), composer/distributed/mosaic_parallelism.py "
    "get_mixed_precision:59-98 and _get_torch_dtype:49-54, composer/distributed/fsdp2.py:181-183; "
    f"{FOUNDRY} llmfoundry/models/consts.py _MASTER_WEIGHTS_PRECISION (float32)")
#: FP8044's fix, and fp8_lint's.
FLOAT32_OUTSIDE_TE_FIX = (
    "on 2+ GPUs, fsdp_config with mixed_precision DEFAULT or PURE (FSDP param_dtype bfloat16 "
    "under amp_fp8); on one GPU LLM-Foundry drops fsdp_config, so train with amp_bf16 there, or "
    "build Composer's Trainer with parallelism_config {'fsdp': ...} yourself")


def float32_outside_te(cause: str) -> str:
    """What runs in float32 under amp_fp8, and why: FP8044's message and fp8_lint's."""
    return (f"precision amp_fp8 with {cause}: amp_fp8 enters only TE's fp8_autocast and no torch "
            "autocast, so everything outside TE's FP8 layers (attention, norms, embeddings, the "
            "LM head, layers te_swap keeps) computes in float32, the dtype LLM-Foundry builds "
            "models in, and TE's layers get float32 activations: slower than amp_bf16 for those "
            "parts, with no error or warning from Composer")


def fsdp_param_dtype(mixed_precision: Any) -> str | None:
    """The dtype FSDP computes in under amp_fp8 for `fsdp_config.mixed_precision` (a
    TORCH_DTYPE_NAMES name; float32: the parameters' own), None where Composer cannot
    interpret it (FP8012 reports that)."""
    if isinstance(mixed_precision, str):
        mode = mixed_precision.upper()
        if mode not in MIXED_PRECISION_MODES:
            return None
        return "float32" if mode == "FULL" else TORCH_DTYPE_NAMES["amp_fp8"]
    if isinstance(mixed_precision, Mapping):
        dtype = mixed_precision.get("param_dtype")
        if dtype is None:  # get_mixed_precision leaves param_dtype None: the parameters' own
            return "float32"
        return TORCH_DTYPE_NAMES.get(dtype) if isinstance(dtype, str) else None
    return None


def built_low_precision(master: Any) -> bool:
    """Does LLM-Foundry's train build the model in `model.master_weights_dtype` `master` (a
    16-bit dtype)? Any other non-null value makes build_composer_model raise."""
    return isinstance(master, str) and master in FOUNDRY_MASTER_WEIGHTS_DTYPES


def flash_note(config: Mapping[str, Any]) -> str:
    """What MPT's flash attention does with float32 q, k and v, for an MPT model using it."""
    model = section(config, "model")
    impl = get(model, "attn_config.attn_impl") or MPT_ATTN_IMPL_DEFAULT
    if str(model.get("name")) not in MPT_MODEL_NAMES or impl != MPT_ATTN_IMPL_DEFAULT:
        return ""
    return ("; with MPT's attn_impl flash (its default) q, k and v reach flash-attn in float32, "
            "which LLM-Foundry's check_valid_inputs accepts and flash-attn's forward refuses "
            "('FlashAttention only support fp16 and bf16 data type'): read in both sources, "
            "not run on a GPU")


@rule(FLOAT32_OUTSIDE_TE, "warning", "`precision: amp_fp8` where nothing lowers the parameters: "
      "no fsdp_config, `mixed_precision: FULL` or a float32 param_dtype, or one GPU",
      why="Composer's amp_fp8 enters TE's fp8_autocast and no torch autocast (amp_bf16 enters "
      "torch.autocast bf16), so everything outside TE's FP8 layers computes in the parameters' "
      "dtype and TE's layers get activations in it. LLM-Foundry builds models in float32; only "
      "FSDP's mixed precision lowers them: DEFAULT and PURE give param_dtype bfloat16 under "
      "amp_fp8; FULL and a mapping without param_dtype leave it None, the parameters' own dtype (float32 as LLM-Foundry builds them), a mapping's param_dtype its own. LLM-Foundry's train "
      "drops fsdp_config on one GPU ('FSDP is not applicable for single-GPU training. Reverting "
      "to DDP.'): an MCLI run config with `compute.gpus: 1` is reported whatever its "
      "fsdp_config. Not reported with `model.master_weights_dtype` bf16, bfloat16, float16 "
      "or f16: train builds the model in it, and for all but f16 rewrites mixed_precision to "
      "keep the parameters' dtype (f16 with an explicit float32 param_dtype is still reported: "
      "FSDP casts back up). Any other master_weights_dtype is FP8045's: the run stops before any dtype matters. With MPT's default attn_impl flash, flash-attn refuses the float32 q, k "
      "and v (read in its csrc/flash_attn/flash_api.cpp mha_fwd and mha_varlen_fwd, not run). "
      "Files only: `fp8_lint` judges the run itself at FIT_START, after FSDP wrapping.",
      source=f"{AMP_FP8_DTYPE_SOURCE}; {FOUNDRY} llmfoundry/command_utils/train.py:319-331 "
      "(single GPU: fsdp_config = None), llmfoundry/utils/builders.py:262-276 "
      "(master_weights_dtype: model.to), llmfoundry/utils/config_utils.py:601-622 "
      "(process_init_device: param_dtype None), llmfoundry/models/layers/attention.py "
      "check_valid_inputs (float32 accepted), flash_attn_fn; flash-attn "
      "csrc/flash_attn/flash_api.cpp (TORCH_CHECK q_dtype fp16 or bf16); "
      "foundry_fp8/composer/lint.py precision_problem",
      fix=FLOAT32_OUTSIDE_TE_FIX, scope="file")
def float32_outside_te_layers(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Hit]:
    if not (is_fp8(config) and uses_te(config)):
        return  # FP8001 / FP8028 speak when nothing runs in TE's FP8
    given = config.get("fsdp_config")
    master = section(config, "model").get("master_weights_dtype")
    if master is not None and not built_low_precision(master):
        return  # FP8045: build_composer_model raises before any dtype matters
    built_low = master is not None
    if built_low and (not isinstance(given, Mapping) or ctx.gpus == 1
                      or master in FOUNDRY_FSDP_KEEPS_MASTER_DTYPES):
        return  # train builds the model in 16 bits and no FSDP param_dtype raises it again
    if ctx.gpus == 1 and isinstance(given, Mapping):
        yield Hit("precision", float32_outside_te(
            f"{ctx.gpus_text()}, where LLM-Foundry drops this fsdp_config ('FSDP is not "
            "applicable for single-GPU training. Reverting to DDP.')") + flash_note(config))
    elif given is None:
        yield Hit("precision", float32_outside_te("no fsdp_config") + flash_note(config))
    elif isinstance(given, Mapping):
        mixed = given.get("mixed_precision", "DEFAULT")  # FSDPConfig's default
        dtype = fsdp_param_dtype(mixed)
        if dtype is None or dtype in LOW_PARAM_DTYPES:
            return
        if built_low and not (isinstance(mixed, Mapping) and mixed.get("param_dtype") is not None):
            return  # FULL or no param_dtype: FSDP keeps the 16-bit master weights' dtype
        cause = "`fsdp_config.mixed_precision: FULL`, which leaves FSDP's param_dtype None: the " \
            "parameters' own dtype, float32 as LLM-Foundry builds the model without a 16-bit " \
            "`model.master_weights_dtype`" if isinstance(mixed, str) else \
            f"fsdp_config.mixed_precision's param_dtype {mixed.get('param_dtype')!r}" \
            if mixed.get("param_dtype") is not None else \
            "an fsdp_config.mixed_precision mapping without param_dtype (FSDP keeps float32)"
        yield Hit("fsdp_config.mixed_precision", float32_outside_te(cause) + flash_note(config))


@rule("FP8045", "error", "a `model.master_weights_dtype` LLM-Foundry's train refuses "
      "(did-you-mean)",
      why="train pops `model.master_weights_dtype` and hands it to build_composer_model, which "
      "takes only f16, float16, bf16 and bfloat16 and raises ValueError 'Invalid "
      "master_weights_dtype' for anything else once the tokenizer and data loaders are built. "
      "fp16, amp_fp16 and amp_bf16 pass process_init_device (which lowers FSDP's mixed "
      "precision for them) and fail there. FP8044 stays quiet on such a value.",
      source=f"{FOUNDRY} llmfoundry/command_utils/train.py train (master_weights_dtype="
      "model_config.pop), llmfoundry/utils/builders.py build_composer_model:262-276 "
      "(str_dtype_to_torch_dtype, ValueError), llmfoundry/utils/config_utils.py "
      "process_init_device:601-622 (small_dtypes)",
      fix="use one of the values the message names, or remove the key for float32 master weights")
def invalid_master_weights_dtype(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Hit]:
    master = section(config, "model").get("master_weights_dtype")
    if master is None or built_low_precision(master):
        return
    hint = did_you_mean(master, FOUNDRY_MASTER_WEIGHTS_DTYPES) if isinstance(master, str) else ""
    yield Hit("model.master_weights_dtype", f"LLM-Foundry's build_composer_model refuses "
              f"master_weights_dtype {master!r:.40} (ValueError 'Invalid master_weights_dtype'; "
              f"it takes {', '.join(sorted(FOUNDRY_MASTER_WEIGHTS_DTYPES))})" + hint)


#: The name LLM-Foundry gives the symlink to a sharded checkpoint's folder
#: (llmfoundry/command_utils/train.py:299 'latest-sharded-rank{rank}').
SHARDED_LINK = re.compile(r"latest-sharded-rank(\d+|\{rank\})")
#: Composer's FSDP / FSDP2 defaults for `state_dict_type` (composer/utils/parallelism.py:39, :92).
STATE_DICT_DEFAULT = {1: "full", 2: "sharded"}


def _sharded_folder(path: str) -> str | None:
    """Why `path` is a sharded checkpoint's folder: LLM-Foundry's symlink name, or a local
    folder (Composer loads any other checkpoint from a file); None when neither shows."""
    if "://" in path:  # an object store: nothing to see from here
        return None
    name = os.path.basename(path.rstrip("/"))
    if SHARDED_LINK.fullmatch(name):
        return f"`{name}` is LLM-Foundry's link to a sharded checkpoint's folder"
    if os.path.isdir(path):
        return "it is a folder here (a sharded checkpoint; any other one is a file)"
    return None


@rule("FP8049", "error", "`load_path` names a sharded checkpoint's folder in a run that does not "
      "load sharded",
      why="Composer loads a folder only with FSDP's sharded state dict (fsdp_config "
      "state_dict_type: sharded, FSDP2's default); otherwise it reads load_path as one file and "
      "raises IsADirectoryError. `llmfoundry train` in one process drops fsdp_config ('FSDP is "
      "not applicable for single-GPU training. Reverting to DDP.'), so a sharded checkpoint "
      "saved on 2+ GPUs does not load on one. An error where the run cannot load it (no "
      "sharded fsdp_config; MCLI `compute.gpus: 1`, `--gpus 1`), an info for a plain YAML with a "
      "sharded fsdp_config linted without `--gpus` (written for 2+ GPUs, where "
      "it loads), nothing on 2 or more. The "
      "path is judged by its name (LLM-Foundry's `latest-sharded-rank{rank}`) or as a folder "
      "where the linter runs; object-store paths are not judged.",
      source=f"{COMPOSER} composer/utils/checkpoint.py load_checkpoint "
      "(fsdp_sharded_state_dict_enabled, composer/core/state.py), composer/utils/parallelism.py "
      f"FSDPConfig/FSDP2Config state_dict_type; {FOUNDRY} llmfoundry/command_utils/train.py:299 "
      "(save_latest_filename), :319-331 (one process: fsdp_config = None)",
      fix="load a monolithic checkpoint (saved with state_dict_type: full) in one process, or "
      "train on 2+ GPUs with fsdp_config state_dict_type: sharded", scope="file")
def sharded_load_path(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Hit]:
    path = config.get("load_path")
    why = _sharded_folder(path) if isinstance(path, str) and path else None
    if why is None:
        return
    settings = config.get("fsdp_config")
    sharded = isinstance(settings, Mapping) and settings.get(
        "state_dict_type", STATE_DICT_DEFAULT.get(ctx.fsdp_version)) == "sharded"
    if not sharded:
        yield Hit("load_path", f"load_path `{path}`: {why}, and this run has no fsdp_config "
                  "with state_dict_type: sharded, so Composer reads it as one file "
                  "(IsADirectoryError)")
    elif ctx.gpus == 1:
        yield Hit("load_path", f"load_path `{path}`: {why}; with {ctx.gpus_text()} LLM-Foundry "
                  "drops fsdp_config ('Reverting to DDP') and Composer reads it as one file "
                  "(IsADirectoryError)")
    elif ctx.gpus is None:
        yield Hit("load_path", f"load_path `{path}`: {why}; it loads on 2+ GPUs, but in one "
                  "process (one GPU, or CPU) LLM-Foundry drops fsdp_config and Composer reads "
                  "it as one file (IsADirectoryError): an error if this config trains in one "
                  f"process ({GPUS_HINT})", severity="info")
