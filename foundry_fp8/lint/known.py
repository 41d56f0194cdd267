"""What LLM-Foundry 0.22.0 and Composer 0.32.1 accept, copied as constants so that linting
never imports torch, Composer or LLM-Foundry; and the releases that carry the upstream crashes
the rules judge against the installed versions (at the end, with the predicates that read them).

tests/test_lint_known.py compares every constant here with the installed packages, so an
upgrade that changes them fails the tests instead of silently drifting.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import fields
from functools import cache

from foundry_fp8.options import did_you_mean  # noqa: F401  (the rules' import)
from foundry_fp8.recipe import FP8Recipe
from foundry_fp8.te.facts import Version, dotted, parse_version

#: The top-level keys `llmfoundry train` cannot do without (llmfoundry/utils/config_utils.py):
#: TrainConfig's fields whose default is omegaconf's MISSING, each of which
#: `make_dataclass_and_log_config` reads (MissingMandatoryValue when absent), less the four the
#: `update_batch_size_info` transform fills first (device_train_batch_size, device_eval_batch_size,
#: n_gpus, device_train_grad_accum), plus the two that transform reads itself with `cfg[key]`
#: (KeyError when absent). tests/test_lint_known.py drops each from a full config and builds it.
TRAIN_REQUIRED_KEYS = ("model", "tokenizer", "optimizer", "scheduler", "train_loader",
                       "max_duration", "max_seq_len", "global_train_batch_size",
                       "device_train_microbatch_size")

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

#: The types of TrainConfig's other fields (llmfoundry/utils/config_utils.py, the same in
#: LLM-Foundry 0.21.0 and 0.22.0), NoneType where the field is Optional (order does not matter:
#: a Union's members each take only their own type). tests/test_lint_train_field_types.py
#: compares them with `fields(TrainConfig)` and LLM-Foundry's loader.
TRAIN_SCALAR_TYPES: dict[str, tuple[type, ...]] = {
    **dict.fromkeys(("max_seq_len", "seed", "save_num_checkpoints_to_keep",
                     "train_subset_num_batches", "eval_subset_num_batches", "n_gpus"), (int,)),
    **dict.fromkeys(("max_split_size_mb", "icl_subset_num_batches", "icl_seq_len",
                     "global_train_batch_size"), (int, type(None))),
    **dict.fromkeys(("expandable_segments", "cuda_load_lazy", "accumulate_train_batch_on_tokens",
                     "progress_bar", "log_to_console", "log_config", "save_overwrite",
                     "save_weights_only", "load_weights_only", "load_strict_model_weights",
                     "only_hf_checkpoint", "only_composer_checkpoint", "spin_dataloaders",
                     "eval_first", "flatten_metadata", "autoresume"), (bool,)),
    "precision": (str,),
    **dict.fromkeys(("icl_tasks_str", "eval_gauntlet_str", "python_log_level", "save_folder",
                     "save_latest_filename", "save_filename", "load_path", "run_name"),
                    (str, type(None))),
    **dict.fromkeys(("device_train_batch_size", "device_eval_batch_size", "dist_timeout"),
                    (int, float)),
    **dict.fromkeys(("max_duration", "eval_interval", "console_log_interval",
                     "device_train_grad_accum"), (int, str)),
    "save_interval": (str, int),
    "device_train_microbatch_size": (str, int, float),
}

#: `fields(TrainConfig)`. `make_dataclass_and_log_config` raises "Unused parameters [...] found
#: in cfg" for any other top-level key.
TRAIN_CONFIG_KEYS = frozenset(SECTION_SHAPES) | frozenset(TRAIN_SCALAR_TYPES)

#: What omegaconf's node for a field of one type converts (omegaconf 2.4 nodes.py,
#: `_validate_and_convert_impl` of IntegerNode, BooleanNode; no lone-float field needs
#: FloatNode's): the value's exact types it passes to int() (ValueError: refused). BooleanNode takes any int (and bool) as
#: is, and a string int() refuses if it is one of `_BOOL_WORDS` in any case.
_CONVERTS: dict[type, tuple[type, ...]] = {int: (str, int), bool: (str,)}
_BOOL_WORDS = ("yes", "y", "on", "true", "no", "n", "off", "false")


def omegaconf_takes(value: object, types: tuple[type, ...]) -> bool:
    """Whether omegaconf's structured config takes `value` for a field of these types. A
    Union's members take only their own exact type (UnionNode turns its members' `convert` flag
    off: base.py UnionNode, nodes.py ValueNode._strict_validate_type); a single type converts."""
    if value is None:
        return type(None) in types
    members = tuple(t for t in types if t is not type(None))
    if len(members) > 1:
        return type(value) in members
    kind = members[0]
    if kind is str:  # StringNode: str() of anything but a container or bytes
        return not isinstance(value, (Mapping, list, bytes))
    if kind is bool and isinstance(value, int):
        return True
    if type(value) not in _CONVERTS[kind]:
        return False
    try:
        (int if kind is bool else kind)(value)  # type: ignore[call-overload]
    except (ValueError, OverflowError):
        return kind is bool and str(value).lower() in _BOOL_WORDS
    return True


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

#: `model.master_weights_dtype` values LLM-Foundry's build_composer_model accepts (its
#: str_dtype_to_torch_dtype, llmfoundry/utils/builders.py:262-276 in 0.21 and 0.22; any other
#: raises ValueError): train builds the model and `model.to(dtype)`s it in that 16-bit dtype.
FOUNDRY_MASTER_WEIGHTS_DTYPES = frozenset({"f16", "float16", "bf16", "bfloat16"})
#: `master_weights_dtype` values for which process_init_device rewrites fsdp_config's
#: mixed_precision to a mapping with param_dtype None, FSDP keeping the parameters' own dtype
#: (its small_dtypes, llmfoundry/utils/config_utils.py:601-622 in 0.21 and 0.22; no 'f16').
FOUNDRY_FSDP_KEEPS_MASTER_DTYPES = frozenset({"bf16", "fp16", "float16", "bfloat16", "amp_fp16",
                                              "amp_bf16"})


#: MPTConfig's defaults for the keys the shape rules read (llmfoundry/models/mpt/
#: configuration_mpt.py, MPTConfig.__init__).
MPT_DEFAULTS = {"d_model": 2048, "n_heads": 16, "n_layers": 24, "head_dim": None,
                "expansion_ratio": 4, "vocab_size": 50368, "norm_type": "low_precision_layernorm",
                "no_bias": False, "tie_word_embeddings": True, "norm_eps": 1e-05,
                "max_seq_len": 2048}
#: The classes LLM-Foundry's norms registry builds for its own names (llmfoundry/models/layers/
#: norm.py, 0.21-0.22: `layernorm` and `rmsnorm` are torch's classes themselves), as
#: (module, class); MPT looks `norm_type` up lower-cased (blocks.py, modeling_mpt.py).
MPT_NORM_CLASSES = {
    "layernorm": ("torch.nn.modules.normalization", "LayerNorm"),
    "rmsnorm": ("torch.nn.modules.normalization", "RMSNorm"),
    "low_precision_layernorm": ("llmfoundry.models.layers.norm", "LPLayerNorm"),
    "low_precision_rmsnorm": ("llmfoundry.models.layers.norm", "LPRMSNorm"),
    "triton_rmsnorm": ("llmfoundry.models.layers.norm", "TritonRMSNorm"),
}
#: The entry-point group LLM-Foundry's norms registry reads (llmfoundry/layers_registry.py:
#: `norms`, entry_points=True): an entry there wins over a name registered in the process
#: (catalogue's Registry.get).
NORMS_GROUP = "llmfoundry_norms"
#: The modules that re-export torch's norm classes from torch.nn.modules.normalization, so that
#: an entry point `torch.nn:LayerNorm` names the class by its home.
TORCH_NORM_EXPORTS = ("torch.nn", "torch.nn.modules")
#: The defaults MPTConfig fills into `attn_config` and `ffn_config` for the keys that decide
#: which linears MPT builds (llmfoundry/models/utils/config_defaults.py).
MPT_ATTN_DEFAULTS = {"attn_type": "multihead_attention", "fused_qkv": True, "kv_dim": None,
                     "qk_ln": False, "qk_gn": False}
MPT_FFN_DEFAULTS = {"ffn_type": "mptmlp"}
#: MPT's attention implementation when `attn_config.attn_impl` is not given (config_defaults.py).
MPT_ATTN_IMPL_DEFAULT = "flash"
#: The flash-attn MPT's `attn_impl: flash` forward needs: modeling_mpt.py imports
#: `flash_attn.bert_padding` only `if is_flash_v2_installed()` (its default '2.0.0',
#: llmfoundry/models/layers/attention.py:36-42), and MPTModel.forward calls it for flash.
FLASH_ATTN_V2 = (2, 0, 0)
#: MPT attention settings MPTConfig refuses without flash-attn of at least a version
#: (llmfoundry/models/mpt/configuration_mpt.py _validate_config in 0.22, through attention.py's
#: is_flash_v2_installed, which reads `flash_attn.__version__`): attn_config key -> (least
#: flash-attn, what MPTConfig raises building the model, its lines). `rope` only with
#: rope_impl dail (MPT's default) and whatever attn_impl; the others only with attn_impl flash
#: (MPT's default).
FLASH_ATTN_NEEDS: dict[str, tuple[tuple[int, ...], str, str]] = {
    "alibi": ((2, 4, 2), "NotImplementedError 'alibi only implemented with torch and flash "
              "(v2.4.2 or higher) attention.'", "312-317"),
    "attn_uses_sequence_id": ((2, 1, 2), "NotImplementedError 'attn_uses_sequence_id only "
                              "implemented with torch and flash (v2.1.2 or higher) attention.'",
                              "318-326"),
    "rope": ((2, 0, 1), "ImportError 'If using the dail implementation of rope, the flash_attn "
             "library v2.0.1 or higher must be installed.'", "344-357"),
    "sliding_window_size": ((2, 3, 0), "NotImplementedError 'sliding window attention only "
                            "implemented for torch attention and flash attention (v2.3.0 or "
                            "higher).'", "358-364"),
    "attn_logit_softcapping": ((2, 6, 2), "NotImplementedError 'Attention "
                               "attn_logit_softcapping is only implemented with torch attention "
                               "or flash attention v2.6.2 (or higher).'", "370-376"),
}
#: The keys an MPT `attn_config` may hold with LLM-Foundry's own attention classes: those
#: MPTConfig fills in (`attn_config_defaults`, llmfoundry/models/utils/config_defaults.py), which
#: MPTBlock reads or passes on, and the keywords of the classes' `__init__`
#: (llmfoundry/models/layers/attention.py). MPTBlock passes any other key to the class, which
#: takes no **kwargs: TypeError building the model. `seq_parallel_world_size` is one only while
#: it is null, which MPTConfig.validate_attention_config deletes (above 1 it raises; 1 reaches the
#: class): `MPT_ATTN_NULL_ONLY_KEY`.
MPT_ATTN_CONFIG_KEYS = frozenset({
    "alibi", "alibi_bias_max", "attn_impl", "attn_logit_softcapping", "attn_pdrop",
    "attn_temperature_tuning", "attn_type", "attn_uses_sequence_id", "clip_qkv", "fused_qkv",
    "kv_dim", "nope", "qk_gn", "qk_ln", "rope", "rope_dail_config", "rope_hf_config",
    "rope_impl", "rope_theta", "sliding_window_size", "softmax_scale",
    "attention_bias", "bias", "d_model", "device", "fc_type", "head_dim", "n_heads", "norm_eps",
    "norm_type", "reuse_kv_layer_idx", "reuse_kv_x_layer_idx", "kv_n_heads",
})
MPT_ATTN_NULL_ONLY_KEY = "seq_parallel_world_size"
#: The one of those only GroupedQueryAttention takes (MultiheadAttention and MultiQueryAttention
#: raise TypeError on it).
MPT_GQA_ONLY_KEY = "kv_n_heads"
#: The keys an MPT `ffn_config` may hold with `ffn_type` mptmlp or mptglu: ffn_type and the
#: keywords of build_mptmlp and build_mptglu (llmfoundry/models/layers/ffn.py), to which
#: build_ffn (llmfoundry/models/layers/layer_builders.py) passes every other key: TypeError.
MPT_FFN_CONFIG_KEYS = frozenset({"ffn_type", "bias", "d_model", "device", "expansion_ratio",
                                 "fc_type", "ffn_act_fn", "ffn_hidden_size"})
#: The `ffn_config` keys LLM-Foundry's torch_dmoe builder pops with no default
#: (llmfoundry/models/layers/ffn.py build_torch_dmoe, 0.22): one missing raises KeyError building
#: the model. It takes these, its keywords (MPT_FFN_CONFIG_KEYS) and nothing else: ValueError
#: ('Invalid arguments to torch dmoe').
TORCH_DMOE_REQUIRED_KEYS = ("moe_num_experts", "moe_top_k", "mlp_type", "moe_jitter_eps",
                            "moe_normalize_expert_weights", "uniform_expert_assignment")
TORCH_DMOE_CONFIG_KEYS = MPT_FFN_CONFIG_KEYS | frozenset(TORCH_DMOE_REQUIRED_KEYS)
#: dMoE's expert MLPs (llmfoundry/models/layers/dmoe.py DroplessMLP: ValueError for any other).
TORCH_DMOE_MLP_TYPES = ("mlp", "glu")
#: The `ffn_config` key megablocks' FFNs (mb_moe, mb_dmoe) need with no default: LLM-Foundry's
#: config_moe_args pops it (llmfoundry/models/utils/config_moe_args.py), KeyError without it.
MEGABLOCKS_REQUIRED_KEY = "moe_world_size"
#: The module whose import registers megablocks' FFNs, mb_moe and mb_dmoe, in LLM-Foundry's
#: ffns_with_megablocks registry (llmfoundry/models/layers/ffn.py:30-34 `import megablocks`,
#: ModuleNotFoundError swallowed; :595-597 the registrations, 0.22): without it build_ffn looks
#: the name up in `ffns` and raises RegistryError. The install is setup.py's `megablocks` extra.
MEGABLOCKS_MODULE = "megablocks"
MEGABLOCKS_INSTALL = ("pip install 'megablocks<1.0' grouped-gemm==0.3.0 (LLM-Foundry's extra: "
                      "pip install 'llm-foundry[megablocks]')")
#: The keys of MPT's `init_config` (llmfoundry/models/utils/config_defaults.py
#: init_config_defaults, 0.21 and 0.22), which MPT's param_init_fn hands to the scheme its `name`
#: picks (modeling_mpt.py MPTModel.param_init_fn): read there, never at the model's top level.
MPT_INIT_CONFIG_KEYS = frozenset({
    "name", "fan_mode", "init_nonlinearity", "init_div_is_residual", "emb_init_std",
    "emb_init_uniform_lim", "init_std", "init_gain",
})
#: The names of LLM-Foundry's `fcs` registry (llmfoundry/models/layers/fc.py: te only where TE
#: imports), which `fc_type` looks up as written (RegistryError for any other).
MPT_FC_TYPES = ("torch", "te")
#: The MPT model keys that name a layer registry entry -> (the names LLM-Foundry registers
#: itself, the entry-point groups catalogue also reads: llmfoundry/layers_registry.py fcs, ffns,
#: ffns_with_norm, ffns_with_megablocks, all `entry_points=True`). Built-ins:
#: llmfoundry/models/layers/fc.py (te where TE imports), ffn.py:588-597 (te_ln_mlp where TE
#: imports, mb_moe and mb_dmoe where megablocks does). build_fc and build_ffn look the name up as
#: written and raise RegistryError for any other, building the model.
MPT_LAYER_REGISTRIES = {
    "fc_type": (frozenset(MPT_FC_TYPES), ("llmfoundry_fcs",)),
    "ffn_config.ffn_type": (frozenset({"mptglu", "mptmlp", "torch_dmoe", "te_ln_mlp", "mb_moe",
                                       "mb_dmoe"}),
                            ("llmfoundry_ffns", "llmfoundry_ffns_with_norm",
                             "llmfoundry_ffns_with_megablocks")),
}
#: MPT's model keys that must be numbers: given as a string (`d_model: "2048"`, `expansion_ratio:
#: "8/3"`), MPTConfig or the model it builds raises (TypeError, ValueError) when LLM-Foundry
#: builds the model. `norm_eps` is not among them: a string builds (torch reads it only in the
#: forward). `attn_config.kv_n_heads` only for grouped_query_attention (the only class taking it).
MPT_NUMBER_KEYS = ("d_model", "n_heads", "n_layers", "head_dim", "expansion_ratio",
                   "max_seq_len", "vocab_size", "resid_pdrop", "emb_pdrop", "embedding_fraction",
                   "logit_scale", "attn_config.attn_pdrop", "attn_config.kv_n_heads",
                   "ffn_config.ffn_hidden_size")
#: The words some of those keys take instead of a number (MPTConfig._validate_config).
MPT_NUMBER_WORDS = {"logit_scale": ("inv_sqrt_d_model",)}
#: What MPT needs of its size keys, as building it (MPTConfig, then MPTForCausalLM) shows:
#: key -> (kind, least value, null allowed). `int`: a Python int (a float, even 64.0, fails in
#: torch's tensor sizes or range()); `integral`: an int or a float equal to one (MPTConfig
#: converts max_seq_len with int() after checking it); `number`: a finite int or float. Less
#: than the least value fails (0 heads: ZeroDivisionError; negative sizes: torch refuses
#: negative dimensions); None: any integer builds (n_layers <= 0 builds no block). NaN and
#: infinity fail everywhere. `attn_config.kv_n_heads` only for grouped_query_attention;
#: `expansion_ratio` only without `ffn_config.ffn_hidden_size`. tests/test_lint_known.py
#: builds each refusal and each least value.
MPT_WHOLE_NUMBERS: dict[str, tuple[str, int | None, bool]] = {
    "d_model": ("int", 1, False),
    "n_heads": ("int", 1, False),
    "n_layers": ("int", None, False),
    "max_seq_len": ("integral", 0, False),
    "vocab_size": ("int", 0, False),
    "head_dim": ("int", 0, True),
    "expansion_ratio": ("number", 0, False),
    "attn_config.kv_n_heads": ("int", 1, False),
    "ffn_config.ffn_hidden_size": ("int", 0, True),
}
#: MPT's fractions, each at most 1 -> whether 0 is allowed: MPTConfig._validate_config raises
#: ValueError outside [0, 1] for the dropouts and outside (0, 1] for embedding_fraction, TypeError
#: for null (llmfoundry/models/mpt/configuration_mpt.py:301-307, 384-387 in 0.22). NaN passes
#: those checks: torch's dropout then raises at the first forward, and an embedding_fraction NaN
#: makes every forward's output NaN (MPTModel.forward mixes the embeddings by it).
MPT_FRACTIONS = {"resid_pdrop": True, "emb_pdrop": True, "attn_config.attn_pdrop": True,
                 "embedding_fraction": False}

#: The FFN types whose builders resolve `ffn_config.ffn_act_fn` with LLM-Foundry's
#: resolve_ffn_act_fn when the model is built (llmfoundry/models/layers/ffn.py:68-91, called by
#: build_mptmlp, build_mptglu, build_torch_dmoe and mb_setup_args in 0.22; te_ln_mlp refuses the
#: key: FP8004). resolve_ffn_act_fn pops `name` (KeyError without one; AttributeError for a
#: value that is no mapping), returns its own quick_gelu for `quick_gelu`, and otherwise
#: `partial(getattr(torch.nn.functional, name), **rest)`: ValueError 'Unrecognized activation
#: function name' for a name torch.nn.functional does not have, TypeError for one that is no
#: function (`math`, `torch`).
ACT_FN_FFN_TYPES = ("mptmlp", "mptglu", "torch_dmoe", "mb_moe", "mb_dmoe")
FOUNDRY_ACT_FNS = frozenset({"quick_gelu"})
#: The keywords of the torch.nn.functional activations an FFN is given (torch 2.7.0; builtins
#: such as gelu and softplus read from their docstrings), beside the input: resolve_ffn_act_fn
#: binds every other ffn_act_fn key with functools.partial, so an unknown one raises TypeError at
#: the first forward. Compared with the installed torch by tests/test_s28_lint_act_fn_kwargs.py.
TORCH_ACT_FN_KEYWORDS: dict[str, frozenset[str]] = {
    "gelu": frozenset({"approximate"}), "softplus": frozenset({"beta", "threshold"}),
    **dict.fromkeys(("relu", "silu", "selu", "mish", "hardswish", "relu6", "hardsigmoid"),
                    frozenset({"inplace"})),
    "leaky_relu": frozenset({"negative_slope", "inplace"}),
    **dict.fromkeys(("elu", "celu"), frozenset({"alpha", "inplace"})),
    **dict.fromkeys(("sigmoid", "tanh", "softsign", "tanhshrink"), frozenset()),
}
#: gelu's `approximate` values (anything else: RuntimeError at the first forward).
GELU_APPROXIMATIONS = ("none", "tanh")
#: Activation names of Hugging Face configs (transformers' ACT2FN, `hidden_act`) that
#: torch.nn.functional lacks -> the ffn_act_fn that computes the same (transformers 4.51
#: activations.py: swish is SiLU; gelu_new, gelu_fast and gelu_pytorch_tanh are GELU's tanh
#: approximation).
HF_ACT_FN_EQUIVALENTS = {
    "swish": "{name: silu}",
    **dict.fromkeys(("gelu_new", "gelu_fast", "gelu_pytorch_tanh"),
                    "{name: gelu, approximate: tanh}"),
}
#: The public callables of torch.nn.functional in torch 2.7.0, the torch LLM-Foundry 0.22 pins
#: (`torch>=2.7.0,<2.7.1`): the names resolve_ffn_act_fn builds (tests/test_lint2_model_values.py
#: compares them with the installed torch).
TORCH_FUNCTIONAL_CALLABLES = frozenset("""
    Callable DType Optional Tensor Union adaptive_avg_pool1d adaptive_avg_pool2d
    adaptive_avg_pool3d adaptive_max_pool1d adaptive_max_pool1d_with_indices adaptive_max_pool2d
    adaptive_max_pool2d_with_indices adaptive_max_pool3d adaptive_max_pool3d_with_indices
    affine_grid alpha_dropout assert_int_or_pair avg_pool1d avg_pool2d avg_pool3d batch_norm
    bilinear binary_cross_entropy binary_cross_entropy_with_logits boolean_dispatch celu celu_
    channel_shuffle conv1d conv2d conv3d conv_tbc conv_transpose1d conv_transpose2d
    conv_transpose3d cosine_embedding_loss cosine_similarity cross_entropy ctc_loss dropout
    dropout1d dropout2d dropout3d elu elu_ embedding embedding_bag feature_alpha_dropout fold
    fractional_max_pool2d fractional_max_pool2d_with_indices fractional_max_pool3d
    fractional_max_pool3d_with_indices gaussian_nll_loss gelu glu grid_sample group_norm
    gumbel_softmax handle_torch_function hardshrink hardsigmoid hardswish hardtanh hardtanh_
    has_torch_function has_torch_function_unary has_torch_function_variadic hinge_embedding_loss
    huber_loss instance_norm interpolate kl_div l1_loss layer_norm leaky_relu leaky_relu_ linear
    local_response_norm log_softmax logsigmoid lp_pool1d lp_pool2d lp_pool3d margin_ranking_loss
    max_pool1d max_pool1d_with_indices max_pool2d max_pool2d_with_indices max_pool3d
    max_pool3d_with_indices max_unpool1d max_unpool2d max_unpool3d mish mse_loss
    multi_head_attention_forward multi_margin_loss multilabel_margin_loss
    multilabel_soft_margin_loss native_channel_shuffle nll_loss normalize one_hot pad
    pairwise_distance pdist pixel_shuffle pixel_unshuffle poisson_nll_loss prelu relu relu6 relu_
    rms_norm rrelu rrelu_ scaled_dot_product_attention selu selu_ sigmoid silu smooth_l1_loss
    soft_margin_loss softmax softmin softplus softshrink softsign tanh tanhshrink threshold
    threshold_ triplet_margin_loss triplet_margin_with_distance_loss unfold upsample
    upsample_bilinear upsample_nearest
""".split())

#: build_text_dataloader's defaults that torch's DataLoader refuses with num_workers=0
#: (llmfoundry/data/text_data.py; torch/utils/data/dataloader.py DataLoader.__init__).
TEXT_LOADER_DEFAULTS = {"prefetch_factor": 2, "persistent_workers": True}
#: The keys a `text` or `finetuning` loader section may hold: build_dataloader pops `name` and
#: hands the rest to build_text_dataloader or build_finetuning_dataloader as keywords (both take
#: these, llmfoundry/data/text_data.py, finetuning/dataloader.py, 0.21 and 0.22; `tokenizer` and
#: `device_batch_size` are given by build_dataloader itself), any other raises TypeError.
#: `label` names one of several eval loaders and is popped from a list's items alone
#: (llmfoundry/utils/builders.py build_eval_loaders).
LOADER_BUILDER_KEYS = frozenset({"name", "dataset", "drop_last", "num_workers", "pin_memory",
                                 "prefetch_factor", "persistent_workers", "timeout"})
LOADER_BUILDERS = ("text", "finetuning")
#: The multiple Seq2SeqFinetuningCollator's `allow_pad_trimming` rounds a batch's longest
#: example up to (llmfoundry/data/finetuning/collator.py:410 `multiple_of = 8` in 0.22.0).
FOUNDRY_PAD_TRIM_MULTIPLE = 8
#: `packing_ratio: auto` picks 1, no packing, for a dataset max_seq_len up to this without
#: profiling (llmfoundry/data/packing.py:409-410 auto_packing_ratio in 0.22.0:
#: `if max_seq_len <= 100: return 1`).
FOUNDRY_AUTO_PACKING_UNPACKED_UP_TO = 100
EVAL_LOADER_LABEL = "label"

#: FSDPConfig.activation_checkpointing_reentrant's default (composer/utils/parallelism.py).
REENTRANT_DEFAULT = True

#: `MPTConfig.__init__`'s named parameters (llmfoundry/models/mpt/configuration_mpt.py). Any
#: other keyword goes to transformers' PretrainedConfig, which keeps it as an attribute that
#: nothing reads: a misspelled model key is silently ignored.
MPT_CONFIG_KEYS = frozenset({
    "d_model", "n_heads", "n_layers", "head_dim", "expansion_ratio", "max_seq_len",
    "vocab_size", "resid_pdrop", "emb_pdrop", "learned_pos_emb", "attn_config", "ffn_config",
    "init_device", "logit_scale", "no_bias", "attention_bias", "embedding_fraction",
    "norm_type", "norm_eps", "use_cache", "init_config", "fc_type", "tie_word_embeddings",
    "use_pad_tok_in_ffn", "block_overrides", "final_logit_softcapping",
})
#: Model keys train pops before the model class sees the rest (llmfoundry/command_utils/
#: train.py train); eval (evaluate_model) pops `name` alone and passes `master_weights_dtype` on.
TRAIN_POPPED_MODEL_KEYS = frozenset({"name", "master_weights_dtype"})
EVAL_POPPED_MODEL_KEYS = frozenset({"name"})
#: Model keys LLM-Foundry itself takes before MPTConfig sees the rest: train's popped keys and
#: `ComposerMPTCausalLM.__init__`'s own parameters (llmfoundry/models/mpt/modeling_mpt.py).
FOUNDRY_MODEL_KEYS = TRAIN_POPPED_MODEL_KEYS | {"use_train_metrics", "additional_train_metrics",
                                                "loss_fn"}
#: Keys MPTConfig keeps as attributes that MPT's code then reads: `fuse_norm_attn_norm`
#: (llmfoundry/models/layers/blocks.py MPTBlock, `kwargs.get`, from `config.to_dict()`) and
#: `activation_checkpointing_target` (modeling_mpt.py activation_checkpointing_fn, `getattr`).
MPT_ATTRIBUTES_READ = frozenset({"fuse_norm_attn_norm", "activation_checkpointing_target"})
#: The attributes transformers 4.51's `PretrainedConfig()` sets from its keywords, plus
#: `num_labels`: keys MPTConfig passes on that do mean something to transformers.
HF_CONFIG_KEYS = frozenset({
    "_attn_implementation_autoset", "_attn_implementation_internal", "_commit_hash",
    "_name_or_path", "add_cross_attention", "architectures", "bad_words_ids",
    "begin_suppress_tokens", "bos_token_id", "chunk_size_feed_forward",
    "cross_attention_hidden_size", "decoder_start_token_id", "diversity_penalty", "do_sample",
    "early_stopping", "encoder_no_repeat_ngram_size", "eos_token_id",
    "exponential_decay_length_penalty", "finetuning_task", "forced_bos_token_id",
    "forced_eos_token_id", "id2label", "is_decoder", "is_encoder_decoder", "label2id",
    "length_penalty", "max_length", "min_length", "no_repeat_ngram_size", "num_beam_groups",
    "num_beams", "num_return_sequences", "output_attentions", "output_hidden_states",
    "output_scores", "pad_token_id", "prefix", "problem_type", "pruned_heads",
    "remove_invalid_values", "repetition_penalty", "return_dict", "return_dict_in_generate",
    "sep_token_id", "suppress_tokens", "task_specific_params", "temperature", "tf_legacy_loss",
    "tie_encoder_decoder", "tie_word_embeddings", "tokenizer_class", "top_k", "top_p",
    "torch_dtype", "torchscript", "transformers_version", "typical_p", "use_bfloat16",
    "num_labels",
})
#: The model names whose keys FP8024 checks: LLM-Foundry's MPT classes.
MPT_MODEL_NAMES = frozenset({"mpt_causal_lm"})
#: `ComposerHFCausalLM.__init__`'s keywords but `tokenizer` (llmfoundry/models/hf/
#: hf_causal_lm.py:71-90 in 0.21 and 0.22), which build_composer_model passes the model section
#: to as it is, less `name` (and, in train alone, `master_weights_dtype`): any other key raises
#: TypeError 'unexpected keyword argument' building the model.
HF_CAUSAL_LM_KEYS = frozenset({
    "pretrained_model_name_or_path", "pretrained", "pretrained_lora_id_or_path",
    "trust_remote_code", "use_auth_token", "use_flash_attention_2", "load_in_8bit",
    "init_device", "config_overrides", "peft_config", "use_train_metrics",
    "allow_embedding_resizing", "additional_train_metrics", "additional_eval_metrics",
    "should_save_peft_only", "attn_implementation",
})
HF_CAUSAL_LM_NAME = "hf_causal_lm"
#: The Hugging Face config key of an MoE's experts per token, and those of its expert count
#: (Mixtral, PhiMoE, Jamba: num_local_experts; Qwen2-MoE, Qwen3-MoE, OLMoE: num_experts;
#: DeepSeek-V3: n_routed_experts; transformers 4.51 configuration_*.py). The routers take
#: `torch.topk(routing_weights, num_experts_per_tok)` (modeling_mixtral.py:125,
#: modeling_qwen2_moe.py:604, modeling_qwen3_moe.py:260).
HF_MOE_TOP_K_KEY = "num_experts_per_tok"
HF_MOE_EXPERTS_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")

#: Where te_swap takes the FP8 recipe (its `fp8_recipe` option, `foundry_fp8.recipe.FP8Recipe`).
FP8_RECIPE_HOME = "algorithms.te_swap.fp8_recipe"
FP8_RECIPE_FIX = "give the FP8 recipe as `algorithms: {te_swap: {fp8_recipe: {...}}}`"
#: Keys whose meaning depends on their section: no home is claimed for them.
_HOMELESS = frozenset({"name", "mixed_precision"})


@cache
def _homes() -> dict[str, str]:
    """key -> the one section ('' the top level) the tables above put it in. MPT fills
    attn_config's and ffn_config's d_model, fc_type, ... from the model's keys, so those are the
    model's; a key of two sections (`max_seq_len`: the top level and the model) has none."""
    model = MPT_CONFIG_KEYS | FOUNDRY_MODEL_KEYS | MPT_ATTRIBUTES_READ
    sections = {
        "": TRAIN_CONFIG_KEYS, "model": model,
        "model.attn_config": (MPT_ATTN_CONFIG_KEYS | {MPT_ATTN_NULL_ONLY_KEY}) - model,
        "model.ffn_config": (TORCH_DMOE_CONFIG_KEYS | {MEGABLOCKS_REQUIRED_KEY}) - model,
        "model.init_config": MPT_INIT_CONFIG_KEYS - model,
        "fsdp_config": FSDP_CONFIG_KEYS | FSDP2_CONFIG_KEYS,
        "algorithms.te_swap": frozenset({"fp8_recipe"}),
        FP8_RECIPE_HOME: frozenset(f.name for f in fields(FP8Recipe)),
    }
    homes: dict[str, str | None] = {}
    for home, keys in sections.items():
        for key in keys - _HOMELESS:
            homes[key] = None if key in homes else home
    return {key: home for key, home in homes.items() if home is not None}


def home_of(key: str, here: str, written: str | None = None) -> str | None:
    """The section ('' the top level) that LLM-Foundry, Composer or our te_swap read `key` in,
    when that is another than `here` (`model`, `fsdp_config`, ...); None when it has no known
    home or this is it. `written`: where `here` is in this file when elsewhere (an eval config's
    `models.0.model`): only a home inside `here` is named then, from there."""
    home = FP8_RECIPE_HOME if key == "fp8_config" and here == "" and written is None else \
        _homes().get(key)
    if home is None or home == here:
        return None
    if written is not None and written != here:
        return written + home[len(here):] if home.startswith(f"{here}.") else None
    return home


def belongs_under(key: str, here: str, written: str | None = None) -> str:
    """' (`key` belongs under `home:`)' for a key read in another section (`home_of`), which the
    unknown-key rules say instead of a spelling guess; '' when it has no known home."""
    home = home_of(key, here, written)
    if home is None:
        return ""
    if key == "fp8_config" and home == FP8_RECIPE_HOME:
        return f" (`{key}` is Accelerate's key; for LLM-Foundry the FP8 recipe belongs under `{home}`)"
    return f" (`{key}` belongs at the top level)" if home == "" else \
        f" (`{key}` belongs under `{home}:`)"


def move_fix(key: str, here: str, written: str | None = None) -> str | None:
    """The fix for a key read in another section (`home_of`); None when it has no known home."""
    home = home_of(key, here, written)
    if home is None:
        return None
    if key == "fp8_config" and home == FP8_RECIPE_HOME:
        return FP8_RECIPE_FIX
    return f"move `{key}` to the top level" if home == "" else f"move `{key}` under `{home}:`"


#: LLM-Foundry 0.22's built-in registry entries (llmfoundry/registry.py, filled by
#: llmfoundry/callbacks/__init__.py, algorithms/__init__.py, loggers/__init__.py), by train
#: config section. Entries others register through entry points (ours among them) are read from
#: package metadata (`foundry_fp8.lint.rules.ours.registered_names`).
FOUNDRY_REGISTRY = {
    "callbacks": frozenset({
        "early_stopper", "env_logging", "eval_output_logging", "fdiff_metrics",
        "generate_callback", "global_lr_scaling", "hf_checkpointer", "kill_loss_spike",
        "layer_freezing", "load_checkpoint", "loss_perp_v_len", "lr_monitor",
        "mbmoe_tok_per_expert", "memory_monitor", "memory_snapshot", "mono_checkpoint_saver",
        "nan_monitor", "oom_observer", "optimizer_monitor", "run_timeout", "runtime_estimator",
        "scheduled_gc", "speed_monitor", "system_metrics_monitor",
        # callbacks_with_config, built from the same `callbacks:` section
        "async_eval", "curriculum_learning", "dataset_swap"}),
    "algorithms": frozenset({"alibi", "gated_linear_units", "gradient_clipping",
                             "low_precision_layernorm"}),
    "loggers": frozenset({"in_memory_logger", "inmemory", "mlflow", "mosaicml", "tensorboard",
                          "wandb"}),
}
#: The entry-point groups catalogue reads for each section (llmfoundry/registry.py namespaces).
REGISTRY_GROUPS = {"callbacks": ("llmfoundry_callbacks", "llmfoundry_callbacks_with_config"),
                   "algorithms": ("llmfoundry_algorithms",),
                   "loggers": ("llmfoundry_loggers",)}

#: The YAML shapes of EvalConfig's container fields (llmfoundry/utils/config_utils.py, the same
#: in LLM-Foundry 0.21.0 and 0.22.0), as for SECTION_SHAPES: `models` is not Optional, and
#: `metadata` is `dict[str, str]`: a mapping whose values omegaconf turns into strings
#: (`STRINGS`: a null, list or mapping value is refused).
STRINGS = "a mapping of strings"
EVAL_SECTION_SHAPES: dict[str, tuple[str, ...]] = {
    "models": (MAPPINGS,),
    **dict.fromkeys(("fsdp_config", "loggers", "callbacks", "variables"), (MAPPING, NULL)),
    "metadata": (STRINGS, NULL),
    "eval_loader": (MAPPING, MAPPINGS, NULL),
    "eval_loaders": (MAPPINGS, NULL),
    "icl_tasks": (MAPPINGS, STRING, NULL),
    "eval_gauntlet": (MAPPING, STRING, NULL),
    "code_paths": (SCALARS, NULL),
}
#: The types of EvalConfig's other fields, as TRAIN_SCALAR_TYPES (tests/test_lint_eval_field_types
#: compares both tables with `fields(EvalConfig)` and LLM-Foundry's eval loader).
EVAL_SCALAR_TYPES: dict[str, tuple[type, ...]] = {
    **dict.fromkeys(("max_seq_len", "eval_subset_num_batches", "seed"), (int,)),
    "icl_subset_num_batches": (int, type(None)),
    "device_eval_batch_size": (int, float),
    "dist_timeout": (float, int),
    **dict.fromkeys(("eval_gauntlet_str", "icl_tasks_str", "python_log_level", "run_name"),
                    (str, type(None))),
    "console_log_interval": (int, str),
    "log_config": (bool,),
    "precision": (str,),
}
#: EvalConfig's fields whose default is omegaconf's MISSING: absent, make_dataclass_and_log_config
#: raises MissingMandatoryValue (`models` is filled by allow_toplevel_keys from a top-level
#: `model:`).
EVAL_REQUIRED_KEYS = ("models", "max_seq_len", "device_eval_batch_size")
#: `fields(EvalConfig)`: `eval_from_yaml` passes them to `make_dataclass_and_log_config`, which
#: refuses any other top-level key.
EVAL_CONFIG_KEYS = frozenset(EVAL_SECTION_SHAPES) | frozenset(EVAL_SCALAR_TYPES)

#: The keys of one `models:` entry of an eval config: the parameters of `evaluate_model`
#: (llmfoundry/command_utils/eval.py) that `evaluate` does not pass itself, since it calls
#: `evaluate_model(..., **model_cfg)`; the train.py shape (`allow_toplevel_keys`) writes them at
#: the top level. Those without a default: EVAL_MODEL_REQUIRED_KEYS.
EVAL_MODEL_KEYS = frozenset({"model_name", "model", "tokenizer", "load_path"})
EVAL_MODEL_REQUIRED_KEYS = ("model_name", "model", "tokenizer")


#: Composer's `patch_unshard_for_automicrobatching` (composer/trainer/_patch_pytorch.py line 30),
#: which the Trainer calls for `device_train_microbatch_size: auto` with FSDP1, installs
#: `unshard_with_sync`, defined only inside `if 2.6.0 <= torch < 2.7.1` (line 41): with any other
#: torch building the Trainer raises NameError. So in 0.31.0 (and its wheel), 0.32.0, 0.32.1 and
#: on main (64051888, 0.33.0.dev0): no release fixes it. Composer pins torch to that range
#: itself, so only a torch installed past the pin meets it. 0.24.0-0.30.0 make the same
#: unguarded call with other torch ranges; foundry-fp8 needs Composer >= 0.31, so older ones
#: are not judged.
AUTO_MICROBATCH_CHECKED_FROM: Version = (0, 31, 0)
UNSHARD_WITH_SYNC_TORCH: tuple[Version, Version] = ((2, 6, 0), (2, 7, 1))
AUTO_MICROBATCH_SOURCE = "composer/trainer/_patch_pytorch.py:30 in 0.31.0-0.32.1"
#: The same torch range as pip writes it, for messages.
UNSHARD_TORCH_RANGE = (f">={dotted(UNSHARD_WITH_SYNC_TORCH[0])},"
                       f"<{dotted(UNSHARD_WITH_SYNC_TORCH[1])}")


def auto_microbatch_fsdp_fails(composer: str | None, torch: str | None) -> bool | None:
    """Whether this Composer's Trainer raises NameError for auto micro-batching with FSDP1
    under this torch (None: either unknown, or a Composer older than the releases checked)."""
    composer_version, torch_version = parse_version(composer), parse_version(torch)
    if composer_version is None or torch_version is None \
            or composer_version < AUTO_MICROBATCH_CHECKED_FROM:
        return None
    low, high = UNSHARD_WITH_SYNC_TORCH
    if _PRE_RELEASE.match(torch):  # sorts just below its release, as packaging orders it
        return not low < torch_version <= high
    return not low <= torch_version < high


#: A pre-release or dev tag after a version's release numbers (NGC's torch `2.6.0a0+df5bbc0`,
#: `2.7.1rc1`, `2.8.0.dev20250601`): packaging's `version.parse`, which Composer's check uses,
#: sorts it before its release (2.6.0a0 < 2.6.0), where `parse_version` keeps the release alone.
_PRE_RELEASE = re.compile(r"\s*v?\d+(?:\.\d+)*[-_.]?(?:a|b|c|rc|alpha|beta|pre|preview|dev)",
                          re.IGNORECASE)
