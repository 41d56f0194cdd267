"""What LLM-Foundry 0.22.0 and Composer 0.32.1 accept, copied as constants so that linting
never imports torch, Composer or LLM-Foundry.

tests/test_lint_known.py compares every constant here with the installed packages, so an
upgrade that changes them fails the tests instead of silently drifting.
"""

from __future__ import annotations

from foundry_fp8.options import did_you_mean  # noqa: F401  (the rules' import)

#: `fields(TrainConfig)` (llmfoundry/utils/config_utils.py). `make_dataclass_and_log_config`
#: raises "Unused parameters [...] found in cfg" for any other top-level key.
TRAIN_CONFIG_KEYS = frozenset({
    "model", "tokenizer", "optimizer", "scheduler", "train_loader", "device_train_batch_size",
    "device_eval_batch_size", "max_duration", "max_seq_len", "seed", "precision", "code_paths",
    "max_split_size_mb", "expandable_segments", "cuda_load_lazy", "dist_timeout", "fsdp_config",
    "tp_config", "accumulate_train_batch_on_tokens", "eval_interval", "eval_loader",
    "eval_loaders", "icl_tasks", "icl_tasks_str", "eval_gauntlet", "eval_gauntlet_str",
    "icl_subset_num_batches", "icl_seq_len", "loggers", "progress_bar", "log_to_console",
    "python_log_level", "console_log_interval", "log_config", "callbacks", "algorithms",
    "save_folder", "save_latest_filename", "save_overwrite", "save_weights_only",
    "save_filename", "save_interval", "save_num_checkpoints_to_keep", "load_path",
    "load_weights_only", "load_strict_model_weights", "load_ignore_keys", "save_ignore_keys",
    "only_hf_checkpoint", "only_composer_checkpoint", "train_subset_num_batches",
    "device_train_microbatch_size", "global_train_batch_size", "spin_dataloaders",
    "eval_subset_num_batches", "eval_first", "compile_config", "metadata", "flatten_metadata",
    "run_name", "autoresume", "profiler", "variables", "n_gpus", "device_train_grad_accum",
})

#: The YAML shapes of TrainConfig's container fields, as `make_dataclass_and_log_config`
#: (llmfoundry/utils/config_utils.py) lets them through: omegaconf's structured config checks
#: the field's type (`dict[str, Any]`: a mapping with string keys; `list[dict[str, Any]]`: a
#: list of such mappings; `list[str]`: a list of scalars, which omegaconf turns into strings),
#: null only where it is Optional; and before that LLM-Foundry flattens three unions: a list
#: `eval_loader` becomes `eval_loaders`, a string `icl_tasks` / `eval_gauntlet` becomes
#: `icl_tasks_str` / `eval_gauntlet_str`.
MAPPING, MAPPINGS, SCALARS, STRING, NULL = ("a mapping", "a list of mappings", "a list of strings",
                                            "a string", "null")
SECTION_SHAPES: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("model", "tokenizer", "optimizer", "scheduler", "train_loader"), (MAPPING,)),
    **dict.fromkeys(("fsdp_config", "tp_config", "loggers", "callbacks", "algorithms",
                     "compile_config", "metadata", "profiler", "variables"), (MAPPING, NULL)),
    "eval_loader": (MAPPING, MAPPINGS, NULL),
    "eval_loaders": (MAPPINGS, NULL),
    "icl_tasks": (MAPPINGS, STRING, NULL),
    "eval_gauntlet": (MAPPING, STRING, NULL),
    **dict.fromkeys(("code_paths", "load_ignore_keys", "save_ignore_keys"), (SCALARS, NULL)),
}

#: Keys LLM-Foundry fills itself from another when flattening those unions, and refuses next to
#: it (`forbid_config_key`): key -> (source key, refused even when the source is null).
FILLED_KEYS: dict[str, tuple[str, bool]] = {
    "eval_loaders": ("eval_loader", False),
    "icl_tasks_str": ("icl_tasks", True),
    "eval_gauntlet_str": ("eval_gauntlet", True),
}

#: `fields(FSDPConfig)` without the private `_device_mesh` (composer/utils/parallelism.py).
#: Its `__init__` sets any keyword as an attribute, so an unknown key is silently ignored.
FSDP_CONFIG_KEYS = frozenset({
    "activation_checkpointing", "activation_checkpointing_reentrant", "activation_cpu_offload",
    "auto_wrap", "te_checkpoint_wrapper", "te_shard_fp8_weight", "backward_prefetch",
    "backward_prefetch_limit", "cpu_offload", "data_parallel_shard_degree",
    "data_parallel_replicate_degree", "forward_prefetch", "forward_prefetch_limit",
    "ignored_modules", "keep_low_precision_grads", "limit_all_gathers",
    "load_monolith_rank0_only", "load_planner", "mixed_precision", "process_group",
    "save_planner", "sharded_ckpt_prefix_dir", "sharding_strategy", "state_dict_type",
    "sync_module_states", "use_orig_params", "verbose",
})

#: `FSDP2Config.settable_attrs()` (composer/utils/parallelism.py). Composer builds an FSDP2Config
#: from `fsdp_config` only when the environment has FSDP_VERSION=2 (composer/trainer/trainer.py,
#: `_parse_parallelism_config`), warning about and dropping every other key.
FSDP2_CONFIG_KEYS = frozenset({
    "device_mesh", "reshard_after_forward", "activation_checkpointing",
    "activation_cpu_offload", "state_dict_type", "load_monolith_rank0_only",
    "mixed_precision", "verbose",
})

#: `Precision` values (composer/core/precision.py); `Precision(value)` matches ignoring case.
PRECISIONS = ("fp32", "amp_fp16", "amp_bf16", "amp_fp8")

#: `get_mixed_precision` (composer/distributed/mosaic_parallelism.py): a string among these
#: (case-insensitive) or a mapping read only for the `MIXED_PRECISION_DTYPE_KEYS`.
MIXED_PRECISION_MODES = ("DEFAULT", "PURE", "FULL")
MIXED_PRECISION_DTYPE_KEYS = ("param_dtype", "reduce_dtype", "buffer_dtype")

#: `_get_torch_dtype` (composer/distributed/mosaic_parallelism.py): the dtype names it knows.
#: The FP8 names give torch.bfloat16 (with a warning): FSDP never holds parameters in FP8.
TORCH_DTYPE_NAMES = {
    "float32": "float32", "torch.float32": "float32", "fp32": "float32",
    "float16": "float16", "torch.float16": "float16", "half": "float16", "fp16": "float16",
    "amp": "float16", "amp_fp16": "float16",
    "bfloat16": "bfloat16", "bfloat": "bfloat16", "torch.bfloat16": "bfloat16",
    "bf16": "bfloat16", "amp_bf16": "bfloat16",
    "float8": "bfloat16", "torch.float8": "bfloat16", "fp8": "bfloat16", "amp_fp8": "bfloat16",
}
FP8_DTYPE_NAMES = frozenset({"float8", "torch.float8", "fp8", "amp_fp8"})


#: MPTConfig's defaults for the dims the shape rules read (llmfoundry/models/mpt/
#: configuration_mpt.py, MPTConfig.__init__).
MPT_DEFAULTS = {"d_model": 2048, "expansion_ratio": 4, "vocab_size": 50368}

#: build_text_dataloader's defaults that torch's DataLoader refuses with num_workers=0
#: (llmfoundry/data/text_data.py; torch/utils/data/dataloader.py DataLoader.__init__).
TEXT_LOADER_DEFAULTS = {"prefetch_factor": 2, "persistent_workers": True}

#: FSDPConfig.activation_checkpointing_reentrant's default (composer/utils/parallelism.py).
REENTRANT_DEFAULT = True
