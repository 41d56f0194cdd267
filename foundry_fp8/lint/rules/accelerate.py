"""HuggingFace Accelerate configs, and the DeepSpeed JSON they point to: FP8 settings that
Accelerate refuses, drops or overrides without a word.

Every fact below was read in Accelerate's sources (tags v0.34.2 to v1.14.0; 1.8.1 installed
here) and TE's; the rules' sources say where. How a config reaches TE: `accelerate launch`
turns `mixed_precision` into ACCELERATE_MIXED_PRECISION and each `fp8_config` key `k` into
ACCELERATE_FP8_<K>, and reads each `fsdp_config` key as its own `fsdp_` argument, adding the
prefix where a key lacks it (commands/launch.py `_validate_launch_command`, utils/launch.py
`setup_fp8_env`: `launch_settings` reads both sections so); the training process's `Accelerator()` builds a `TERecipeKwargs` from those
variables, and `apply_fp8_autowrap` (utils/transformer_engine.py) gives TE's `DelayedScaling`
only the values that differ from TERecipeKwargs' own defaults (`KwargsHandler.to_kwargs`).

Checks read an `AccelerateInput` (`foundry_fp8.lint.accelerate` reads the files).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from foundry_fp8.lint.known import did_you_mean
from foundry_fp8.lint.load import position_of
from foundry_fp8.lint.registry import Hit, LintContext, Severity, join_key, rule, section
from foundry_fp8.lint.rules.fsdp import TE_1190
from foundry_fp8.recipe import TE_DELAYED_DEFAULTS, recipe_problems
from foundry_fp8.te.facts import MXFP8_CAPABILITY, MXFP8_CAPABILITY_CAPPED_FROM, Version, dotted

ACC = "Accelerate (huggingface/accelerate, tags v0.34.2-v1.14.0)"
TE = "TransformerEngine (NVIDIA/TransformerEngine, tags v1.0-v2.18)"

#: `fp8_config` names (`Setting.name`: the key without the fp8_ prefix the launcher adds) whose
#: ACCELERATE_FP8_<NAME> variable something reads (TERecipeKwargs, MSAMPRecipeKwargs,
#: AORecipeKwargs, Accelerator.fp8_backend). Any other key is dropped. `fp8_format`, which
#: `accelerate config` writes, is read as `format` (ACCELERATE_FP8_FORMAT).
FP8_CONFIG_KEYS = frozenset({
    "backend", "use_autocast_during_eval", "margin", "interval", "format",
    "amax_history_len", "amax_compute_algo", "override_linear_precision",
    "use_mxfp8_block_scaling", "opt_level", "enable_fsdp_float8_all_gather", "pad_inner_dim",
})
#: Names `accelerate config` writes (commands/config/cluster.py) that the launcher never reads.
QUESTIONNAIRE_NAMES = {"amax_history_length": "amax_history_len",
                       "amax_compute_algorithm": "amax_compute_algo",
                       "optimization_level": "opt_level"}
#: TERecipeKwargs' defaults: a value equal to these never reaches TE (to_kwargs drops it).
TE_RECIPE_DEFAULTS: dict[str, Any] = {
    "fp8_format": "HYBRID", "amax_history_len": 1024, "amax_compute_algo": "most_recent",
    "margin": 0, "interval": 1, "override_linear_precision": (False, False, False),
    "use_autocast_during_eval": False, "use_mxfp8_block_scaling": False,
}
#: How TERecipeKwargs.__post_init__ reads each ACCELERATE_FP8_* value (src/accelerate/utils/
#: dataclasses.py:363-389, v1.8.1; the same v0.34.2-v1.14.0): int() for these, the truth values
#: of str_to_bool (utils/environment.py:59-71) for the flags, and the case it folds the two
#: choices to before checking them against FP8Format / AmaxComputeAlgorithm (:292-293).
TE_RECIPE_INTS = ("margin", "interval", "amax_history_len")
TE_RECIPE_FLAGS = ("use_autocast_during_eval", "use_mxfp8_block_scaling")
#: AORecipeKwargs' flags (parse_flag_from_env, default true: src/accelerate/utils/dataclasses.py:
#: 346-351, v1.13.0-v1.14.0), read only when its backend is torchao.
AO_RECIPE_FLAGS = ("pad_inner_dim", "enable_fsdp_float8_all_gather")
#: fp8_config names that nothing reads before a release (the launcher exports them all the same):
#: use_mxfp8_block_scaling by TERecipeKwargs from v1.11.0 (dataclasses.py:403-404 there, no such
#: field in v1.10.1); AO_RECIPE_FLAGS by AORecipeKwargs from v1.13.0 (dataclasses.py:346-351,
#: PR #3831; v1.12.0's AORecipeKwargs has only config and module_filter_func, and torchao's own
#: Float8LinearConfig() runs).
READ_FROM: dict[str, Version] = {"use_mxfp8_block_scaling": (1, 11),
                                 **dict.fromkeys(AO_RECIPE_FLAGS, (1, 13))}
TRUTH = (("y", "yes", "t", "true", "on", "1"), ("n", "no", "f", "false", "off", "0"))
TE_RECIPE_CASE = {"fp8_format": "upper", "amax_compute_algo": "lower"}
TE_RECIPE_CHOICES = {"fp8_format": ("HYBRID", "E4M3", "E5M2"),
                     "amax_compute_algo": ("max", "most_recent")}
#: accelerate-yaml `deepspeed_config` keys refused next to `deepspeed_config_file`
#: (DeepSpeedPlugin._deepspeed_config_checks), plus a top-level `mixed_precision`.
DS_FILE_EXCLUSIVE = ("gradient_accumulation_steps", "gradient_clipping", "zero_stage",
                     "offload_optimizer_device", "offload_param_device",
                     "offload_param_nvme_path", "offload_optimizer_nvme_path",
                     "zero3_save_16bit_model")
DS_FILE_KEY = "deepspeed_config.deepspeed_config_file"

#: The two values of compute_environment. `load_config_from_file` (config_args.py:43-72, the same
#: in v0.34.2-v1.14.0) reads the file with ClusterConfig when compute_environment is
#: LOCAL_MACHINE or absent, and with SageMakerConfig for any other value.
LOCAL, SAGEMAKER = "LOCAL_MACHINE", "AMAZON_SAGEMAKER"
#: (first release with the key, first release without it); None: before v0.34.2 / still there.
Span = tuple[Version | None, Version | None]
_EVERY: Span = (None, None)
#: BaseConfig's fields (config_args.py:76-81), and the legacy keys `process_config` converts for
#: either class (`fp16`, `dynamo_backend`: config_args.py:115-119).
_BASE = ("compute_environment", "distributed_type", "mixed_precision", "use_cpu", "debug",
         "fp16", "dynamo_backend")
#: The one list of the top-level keys each config class accepts, with the releases that have
#: them: `from_yaml_file`/`from_json_file` raise "had unknown keys" for any other key after
#: `process_config` (config_args.py:134, :154). Checked at every tag v0.34.2-v1.14.0 with `ast`
#: (a field's line in config_args.py given where it changed):
#: tp_config v1.4.0:198 to v1.6.0 (gone in v1.7.0, PR #3457); parallelism_config from
#: v1.10.0:198 (PR #3700); ipex_config v0.34.2:200 to v1.12.0:202 (gone in v1.13.0, PR #3883).
ACCELERATE_KEYS: dict[str, dict[str, Span]] = {
    LOCAL: {**dict.fromkeys(_BASE + (  # ClusterConfig, config_args.py:179-217 (v1.8.1)
        "num_processes", "machine_rank", "num_machines", "gpu_ids", "main_process_ip",
        "main_process_port", "rdzv_backend", "same_network", "main_training_function",
        "enable_cpu_affinity", "fp8_config", "deepspeed_config", "fsdp_config",
        "megatron_lm_config", "mpirun_config", "downcast_bf16", "tpu_name", "tpu_zone",
        "tpu_use_cluster", "tpu_use_sudo", "command_file", "commands", "tpu_vm", "tpu_env",
        "dynamo_config"), _EVERY),
        "tp_config": ((1, 4), (1, 7)), "parallelism_config": ((1, 10), None),
        "ipex_config": (None, (1, 13))},
    SAGEMAKER: dict.fromkeys(_BASE + (  # SageMakerConfig, config_args.py:236-252 (v1.8.1)
        "ec2_instance_type", "iam_role_name", "image_uri", "profile", "region", "num_machines",
        "gpu_ids", "base_job_name", "pytorch_version", "transformers_version", "py_version",
        "sagemaker_inputs_file", "sagemaker_metrics_file", "additional_args", "dynamo_config",
        "enable_cpu_affinity"), _EVERY),
}


def _has(span: Span, version: Version | None) -> bool:
    """Does this Accelerate release have a key of this span (None: any release)?"""
    since, until = span
    return version is None or ((since is None or version >= since)
                               and (until is None or version < until))


def accelerate_keys(environment: str, version: Version | None = None) -> frozenset[str]:
    """The top-level keys Accelerate `version` (None: any release checked) accepts in a config
    of this compute_environment."""
    return frozenset(k for k, span in ACCELERATE_KEYS[environment].items() if _has(span, version))


def _releases(span: Span) -> str:
    """'from 1.10', 'removed in 1.13', 'from 1.4, removed in 1.7'."""
    since, until = span
    return ", ".join(([f"from {dotted(since)}"] if since else [])
                     + ([f"removed in {dotted(until)}"] if until else []))


FP8_FROM_CONFIG_UNDER_DEEPSPEED = (1, 11)  # AcceleratorState keeps "fp8" under DeepSpeed
FP8_AUTO_BROKEN = ((1, 4), (1, 8))  # auto-created recipe never marked as an FP8 handler
DS_RECIPE_FROM_FP8_RECIPE_KWARGS_ONLY = (1, 4)  # TERecipeKwargs exists; DS path ignores it
STR_FP8_ENV = (1, 9)  # setup_fp8_env puts the override's bools in the env until 1.9.0
BACKEND_READ = (1, 9)  # Accelerator.fp8_backend reads ACCELERATE_FP8_BACKEND outside DeepSpeed
#: prepare() sends FSDP2 to _prepare_fsdp2, which never calls prepare_model, the one place
#: outside DeepSpeed that wraps the forward in TE's fp8_autocast (PR #3585, v1.8.0 to v1.14.0)
FSDP2_WITHOUT_TE_AUTOCAST = (1, 8)
AO_REFUSED = (1, 8)  # Accelerator() refuses torchao with FSDP's cpu_ram_efficient_loading
#: `accelerate launch`'s --fsdp_cpu_ram_efficient_loading default ("true", commands/launch.py:
#: 593-595 in v1.8.1, the same to v1.14.0), which it exports as FSDP_CPU_RAM_EFFICIENT_LOADING
#: (utils/launch.py:328) when fsdp_config does not set the key.
CPU_RAM_EFFICIENT_LOADING_DEFAULT = True
#: The least torchao `is_torchao_available` (utils/imports.py:149-154, v1.8.1) accepts.
TORCHAO_MIN: Version = (0, 6, 1)
#: FP8BackendType's values (src/accelerate/utils/dataclasses.py, v1.9.0 to main), which
#: Accelerator.fp8_backend looks ACCELERATE_FP8_BACKEND up in as written.
FP8_BACKENDS = ("TE", "MSAMP", "AO")
#: MS-AMP's opt levels, as OptLevel (src/accelerate/utils/dataclasses.py:291, v1.8.1) and
#: DeepSpeedPlugin (:1274) accept them, case included.
MSAMP_OPT_LEVELS = ("O1", "O2")


@dataclass(frozen=True)
class AccelerateInput:
    """What the rules read. `accelerate`: the Accelerate config ({} when linting a DeepSpeed
    JSON alone); `deepspeed`: the DeepSpeed JSON; `version`: the installed Accelerate (None:
    unknown); `deepspeed_path`/`deepspeed_positions`: where DeepSpeed keys are, for messages;
    `deepspeed_missing`: a `deepspeed_config_file` that could not be found, or names no regular
    file; `deepspeed_lookup_error` the OS's reason when looking for it failed (None: not there);
    `deepspeed_kind` what it names when that is not a regular file (`a folder`, `a FIFO`);
    `deepspeed_duplicates` the dotted keys the DeepSpeed JSON gives twice in one object;
    `torchao`: a torchao Accelerate would use is installed where the linter runs."""

    accelerate: Mapping[str, Any] = field(default_factory=dict)
    deepspeed: Mapping[str, Any] | None = None
    version: tuple[int, ...] | None = None
    deepspeed_path: str | None = None
    deepspeed_positions: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    deepspeed_missing: str | None = None
    deepspeed_lookup_error: str | None = None
    deepspeed_kind: str | None = None
    deepspeed_duplicates: tuple[str, ...] = ()
    torchao: bool = False


#: The prefix `accelerate launch` gives each key of these sections that does not start with it,
#: before it reads the key as its own argument: `fsdp_config.activation_checkpointing` is
#: --fsdp_activation_checkpointing, `fp8_config.fp8_backend` and `fp8_config.backend` are both
#: --fp8_backend (commands/launch.py:1051-1054 `_validate_launch_command`, v1.8.1; the same test
#: from v1.5.0 to v1.14.0, which v1.4 wrote as `"fsdp" not in key`). A key written both ways sets
#: one argument twice, in file order: the later wins.
LAUNCH_PREFIXES = {"fsdp_config": "fsdp", "fp8_config": "fp8"}


@dataclass(frozen=True)
class Setting:
    """One key of `fsdp_config` or `fp8_config` as the launcher reads it: `name` without the
    section's prefix (`activation_checkpointing`, `backend`; for fp8_config the <NAME> of the
    ACCELERATE_FP8_<NAME> variable setup_fp8_env exports), `key` the dotted key as written (where
    findings point), `value` its value."""

    name: str
    key: str
    value: Any


def launch_settings(acc: Mapping[str, Any], name: str) -> list[Setting]:
    """Every key of section `name` (a key of LAUNCH_PREFIXES), in file order, named as the
    launcher reads it."""
    prefix = LAUNCH_PREFIXES[name]
    settings = []
    for key, value in section(acc, name).items():
        written = str(key)
        argument = written if written.startswith(prefix) else f"{prefix}_{written}"
        settings.append(Setting(argument.removeprefix(f"{prefix}_"), join_key(name, written),
                                value))
    return settings


def setting(acc: Mapping[str, Any], name: str, option: str) -> Setting | None:
    """`option` of section `name` as the launcher reads it, written with or without the prefix
    (the later one when both); None when the section does not set it."""
    return next((s for s in reversed(launch_settings(acc, name)) if s.name == option), None)


def _text(value: Any) -> str:
    return str(value).strip().lower() if value is not None else ""


def _is_true(value: Any) -> bool:
    return _text(value) in ("true", "1", "yes")


def _fp8(acc: Mapping[str, Any]) -> bool:
    return _text(acc.get("mixed_precision")) == "fp8"


def _deepspeed(acc: Mapping[str, Any]) -> bool:
    return _text(acc.get("distributed_type")) == "deepspeed"


def _megatron(acc: Mapping[str, Any]) -> bool:
    return _text(acc.get("distributed_type")) == "megatron_lm"


def _fsdp2(acc: Mapping[str, Any]) -> Setting | None:
    """fsdp_config's fsdp_version when it is 2 under FSDP (the launcher exports it as
    FSDP_VERSION, which FullyShardedDataParallelPlugin int()s); else None."""
    fsdp_version = setting(acc, "fsdp_config", "version")
    if _text(acc.get("distributed_type")) != "fsdp" or fsdp_version is None:
        return None
    return fsdp_version if _text(fsdp_version.value) == "2" else None


def _te_under_fsdp2(inp: AccelerateInput) -> Setting | None:
    """The fsdp_version setting of an FSDP2 config whose FP8 runs on TE, with an Accelerate
    (None: unknown) whose FSDP2 path never enters TE's fp8_autocast; else None. Not where the
    backend is, or may be, torchao (_takes_torchao), nor a backend 1.9+ refuses (FP8116)."""
    acc, version = inp.accelerate, inp.version
    fsdp2 = _fsdp2(acc)
    if not (_fp8(acc) and fsdp2 and _te_backend(acc) and _takes_torchao(inp) is None):
        return None
    if version is not None and version < FSDP2_WITHOUT_TE_AUTOCAST:
        return None  # 1.6-1.7: FSDP2 went through prepare_model; no FP8 from the config anyway
    backend = _backend(acc)
    if (version is None or version >= BACKEND_READ) and backend is not None \
            and backend.value not in (None, "", "TE"):
        return None
    return fsdp2


def _sagemaker(acc: Mapping[str, Any]) -> bool:
    return acc.get("compute_environment") == SAGEMAKER


def _backend(acc: Mapping[str, Any]) -> Setting | None:
    """fp8_config's backend, written `backend` or `fp8_backend`."""
    return setting(acc, "fp8_config", "backend")


def _te_backend(acc: Mapping[str, Any]) -> bool:
    backend = _backend(acc)
    return backend is None or _text(backend.value) in ("", "te")


def _ds_where(inp: AccelerateInput, ds_key: str) -> tuple[str, str]:
    """(finding key, message prefix) for a key of the DeepSpeed JSON: its own key when the JSON
    is the linted file, else the Accelerate file's `deepspeed_config_file` and the JSON's line."""
    if inp.accelerate:
        line = position_of(ds_key, inp.deepspeed_positions)
        where = f"{inp.deepspeed_path}:{line[0]}" if line else str(inp.deepspeed_path)
        return DS_FILE_KEY, f"{where}: `{ds_key}` "
    return ds_key, f"`{ds_key}` "


@rule("FP8101", "error", "Accelerate `mixed_precision: fp8` with DeepSpeed `fp16` enabled",
      why="DeepSpeedPlugin.set_mixed_precision runs FP8 on a bf16 base and raises when the "
      "DeepSpeed JSON enables fp16. A bf16 block is what Accelerate itself adds for FP8, so it "
      "is not flagged.",
      source=f"{ACC} src/accelerate/utils/dataclasses.py DeepSpeedPlugin.set_mixed_precision",
      fix='set "fp16": {"enabled": false} and "bf16": {"enabled": true} (or "auto") in the '
      "DeepSpeed JSON", family="accelerate")
def fp16_with_fp8(inp: AccelerateInput, _: LintContext) -> Iterator[Hit]:
    if _fp8(inp.accelerate) and inp.deepspeed is not None \
            and _is_true(section(inp.deepspeed, "fp16").get("enabled")):
        key, prefix = _ds_where(inp, "fp16.enabled")
        yield Hit(key, f"{prefix}is true with mixed_precision fp8: Accelerate refuses it at "
                  "Accelerator() ('cannot be set to fp8 when fp16 is set in the DeepSpeed "
                  "config file'); FP8 runs on a bf16 base")


@rule("FP8102", "error", "`deepspeed_config_file` with mixed_precision or ZeRO settings in the "
      "Accelerate config",
      why="The launcher records the Accelerate config's deepspeed_config keys (and "
      "mixed_precision) in ACCELERATE_CONFIG_DS_FIELDS; with a DeepSpeed file, "
      "_deepspeed_config_checks raises for mixed_precision, zero_stage, "
      "gradient_accumulation_steps, gradient_clipping, offload_* and zero3_save_16bit_model.",
      source=f"{ACC} src/accelerate/commands/launch.py launch_command; "
      "src/accelerate/utils/dataclasses.py DeepSpeedPlugin._deepspeed_config_checks",
      fix="move them to the DeepSpeed JSON; FP8 via `accelerate launch --mixed_precision fp8`",
      family="accelerate")
def deepspeed_file_exclusive(inp: AccelerateInput, _: LintContext) -> Iterator[Hit]:
    ds_config = section(inp.accelerate, "deepspeed_config")
    if not ds_config.get("deepspeed_config_file"):
        return
    if inp.accelerate.get("mixed_precision") is not None:
        yield Hit("mixed_precision", "with deepspeed_config_file, Accelerate refuses "
                  "mixed_precision in the Accelerate config (ValueError at Accelerator(): 'the "
                  "following accelerate config variables will be ignored')")
    for name in DS_FILE_EXCLUSIVE:
        if name in ds_config:
            yield Hit(f"deepspeed_config.{name}", f"with deepspeed_config_file, Accelerate "
                      f"refuses {name} in the Accelerate config (ValueError at Accelerator())")


def _deepspeed_precision(inp: AccelerateInput) -> str:
    """The precision AcceleratorState reported under DeepSpeed: the DeepSpeed JSON's fp16 when
    it enables it, else bf16 (what DeepSpeedPlugin.set_mixed_precision writes for fp8)."""
    ds = inp.deepspeed
    return "fp16" if ds is not None and _is_true(section(ds, "fp16").get("enabled")) else "bf16"


@rule("FP8103", "error", "FP8 from the config never reaches TE with this Accelerate",
      why="Under DeepSpeed, AcceleratorState.mixed_precision returned the DeepSpeed config's "
      "precision (bf16, or the JSON's fp16) until 1.11 (fixed by PR #3688), so Accelerator() never enabled "
      "FP8 from a config (issue #3360, PR #3714); in 1.0-1.3 fp8_backend needed that same "
      "value, in 1.4-1.7 an auto-created recipe was never marked as an FP8 handler (any "
      "distributed type; fixed by PR #3611 in 1.8). Under MEGATRON_LM, in every release to "
      "1.14 and main: MegatronLMPlugin.set_mixed_precision sets Megatron-LM's fp16 or bf16 "
      "only, and no FP8 setting reaches Megatron-LM (utils/megatron_lm.py has none), which "
      "builds the model that trains from its own arguments; TE's autocast "
      "(apply_fp8_autowrap) is not on _prepare_megatron_lm's path: the run trains in FP32 "
      "without FP8. Under FSDP2 (fsdp_version 2) from 1.8 (PR #3585) to 1.14 and main: "
      "prepare() converts the layers to TE (_prepare_te) and then takes _prepare_fsdp2, which "
      "never calls prepare_model, the only place outside DeepSpeed that wraps the forward in "
      "TE's fp8_autocast (apply_fp8_autowrap): TE's layers run without FP8 (1.6-1.7 took "
      "FSDP2 through prepare_model). Not under DeepSpeed with backend MSAMP: "
      "DeepSpeedPlugin turns MS-AMP on from ACCELERATE_FP8_BACKEND and Accelerator.fp8_backend "
      "returns MSAMP from it (dataclasses.py:1190, accelerator.py:3969-3970 in v1.8.1; the "
      "same from v1.0.0). Judged against the Accelerate installed where the linter runs; a "
      "warning when it is not installed (MEGATRON_LM: an error in any release).",
      source=f"{ACC} src/accelerate/state.py AcceleratorState.mixed_precision; "
      "src/accelerate/accelerator.py Accelerator.__init__ and fp8_backend, :1419-1426 prepare "
      "and :2154-2240 _prepare_megatron_lm (v1.8.1); src/accelerate/utils/dataclasses.py:"
      "2435-2441 MegatronLMPlugin.set_mixed_precision (v1.8.1; :2749-2755 in v1.14.0); "
      "src/accelerate/utils/megatron_lm.py:877-892 initialize (args_defaults); "
      "src/accelerate/accelerator.py:1455-1523 _prepare_fsdp2 and :1581, :1803 "
      "apply_fp8_autowrap in prepare_model (v1.8.1; :1673-1767, :1833, :2060 in v1.14.0); "
      "https://github.com/huggingface/accelerate/pull/3585; "
      "https://github.com/huggingface/accelerate/issues/3360; "
      "https://github.com/huggingface/accelerate/pull/3714",
      fix="upgrade Accelerate (1.11+ under DeepSpeed, 1.9+ otherwise: 1.8 enables FP8 but "
      "ignores fp8_config.backend, FP8115); under MEGATRON_LM no release helps: give "
      "Megatron-LM its own FP8 arguments; under FSDP2 use fsdp_version: 1 or torchao "
      "(backend AO)", family="accelerate")
def fp8_not_enabled(inp: AccelerateInput, _: LintContext) -> Iterator[Hit]:
    """FP8 asked for in the config but never reaching TE with this Accelerate version."""
    acc, version = inp.accelerate, inp.version
    if not _fp8(acc):
        return
    shown = f"accelerate {dotted(version)}" if version else "accelerate"
    if _megatron(acc):
        yield Hit("mixed_precision", "under MEGATRON_LM Accelerate passes no FP8 setting to "
                  "Megatron-LM, which builds and runs the model that trains: "
                  "MegatronLMPlugin.set_mixed_precision sets only fp16 or bf16, so with fp8 "
                  "the run trains in FP32 without FP8, with no error (every release to 1.14)",
                  fix="set mixed_precision: bf16 and give Megatron-LM its FP8 arguments "
                  "(--fp8-format) yourself through MegatronLMPlugin(other_megatron_args=...), or "
                  "train with MULTI_GPU or FSDP, where Accelerate wraps the model in TE's autocast")
        return
    backend = _backend(acc)
    if _deepspeed(acc) and backend is not None and backend.value == "MSAMP":
        return  # DeepSpeedPlugin runs MS-AMP itself from ACCELERATE_FP8_BACKEND (FP8122)
    if _deepspeed(acc) and (version is None or version < FP8_FROM_CONFIG_UNDER_DEEPSPEED):
        ds = _deepspeed_precision(inp)
        yield Hit("mixed_precision", f"under DeepSpeed, {shown}"
                  f"{'' if version else ' older than 1.11'} reports the DeepSpeed config's "
                  f"{ds} as the mixed precision, so Accelerator() never enables FP8 from this "
                  f"config: the run trains in {ds.upper()} with no error "
                  "(accelerate #3360)", severity=None if version else "warning",
                  fix="use accelerate>=1.11; older versions need an explicit "
                  "FP8RecipeKwargs(backend='TE') in Accelerator(kwargs_handlers=...) (1.0-1.3: "
                  "not even that), checked with has_transformer_engine_layers(model.module)")
    elif (not _deepspeed(acc) and version is not None
          and FP8_AUTO_BROKEN[0] <= version < FP8_AUTO_BROKEN[1]):
        yield Hit("mixed_precision", f"{shown} creates the FP8 recipe from this config but "
                  "never marks it as an FP8 handler, so no layer is converted to TE and no FP8 "
                  "autocast runs: the run trains without FP8, with no error",
                  fix="use accelerate>=1.9 (1.8 enables FP8 but ignores fp8_config.backend: "
                  "FP8115), or pass TERecipeKwargs(...) in Accelerator(kwargs_handlers=...)")
    elif (fsdp2 := _te_under_fsdp2(inp)) is not None:
        later = "" if version else " (1.8 and later)"
        yield Hit(fsdp2.key, f"under FSDP2 {shown}{later} converts the model's layers to TE but never wraps its forward in TE's "
                  "fp8_autocast (_prepare_fsdp2 skips prepare_model, where apply_fp8_autowrap "
                  "is): the TE layers run in high precision, without FP8, with no error",
                  severity=None if version else "warning",
                  fix="set fsdp_config.fsdp_version: 1 (prepare_model wraps the forward in TE's "
                  "fp8_autocast), or use torchao, which Accelerate's FSDP2 path converts: "
                  "fp8_config.backend: AO with fsdp_cpu_ram_efficient_loading: false (FP8120)")


def _custom(key: str, value: Any) -> bool:
    """Would TERecipeKwargs forward this value to TE (it differs from Accelerate's default)?
    Not a null: the launcher exports none, so TERecipeKwargs keeps its default (see _unparsable)."""
    if value is None:
        return False
    default = TE_RECIPE_DEFAULTS[key]
    if key == "override_linear_precision":
        values = value if isinstance(value, (list, tuple)) else [value]
        return any(_is_true(v) for v in values)
    if isinstance(default, bool):
        return bool(_str_to_bool(str(value)))
    if isinstance(default, str):
        return _text(value) != default.lower()
    if key in TE_RECIPE_INTS and _int_reads(text := str(value)):
        # the launcher exports str(value), TERecipeKwargs int()s it and to_kwargs compares that
        # int with the default's (utils/launch.py:96, utils/dataclasses.py:82 and :384, v1.8.1;
        # the same at main, 2026-07): `"01024"` or `" 1024"` is the default, 1024
        return int(text) != default
    return value != default and str(value) != str(default)


def _te_default(key: str, value: Any) -> bool:
    """Is this TE's own DelayedScaling default, which a recipe built without the config (under
    DeepSpeed) runs anyway: `amax_compute_algo: max`, Accelerate's non-default, is one."""
    return key in TE_DELAYED_DEFAULTS and \
        str(_as_read(key, value)).lower() == str(TE_DELAYED_DEFAULTS[key]).lower()


def _as_read(key: str, value: Any) -> Any:
    """A recipe value as TERecipeKwargs holds it: fp8_format upper-cased, amax_compute_algo
    lower-cased (dataclasses.py:375 and :380, v1.8.1; the same v0.34.2-v1.14.0), an integer
    written as a string int()ed."""
    if key in TE_RECIPE_CASE:
        return getattr(str(value), TE_RECIPE_CASE[key])()
    if key in TE_RECIPE_INTS and isinstance(value, str) and _int_reads(value):
        return int(value)
    return value


def _str_to_bool(text: str) -> bool | None:
    """Accelerate's str_to_bool (utils/environment.py:59-71, v1.8.1); None where it raises."""
    text = text.lower()
    return True if text in TRUTH[0] else False if text in TRUTH[1] else None


def _int_reads(text: str) -> bool:
    """Does int() read this exported text, as TERecipeKwargs does (`1_000` yes, `1.0` no)?"""
    try:
        int(text)
    except ValueError:
        return False
    return True


def _read(name: str, version: Version | None) -> bool:
    """Does Accelerate `version` (None: unknown, taken as a release that reads it) read this
    fp8_config name at all (READ_FROM)?"""
    return name not in READ_FROM or _has((READ_FROM[name], None), version)


def _unparsable(inp: AccelerateInput) -> dict[str, str]:
    """TE recipe key -> why TERecipeKwargs cannot read the value the launcher exports for it
    (str() of the YAML value): int() for the integers, str_to_bool for the flags, the case-folded
    value for fp8_format and amax_compute_algo. A null is not exported (setup_fp8_env skips
    None, utils/launch.py:90, v1.8.1), so TERecipeKwargs takes its default."""
    problems = {}
    for item in launch_settings(inp.accelerate, "fp8_config"):
        key = "fp8_format" if item.name == "format" else item.name
        text = str(item.value)
        if item.value is None or not _read(key, inp.version):
            problems.pop(key, None)  # nothing reads it; a later null also unsets an earlier value
        elif key in TE_RECIPE_INTS and not _int_reads(text):
            problems[key] = f"int({text!r:.40}) raises ValueError"
        elif key in TE_RECIPE_FLAGS + AO_RECIPE_FLAGS and _str_to_bool(text) is None:
            problems[key] = f"str_to_bool({text!r:.40}) raises ValueError ('invalid truth value')"
        elif key in TE_RECIPE_CHOICES and _as_read(key, text) not in TE_RECIPE_CHOICES[key]:
            problems[key] = (f"{_as_read(key, text)!r:.40} is not one of "
                             f"{', '.join(TE_RECIPE_CHOICES[key])}: ValueError")
        else:
            problems.pop(key, None)  # the later of two spellings is what the launcher exports
    return problems


def _recipe_items(acc: Mapping[str, Any]) -> dict[str, Setting]:
    """TE recipe key -> the fp8_config setting, for the values Accelerate forwards to TE (a key
    written twice: the later, as the launcher reads it)."""
    items = {}
    for item in launch_settings(acc, "fp8_config"):
        key = "fp8_format" if item.name == "format" else item.name
        if key in TE_RECIPE_DEFAULTS:
            items[key] = item
    return {key: item for key, item in items.items() if _custom(key, item.value)}


@rule("FP8104", "warning", "FP8 recipe in `fp8_config` under DeepSpeed (ignored)",
      why="_prepare_deepspeed wraps the model with apply_fp8_autowrap(model, "
      "self.fp8_recipe_handler): the recipe built from the config is a TERecipeKwargs "
      "(te_recipe_handler), so TE gets DelayedScaling() with its defaults. Since 1.4, still in "
      "1.14. A value equal to TE's default (amax_compute_algo max, which is not Accelerate's "
      "default) runs all the same and is not reported.",
      source=f"{ACC} src/accelerate/accelerator.py Accelerator._prepare_deepspeed; "
      "src/accelerate/utils/transformer_engine.py apply_fp8_autowrap",
      fix="pass FP8RecipeKwargs(backend='TE', ...) with these values in "
      "Accelerator(kwargs_handlers=...), or rely on TE's defaults", family="accelerate")
def deepspeed_recipe_ignored(inp: AccelerateInput, _: LintContext) -> Iterator[Hit]:
    acc, version = inp.accelerate, inp.version
    if not (_fp8(acc) and _deepspeed(acc) and _te_backend(acc)):
        return
    if version is not None and version < DS_RECIPE_FROM_FP8_RECIPE_KWARGS_ONLY:
        return  # FP8 does not run under DeepSpeed there at all (FP8103)
    custom = {key: item for key, item in _recipe_items(acc).items()
              if key != "use_autocast_during_eval" and not _te_default(key, item.value)}
    if custom:
        names = ", ".join(item.key.removeprefix("fp8_config.") for item in custom.values())
        yield Hit("fp8_config", f"under DeepSpeed Accelerate builds TE's recipe only from the "
                  f"deprecated FP8RecipeKwargs, so this config's {names} never reach TE: it "
                  "runs TE's default DelayedScaling (HYBRID, amax_history_len 1024, max)")


@rule("FP8105", "warning", "`fp8_config` keys Accelerate never reads (did-you-mean)",
      why="The launcher turns each fp8_config key k into ACCELERATE_FP8_<K>, adding the fp8_ "
      "prefix only where k lacks it (fp8_amax_history_len and amax_history_len are one key, "
      "ACCELERATE_FP8_AMAX_HISTORY_LEN; every fp8_config rule reads keys so); only the names "
      "the recipe classes read have an effect. `accelerate config` itself writes "
      "amax_history_length, amax_compute_algorithm and optimization_level, which are dropped: "
      "the run uses the defaults (1024, most_recent, O2). An fp8_config that is no mapping "
      "(`fp8_config: TE`) is not read at all (the launcher copies only a dict's keys). "
      "use_mxfp8_block_scaling is exported by every release, but TERecipeKwargs reads it only from 1.11; AORecipeKwargs reads "
      "pad_inner_dim and enable_fsdp_float8_all_gather (which `accelerate config` writes for "
      "backend AO from 1.13) only from 1.13. Judged against the installed Accelerate.",
      source=f"{ACC} src/accelerate/commands/config/cluster.py; src/accelerate/commands/launch.py"
      ":1053-1054 _validate_launch_command (v1.8.1); src/accelerate/utils/launch.py:82-97 "
      "setup_fp8_env; "
      "src/accelerate/utils/dataclasses.py TERecipeKwargs/MSAMPRecipeKwargs.__post_init__ "
      "(use_mxfp8_block_scaling: :403-404 from v1.11.0), AORecipeKwargs.__post_init__ "
      "(:346-351 from v1.13.0, PR #3831); "
      f"{TE} transformer_engine/pytorch/fp8.py check_mxfp8_support",
      fix="use amax_history_len, amax_compute_algo, opt_level", family="accelerate")
def fp8_config_unknown_keys(inp: AccelerateInput, _: LintContext) -> Iterator[Hit]:
    written = inp.accelerate.get("fp8_config")
    if written is not None and not isinstance(written, Mapping):
        yield Hit("fp8_config", f"fp8_config is {written!r:.40}, not a mapping: the launcher "
                  "reads a section only as a mapping of keys, so none of it reaches the run, "
                  "which gets Accelerate's default FP8 backend and recipe",
                  fix="write the keys under it: fp8_config: {backend: TE}")
        return
    for item in launch_settings(inp.accelerate, "fp8_config"):
        name = item.name
        if not _read(name, inp.version) and item.value is not None \
                and _str_to_bool(str(item.value)) is not False:
            # The launcher exports it (setup_fp8_env exports every fp8_ argument), but nothing
            # reads it before READ_FROM; null/false ask for what the older release runs.
            since = dotted(READ_FROM[name])
            low, high = MXFP8_CAPABILITY
            needs = (f"MXFP8 block scaling needs Accelerate >= {since} and, per TE, a GPU of "
                     f"compute capability {dotted(low)}+ and below {dotted(high)} (data-centre "
                     f"Blackwell, as B200; TE >= {dotted(MXFP8_CAPABILITY_CAPPED_FROM)} refuses "
                     f"{dotted(high)}+)" if name == "use_mxfp8_block_scaling"
                     else f"AORecipeKwargs reads it from {since}; before, torchao's default "
                     "Float8LinearConfig() runs")
            yield Hit(item.key, f"{item.key} is silently dropped: Accelerate "
                      f"{dotted(inp.version)} does not read it; {needs}",
                      fix=f"upgrade to accelerate>={since}, or remove the key")
            continue
        if name in FP8_CONFIG_KEYS:
            continue
        if name in QUESTIONNAIRE_NAMES:
            yield Hit(item.key, f"{item.key} is silently dropped: `accelerate config` writes "
                      f"{name}, but `accelerate launch` reads {QUESTIONNAIRE_NAMES[name]}",
                      fix=f"rename it to {QUESTIONNAIRE_NAMES[name]}")
        else:
            yield Hit(item.key, f"{item.key} is silently dropped: no part of Accelerate reads it",
                      fix="fix the spelling" + did_you_mean(name, FP8_CONFIG_KEYS))


@rule("FP8106", "warning", "`fp8_config.amax_compute_algo: most_recent` (TE runs max)",
      why="KwargsHandler.to_kwargs forwards only values that differ from TERecipeKwargs' "
      "defaults, and Accelerate's default is most_recent while TE's DelayedScaling default "
      "is max: asking for most_recent gives max.",
      source=f"{ACC} src/accelerate/utils/dataclasses.py KwargsHandler.to_kwargs, "
      f"TERecipeKwargs; {TE} transformer_engine/common/recipe/__init__.py DelayedScaling",
      fix="write max (what runs); most_recent cannot be set through Accelerate",
      family="accelerate")
def most_recent_dropped(inp: AccelerateInput, _: LintContext) -> Iterator[Hit]:
    algo = setting(inp.accelerate, "fp8_config", "amax_compute_algo")
    if _te_backend(inp.accelerate) and algo and _text(algo.value) == "most_recent":
        yield Hit(algo.key, "most_recent is Accelerate's default, and "
                  "Accelerate forwards to TE only values that differ from its defaults: TE uses "
                  "its own default, max")


@rule("FP8107", "error", "`fp8_config` recipe values TE rejects (E5M2, removed keys)",
      why="Accelerate passes non-default values to DelayedScaling: TE asserts 'Pure E5M2 "
      "training is not supported'; override_linear_precision is gone in TE 2.0 and interval "
      "in TE 2.2 (TypeError; interval was unused since 1.8). Values are checked by "
      "recipe.recipe_problems, as for te_swap's fp8_recipe.",
      source=f"{TE} transformer_engine/common/recipe/__init__.py DelayedScaling; "
      f"{ACC} src/accelerate/utils/transformer_engine.py apply_fp8_autowrap",
      fix="fp8_format HYBRID or E4M3; remove interval and override_linear_precision",
      family="accelerate")
def recipe_values(inp: AccelerateInput, _: LintContext) -> Iterator[Hit]:
    if not _te_backend(inp.accelerate):
        return
    items = _recipe_items(inp.accelerate)
    for key in ("use_autocast_during_eval", "use_mxfp8_block_scaling"):
        items.pop(key, None)  # Accelerate's own switches, not TE recipe fields
    override = items.get("override_linear_precision")
    if override and isinstance(override.value, str):
        items.pop("override_linear_precision")  # FP8110: the launcher fails first
    for key in _unparsable(inp):
        items.pop(key, None)  # FP8123: TERecipeKwargs fails first
    for problem in recipe_problems({key: _as_read(key, item.value)
                                    for key, item in items.items()}):
        where = items[problem.key].key if problem.key in items else f"fp8_config.{problem.key}"
        yield Hit(where, problem.message, fix=problem.fix)


@rule("FP8108", "warning", "DeepSpeed `zero_optimization.stage: auto`",
      why="DeepSpeedPlugin fills an `auto` stage from its zero_stage, which is "
      "ACCELERATE_DEEPSPEED_ZERO_STAGE or 2; with a DeepSpeed file the Accelerate config "
      "cannot set zero_stage (FP8102), so `auto` silently means ZeRO-2.",
      source=f"{ACC} src/accelerate/utils/dataclasses.py DeepSpeedPlugin.__post_init__ and "
      "fill_match",
      fix="write the ZeRO stage you want (0-3)", family="accelerate")
def zero_stage_auto(inp: AccelerateInput, _: LintContext) -> Iterator[Hit]:
    ds = inp.deepspeed
    if ds is not None and _text(section(ds, "zero_optimization").get("stage")) == "auto":
        key, prefix = _ds_where(inp, "zero_optimization.stage")
        yield Hit(key, f"{prefix}is auto: Accelerate fills it with its own zero_stage, 2 unless "
                  "`accelerate launch --zero_stage N` is given (the Accelerate config may not set "
                  "zero_stage next to a DeepSpeed file)")


@rule("FP8109", "error", "`deepspeed_config_file` not found, not a regular file, or not a "
      "path",
      why="`accelerate launch` exports str(deepspeed_config_file) as "
      "ACCELERATE_DEEPSPEED_CONFIG_FILE, and HfDeepSpeedConfig opens that path as written (`~` "
      "is not expanded) from the launch directory with json.load, or else reads the text itself "
      "as JSON or base64 JSON and raises 'Expected a string path to an existing deepspeed "
      "config'. A path we cannot find from here is a warning (it may exist where the run "
      "launches); a folder (IsADirectoryError), a FIFO or device (json.load waits, or reads "
      "without end) or a value that is not a string (a list exports its Python repr) is an "
      "error.",
      source=f"{ACC} src/accelerate/utils/deepspeed.py HfDeepSpeedConfig.__init__, "
      "src/accelerate/utils/launch.py prepare_deepspeed_cmd_env",
      fix="use an absolute path, or lint from the launch directory", family="accelerate")
def deepspeed_file_missing(inp: AccelerateInput, _: LintContext) -> Iterator[Hit]:
    name = section(inp.accelerate, "deepspeed_config").get("deepspeed_config_file")
    if name is not None and not (isinstance(name, str) and name):
        shown = "an empty string" if name == "" else f"{type(name).__name__} {name!r:.60}"
        yield Hit(DS_FILE_KEY, f"deepspeed_config_file must be the path of the DeepSpeed JSON, "
                  f"got {shown}: `accelerate launch` exports str() of it, which "
                  "HfDeepSpeedConfig cannot open as a DeepSpeed JSON",
                  fix="write deepspeed_config_file as one path, e.g. ds_config.json")
    elif inp.deepspeed_kind:
        yield Hit(DS_FILE_KEY, f"DeepSpeed config {inp.deepspeed_missing} is {inp.deepspeed_kind}"
                  ", not a JSON file: HfDeepSpeedConfig opens it with json.load, which "
                  + ("raises IsADirectoryError" if inp.deepspeed_kind == "a folder" else
                     "waits for data or reads without end"),
                  fix="point deepspeed_config_file at the DeepSpeed JSON file")
    elif inp.deepspeed_missing:
        where = (f"could not be looked for ({inp.deepspeed_lookup_error})"
                 if inp.deepspeed_lookup_error else
                 "not found next to this file or in the current directory")
        yield Hit(DS_FILE_KEY, f"DeepSpeed config {inp.deepspeed_missing} {where}, so it was "
                  "not checked; Accelerate opens a relative path from the directory "
                  "`accelerate launch` runs in", severity="warning")


@rule("FP8110", "error", "`fp8_config.override_linear_precision` written as a string",
      why="setup_fp8_env exports value[0], value[1] and value[2] as ACCELERATE_FP8_OVERRIDE_"
      "FPROP/DGRAD/WGRAD: a string such as `(false, false, false)` (the form Accelerate's own "
      "docs show) exports '(', 'f' and 'a', and TERecipeKwargs() fails to read them as flags.",
      source=f"{ACC} src/accelerate/utils/launch.py setup_fp8_env; "
      "src/accelerate/utils/dataclasses.py TERecipeKwargs.__post_init__ (parse_flag_from_env)",
      fix="write a YAML list: override_linear_precision: [false, false, false] (or remove it: "
      "that is the default)", family="accelerate")
def override_as_string(inp: AccelerateInput, _: LintContext) -> Iterator[Hit]:
    override = setting(inp.accelerate, "fp8_config", "override_linear_precision")
    if override and isinstance(override.value, str):
        value = override.value
        shown = [value[i] if i < len(value) else "" for i in range(3)]
        yield Hit(override.key, f"a string: the launcher exports its "
                  f"first three characters {shown} as the FPROP/DGRAD/WGRAD flags, which "
                  "TERecipeKwargs cannot read")


@rule("FP8111", "error", "top-level keys the Accelerate config class does not have "
      "(`fp8_backend`, misspellings, keys of other releases, a wrong `compute_environment`) "
      "(did-you-mean)",
      why="load_config_from_file reads the file as a ClusterConfig when compute_environment is "
      "LOCAL_MACHINE or absent and as a SageMakerConfig otherwise (`accelerate config` writes "
      "AMAZON_SAGEMAKER, ec2_instance_type, region, ...); from_yaml_file raises 'had unknown "
      "keys' for any top-level key that is not a field of that class after process_config, "
      "which adds num_processes when distributed_type is 'NO' (a field SageMakerConfig lacks: "
      "accelerate #3463). Fields come and go: tp_config 1.4-1.6, parallelism_config from 1.10, "
      "ipex_config until 1.12. Judged against the installed Accelerate; a key of other "
      "releases is a warning when it is not installed. The FP8 backend belongs under "
      "fp8_config.",
      source=f"{ACC} src/accelerate/commands/config/config_args.py:43-72 "
      "load_config_from_file, :103-126 BaseConfig.process_config, :134/:154 from_json_file/"
      "from_yaml_file, :179 ClusterConfig, :236 SageMakerConfig; "
      "https://github.com/huggingface/accelerate/issues/3463",
      fix="fix the spelling; write the FP8 backend as fp8_config: {backend: TE}",
      family="accelerate")
def unknown_accelerate_keys(inp: AccelerateInput, _: LintContext) -> Iterator[Hit]:
    acc, version = inp.accelerate, inp.version
    environment = acc.get("compute_environment", LOCAL)
    if not (isinstance(environment, str) and environment in ACCELERATE_KEYS):
        yield Hit("compute_environment", f"compute_environment {environment!r} is neither "
                  f"{LOCAL} nor {SAGEMAKER} (in capitals): Accelerate reads the file as a "
                  "SageMakerConfig and refuses it"
                  + did_you_mean(str(environment).upper(), ACCELERATE_KEYS),
                  fix=f"write compute_environment: {LOCAL} (or {SAGEMAKER})")
        return
    known = ACCELERATE_KEYS[environment]
    config = "Accelerate's SageMaker config" if environment == SAGEMAKER else "Accelerate's config"
    for key in map(str, acc):
        span = known.get(key)
        if span is None and key == "fp8_backend" and environment == LOCAL:
            yield Hit(key, "Accelerate's config has no fp8_backend (`accelerate launch` raises "
                      "on unknown keys); the backend is fp8_config.backend",
                      fix="write fp8_config: {backend: TE} (or MSAMP, AO)")
        elif span is None:
            yield Hit(join_key("", key), f"{config} has no `{key}` (`accelerate launch` raises on unknown "
                      "keys)" + did_you_mean(key, known))
        elif not _has(span, version) or (version is None and span != _EVERY):
            fix = f"use an Accelerate that has it ({_releases(span)}), or remove it"
            if version is None:
                yield Hit(key, f"`{key}` is a key of Accelerate's config only in some releases "
                          f"({_releases(span)}); the others raise on it as an unknown key",
                          severity="warning", fix=fix)
            else:
                yield Hit(key, f"accelerate {dotted(version)}'s config has no `{key}` "
                          f"({_releases(span)}): `accelerate launch` raises on unknown keys",
                          fix=fix)
    if environment == SAGEMAKER and acc.get("distributed_type") == "NO" \
            and "num_processes" not in acc:
        yield Hit("distributed_type", "with compute_environment AMAZON_SAGEMAKER, "
                  "distributed_type 'NO' makes Accelerate's process_config add num_processes, "
                  "which SageMakerConfig has no field for: `accelerate launch` raises 'unknown "
                  "keys ([\'num_processes\'])' on the file `accelerate config` itself writes "
                  "(accelerate #3463)",
                  fix="use DATA_PARALLEL on an instance type SageMaker data parallelism "
                  "supports: Accelerate v0.34.2-v1.14.0 cannot load a single-process SageMaker "
                  "config")


@rule("FP8112", "warning", "`fp8_config` with `mixed_precision` other than fp8",
      why="The launcher exports fp8_config only when mixed_precision is fp8 "
      "(setup_fp8_env is called under `mixed_precision == 'fp8'`): otherwise the recipe is "
      "silently unused.",
      source=f"{ACC} src/accelerate/utils/launch.py prepare_simple_launcher_cmd_env, "
      "prepare_multi_gpu_env, prepare_deepspeed_cmd_env",
      fix="set mixed_precision: fp8, or remove fp8_config", family="accelerate")
def fp8_config_unused(inp: AccelerateInput, _: LintContext) -> Iterator[Hit]:
    acc = inp.accelerate
    if section(acc, "fp8_config") and not _fp8(acc) \
            and not section(acc, "deepspeed_config").get("deepspeed_config_file"):
        yield Hit("fp8_config", f"mixed_precision is {acc.get('mixed_precision') or 'not set'}, "
                  "so the launcher never exports fp8_config: it is silently unused")


@rule("FP8113", "error", "Accelerate < 1.9 launching FP8 with `distributed_type: NO`",
      why="Before 1.9.0 setup_fp8_env put override_linear_precision's booleans (default "
      "(False, False, False)) into the launch environment unconverted, and the single-process "
      "launcher hands that environment to subprocess, which raises TypeError on a bool: "
      "`accelerate launch` fails before training. Judged against the installed Accelerate; a "
      "warning when it is not installed.",
      source=f"{ACC} src/accelerate/utils/launch.py setup_fp8_env, "
      "prepare_simple_launcher_cmd_env (v1.8.1); fixed in v1.9.0",
      fix="use accelerate>=1.9", family="accelerate")
def fp8_single_process_old_accelerate(inp: AccelerateInput, _: LintContext) -> Iterator[Hit]:
    acc, version = inp.accelerate, inp.version
    if not (_fp8(acc) and _text(acc.get("distributed_type")) == "no") or _sagemaker(acc):
        return  # a SageMaker config with distributed_type NO does not load (FP8111)
    if version is None or version < STR_FP8_ENV:
        who = f"accelerate {dotted(version)}" if version else "an Accelerate older than 1.9"
        yield Hit("distributed_type", f"{who} exports FP8 flags as Python booleans into the "
                  "single-process launch environment: `accelerate launch` fails with TypeError",
                  severity=None if version else "warning")


@rule("FP8114", "error", "an Accelerate config without `distributed_type`",
      why="ClusterConfig.process_config raises 'A `distributed_type` must be specified in the "
      "config file.' A file with Accelerate's keys (mixed_precision, fp8_config, "
      "num_processes, ...) and none of LLM-Foundry's is linted as an Accelerate config.",
      source=f"{ACC} src/accelerate/commands/config/config_args.py BaseConfig.process_config",
      fix="add distributed_type (NO, MULTI_GPU, FSDP, DEEPSPEED, ...)", family="accelerate")
def missing_distributed_type(inp: AccelerateInput, _: LintContext) -> Iterator[Hit]:
    if inp.accelerate and "distributed_type" not in inp.accelerate:
        yield Hit(next(iter(map(str, inp.accelerate))), "this Accelerate config has no "
                  "distributed_type: `accelerate launch --config_file` refuses it")


@rule("FP8115", "warning", "`fp8_config.backend` that Accelerate 1.8 ignores outside DeepSpeed",
      why="The launcher exports fp8_config.backend as ACCELERATE_FP8_BACKEND, but in 1.8.x "
      "Accelerator() with no FP8 kwargs handler picks the backend by what is installed: torchao, "
      "then TransformerEngine, then MS-AMP; outside DeepSpeed (whose plugin reads the variable "
      "for MS-AMP) nothing reads it. 1.9.0 reads it (PR #3677), in capitals as "
      "FP8BackendType. 1.0-1.3 read it through FP8RecipeKwargs; 1.4-1.7 run no FP8 from the "
      "config at all (FP8103), nor does MEGATRON_LM in any release (FP8103). Judged against "
      "the installed Accelerate; a warning for Accelerate < 1.9 when it is not installed.",
      source=f"{ACC} src/accelerate/accelerator.py:457-474 Accelerator.__init__ and :3958-3971 "
      "fp8_backend (v1.8.1), :466-490 and :3998-4012 (v1.9.0); src/accelerate/utils/launch.py"
      ":82-97 setup_fp8_env; src/accelerate/commands/launch.py:1044-1055 "
      "_validate_launch_command; src/accelerate/utils/dataclasses.py:1190 DeepSpeedPlugin "
      "(v1.8.1); https://github.com/huggingface/accelerate/pull/3677",
      fix="use accelerate>=1.9, or pass the backend's handler (TERecipeKwargs(), "
      "MSAMPRecipeKwargs() or AORecipeKwargs()) in Accelerator(kwargs_handlers=...)",
      family="accelerate")
def backend_ignored(inp: AccelerateInput, _: LintContext) -> Iterator[Hit]:
    acc, version = inp.accelerate, inp.version
    backend = _backend(acc)
    if not (_fp8(acc) and backend and backend.value and not _deepspeed(acc)
            and not _megatron(acc) and not _sagemaker(acc)):
        return
    if version is None or FP8_AUTO_BROKEN[1] <= version < BACKEND_READ:
        who = f"accelerate {dotted(version)}" if version else "Accelerate < 1.9 (1.8.x)"
        yield Hit(backend.key, f"{who} ignores {backend.key} ({backend.value}) outside "
                  "DeepSpeed: Accelerator() takes torchao if it is installed, then "
                  "TransformerEngine, then MS-AMP, whatever the config says")


@rule("FP8116", "error", "an `fp8_config.backend` Accelerate >= 1.9 cannot read (`te` for `TE`)",
      why="The launcher exports fp8_config.backend as written (setup_fp8_env upper-cases the "
      "variable's name, not its value), and from 1.9 Accelerator() reads it as "
      "FP8BackendType(value), whose values are capitals: `backend: te` (the spelling of "
      "`accelerate launch --fp8_backend`'s choices) raises ValueError before training. 1.0-1.3 "
      "upper-cased it in FP8RecipeKwargs; 1.4-1.8 do not read it (FP8103, FP8115). Judged "
      "against the installed Accelerate; a warning when it is not installed.",
      source=f"{ACC} src/accelerate/utils/launch.py:82-97 setup_fp8_env; "
      "src/accelerate/accelerator.py:466-490 Accelerator.__init__ and :3998-4012 fp8_backend "
      "(v1.9.0); src/accelerate/utils/dataclasses.py FP8BackendType; "
      "src/accelerate/commands/launch.py --fp8_backend (choices ao, te, msamp)",
      fix="write the backend in capitals: TE, MSAMP or AO", family="accelerate")
def backend_unreadable(inp: AccelerateInput, _: LintContext) -> Iterator[Hit]:
    acc, version = inp.accelerate, inp.version
    backend = _backend(acc)
    if not _fp8(acc) or backend is None or backend.value is None or _sagemaker(acc) \
            or str(backend.value) in FP8_BACKENDS:
        return
    if version is not None and version < BACKEND_READ:
        return
    who = f"accelerate {dotted(version)}" if version else "Accelerate >= 1.9"
    capitals = str(backend.value).upper()
    hint = f"; write {capitals}" if capitals in FP8_BACKENDS else ""
    yield Hit(backend.key, f"{who} reads {backend.key} as FP8BackendType("
              f"{str(backend.value)!r}), which raises ValueError at Accelerator(){hint}",
              severity=None if version else "warning")


@rule("FP8117", "error", "a key given twice in one object of a DeepSpeed JSON",
      why="DeepSpeed reads a config file with `object_pairs_hook=dict_raise_error_on_duplicate_"
      "keys` and raises 'Duplicate keys in DeepSpeed config'; Accelerate's HfDeepSpeedConfig "
      "reads the file with plain json.load, which silently keeps the last value, and hands "
      "DeepSpeed the dict. An error for a DeepSpeed JSON on its own, a warning behind an "
      "Accelerate config (a setting silently dropped).",
      source="DeepSpeed (microsoft/DeepSpeed, master) deepspeed/runtime/config_utils.py "
      "dict_raise_error_on_duplicate_keys, deepspeed/runtime/config.py DeepSpeedConfig.__init__; "
      f"{ACC} src/accelerate/utils/deepspeed.py HfDeepSpeedConfig.__init__",
      fix="keep one of the two values", family="accelerate")
def deepspeed_duplicate_keys(inp: AccelerateInput, _: LintContext) -> Iterator[Hit]:
    for ds_key in inp.deepspeed_duplicates:
        key, prefix = _ds_where(inp, ds_key)
        if inp.accelerate:
            yield Hit(key, f"{prefix}is given twice: Accelerate reads the file with json.load, "
                      "which keeps the last value without a word (DeepSpeed itself refuses such a "
                      "file)", severity="warning")
        else:
            yield Hit(key, f"{prefix}is given twice: DeepSpeed raises 'Duplicate keys in "
                      "DeepSpeed config' reading the file (json.load, as Accelerate reads it, "
                      "keeps the last)")


def _zero_stage_refused(stage: Any) -> bool:
    """A ZeRO stage DeepSpeed's ZeroStageEnum (0-3) refuses: NaN, 4, 2.5, `two` (`auto`: FP8108;
    a string of digits is left to DeepSpeed's lax reading)."""
    if isinstance(stage, bool):
        return True
    if isinstance(stage, str):
        return stage.strip().lower() != "auto" and not stage.strip().isdigit()
    if isinstance(stage, float):
        return not (math.isfinite(stage) and stage.is_integer() and 0 <= stage <= 3)
    return isinstance(stage, int) and not 0 <= stage <= 3


@rule("FP8118", "error", "a DeepSpeed `zero_optimization.stage` that is not 0-3 (`NaN`, `4`)",
      why="DeepSpeedZeroConfig types `stage` as ZeroStageEnum (0, 1, 2, 3) and refuses any other "
      "value when the engine is built; Python's json (Accelerate's reader) accepts `NaN` and "
      "`Infinity`, which are not JSON, so such a file gets that far.",
      source="DeepSpeed (microsoft/DeepSpeed, master) deepspeed/runtime/zero/config.py "
      f"ZeroStageEnum, DeepSpeedZeroConfig.stage; {ACC} src/accelerate/utils/deepspeed.py "
      "HfDeepSpeedConfig.set_stage_and_offload",
      fix="write the ZeRO stage you want (0, 1, 2 or 3)", family="accelerate")
def zero_stage_refused(inp: AccelerateInput, _: LintContext) -> Iterator[Hit]:
    zero = section(inp.deepspeed, "zero_optimization") if inp.deepspeed is not None else {}
    if "stage" in zero and _zero_stage_refused(zero["stage"]):
        key, prefix = _ds_where(inp, "zero_optimization.stage")
        yield Hit(key, f"{prefix}is {zero['stage']!r:.40}: DeepSpeed's ZeRO stage is 0, 1, 2 or 3 "
                  "(ZeroStageEnum), and building the engine refuses anything else")


@rule("FP8119", "error", "Accelerate FSDP activation checkpointing with FP8 on TransformerEngine",
      why="With fsdp_config's activation_checkpointing (written with or without the fsdp_ "
      "prefix, which the launcher adds) Accelerate wraps the auto-wrapped blocks in "
      "torch's checkpoint_wrapper (non-reentrant, under FSDP1 and FSDP2 alike), while its TE "
      "FP8 autocast wraps only the model's forward (apply_fp8_autowrap, "
      "contextual_fp8_autocast): the recompute in backward runs TE's layers outside "
      "fp8_autocast, without FP8, unlike the forward it replays (the TE #1190 class; Composer's "
      "analogue is FP8002). Accelerate has no TE-aware checkpoint. Not reported for Accelerate "
      "1.4-1.7, which runs no FP8 from the config, nor under FSDP2 from 1.8, which never "
      "enters TE's autocast (both FP8103).",
      source=f"{ACC} src/accelerate/accelerator.py Accelerator.prepare_model "
      "(apply_activation_checkpointing with CheckpointImpl.NO_REENTRANT, apply_fp8_autowrap), "
      "src/accelerate/utils/fsdp_utils.py fsdp2_prepare_model / fsdp2_apply_ac, "
      "src/accelerate/utils/transformer_engine.py contextual_fp8_autocast, "
      "src/accelerate/utils/dataclasses.py FullyShardedDataParallelPlugin "
      "(FSDP_ACTIVATION_CHECKPOINTING), src/accelerate/commands/launch.py:1051-1052 "
      f"_validate_launch_command (the fsdp_ prefix, v1.8.1); {TE_1190}",
      fix="set fsdp_config.fsdp_activation_checkpointing: false, or checkpoint inside your "
      "model with te.distributed.checkpoint (TE's recompute under FP8)", family="accelerate")
def fsdp_recompute_outside_fp8(inp: AccelerateInput, _: LintContext) -> Iterator[Hit]:
    acc, version = inp.accelerate, inp.version
    checkpointing = setting(acc, "fsdp_config", "activation_checkpointing")
    if not (_fp8(acc) and _text(acc.get("distributed_type")) == "fsdp" and _te_backend(acc)
            and checkpointing and _is_true(checkpointing.value)):
        return
    if version is not None and FP8_AUTO_BROKEN[0] <= version < FP8_AUTO_BROKEN[1]:
        return
    if _te_under_fsdp2(inp) is not None:
        return  # no TE autocast at all under FSDP2 (FP8103)
    yield Hit(checkpointing.key, "Accelerate recomputes the "
              "checkpointed blocks with torch's checkpoint_wrapper in backward, outside the TE "
              "fp8_autocast it wraps around the model's forward: TE's layers recompute without "
              "FP8, unlike their forward")


def _takes_torchao(inp: AccelerateInput) -> tuple[str, Severity | None] | None:
    """Why Accelerator() makes torchao (AO) its FP8 backend for this config, and the severity
    (None: the rule's; a warning where only a torchao installed here, or an Accelerate not
    installed here, says so); None where it does not, or this Accelerate checks nothing."""
    version = inp.version
    backend = _backend(inp.accelerate)
    written = None if backend is None else backend.value
    if version is None:
        return (f"{backend.key} is AO", "warning") if backend and written == "AO" else None
    shown = f"accelerate {dotted(version)}"
    if version < AO_REFUSED:
        return None
    if version < BACKEND_READ:  # 1.8 ignores the backend: torchao whenever installed
        if written == "AO":
            return (f"backend AO needs torchao installed, and {shown} takes torchao whenever it "
                    "is installed"), None
        return (f"torchao is installed here, and {shown} takes it whatever fp8_config.backend "
                "says", "warning") if inp.torchao else None
    if backend and written == "AO":
        return f"{backend.key} is AO", None
    if written in (None, "NO") and inp.torchao:
        return (f"with no fp8_config.backend {shown} picks torchao, installed here, before "
                "TransformerEngine", "warning")
    return None


@rule("FP8120", "error", "torchao FP8 (`fp8_config.backend: AO`) that Accelerator() refuses: "
      "FSDP with `cpu_ram_efficient_loading`, and in 1.8 any setup but FSDP",
      why="From 1.8.0 Accelerator() raises ValueError 'torchao with FSDP2 and "
      "cpu_ram_efficient_loading is not supported' when its FP8 backend is AO and the FSDP "
      "plugin's cpu_ram_efficient_loading is on; 1.9+ tests distributed_type FSDP, not "
      "fsdp_version, so FSDP1 raises too. `accelerate launch` sets cpu_ram_efficient_loading "
      "true unless fsdp_config says false (with or without the fsdp_ prefix). The backend is AO "
      "from 1.9 for fp8_config.backend AO, or with no backend (or NO) when torchao is installed "
      "(picked before TransformerEngine); 1.8 ignores the backend and takes torchao whenever it "
      "is installed, and reads state.fsdp_plugin without testing for FSDP, so every other "
      "distributed type raises AttributeError (`AcceleratorState` object has no attribute "
      "`fsdp_plugin`). 1.4-1.7 run no FP8 from the config (FP8103) and have no such check. "
      "Judged against the installed Accelerate, a warning when it is not installed; where only "
      "an installed torchao makes the backend AO, a warning when torchao is installed where the "
      "linter runs (the run may launch elsewhere), nothing when it is not.",
      source=f"{ACC} src/accelerate/accelerator.py:457-474 and :488-492 Accelerator.__init__, "
      ":3958-3971 fp8_backend (v1.8.1); :466-490 and :504-512, :3998-4012 (v1.9.0); :517-525 "
      "(v1.14.0); src/accelerate/commands/launch.py:593-595 (--fsdp_cpu_ram_efficient_loading, "
      "default 'true') and :1051-1052; src/accelerate/utils/launch.py:328; "
      "src/accelerate/state.py:977-981 (fsdp_plugin set under FSDP only, v1.8.1); "
      "src/accelerate/utils/imports.py:149-154 is_torchao_available",
      fix="set fsdp_config.fsdp_cpu_ram_efficient_loading: false (what Accelerate's message "
      "says), or use fp8_config.backend: TE", family="accelerate")
def torchao_refused(inp: AccelerateInput, _: LintContext) -> Iterator[Hit]:
    acc, version = inp.accelerate, inp.version
    distributed = _text(acc.get("distributed_type"))
    if not _fp8(acc) or _deepspeed(acc) or _sagemaker(acc) or distributed == "no" \
            or "distributed_type" not in acc:
        return  # DeepSpeed: no FP8 handler from the config before 1.11 (FP8103); NO: FP8113;
        # no key: `accelerate launch` refuses the file first (FP8114; a null loads)
    takes = _takes_torchao(inp)
    if takes is None:
        return
    why, severity = takes
    if distributed == "fsdp":
        loading = setting(acc, "fsdp_config", "cpu_ram_efficient_loading")
        if not _is_true(loading.value if loading else CPU_RAM_EFFICIENT_LOADING_DEFAULT):
            return
        key = loading.key if loading else "fsdp_config" if "fsdp_config" in acc \
            else "distributed_type"
        said = "on" if loading else "not set, which `accelerate launch` turns on"
        yield Hit(key, f"{why}; with FSDP and cpu_ram_efficient_loading {said}, Accelerator() "
                  "raises ValueError 'torchao with FSDP2 and cpu_ram_efficient_loading is not "
                  "supported' (whatever fsdp_version)", severity=severity)
    elif version is not None and version < BACKEND_READ:
        yield Hit("distributed_type", f"{why}; then it reads the FSDP plugin, which only FSDP "
                  f"sets: under distributed_type {acc.get('distributed_type')} Accelerator() "
                  "raises AttributeError ('AcceleratorState' object has no attribute "
                  "'fsdp_plugin')", severity=severity,
                  fix="use accelerate>=1.9 with fp8_config.backend: TE, or uninstall torchao")


@rule("FP8121", "error", "a DeepSpeed JSON without `zero_optimization`",
      why="DeepSpeedPlugin raises 'Please specify the ZeRO optimization config in the DeepSpeed "
      "config.' at Accelerator() when the file has no zero_optimization section (the same in "
      "v0.34.2-v1.14.0); DeepSpeed itself does without one, so a DeepSpeed JSON linted on its "
      "own gets a warning.",
      source=f"{ACC} src/accelerate/utils/dataclasses.py:1206-1207 DeepSpeedPlugin.__post_init__ "
      "(v1.8.1; :1274-1275 in v1.14.0)",
      fix='add "zero_optimization": {"stage": N} to the DeepSpeed JSON', family="accelerate")
def deepspeed_no_zero(inp: AccelerateInput, _: LintContext) -> Iterator[Hit]:
    ds = inp.deepspeed
    if ds is None or "zero_optimization" in ds:
        return
    if inp.accelerate:
        yield Hit(DS_FILE_KEY, f"{inp.deepspeed_path}: has no zero_optimization: Accelerate's "
                  "DeepSpeedPlugin raises ValueError 'Please specify the ZeRO optimization "
                  "config in the DeepSpeed config.' at Accelerator()")
    else:
        yield Hit(next(iter(map(str, ds)), ""), "this DeepSpeed JSON has no zero_optimization: "
                  "Accelerate refuses it at Accelerator() ('Please specify the ZeRO optimization "
                  "config in the DeepSpeed config.'); DeepSpeed alone accepts it",
                  severity="warning")


def _msamp_zero3(inp: AccelerateInput) -> str | None:
    """The key that makes DeepSpeedPlugin's zero_stage 3 when it checks MS-AMP (None: another
    stage): the DeepSpeed JSON's stage as JSON gives it (`"3"` is not 3) unless absent or
    `auto`, else the config's zero_stage, which the launcher exports and the plugin int()s."""
    ds_stage = section(inp.deepspeed, "zero_optimization").get("stage") \
        if inp.deepspeed is not None else None
    if ds_stage is not None and _text(ds_stage) != "auto":
        three = ds_stage == 3 and not isinstance(ds_stage, bool)
        return _ds_where(inp, "zero_optimization.stage")[0] if three else None
    stage = section(inp.accelerate, "deepspeed_config").get("zero_stage")
    return "deepspeed_config.zero_stage" if str(stage).strip() == "3" else None


@rule("FP8122", "error", "MS-AMP settings Accelerate refuses (`opt_level` not O1/O2, ZeRO-3 "
      "under DeepSpeed)",
      why="Under DeepSpeed, DeepSpeedPlugin turns MS-AMP on when ACCELERATE_FP8_BACKEND is "
      "exactly MSAMP and the DeepSpeed JSON has no `msamp` block, then raises "
      "NotImplementedError for ZeRO stage 3 and ValueError for an opt_level other than O1 or O2 "
      "(v1.0.0-v1.14.0; its default is O1). Outside DeepSpeed MSAMPRecipeKwargs (FP8RecipeKwargs "
      "before 1.4) raises ValueError for such an opt_level when Accelerator() builds it from "
      "the config: for backend MSAMP in 1.0-1.3 and from 1.9 (1.4-1.8 pick the backend by what "
      "is installed, FP8103/FP8115). Judged against the installed Accelerate outside "
      "DeepSpeed; a warning there when it is not installed.",
      source=f"{ACC} src/accelerate/utils/dataclasses.py:1190-1193 and :1268-1276 "
      "DeepSpeedPlugin.__post_init__, :395-406 MSAMPRecipeKwargs (v1.8.1); "
      "src/accelerate/accelerator.py:466-473 Accelerator.__init__ (v1.9.0), :436-437 (v1.2.0)",
      fix="opt_level O1 or O2; ZeRO stage 0, 1 or 2 with MS-AMP", family="accelerate")
def msamp_refused(inp: AccelerateInput, _: LintContext) -> Iterator[Hit]:
    acc, version = inp.accelerate, inp.version
    backend = _backend(acc)
    written = None if backend is None else str(backend.value)
    level = setting(acc, "fp8_config", "opt_level")
    bad_level = level is not None and str(level.value) not in MSAMP_OPT_LEVELS
    if _deepspeed(acc):
        if written != "MSAMP" or not (_fp8(acc) or "deepspeed_config_file"
                                      in section(acc, "deepspeed_config")):
            return  # no MS-AMP: mixed_precision fp8 comes from the CLI with a DeepSpeed file
        if inp.deepspeed is not None and "msamp" in inp.deepspeed:
            return  # DeepSpeedPlugin leaves a JSON's own msamp block unchecked
        where = _msamp_zero3(inp)
        if where:
            yield Hit(where, "ZeRO stage 3 with fp8_config.backend MSAMP: Accelerate's "
                      "DeepSpeedPlugin raises NotImplementedError 'MS-AMP is not supported for "
                      "ZeRO Stage 3' at Accelerator()")
        if bad_level:
            yield Hit(level.key, f"{level.value!r:.40} with fp8_config.backend MSAMP under "
                      "DeepSpeed: DeepSpeedPlugin raises ValueError 'Invalid optimization level "
                      "for MS-AMP' at Accelerator()")
        return
    if not (_fp8(acc) and bad_level and written) or _sagemaker(acc):
        return
    old = version is not None and version < DS_RECIPE_FROM_FP8_RECIPE_KWARGS_ONLY
    if not (written.upper() == "MSAMP" if old or version is None else written == "MSAMP"
            and version >= BACKEND_READ):
        return
    shown = f"accelerate {dotted(version)}" if version else "Accelerate 1.0-1.3 and >= 1.9"
    yield Hit(level.key, f"{level.value!r:.40} with backend MSAMP: {shown} builds MS-AMP's "
              "recipe from the config and raises ValueError ('opt_level must be one of O1 or "
              "O2') at Accelerator()", severity=None if version else "warning")


@rule("FP8123", "error", "an `fp8_config` value TERecipeKwargs or AORecipeKwargs cannot read "
      "(`margin: 0.5`, `interval: 1.0`, `use_autocast_during_eval: maybe`, `pad_inner_dim: "
      "maybe`)",
      why="The launcher exports str() of each fp8_config value, and TERecipeKwargs, which "
      "Accelerator() builds from those variables for the TE backend, reads margin, interval and "
      "amax_history_len with int() (`1.0` and `1e3` raise), the flags with str_to_bool, and "
      "fp8_format/amax_compute_algo after upper()/lower() against its choices (so `MAX` and "
      "`e4m3` are accepted, `HYBRID ` is not): ValueError at Accelerator(). A null is not "
      "exported (TERecipeKwargs keeps its default); use_mxfp8_block_scaling is read from 1.11 "
      "only. Not under DeepSpeed "
      "before 1.11, which builds no recipe from the config (FP8103). A warning where torchao, "
      "installed here, may be taken instead. For torchao (backend AO, or no backend with "
      "torchao installed here: a warning) AORecipeKwargs reads pad_inner_dim and "
      "enable_fsdp_float8_all_gather with str_to_bool from 1.13 (FP8105 before).",
      source=f"{ACC} src/accelerate/utils/dataclasses.py:363-389 TERecipeKwargs.__post_init__, "
      ":346-351 AORecipeKwargs.__post_init__ (v1.13.0), "
      "src/accelerate/utils/environment.py:59-86 str_to_bool/parse_flag_from_env, "
      "src/accelerate/utils/launch.py:82-97 setup_fp8_env (v1.8.1; the same v0.34.2-v1.14.0)",
      fix="write integers as integers (margin: 0), flags as true/false, fp8_format HYBRID, E4M3 "
      "or E5M2, amax_compute_algo max or most_recent", family="accelerate")
def recipe_unparsable(inp: AccelerateInput, _: LintContext) -> Iterator[Hit]:
    acc, version = inp.accelerate, inp.version
    if not _fp8(acc) or _sagemaker(acc):
        return
    if _deepspeed(acc) and (version is None or version < FP8_FROM_CONFIG_UNDER_DEEPSPEED):
        return
    backend = _backend(acc)
    explicit = backend is not None and backend.value == "TE" and version is not None \
        and version >= BACKEND_READ
    torchao = _takes_torchao(inp)
    for key, why in _unparsable(inp).items():
        item = setting(acc, "fp8_config", "format" if key == "fp8_format" else key)
        where = item.key if item else f"fp8_config.{key}"
        if key in AO_RECIPE_FLAGS and torchao:
            yield Hit(where, f"AORecipeKwargs cannot read it: {why} at Accelerator() "
                      f"({torchao[0]})", severity=torchao[1])
        elif key not in AO_RECIPE_FLAGS and _te_backend(acc):
            yield Hit(where, f"TERecipeKwargs cannot read it: {why} at Accelerator()",
                      severity="warning" if inp.torchao and not explicit else None)


@rule("FP8124", "error", "MS-AMP (`fp8_config.backend: MSAMP`) under FSDP: Accelerator() "
      "raises",
      why="Accelerator.__init__ raises NotImplementedError '`accelerate` + `MS-AMP` + `FSDP` is "
      "not supported at this time' when its FP8 backend is MSAMP and distributed_type is FSDP, "
      "whatever fsdp_version, before prepare() (whose FSDP2 branch would not call "
      "_prepare_msamp either). From 1.9, where backend MSAMP is read (1.4-1.8 take MS-AMP only "
      "when neither torchao nor TE is installed); the same in v1.14.0. Judged against the "
      "installed Accelerate; a warning when it is not installed.",
      source=f"{ACC} src/accelerate/accelerator.py:590-598 Accelerator.__init__ (v1.9.0; "
      ":601-609 in v1.14.0, :570-578 in v1.8.1), :1448-1452 Accelerator.prepare (v1.9.0); "
      "src/accelerate/utils/dataclasses.py:1714 FullyShardedDataParallelPlugin (FSDP_VERSION)",
      fix="use DeepSpeed ZeRO 0-2 with MS-AMP (what Accelerate's message says), or backend TE",
      family="accelerate")
def msamp_fsdp_refused(inp: AccelerateInput, _: LintContext) -> Iterator[Hit]:
    acc, version = inp.accelerate, inp.version
    backend = _backend(acc)
    if not (_fp8(acc) and _text(acc.get("distributed_type")) == "fsdp" and backend
            and backend.value == "MSAMP"):
        return
    if version is not None and version < BACKEND_READ:
        return
    fsdp_version = setting(acc, "fsdp_config", "version")
    who = f"accelerate {dotted(version)}" if version else "Accelerate >= 1.9"
    yield Hit(fsdp_version.key if fsdp_version else "distributed_type", f"FSDP with backend MSAMP: {who} refuses it at Accelerator() "
              "(NotImplementedError '`accelerate` + `MS-AMP` + `FSDP` is not supported at this "
              "time')", severity=None if version else "warning")


@rule("FP8125", "error", "`amax_compute_algo`/`amax_history_len` with "
      "`fp8_config.use_mxfp8_block_scaling` (Accelerate raises)",
      why="apply_fp8_autowrap builds TE's MXFP8BlockScaling when the recipe's "
      "use_mxfp8_block_scaling is on, and raises ValueError '`amax_compute_algo` is not "
      "supported for MXFP8 block scaling.' (and the same for amax_history_len) when the recipe "
      "forwards either, i.e. when it differs from TERecipeKwargs' default (most_recent, 1024; "
      "to_kwargs drops defaults): `amax_compute_algo: max` or `amax_history_len: 16` fails when "
      "prepare() wraps the model. From 1.11, where TERecipeKwargs reads the flag (FP8105 "
      "before); not under DeepSpeed, which builds TE's recipe without the config (FP8104). "
      "Checked by running Accelerate 1.14.0's TERecipeKwargs and apply_fp8_autowrap on the "
      "environment its setup_fp8_env exports. Judged against the installed Accelerate; a "
      "warning when it is not installed, or where torchao installed here may be taken instead.",
      source=f"{ACC} src/accelerate/utils/transformer_engine.py:170-174 apply_fp8_autowrap "
      "(v1.11.0-v1.14.0); src/accelerate/utils/dataclasses.py:403-404 TERecipeKwargs "
      "(v1.11.0); src/accelerate/accelerator.py:1833 and :2060 (v1.14.0); "
      f"{TE} transformer_engine/common/recipe/__init__.py MXFP8BlockScaling (no amax fields)",
      fix="remove amax_compute_algo and amax_history_len (MXFP8 has no amax history), or turn "
      "use_mxfp8_block_scaling off", family="accelerate")
def mxfp8_with_amax(inp: AccelerateInput, _: LintContext) -> Iterator[Hit]:
    acc, version = inp.accelerate, inp.version
    if not (_fp8(acc) and _te_backend(acc)) or _deepspeed(acc) or _sagemaker(acc):
        return
    mxfp8 = setting(acc, "fp8_config", "use_mxfp8_block_scaling")
    unparsable = _unparsable(inp)
    if mxfp8 is None or not _read(mxfp8.name, version) \
            or _str_to_bool(str(mxfp8.value)) is not True or mxfp8.name in unparsable:
        return
    backend = _backend(acc)
    explicit = backend is not None and backend.value == "TE"
    severity = None if version is not None and not (inp.torchao and not explicit) else "warning"
    for key, item in _recipe_items(acc).items():
        if key in ("amax_compute_algo", "amax_history_len") and key not in unparsable:
            yield Hit(item.key, f"{item.value!r:.40} with {mxfp8.key} on: Accelerate raises "
                      f"ValueError '`{key}` is not supported for MXFP8 block scaling.' when "
                      "prepare() wraps the model", severity=severity)



#: `DistributedType`'s values in accelerate 1.8.1 (utils/dataclasses.py:555) and
#: `SageMakerDistributedType`'s (:591); tests/test_lint_accelerate_types.py compares both with
#: the installed Accelerate's.
DISTRIBUTED_TYPES = ("NO", "MULTI_CPU", "MULTI_GPU", "MULTI_NPU", "MULTI_MLU", "MULTI_SDAA",
                     "MULTI_MUSA", "MULTI_XPU", "DEEPSPEED", "FSDP", "TP", "XLA", "MEGATRON_LM",
                     "MULTI_HPU")
SAGEMAKER_DISTRIBUTED_TYPES = ("NO", "DATA_PARALLEL", "MODEL_PARALLEL")


@rule("FP8126", "error", "a `distributed_type` Accelerate's enum does not hold (`multi_gpu`, "
      "`MULTI_GPUS`)",
      why="BaseConfig.__post_init__ turns a string distributed_type into DistributedType (or, "
      "under compute_environment AMAZON_SAGEMAKER, SageMakerDistributedType), a plain "
      "str Enum whose lookup is exact: any other spelling, lower case included, raises "
      "ValueError \"'multi_gpu' is not a valid DistributedType\" when `accelerate launch` loads "
      "the file. An error where the value is no member in any case (every release writes "
      "them in upper case: `''` too); a warning for an upper-case name 1.8.1 lacks, which "
      "another release may have. An unquoted `NO` is YAML's false, which Accelerate keeps as is.",
      source=f"{ACC} src/accelerate/commands/config/config_args.py:166-175 "
      "BaseConfig.__post_init__ (v1.8.1); src/accelerate/utils/dataclasses.py DistributedType, "
      "SageMakerDistributedType; tests/test_lint_accelerate_types.py loads each case with "
      "load_config_from_file", fix="write it as Accelerate spells it (NO, MULTI_GPU, FSDP, "
      "DEEPSPEED, ...; quote \"NO\")", family="accelerate")
def distributed_type_value(inp: AccelerateInput, _: LintContext) -> Iterator[Hit]:
    value = inp.accelerate.get("distributed_type")
    members = SAGEMAKER_DISTRIBUTED_TYPES if _sagemaker(inp.accelerate) else DISTRIBUTED_TYPES
    if not isinstance(value, str) or value in members:
        return
    enum = "SageMakerDistributedType" if _sagemaker(inp.accelerate) else "DistributedType"
    # a member's name: upper case, a letter first (DistributedType's values are their names)
    if value.upper() in members or not re.fullmatch(r"[A-Z][A-Z0-9_]*", value):
        hint = f" (write {value.upper()})" if value.upper() in members \
            else did_you_mean(value.upper(), members)
        yield Hit("distributed_type", f"distributed_type {value!r:.40} is not a {enum}: "
                  f"`accelerate launch` refuses the file (ValueError, its lookup is exact and its "
                  f"values are upper case){hint}")
        return
    yield Hit("distributed_type", f"distributed_type {value!r:.40} is not a {enum} of "
              f"accelerate 1.8.1 ({', '.join(members)}), which refuses the file (ValueError)"
              + did_you_mean(value, members), severity="warning")


#: accelerate 1.8.1's PrecisionType values (utils/dataclasses.py), which the launchers look a
#: config's mixed_precision up in after `.lower()`.
PRECISION_TYPES = ("no", "fp8", "fp16", "bf16")


@rule("FP8127", "error", "a `mixed_precision` `accelerate launch` refuses (unquoted `no`, "
      "`true`, `fp9`)",
      why="_validate_launch_command takes the config's mixed_precision as it is (null: 'no'), "
      "and every launcher but the TPU one reads it as `args.mixed_precision.lower()` and looks "
      "that up in PrecisionType: YAML reads an unquoted `no`, `false`, `true` or a number as a "
      "boolean or a number, which has no .lower() (AttributeError 'bool' object has no "
      "attribute 'lower', a traceback), and any other text raises ValueError 'Unknown "
      "mixed_precision mode'. `accelerate config` writes `mixed_precision: 'no'`, quoted.",
      source=f"{ACC} src/accelerate/commands/launch.py:1066-1070 _validate_launch_command, "
      ":1176-1198 launch_command; src/accelerate/utils/launch.py:169 "
      "prepare_simple_launcher_cmd_env, :278 prepare_multi_gpu_env, :472 "
      "prepare_deepspeed_cmd_env, :601 prepare_sagemager_args_inputs (v1.8.1); "
      "tests/test_lint_accelerate_types.py runs `accelerate launch` on each case",
      fix="write one of 'no' (quoted), fp8, fp16 or bf16", family="accelerate")
def mixed_precision_value(inp: AccelerateInput, _: LintContext) -> Iterator[Hit]:
    acc = inp.accelerate
    value = acc.get("mixed_precision")
    if value is None or _text(acc.get("distributed_type")) in ("xla", "tpu") \
            or (isinstance(value, str) and value.lower() in PRECISION_TYPES):
        return
    if isinstance(value, str):
        yield Hit("mixed_precision", f"mixed_precision {value!r:.40} is none of "
                  f"{', '.join(PRECISION_TYPES)}: `accelerate launch` raises ValueError 'Unknown "
                  "mixed_precision mode'" + did_you_mean(value.lower(), PRECISION_TYPES))
        return
    quoted = " (an unquoted `no` is YAML's false: write 'no')" if value is False else ""
    yield Hit("mixed_precision", f"mixed_precision is the {type(value).__name__} {value!r:.20}, "
              f"not text: `accelerate launch` fails on its .lower() (AttributeError, a "
              f"traceback){quoted}")
