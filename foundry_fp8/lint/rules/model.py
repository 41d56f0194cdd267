"""The model section: keys MPT silently ignores, TE layer choices, GEMM shapes, the loss, and
LLM-Foundry's init of te.LayerNormMLP."""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from importlib import util
from typing import Any, Literal

from foundry_fp8.filters import (
    MOE_EXPERTS_KEPT,
    MOE_ROUTER_KEPT,
    filter_reason,
    shape_reason,
    te_norm,
)
from foundry_fp8.lint.config import (
    as_int,
    as_number,
    fc_type_name,
    get,
    native_te_layers,
    te_swap,
)
from foundry_fp8.lint.entries import entry_point_names, entry_point_value
from foundry_fp8.lint.known import (
    ACT_FN_FFN_TYPES,
    FLASH_ATTN_NEEDS,
    FLASH_ATTN_V2,
    FOUNDRY_ACT_FNS,
    FOUNDRY_MODEL_KEYS,
    GELU_APPROXIMATIONS,
    HF_ACT_FN_EQUIVALENTS,
    HF_CAUSAL_LM_KEYS,
    HF_CAUSAL_LM_NAME,
    HF_CONFIG_KEYS,
    HF_MOE_EXPERTS_KEYS,
    HF_MOE_TOP_K_KEY,
    MEGABLOCKS_INSTALL,
    MEGABLOCKS_MODULE,
    MEGABLOCKS_REQUIRED_KEY,
    MPT_ATTN_CONFIG_KEYS,
    MPT_ATTN_DEFAULTS,
    MPT_ATTN_IMPL_DEFAULT,
    MPT_ATTN_NULL_ONLY_KEY,
    MPT_ATTRIBUTES_READ,
    MPT_CONFIG_KEYS,
    MPT_DEFAULTS,
    MPT_FC_TYPES,
    MPT_FFN_CONFIG_KEYS,
    MPT_FFN_DEFAULTS,
    MPT_FRACTIONS,
    MPT_GQA_ONLY_KEY,
    MPT_LAYER_REGISTRIES,
    MPT_MODEL_NAMES,
    MPT_NORM_CLASSES,
    MPT_NUMBER_KEYS,
    MPT_NUMBER_WORDS,
    MPT_WHOLE_NUMBERS,
    NORMS_GROUP,
    TORCH_ACT_FN_KEYWORDS,
    TORCH_DMOE_CONFIG_KEYS,
    TORCH_DMOE_MLP_TYPES,
    TORCH_DMOE_REQUIRED_KEYS,
    TORCH_FUNCTIONAL_CALLABLES,
    TORCH_NORM_EXPORTS,
    TRAIN_POPPED_MODEL_KEYS,
    belongs_under,
    did_you_mean,
    move_fix,
)
from foundry_fp8.lint.load import OC_ENV
from foundry_fp8.lint.registry import Hit, LintContext, join_key, rule, section
from foundry_fp8.lint.rules.environment import judged_version, what_runs
from foundry_fp8.lint.rules.train import (
    COMPOSER,
    FOUNDRY,
    TE28,
    TE_GEMM_LEADING_DIM,
    _padded_to,
    loader_sections,
)
from foundry_fp8.lint.values import built_options
from foundry_fp8.options import SwapConfig
from foundry_fp8.sdpa_facts import SDPA, SDPA_REFUSED_ATTN_KEYS
from foundry_fp8.shapes import (
    FP8_DIM_MULTIPLE,
    FP8_TOKEN_MULTIPLE,
    dim_fits_fp8,
    tokens_fit_fp8,
)
from foundry_fp8.te.facts import (
    INIT_SCHEMES_WITHOUT_MODULE_INITS,
    MPT_DEFAULT_INIT_SCHEME,
    TE_GEMM_LEADING_DIM_ERROR,
    TE_GEMM_LEADING_DIM_FROM,
    TE_LN_MLP_INIT_FAILS_FROM,
    TE_LN_MLP_INIT_SOURCE,
    Version,
    dotted,
    parse_version,
    te_ln_mlp_init_fails,
)


@rule("FP8004", "error", "`ffn_type: te_ln_mlp` with `ffn_act_fn`",
      why="LLM-Foundry raises for ffn_act_fn with te_ln_mlp; te.LayerNormMLP picks its "
      "activation from its own `activation` argument (default gelu), which LLM-Foundry "
      "passes through from ffn_config.",
      source=f"{FOUNDRY} llmfoundry/models/mpt/configuration_mpt.py _validate_config and "
      f"llmfoundry/models/layers/ffn.py build_te_ln_mlp; {TE28} "
      "transformer_engine/pytorch/module/layernorm_mlp.py LayerNormMLP.__init__",
      fix="remove ffn_act_fn; to pick TE's activation, set ffn_config.activation (passed to "
      "te.LayerNormMLP, default gelu)")
def te_ln_mlp_with_act_fn(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Hit]:
    ffn = section(section(config, "model"), "ffn_config")
    if ffn.get("ffn_type") == "te_ln_mlp" and "ffn_act_fn" in ffn:
        yield Hit("model.ffn_config.ffn_act_fn", "te_ln_mlp does not take ffn_act_fn "
                  "(LLM-Foundry raises 'Transformer Engine block does not support custom "
                  "activation functions')")


def _ratio_hidden(model: Mapping[str, Any], d_model: int) -> int | float | None:
    """d_model * expansion_ratio, which LLM-Foundry (ffn.py, resolve_ffn_hidden_size) makes the
    FFN hidden size when ffn_config.ffn_hidden_size is not given; None when it is, or when the
    ratio is no finite number (NaN and infinity: FP8035)."""
    ratio = as_number(mpt_value(model, "expansion_ratio"))
    if get(model, "ffn_config.ffn_hidden_size") is not None or ratio is None:
        return None
    try:
        return d_model * ratio
    except OverflowError:  # a d_model too large for a float
        return None


def _whole(size: int | float) -> bool:
    return isinstance(size, int) or size.is_integer()


def _ffn_hidden(model: Mapping[str, Any], d_model: int) -> tuple[str, int] | None:
    """(key, size) of the FFN hidden size as LLM-Foundry resolves it (ffn.py,
    resolve_ffn_hidden_size): ffn_config.ffn_hidden_size, else d_model * expansion_ratio."""
    given = as_int(get(model, "ffn_config.ffn_hidden_size"))
    if given is not None:
        return "model.ffn_config.ffn_hidden_size", given
    hidden = _ratio_hidden(model, d_model)
    return ("model.expansion_ratio", int(hidden)) if hidden is not None and _whole(hidden) \
        else None


#: Where Composer's model (ComposerMPTCausalLM: `model`, an MPTForCausalLM, whose `transformer`
#: is an MPTModel) holds MPT's blocks and its untied LM head: the module names te_swap plans
#: (llmfoundry/models/mpt/modeling_mpt.py).
MPT_BLOCKS = "model.transformer.blocks"
MPT_LM_HEAD = "model.lm_head"
#: MPT's attention classes (llmfoundry/models/layers/attention.py): MultiheadAttention (kv heads:
#: n_heads), MultiQueryAttention (one), GroupedQueryAttention (`attn_config.kv_n_heads`, which
#: only it takes).
_MQA, _GQA = "multiquery_attention", "grouped_query_attention"
_ATTN_TYPES = ("multihead_attention", _MQA, _GQA)
#: The FFN classes modelled (llmfoundry/models/layers/ffn.py): MPTMLP, MPTGLU, te.LayerNormMLP,
#: and torch_dmoe's dMoE (llmfoundry/models/layers/dmoe.py).
_DMOE = "torch_dmoe"
_FFN_TYPES = ("mptmlp", "mptglu", "te_ln_mlp", _DMOE)
#: megablocks' FFNs (ffn.py, registered where megablocks imports): not modelled.
_MEGABLOCKS = ("mb_moe", "mb_dmoe")
#: The most blocks modelled (te_swap's names are listed one by one); more are not judged.
_MAX_BLOCKS = 1024


def mpt_value(model: Mapping[str, Any], key: str) -> Any:
    """A model key's value, MPTConfig's default where the section does not give it."""
    return model.get(key, MPT_DEFAULTS[key])


@dataclass(frozen=True)
class Attention:
    """An MPT block's attention dims as GroupedQueryAttention.__init__ computes them
    (attention.py): head_dim is MPT's `head_dim` when given, else d_model // n_heads."""

    attn_type: str
    n_heads: int
    kv_heads: int
    head_dim: int
    fused_qkv: bool
    kv_in: int  # Wk's and Wv's in_features: attn_config.kv_dim, else d_model

    @property
    def width(self) -> int:
        """Wq's out_features and out_proj's in_features."""
        return self.n_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim


def mpt_attention(model: Mapping[str, Any], d_model: int) -> Attention | None:
    """The attention an MPT section builds; None where it builds none this models, or raises
    (d_model not divisible by n_heads, kv_n_heads missing or given to a class without it)."""
    attn = section(model, "attn_config")
    options = {k: attn.get(k, v) for k, v in MPT_ATTN_DEFAULTS.items()}
    n_heads = as_int(mpt_value(model, "n_heads"))
    head_dim = mpt_value(model, "head_dim")
    attn_type = options["attn_type"]
    if not (isinstance(attn_type, str) and attn_type in _ATTN_TYPES and n_heads and n_heads > 0
            and d_model % n_heads == 0 and (head_dim is None or (as_int(head_dim) or 0) > 0)
            and isinstance(options["fused_qkv"], bool)
            and (options["kv_dim"] is None or (as_int(options["kv_dim"]) or 0) > 0)):
        return None
    if attn_type == _GQA:
        kv_heads = as_int(attn.get("kv_n_heads"))
    elif "kv_n_heads" in attn:  # the other classes take no kv_n_heads: TypeError
        kv_heads = None
    else:
        kv_heads = 1 if attn_type == _MQA else n_heads
    if kv_heads is None or not 0 < kv_heads <= n_heads or n_heads % kv_heads \
            or (options["kv_dim"] is not None and options["fused_qkv"]):
        return None
    return Attention(attn_type, n_heads, kv_heads, head_dim or d_model // n_heads,
                     options["fused_qkv"], options["kv_dim"] or d_model)


@dataclass(frozen=True)
class MPTModule:
    """A module of an MPT that te_swap plans, named as te_swap sees it under Composer's model.
    `kind`: a linear, a LayerNorm, or a block's norm_2 + MLP (`ln_mlp`, its dims the
    up_proj's) that te_swap's fuse_ln_mlp could fuse; `te`: the model builds it as a TE module
    itself (fc_type te, te_ln_mlp), which runs in FP8 under amp_fp8 and te_swap leaves alone;
    `kept`: why te_swap keeps it whatever its options (a dMoE's router and experts)."""

    name: str
    kind: Literal["linear", "layernorm", "ln_mlp", "moe_experts"]
    in_features: int
    out_features: int
    te: bool = False
    bias: bool = True
    kept: str | None = None


def _attention_modules(block: str, attn: Attention, d_model: int, te: bool, norm: bool,
                       qk_norm: bool, bias: bool) -> Iterator[MPTModule]:
    """An MPT block's attention (GroupedQueryAttention.__init__): fused Wqkv, or Wq, Wk, Wv;
    q_ln and k_ln with qk_ln / qk_gn; out_proj."""
    prefix = f"{block}.attn"
    if attn.fused_qkv:
        yield MPTModule(f"{prefix}.Wqkv", "linear", d_model, attn.width + 2 * attn.kv_width, te)
    else:
        yield MPTModule(f"{prefix}.Wq", "linear", d_model, attn.width, te)
        yield MPTModule(f"{prefix}.Wk", "linear", attn.kv_in, attn.kv_width, te)
        yield MPTModule(f"{prefix}.Wv", "linear", attn.kv_in, attn.kv_width, te)
    if qk_norm and norm:
        yield MPTModule(f"{prefix}.q_ln", "layernorm", 0, 0, bias=bias)
        yield MPTModule(f"{prefix}.k_ln", "layernorm", 0, 0, bias=bias)
    yield MPTModule(f"{prefix}.out_proj", "linear", attn.width, d_model, te)


def mpt_modules(model: Mapping[str, Any]) -> list[MPTModule] | None:
    """The linears, LayerNorms and fusable MLPs LLM-Foundry builds for an MPT model section, in
    the order te_swap meets them (MPTBlock.__init__, MPTModel.__init__, MPTForCausalLM.__init__);
    None where this does not model the section: not MPT, `block_overrides`,
    `fuse_norm_attn_norm`, other FFN or fc classes (megablocks' MoE among them), dims that are
    not integers or that MPT refuses, a torch_dmoe without a whole moe_num_experts."""
    d_model, n_layers = as_int(mpt_value(model, "d_model")), as_int(mpt_value(model, "n_layers"))
    if not _is_mpt(model) or model.get("block_overrides") is not None \
            or model.get("fuse_norm_attn_norm") or d_model is None or d_model <= 0 \
            or n_layers is None or not 0 < n_layers <= _MAX_BLOCKS:
        return None
    attn, hidden = mpt_attention(model, d_model), _ffn_hidden(model, d_model)
    ffn_type = section(model, "ffn_config").get("ffn_type", MPT_FFN_DEFAULTS["ffn_type"])
    fc_type, norm_type = fc_type_name(model) or "torch", mpt_value(model, "norm_type")
    tied = bool(mpt_value(model, "tie_word_embeddings"))  # MPTForCausalLM: `if not ...`
    vocab = as_int(mpt_value(model, "vocab_size"))
    experts = as_int(get(model, "ffn_config.moe_num_experts"))
    if ffn_type == _DMOE and (experts is None or experts <= 0):
        return None
    if attn is None or hidden is None or hidden[1] <= 0 or ffn_type not in _FFN_TYPES \
            or fc_type not in ("torch", "te") or not isinstance(norm_type, str) \
            or not (tied or (vocab or 0) > 0):
        return None
    te, norm, bias = fc_type == "te", mpt_te_norm(model) == "LayerNorm", not model.get("no_bias")
    attn_config = section(model, "attn_config")
    qk_norm = bool(attn_config.get("qk_ln") or attn_config.get("qk_gn"))
    size, fusable = hidden[1], _te_swap_fuses(model)
    modules: list[MPTModule] = []
    for index in range(n_layers):
        block = f"{MPT_BLOCKS}.{index}"
        if norm:
            modules.append(MPTModule(f"{block}.norm_1", "layernorm", 0, 0, bias=bias))
        modules += _attention_modules(block, attn, d_model, te, norm, qk_norm, bias)
        if ffn_type == "te_ln_mlp":  # te.LayerNormMLP, its own norm: no norm_2
            modules.append(MPTModule(f"{block}.ffn", "ln_mlp", d_model, size, te=True))
            continue
        if norm:
            modules.append(MPTModule(f"{block}.norm_2", "layernorm", 0, 0, bias=bias))
        if ffn_type == _DMOE:  # dMoE: LearnedRouter's torch Linear whatever fc_type, then experts
            modules += [MPTModule(f"{block}.ffn.router.layer", "linear", d_model, experts or 0,
                                  kept=MOE_ROUTER_KEPT),
                        MPTModule(f"{block}.ffn.experts", "moe_experts", d_model, size,
                                  kept=MOE_EXPERTS_KEPT)]
            continue
        if fusable:
            modules.append(MPTModule(f"{block}.ffn", "ln_mlp", d_model, size))
        modules += [MPTModule(f"{block}.ffn.up_proj", "linear", d_model, size, te),
                    MPTModule(f"{block}.ffn.down_proj", "linear", size, d_model, te)]
        if ffn_type == "mptglu":
            modules.append(MPTModule(f"{block}.ffn.gate_proj", "linear", d_model, size, te))
    if norm:
        modules.append(MPTModule("model.transformer.norm_f", "layernorm", 0, 0, bias=bias))
    if not tied:
        modules.append(MPTModule(MPT_LM_HEAD, "linear", d_model, vocab or 0))
    return modules


def te_swap_options(config: Mapping[str, Any]) -> SwapConfig | None:
    """te_swap's options as TESwap builds them; None without te_swap or when it refuses them."""
    algorithms = section(config, "algorithms")
    built = built_options("te_swap", algorithms["te_swap"]) if "te_swap" in algorithms else None
    return built if isinstance(built, SwapConfig) else None


def _attention_key(model: Mapping[str, Any], attn: Attention, width_only: bool) -> str:
    """The model key an attention dim off TE's rule comes from: head_dim when given, else (for
    Wqkv) GQA's kv_n_heads or the attention type."""
    if "head_dim" in model:
        return "model.head_dim"
    if width_only:
        return "model.n_heads" if "n_heads" in model else "model"
    attn_config = section(model, "attn_config")
    key = "kv_n_heads" if attn.attn_type == _GQA else "attn_type"
    return f"model.attn_config.{key}" if key in attn_config else "model"


def _attention_dims(layer: str, attn: Attention) -> str:
    """How an attention linear's dim that depends on the heads comes from the config."""
    heads = {"Wqkv": f"(n_heads {attn.n_heads} + 2 x kv_n_heads {attn.kv_heads})",
             "Wq": f"n_heads {attn.n_heads}", "out_proj": f"n_heads {attn.n_heads}"}
    width = attn.width + 2 * attn.kv_width if layer == "Wqkv" else \
        attn.width if layer in heads else attn.kv_width
    return (f"{'in' if layer == 'out_proj' else 'out'}_features {width} = "
            f"{heads.get(layer, f'kv_n_heads {attn.kv_heads}')} x head_dim {attn.head_dim}")


def _attention_hits(model: Mapping[str, Any], swap: SwapConfig | None) -> Iterator[Hit]:
    """FP8005 for the attention linears whose dims do not follow from d_model alone (an explicit
    head_dim, GQA's or MQA's kv heads): TE's own assert for fc_type te; te_swap's shape rule for
    those te_swap would convert (its block filters applied)."""
    modules, d_model = mpt_modules(model), as_int(mpt_value(model, "d_model"))
    attn = mpt_attention(model, d_model) if d_model else None
    if modules is None or attn is None:
        return
    n_layers, seen = int(mpt_value(model, "n_layers")), set()
    for m in modules:
        layer = m.name.partition(".attn.")[2]
        if m.kind != "linear" or not layer or layer in seen or (
                not m.te and (swap is None
                              or filter_reason(m.name, swap, n_layers) is not None)):
            continue
        seen.add(layer)
        key = _attention_key(model, attn, layer in ("Wq", "out_proj"))
        what = (f"attention {layer} weight {m.out_features}x{m.in_features} (its "
                f"{_attention_dims(layer, attn)})")
        if not m.te:
            if shape_reason(m.in_features, m.out_features) is not None:
                yield Hit(key, f"{what} is not divisible by {FP8_DIM_MULTIPLE}: te_swap keeps "
                          f"the attention {layer} layers in high precision", severity="warning")
        elif not (dim_fits_fp8(m.in_features) and tokens_fit_fp8(m.out_features)):
            # TE applies its leading-dims rule to the weight [out, in] too (out_features)
            yield Hit(key, f"{what} breaks TE's FP8 check (weight out_features divisible by "
                      f"{FP8_TOKEN_MULTIPLE}, in_features by {FP8_DIM_MULTIPLE}), which fc_type "
                      "te's te.Linear asserts in its forward")
        elif not dim_fits_fp8(m.out_features):
            also = ("; te_swap's shape rule keeps such layers out of FP8, but it leaves this one, "
                    "which the model builds as a TE layer itself, alone") if swap else ""
            yield Hit(key, f"{what}: out_features not divisible by {FP8_DIM_MULTIPLE}: TE's forward "
                      "check passes, but it is the inner dim of the backward GEMM that reads the "
                      f"output gradient, which TE >= {dotted(TE_GEMM_LEADING_DIM_FROM)} checks for "
                      f"{FP8_DIM_MULTIPLE} ('{TE_GEMM_LEADING_DIM_ERROR}'; read in TE's sources, "
                      f"it has not been run on a GPU){also}", severity="warning")


@rule("FP8005", "error", "GEMM dims (d_model, FFN hidden size, attention Wqkv and out_proj, "
      "vocab when te_swap converts the LM head) that break TE's FP8 shape rule",
      why="TE asserts before an FP8 GEMM that the input's last dim is divisible by "
      f"{FP8_DIM_MULTIPLE} and the product of its other dims by {FP8_TOKEN_MULTIPLE}, and the "
      f"same of the weight [out, in] (out by {FP8_TOKEN_MULTIPLE}, in by {FP8_DIM_MULTIPLE}). "
      "TE layers the model builds itself (fc_type: te, te_ln_mlp) then fail at the first "
      "forward (error); te_swap keeps such layers in high precision (warning), and with d_model "
      "off no block layer is left. The attention linears' dims follow from d_model unless "
      "head_dim is given or the kv heads are fewer (GQA, MQA): Wqkv's out_features is "
      "(n_heads + 2 x kv_n_heads) x head_dim, out_proj's in_features n_heads x head_dim. An MoE "
      "FFN's hidden size (torch_dmoe, mb_moe, mb_dmoe) is not judged: its experts are weight "
      "tensors, never TE layers (build_torch_dmoe drops fc_type). A "
      f"Wqkv out_features divisible by {FP8_TOKEN_MULTIPLE} but not {FP8_DIM_MULTIPLE} passes "
      "TE's forward check but is the inner dim of its backward GEMM, whose FP8 operands' "
      f"leading dim TE's GEMM checks for {FP8_DIM_MULTIPLE} from "
      f"v{dotted(TE_GEMM_LEADING_DIM_FROM)} (a warning: read in TE's "
      "sources, not run "
      "on a GPU; te_swap's rule keeps such layers out, and leaves layers the model builds in TE "
      "alone).",
      source=f"{TE28} transformer_engine/pytorch/utils.py:433 assert_dim_for_fp8_exec (called "
      "with the input and the weight by module/linear.py:168, layernorm_linear.py:150, "
      f"layernorm_mlp.py:217); {TE_GEMM_LEADING_DIM}; {FOUNDRY} llmfoundry/models/layers/ffn.py "
      "resolve_ffn_hidden_size, llmfoundry/models/layers/attention.py "
      "GroupedQueryAttention.__init__ (head_dim, Wqkv, out_proj); foundry_fp8/shapes.py, "
      "foundry_fp8/filters.py shape_reason, filter_reason",
      fix=f"use multiples of {FP8_DIM_MULTIPLE} (d_model, head_dim and the kv heads, "
      "expansion_ratio / ffn_hidden_size, vocab_size)")
def gemm_dims(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Hit]:
    swap = te_swap(config)
    native = native_te_layers(config)
    if not (native or swap is not None):
        return
    model = section(config, "model")
    d_model = as_int(mpt_value(model, "d_model"))
    if d_model is None:
        return
    if not dim_fits_fp8(d_model):
        yield Hit("model.d_model", f"d_model {d_model} is not divisible by {FP8_DIM_MULTIPLE}, "
                  "as TE's FP8 GEMMs require" + ("" if native else " (te_swap would keep every "
                                                 "block layer out of FP8)"))
    else:
        yield from _attention_hits(model, te_swap_options(config))
    hidden = _ffn_hidden(model, d_model)
    # MoE experts are weight tensors, never TE's (build_torch_dmoe drops fc_type; megablocks)
    moe = get(model, "ffn_config.ffn_type") in (_DMOE, *_MEGABLOCKS)
    if hidden and not moe and not dim_fits_fp8(hidden[1]):
        if native:
            yield Hit(hidden[0], f"FFN hidden size {hidden[1]} is not divisible by "
                      f"{FP8_DIM_MULTIPLE}, as TE's FP8 GEMMs require")
        else:
            yield Hit(hidden[0], f"FFN hidden size {hidden[1]} is not divisible by "
                      f"{FP8_DIM_MULTIPLE}: te_swap keeps the FFN layers in high precision",
                      severity="warning")
    vocab = as_int(mpt_value(model, "vocab_size"))
    converts_head = (swap is not None and swap.get("keep_lm_head") is False
                     and model.get("tie_word_embeddings") is False)
    if converts_head and vocab is not None and not dim_fits_fp8(vocab):
        yield Hit("model.vocab_size", f"vocab_size {vocab} is not divisible by "
                  f"{FP8_DIM_MULTIPLE}: te_swap keeps the LM head in high precision although "
                  "keep_lm_head is false", severity="warning")


@rule("FP8032", "error", "MPT's `d_model * expansion_ratio` not a whole number",
      why="Every MPT FFN (MPTMLP, te_ln_mlp, the MoE FFNs) takes its hidden size from "
      "resolve_ffn_hidden_size, which raises '`d_model * expansion_ratio` must be an integer' "
      "unless ffn_config.ffn_hidden_size is given: the model is never built.",
      source=f"{FOUNDRY} llmfoundry/models/layers/ffn.py resolve_ffn_hidden_size (from "
      "MPTMLP.__init__, build_te_ln_mlp, build_torch_dmoe, mb_setup_args)",
      fix="an expansion_ratio whose product with d_model is whole, or ffn_config.ffn_hidden_size")
def fractional_ffn_hidden(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Hit]:
    model = section(config, "model")
    d_model = as_int(mpt_value(model, "d_model"))
    hidden = _ratio_hidden(model, d_model) if _is_mpt(model) and d_model is not None else None
    if hidden is not None and not _whole(hidden):
        yield Hit("model.expansion_ratio", f"d_model * expansion_ratio is {hidden}, not a whole "
                  "number: LLM-Foundry raises '`d_model * expansion_ratio` must be an integer' "
                  "building the model")


@rule("FP8035", "error", "MPT model values MPT refuses when LLM-Foundry builds the model: "
      "numbers written as strings (`d_model: \"2048\"`, `expansion_ratio: 8/3`), sizes that are "
      "not whole numbers or too small (`n_heads: 0`, `d_model: .nan`, `1e400`, `n_layers: 2.0`), "
      "d_model not divisible by n_heads, GQA's kv_n_heads above n_heads or not dividing it, "
      "attn_config's qk_ln with qk_gn, kv_dim with fused_qkv or other than d_model, a dropout "
      "outside [0, 1] or embedding_fraction outside (0, 1] (null, NaN), an explicit head_dim "
      "whose heads are not d_model wide with fused_qkv",
      why="LLM-Foundry passes the model section to MPTConfig unconverted, and YAML reads a quoted "
      "number or a fraction such as 8/3 as a string: MPTConfig's checks then raise (`d_model % "
      "n_heads` formats the string, `max_seq_len != int(max_seq_len)`, the dropout bounds), or "
      "the model it builds does (d_model * expansion_ratio repeats the string; nn.Linear and "
      "nn.Embedding take no string size). Only a string `norm_eps` builds (torch reads it in the "
      "forward); `logit_scale` takes the one word inv_sqrt_d_model. The sizes fail the same way "
      "as numbers that are not whole (a float, even 64.0, in a tensor size or range(); NaN and "
      "infinity, which omegaconf reads from `.nan` and `1e400`, fail MPTConfig's checks), that "
      "are zero where MPT divides by them (n_heads, kv_n_heads: ZeroDivisionError, 'kv_n_heads "
      "should be greater than zero') or negative (torch refuses negative dimensions); "
      "max_seq_len may be a float equal to a whole number, expansion_ratio any finite number "
      "from 0 (FP8032 judges its product). MPTConfig also raises 'd_model must be divisible by "
      "n_heads', even when head_dim is given, and GroupedQueryAttention refuses a kv_n_heads "
      "above n_heads or not dividing it (each Q head gets the same number of KV heads), and "
      "qk_ln and qk_gn both true. MPTConfig refuses a kv_dim with fused_qkv, which is true "
      "unless the config says false; unfused, a kv_dim other than d_model builds, and the first "
      "forward raises (MPT's blocks feed Wk and Wv the d_model-wide hidden states). MPTConfig "
      "refuses resid_pdrop, emb_pdrop and attn_pdrop outside [0, 1] and embedding_fraction "
      "outside (0, 1] (ValueError; null: TypeError); NaN passes its check, and then torch's "
      "dropout raises at the first forward, or an embedding_fraction NaN makes every output "
      "NaN. An explicit head_dim builds whatever its value, but with fused_qkv MPT's attention "
      "splits Wqkv's output at d_model for the queries: unless n_heads x head_dim is d_model, "
      "the first forward raises RuntimeError (split_with_sizes); unfused it trains.",
      source=f"{FOUNDRY} llmfoundry/models/mpt/configuration_mpt.py MPTConfig.__init__ "
      "(max_seq_len) and _validate_config (d_model % n_heads, the pdrop and embedding_fraction "
      "bounds, logit_scale, kv_dim with fused_qkv); llmfoundry/models/layers/ffn.py "
      "resolve_ffn_hidden_size; llmfoundry/models/layers/attention.py "
      "GroupedQueryAttention.__init__ (kv_n_heads, qk_ln with qk_gn) and get_qkv (Wk(x); "
      "the fused split at d_model, attention.py:762-769); configuration_mpt.py:301-307, "
      "384-387 (the dropout and embedding_fraction bounds); "
      "llmfoundry/models/utils/config_defaults.py attn_config_defaults; "
      "tests/test_lint_known.py builds each one (MPT_WHOLE_NUMBERS)",
      fix="write the number without quotes (a decimal for expansion_ratio, or give "
      "ffn_config.ffn_hidden_size), sizes as whole numbers from 1 (n_heads, d_model); pick "
      "n_heads dividing d_model, kv_n_heads dividing n_heads; dropouts in [0, 1]; head_dim "
      "d_model / n_heads (or none)")
def mpt_refuses_values(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Hit]:
    model = section(config, "model")
    if not _is_mpt(model):
        return
    gqa = section(model, "attn_config").get("attn_type") == _GQA
    for path in MPT_NUMBER_KEYS:
        value = get(model, path)
        if path == "attn_config.kv_n_heads" and not gqa:
            continue  # only GroupedQueryAttention takes it
        if isinstance(value, str) and value not in MPT_NUMBER_WORDS.get(path, ()):
            yield Hit(f"model.{path}", f"model.{path} is the string {value!r}, not a number "
                      "(YAML reads a quoted value or a fraction as a string): MPT raises building "
                      "the model")
        elif _given(model, path) and (need := _number_refused(model, path, value)):
            yield Hit(f"model.{path}", f"model.{path} is {_number_text(value)}: MPT needs "
                      f"{need} there and raises building the model")
    d_model, n_heads = as_int(mpt_value(model, "d_model")), as_int(mpt_value(model, "n_heads"))
    if d_model is not None and n_heads is not None and n_heads > 0 and d_model % n_heads:
        key = next((f"model.{k}" for k in ("n_heads", "d_model") if k in model), "model")
        yield Hit(key, f"d_model {d_model} is not divisible by n_heads {n_heads}: MPTConfig "
                  "raises 'd_model must be divisible by n_heads'")
    kv_heads = as_int(get(model, "attn_config.kv_n_heads")) if gqa else None
    if kv_heads is not None and n_heads is not None and 0 < kv_heads and 0 < n_heads \
            and (kv_heads > n_heads or n_heads % kv_heads):
        need = ("'The number of KV heads should be less than or equal to Q heads.'"
                if kv_heads > n_heads else "'Each Q head should get the same number of KV "
                "heads, so n_heads must be divisible by kv_n_heads.'")
        yield Hit("model.attn_config.kv_n_heads", f"kv_n_heads {kv_heads} with n_heads "
                  f"{n_heads}: GroupedQueryAttention raises {need} building the model")
    yield from _attention_refusals(section(model, "attn_config"), d_model)
    yield from _fraction_hits(model)
    if d_model is not None and d_model > 0:
        yield from _head_dim_hits(model, d_model)


def _fraction_hits(model: Mapping[str, Any]) -> Iterator[Hit]:
    """The dropouts and embedding_fraction as MPTConfig checks them (MPT_FRACTIONS): outside
    their bounds or null it raises building the model; NaN passes it, and the forward fails."""
    for path, zero_ok in MPT_FRACTIONS.items():
        value = get(model, path)
        if not _given(model, path) or isinstance(value, (bool, str)):
            continue  # a bool is 0 or 1 to MPT; a string is refused above
        key, bounds = f"model.{path}", "[0, 1]" if zero_ok else "(0, 1]"
        dropout = path != "embedding_fraction"
        refusal = ("'self.attn_config['attn_pdrop'], resid_pdrop, emb_pdrop are probabilities and "
                   "must be between 0 and 1'" if dropout else "'model.embedding_fraction must be "
                   "between 0 (exclusive) and 1 (inclusive)!'")
        fix = f"model.{path}: a number in {bounds}" + (" (0: no dropout)" if dropout else
                                                      " (1: MPT's default)")
        if value is None:
            yield Hit(key, f"model.{path} is null: MPTConfig compares it with 0 and raises "
                      "TypeError building the model", fix=fix)
        elif isinstance(value, float) and math.isnan(value):
            yield Hit(key, f"model.{path} is NaN, which MPTConfig's bounds check lets through: "
                      + ("the model builds, and its first forward raises RuntimeError ('dropout "
                         "probability has to be between 0 and 1, but got nan')" if dropout else
                         "MPTModel.forward mixes the embeddings by it, so every output and loss "
                         "is NaN (no error)"), fix=fix)
        elif isinstance(value, (int, float)) and (value < 0 or value > 1
                                                  or (value == 0 and not zero_ok)):
            yield Hit(key, f"model.{path} is {value!r}, outside {bounds}: MPTConfig raises "
                      f"ValueError ({refusal}) building the model", fix=fix)


def _head_dim_hits(model: Mapping[str, Any], d_model: int) -> Iterator[Hit]:
    """An explicit head_dim whose n_heads heads are not d_model wide, with fused_qkv: the model
    builds, and GroupedQueryAttention.get_qkv splits Wqkv's output at d_model for the queries
    (llmfoundry/models/layers/attention.py:762-769 in 0.22), which then do not add up."""
    attn_config = section(model, "attn_config")
    attn = mpt_attention(model, d_model)
    if attn is None or as_int(model.get("head_dim")) is None or not attn.fused_qkv \
            or attn.width == d_model or model.get("block_overrides") is not None \
            or attn_config.get("reuse_kv_layer_idx") is not None:
        return
    fused = "fused_qkv" + ("" if "fused_qkv" in attn_config else " (MPT's default: true)")
    yield Hit("model.head_dim", f"head_dim {attn.head_dim} x n_heads {attn.n_heads} is "
              f"{attn.width}, not d_model {d_model}, with {fused}: the model builds, and its "
              "first forward raises RuntimeError ('split_with_sizes expects split_sizes to sum "
              f"exactly to {attn.width + 2 * attn.kv_width}'): MPT's attention splits the fused "
              "QKV output at d_model for the queries",
              fix=f"drop head_dim (MPT then uses d_model / n_heads = {d_model // attn.n_heads}), "
              "or set attn_config.fused_qkv: false (MPT's softmax scale still uses d_model / "
              "n_heads)")


#: FP8035's fix for a kv_dim (attention.py: Wk and Wv take kv_dim-wide inputs; MPTBlock passes x).
_KV_DIM_FIX = ("drop kv_dim: it sizes Wk and Wv for cross-attention, and MPT's blocks feed them "
               "the d_model-wide hidden states")


def _attention_refusals(attn: Mapping[str, Any], d_model: int | None) -> Iterator[Hit]:
    """attn_config pairs MPT refuses, judged as MPT does: by truth value, after its defaults
    (`qk_ln`/`qk_gn` false, `fused_qkv` true, `kv_dim` null) fill what is not given; and a
    kv_dim other than d_model, which builds unfused but fails the first forward."""
    if attn.get("qk_ln") and attn.get("qk_gn"):
        yield Hit("model.attn_config.qk_gn", "attn_config sets both qk_ln and qk_gn: "
                  "GroupedQueryAttention raises 'Only one of qk_ln and qk_gn can be set to "
                  "True.' building the model", fix="keep one of qk_ln (LayerNorm over all heads) "
                  "and qk_gn (per head)")
    if attn.get("kv_dim") is not None and attn.get("fused_qkv", True):
        fused = "fused_qkv" + ("" if "fused_qkv" in attn else " (MPT's default: true)")
        yield Hit("model.attn_config.kv_dim", f"attn_config.kv_dim {attn['kv_dim']!r} with "
                  f"{fused}: MPTConfig raises 'fused_qkv should be False when \"kv_dim\" is "
                  "specified.' building the model", fix=_KV_DIM_FIX)
    elif (kv_dim := as_int(attn.get("kv_dim"))) is not None and d_model is not None \
            and kv_dim != d_model:
        yield Hit("model.attn_config.kv_dim", f"attn_config.kv_dim {kv_dim} with fused_qkv "
                  f"false: MPT builds Wk and Wv for {kv_dim}-wide inputs, but its blocks feed "
                  f"them the hidden states, d_model {d_model} wide: the first forward raises "
                  "RuntimeError 'mat1 and mat2 shapes cannot be multiplied'", fix=_KV_DIM_FIX)


def _given(model: Mapping[str, Any], path: str) -> bool:
    parent, _, leaf = path.rpartition(".")
    return leaf in (section(model, parent) if parent else model)


def _number_text(value: Any) -> str:
    return "null" if value is None else repr(value)


def _number_refused(model: Mapping[str, Any], path: str, value: Any) -> str | None:
    """What MPT needs at `path` when `value` (not a string: those are refused above) is not it,
    per MPT_WHOLE_NUMBERS; None when it builds."""
    if path not in MPT_WHOLE_NUMBERS or isinstance(value, bool):
        return None
    kind, least, nullable = MPT_WHOLE_NUMBERS[path]
    if path == "expansion_ratio" and get(model, "ffn_config.ffn_hidden_size") is not None:
        return None  # resolve_ffn_hidden_size ignores it
    need = {"int": "a whole number", "integral": "a whole number",
            "number": "a finite number"}[kind] + (f" of at least {least}" if least is not None
                                                  else "") + (" (or null)" if nullable else "")
    if value is None:
        return None if nullable else need
    if not isinstance(value, (int, float)):
        return None  # a list or a mapping: not modelled
    if isinstance(value, float) and (not math.isfinite(value)
                                     or kind == "int"
                                     or (kind == "integral" and not value.is_integer())):
        return need + (" (written without a decimal point)" if kind == "int"
                       and math.isfinite(value) and value.is_integer() else "")
    return need if least is not None and value < least else None


@rule("FP8016", "warning", "`fc_type: {name: te}` (mapping form)",
      why="MPT accepts the mapping, but LLM-Foundry's validate_config compares fc_type with the "
      "string 'te': it warns that fp8 needs te.Linear layers and does not make TE "
      "checkpointing non-reentrant.",
      source=f"{FOUNDRY} llmfoundry/command_utils/train.py validate_config, "
      "llmfoundry/models/mpt/configuration_mpt.py",
      fix="write `fc_type: te` unless you pass te.Linear arguments; then set "
      "fsdp_config.activation_checkpointing_reentrant: false yourself")
def fc_type_dict(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Hit]:
    fc_type = section(config, "model").get("fc_type")
    if isinstance(fc_type, Mapping) and fc_type.get("name") == "te":
        yield Hit("model.fc_type", "LLM-Foundry's validate_config compares fc_type with the "
                  "string 'te': in mapping form it warns 'fp8 only supported for te.Linear "
                  "layers' and skips its reentrant-checkpointing fix for TE layers")


def _is_mpt(model: Mapping[str, Any]) -> bool:
    name = model.get("name")
    return isinstance(name, str) and name in MPT_MODEL_NAMES


#: Values that ask for TE layers: an ignored key holding one changes what FP8 does.
_TE_WORDS = frozenset({"te", "te_ln_mlp"})


def _asks_for_te(value: Any, depth: int = 0) -> bool:
    if depth > 20:
        return False
    if isinstance(value, str):
        return value in _TE_WORDS
    if isinstance(value, Mapping):
        return any(_asks_for_te(v, depth + 1) for v in value.values())
    if isinstance(value, list):
        return any(_asks_for_te(v, depth + 1) for v in value)
    return False


@rule("FP8024", "error", "model keys MPT silently ignores (did-you-mean, or where the key "
      "belongs: `attn_impl` under `attn_config`)",
      why="LLM-Foundry passes the model section to ComposerMPTCausalLM, which gives every key it "
      "does not name to MPTConfig, which gives every key it does not name to transformers' "
      "PretrainedConfig, which stores it as an attribute nothing reads: "
      "`ffn_config_defaults: {ffn_type: te_ln_mlp}` builds the default MLP (the few such "
      "attributes MPT's code reads, fuse_norm_attn_norm and activation_checkpointing_target, "
      "are known). A warning, and an "
      "error when the ignored value asks for TE layers (`te`, `te_ln_mlp`), since FP8 then "
      "does not happen as written.",
      source=f"{FOUNDRY} llmfoundry/models/mpt/configuration_mpt.py MPTConfig.__init__, "
      "llmfoundry/models/mpt/modeling_mpt.py ComposerMPTCausalLM.__init__ and "
      "activation_checkpointing_fn, llmfoundry/models/layers/blocks.py MPTBlock.__init__, "
      "llmfoundry/command_utils/train.py train (name, master_weights_dtype); transformers 4.51 "
      "configuration_utils.py PretrainedConfig.__init__ (setattr for remaining kwargs)",
      fix="fix the spelling (the message names the closest MPT key) or remove the key",
      unresolved=True)
def unknown_model_keys(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Hit]:
    yield from model_key_hits(section(config, "model"), "model")


#: A model key naming a param_init_fns scheme (LLM-Foundry's dbrx-gauntlet eval YAMLs carry
#: `param_init_fn: kaiming_normal_`), which MPT reads from `init_config.name` alone.
_SCHEME_KEY = "param_init_fn"


def model_key_hits(model: Mapping[str, Any], prefix: str) -> Iterator[Hit]:
    """FP8024's findings for one model section (a train config's, or an eval config's
    `models.N.model`)."""
    if not _is_mpt(model):
        return
    known = MPT_CONFIG_KEYS | FOUNDRY_MODEL_KEYS
    for key, value in model.items():
        if not isinstance(key, str) or key in known or key in HF_CONFIG_KEYS \
                or key in MPT_ATTRIBUTES_READ:
            continue
        if key == _SCHEME_KEY:
            hint = f" (MPT takes the init scheme as `{prefix}.init_config.name`)"
            fix: str | None = f"give the scheme as `{prefix}.init_config.name`"
        else:
            hint = belongs_under(key, "model", prefix) or did_you_mean(key, known)
            fix = move_fix(key, "model", prefix)
        if _asks_for_te(value):
            yield Hit(join_key(prefix, key), f"MPT ignores `{key}`, so the TE layers it asks for are "
                      "never built and FP8 does not run as written" + hint, fix=fix)
        else:
            yield Hit(join_key(prefix, key), f"MPT ignores `{key}` (kept as an unused attribute)"
                      + hint, severity="warning", fix=fix)


HF_CAUSAL_LM_SOURCE = ("llmfoundry/models/hf/hf_causal_lm.py ComposerHFCausalLM."
                       "__init__:71-90, llmfoundry/utils/builders.py build_composer_model "
                       "(construct_from_registry with the section as keywords)")


@rule("FP8046", "error", "an `hf_causal_lm` model key ComposerHFCausalLM does not take "
      "(`fc_type: te` and other MPT keys included), a `pretrained_model_name_or_path` it "
      "refuses (`mosaicml/mpt-7b`), or a `config_overrides.num_experts_per_tok` "
      "an MoE's router cannot use (0, negative, above the experts, no integer)",
      why="train pops `name` and `master_weights_dtype` from the model section and "
      "build_composer_model hands every other key to ComposerHFCausalLM as a keyword: one it "
      "does not name raises TypeError 'unexpected keyword argument' after the tokenizer and the "
      "data loaders are built. MPT's TE keys (`fc_type: te`, `ffn_config: {ffn_type: "
      "te_ln_mlp}`) are among them: a Hugging Face model gets FP8 from te_swap. From 0.18 "
      "build_inner_model raises ValueError for a `pretrained_model_name_or_path` starting with "
      "`mosaicml/mpt` (the Hub's MPTs), also after the tokenizer and the loaders. "
      "config_overrides sets the pretrained config's attributes (set_config_overrides); "
      "transformers' MoE routers (Mixtral, Qwen2-MoE, Qwen3-MoE) pick num_experts_per_tok "
      "experts with torch.topk in the forward: 0 trains without error, every MoE block adding "
      "zeros and its experts and router never getting a gradient (checked on tiny Mixtral and "
      "Qwen2-MoE); negative or above the experts raises RuntimeError at the first forward "
      "(the expert count judged where config_overrides gives it), a value no integer "
      "TypeError.",
      source=f"{FOUNDRY} {HF_CAUSAL_LM_SOURCE}; llmfoundry/command_utils/train.py train (name, "
      "master_weights_dtype popped); llmfoundry/models/hf/hf_base.py:294-303 "
      "build_inner_model (https://github.com/mosaicml/llm-foundry/pull/1735, first in v0.18.0); "
      "llmfoundry/utils/config_utils.py set_config_overrides; "
      "transformers 4.51 models/mixtral/modeling_mixtral.py:125, "
      "models/qwen2_moe/modeling_qwen2_moe.py:604, models/qwen3_moe/modeling_qwen3_moe.py:260",
      fix="remove the key (for FP8, `algorithms: {te_swap: {}}`), or fix its spelling",
      unresolved=True)
def hf_model_keys(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Hit]:
    model = section(config, "model")
    yield from hf_model_key_hits(model, "model", TRAIN_POPPED_MODEL_KEYS)
    if model.get("name") == HF_CAUSAL_LM_NAME:
        yield from _hf_moe_top_k_hits(section(model, "config_overrides"))


def _hf_moe_top_k_hits(overrides: Mapping[str, Any]) -> Iterator[Hit]:
    """A num_experts_per_tok override that transformers' MoE routers (torch.topk) cannot use:
    0 trains silently with the experts unused; negative, above the experts the overrides give,
    or no integer fails the first forward."""
    if HF_MOE_TOP_K_KEY not in overrides:
        return
    top_k = overrides[HF_MOE_TOP_K_KEY]
    key = f"model.config_overrides.{HF_MOE_TOP_K_KEY}"
    experts = next((n for k in HF_MOE_EXPERTS_KEYS
                    if (n := as_int(overrides.get(k))) is not None and n > 0), None)
    fix = f"{HF_MOE_TOP_K_KEY} from 1 to {experts or 'the experts of the model'} (or drop it: "
    fix += "the pretrained config's own)"
    k, router = as_int(top_k), "the MoE router's torch.topk"
    if isinstance(top_k, bool) or (isinstance(top_k, str) and OC_ENV.search(top_k)):
        return
    if k is None:
        yield Hit(key, f"{HF_MOE_TOP_K_KEY} {top_k!r:.40} is not an integer: the model builds, "
                  f"and its first forward raises TypeError ({router})", fix=fix)
    elif k == 0:
        yield Hit(key, f"{HF_MOE_TOP_K_KEY} 0 routes every token to no expert: the run trains "
                  "without error, every MoE block adds zeros, and its experts and router never "
                  f"get a gradient ({router} with k 0)", fix=fix)
    elif k < 0 or (experts is not None and k > experts):
        why = "is negative" if k < 0 else f"is more than the {experts} experts"
        yield Hit(key, f"{HF_MOE_TOP_K_KEY} {k} {why}: the model builds, and its first "
                  f"forward raises RuntimeError ('selected index k out of range': {router})",
                  fix=fix)


def hf_model_key_hits(model: Mapping[str, Any], prefix: str,
                      taken: frozenset[str]) -> Iterator[Hit]:
    """FP8046's findings for one `hf_causal_lm` model section; `taken`: the keys the caller pops
    before building (train: `name`, `master_weights_dtype`; eval: `name` alone)."""
    if model.get("name") != HF_CAUSAL_LM_NAME:
        return
    for key in model:
        if isinstance(key, str) and key not in HF_CAUSAL_LM_KEYS and key not in taken:
            hint = " (MPT's key; a Hugging Face model gets FP8 from `algorithms: {te_swap: {}}`)" \
                if key in MPT_CONFIG_KEYS else " (only train takes it from the model section; " \
                "eval's evaluate_model passes it on)" if key in TRAIN_POPPED_MODEL_KEYS \
                else belongs_under(key, "model", prefix) or did_you_mean(key, HF_CAUSAL_LM_KEYS)
            yield Hit(join_key(prefix, key), f"ComposerHFCausalLM takes no `{key}`: building the "
                      "model raises TypeError (unexpected keyword argument)" + hint,
                      fix=move_fix(key, "model", prefix))
    path = model.get("pretrained_model_name_or_path")
    if isinstance(path, str) and path.startswith(HF_MPT_REFUSED_PREFIX):
        yield Hit(join_key(prefix, "pretrained_model_name_or_path"), f"{path!r:.60}: LLM-Foundry "
                  "from 0.18 raises ValueError 'The MPT series of models on the Hugging Face Hub "
                  "is no longer supported by LLM Foundry' building the model, after the "
                  "tokenizer and the data loaders (its own finetune/mpt-7b_dolly_sft.yaml meets "
                  "it)", fix="fine-tune another Hugging Face model, or train an MPT with "
                  "`name: mpt_causal_lm`")


#: The Hub names ComposerHFCausalLM.build_inner_model refuses from LLM-Foundry 0.18 (#1735;
#: llmfoundry/models/hf/hf_base.py:294-303 in 0.22): `pretrained_model_name_or_path.startswith`.
HF_MPT_REFUSED_PREFIX = "mosaicml/mpt"


#: The attn_impl names MPTConfig._validate_config accepts (llmfoundry/models/mpt/
#: configuration_mpt.py:308, 0.22: ValueError 'Unknown attn_impl=...' for any other, `triton`
#: of older releases too), with ours (`sdpa`, FP8041's when foundry_fp8.attention is not loaded).
_ATTN_IMPLS = ("torch", "flash", SDPA)
#: The rope_impl names it accepts where rope is on (configuration_mpt.py:327-332).
_ROPE_IMPLS = ("dail", "hf")


def _attn_impl_hits(attn: Mapping[str, Any]) -> Iterator[Hit]:
    """An attn_impl, or a rope_impl with rope on, that MPTConfig refuses (ValueError)."""
    impl = attn.get("attn_impl")
    if "attn_impl" in attn and not (isinstance(impl, str) and impl in _ATTN_IMPLS):
        yield Hit("model.attn_config.attn_impl", f"attn_impl {impl!r:.40} is none of "
                  f"{', '.join(_ATTN_IMPLS)}: MPTConfig raises ValueError 'Unknown "
                  f"attn_impl={impl!s:.40}' building the model"
                  + ("" if impl == "triton" else did_you_mean(str(impl), _ATTN_IMPLS)),
                  fix="attn_impl: flash (LLM-Foundry no longer has its triton attention)"
                  if impl == "triton" else "attn_impl: flash (or torch)")
    rope_impl = attn.get("rope_impl")
    if attn.get("rope") and "rope_impl" in attn and rope_impl not in _ROPE_IMPLS:
        yield Hit("model.attn_config.rope_impl", f"rope_impl {rope_impl!r:.40} with rope on: "
                  "MPTConfig raises ValueError ('rope_impl should be either \"dail\", or "
                  "\"hf\"') building the model" + did_you_mean(str(rope_impl), _ROPE_IMPLS),
                  fix="rope_impl: hf (or dail, which needs flash-attn)")


def _attn_config_hits(model: Mapping[str, Any]) -> Iterator[Hit]:
    """attn_config keys the built-in attention class of its attn_type refuses."""
    attn = section(model, "attn_config")
    yield from _attn_impl_hits(attn)
    attn_type = attn.get("attn_type", MPT_ATTN_DEFAULTS["attn_type"])
    if not (isinstance(attn_type, str) and attn_type in _ATTN_TYPES):
        return  # another registered class: its keywords are its own
    for key in attn:
        if key == MPT_ATTN_NULL_ONLY_KEY:
            if attn[key] is not None:
                yield Hit(join_key("model.attn_config", key), f"MPT deletes `{key}` only when it "
                          f"is null (above 1 it raises NotImplementedError; else {attn_type} "
                          "gets it and raises TypeError building the model)")
        elif key == MPT_GQA_ONLY_KEY and attn_type != _GQA:
            yield Hit(join_key("model.attn_config", key), f"only grouped_query_attention takes "
                      f"{key}: {attn_type} raises TypeError building the model")
        elif isinstance(key, str) and key not in MPT_ATTN_CONFIG_KEYS:
            yield Hit(join_key("model.attn_config", key), f"{attn_type} takes no `{key}` (MPTBlock "
                      "passes it on): building the model raises TypeError"
                      + (belongs_under(key, "model.attn_config")
                         or did_you_mean(key, MPT_ATTN_CONFIG_KEYS)),
                      fix=move_fix(key, "model.attn_config"))


def _sdpa_refused_hits(model: Mapping[str, Any]) -> Iterator[Hit]:
    """attn_config keys our sdpa refuses when MPTConfig is built (foundry_fp8.attention's
    validate_sdpa reads the same SDPA_REFUSED_ATTN_KEYS)."""
    attn = section(model, "attn_config")
    if attn.get("attn_impl") != SDPA:
        return
    for key, why in SDPA_REFUSED_ATTN_KEYS.items():
        if attn.get(key) is not None:
            yield Hit(join_key("model.attn_config", key), f"attn_impl sdpa does not support "
                      f"`{key}` ({why}): MPTConfig raises NotImplementedError building the model",
                      fix="attn_impl: torch")


def _torch_dmoe_hits(ffn: Mapping[str, Any]) -> Iterator[Hit]:
    """build_torch_dmoe's refusals: a key it pops with no default missing (KeyError), a key it
    does not take (ValueError), an mlp_type DroplessMLP does not build (ValueError)."""
    for key in TORCH_DMOE_REQUIRED_KEYS:
        if key not in ffn:
            yield Hit(join_key("model.ffn_config", key), f"torch_dmoe needs ffn_config.{key}, "
                      "which build_torch_dmoe reads with no default: building the model raises "
                      f"KeyError: '{key}'", fix=f"give model.ffn_config.{key} (torch_dmoe needs "
                      f"all of {', '.join(TORCH_DMOE_REQUIRED_KEYS)})")
    for key in ffn:
        if isinstance(key, str) and key not in TORCH_DMOE_CONFIG_KEYS:
            yield Hit(join_key("model.ffn_config", key), f"torch_dmoe takes no `{key}`: building "
                      "the model raises ValueError ('Invalid arguments to torch dmoe')"
                      + (belongs_under(key, "model.ffn_config")
                         or did_you_mean(key, TORCH_DMOE_CONFIG_KEYS)),
                      fix=move_fix(key, "model.ffn_config") or f"remove `{key}`")
    mlp_type = ffn.get("mlp_type")
    if "mlp_type" in ffn and mlp_type not in TORCH_DMOE_MLP_TYPES:
        yield Hit("model.ffn_config.mlp_type", f"torch_dmoe's experts are 'mlp' or 'glu', not "
                  f"{mlp_type!r:.40}: building the model raises ValueError (DroplessMLP)",
                  fix="mlp_type: mlp (or glu)")
    experts = ffn.get("moe_num_experts")
    if "moe_num_experts" in ffn and not (as_int(experts) is not None and experts > 0) \
            and not (isinstance(experts, str) and OC_ENV.search(experts)):
        yield Hit("model.ffn_config.moe_num_experts", f"moe_num_experts {experts!r:.40} is no "
                  "whole number above 0: " + ("the model builds, and its first forward raises "
                  "IndexError (max() over no expert in dMoE's LearnedRouter)" if experts == 0
                  and as_int(experts) is not None else "building the model raises (torch "
                  "creates the router's weight of that many rows: TypeError or RuntimeError)"),
                  fix="moe_num_experts: 8 (any whole number from 1)")
    if "moe_top_k" in ffn:
        yield from _moe_top_k_hits(ffn["moe_top_k"], as_int(experts))


def _moe_top_k_hits(top_k: Any, experts: int | None) -> Iterator[Hit]:
    """What dMoE's LearnedRouter does with moe_top_k (llmfoundry/models/layers/dmoe.py
    `_top_k`): a value equal to 1 (`1`, `1.0`, `true`) takes `scores.max`; anything else goes to
    `torch.topk(scores, moe_top_k)`, which raises TypeError for what is not an int and
    RuntimeError for k < 0 or above the experts, at the first forward. k = 0 raises nothing:
    every token gets no expert, the FFN adds zeros, and neither experts nor router ever get a
    gradient (checked on LLM-Foundry 0.22's MPT)."""
    key, fix = "model.ffn_config.moe_top_k", f"moe_top_k from 1 to {experts or 'moe_num_experts'}"
    k = as_int(top_k)
    if isinstance(top_k, (int, float)) and top_k == 1 \
            or isinstance(top_k, str) and OC_ENV.search(top_k):  # FP8017 says so
        return
    if k is None:
        yield Hit(key, f"moe_top_k {top_k!r:.40} is not an integer: the model builds, and its "
                  "first forward raises TypeError (torch.topk's k in dMoE's LearnedRouter)",
                  fix=fix)
    elif k == 0:
        yield Hit(key, "moe_top_k 0 routes every token to no expert: the run trains without "
                  "error, the MoE FFN of every block adds zeros, and its experts and router never "
                  "get a gradient (dMoE's LearnedRouter: torch.topk with k 0)", fix=fix)
    elif k < 0:
        yield Hit(key, f"moe_top_k {k} is negative: the model builds, and its first forward "
                  "raises RuntimeError ('selected index k out of range': torch.topk in dMoE's "
                  "LearnedRouter)", fix=fix)
    elif experts is not None and k > experts > 0:
        yield Hit(key, f"moe_top_k {k} is more than moe_num_experts {experts}: the model "
                  "builds, and its first forward raises RuntimeError ('selected index k out of "
                  "range': torch.topk in dMoE's LearnedRouter)", fix=fix)


#: FP8042's fix for an ffn_act_fn resolve_ffn_act_fn refuses.
_ACT_FN_FIX = ("ffn_act_fn: {name: gelu} (a torch.nn.functional function or quick_gelu, its "
               "keywords beside the name: {name: gelu, approximate: tanh})")


def _act_fn_hits(ffn: Mapping[str, Any]) -> Iterator[Hit]:
    """An ffn_act_fn that resolve_ffn_act_fn refuses when the FFN is built (ACT_FN_FFN_TYPES):
    no mapping, no `name`, or a name that is neither quick_gelu nor a function of
    torch.nn.functional (a private `_name` is not judged)."""
    act = ffn.get("ffn_act_fn")
    if act is None or ffn.get("ffn_type", MPT_FFN_DEFAULTS["ffn_type"]) not in ACT_FN_FFN_TYPES:
        return
    key, says = "model.ffn_config.ffn_act_fn", "LLM-Foundry's resolve_ffn_act_fn"
    if not isinstance(act, Mapping):
        if isinstance(act, str) and OC_ENV.search(act):
            return  # FP8017 says so
        yield Hit(key, f"ffn_act_fn {act!r:.40} is no mapping: {says} pops its `name` and "
                  "raises building the model (AttributeError or TypeError)",
                  fix=f"ffn_act_fn: {{name: {act}}}" if isinstance(act, str) else _ACT_FN_FIX)
    elif "name" not in act:
        yield Hit(key, f"ffn_act_fn has no `name`: {says} raises KeyError: 'name' building the "
                  "model", fix=_ACT_FN_FIX)
    elif not isinstance(name := act["name"], str):
        yield Hit(f"{key}.name", f"ffn_act_fn.name {name!r:.40} is no string: {says} raises "
                  "TypeError building the model (hasattr needs a name)", fix=_ACT_FN_FIX)
    elif not (name.startswith("_") or OC_ENV.search(name) or name in FOUNDRY_ACT_FNS
              or name in TORCH_FUNCTIONAL_CALLABLES):
        names = FOUNDRY_ACT_FNS | TORCH_FUNCTIONAL_CALLABLES
        gated = (" (a gated FFN is `ffn_type: mptglu`, this name the activation inside it: silu "
                 "for SwiGLU, gelu for GeGLU)") if name.lower().endswith("glu") else ""
        hint = (f" (Hugging Face's `{name}` is ffn_act_fn {HF_ACT_FN_EQUIVALENTS[name]})"
                if name in HF_ACT_FN_EQUIVALENTS else gated or did_you_mean(name.lower(), names))
        yield Hit(f"{key}.name", f"ffn_act_fn.name {name!r:.40} is neither quick_gelu nor a "
                  f"function of torch.nn.functional: {says} raises building the model "
                  f"(ValueError 'Unrecognized activation function name ({name:.40}).', or "
                  "TypeError for a name that is no function)" + hint,
                  fix=f"ffn_act_fn: {HF_ACT_FN_EQUIVALENTS[name]}"
                  if name in HF_ACT_FN_EQUIVALENTS else _ACT_FN_FIX)
    else:
        yield from _act_fn_keyword_hits(act, key)


def _act_fn_keyword_hits(act: Mapping[str, Any], key: str) -> Iterator[Hit]:
    """ffn_act_fn keys beside `name` that its function does not take (TORCH_ACT_FN_KEYWORDS):
    resolve_ffn_act_fn binds them with functools.partial, so the model builds and the first
    forward raises; quick_gelu, returned without them, ignores them all."""
    name = act["name"]
    for word in (k for k in act if k != "name"):
        where = join_key(key, str(word))
        if name in FOUNDRY_ACT_FNS:
            yield Hit(where, f"quick_gelu takes no `{word}`: resolve_ffn_act_fn returns LLM-"
                      "Foundry's quickgelu_activation without the keys beside `name`, so it is "
                      "ignored", severity="warning", fix=f"remove {word}")
        elif name in TORCH_ACT_FN_KEYWORDS and word not in TORCH_ACT_FN_KEYWORDS[name]:
            takes = ", ".join(sorted(TORCH_ACT_FN_KEYWORDS[name])) or "no keyword"
            yield Hit(where, f"torch.nn.functional.{name} takes no `{word}` ({takes}): "
                      "resolve_ffn_act_fn binds it with functools.partial, so the model builds "
                      "and its first forward raises TypeError (unexpected keyword argument)"
                      + did_you_mean(str(word), TORCH_ACT_FN_KEYWORDS[name]),
                      fix=f"remove {word}" + (f" (keywords: {takes})"
                                              if TORCH_ACT_FN_KEYWORDS[name] else ""))
        elif name == "gelu" and word == "approximate" and act[word] not in GELU_APPROXIMATIONS:
            yield Hit(where, f"gelu's approximate {act[word]!r:.40} is neither 'none' nor "
                      "'tanh': the model builds and its first forward raises RuntimeError",
                      fix="approximate: tanh (or none, exact GELU)")


def _ffn_config_hits(model: Mapping[str, Any]) -> Iterator[Hit]:
    """ffn_config keys mptmlp's, mptglu's and torch_dmoe's builders refuse, and an
    ffn_config.fc_type that MPTConfig replaces by the model's."""
    ffn = section(model, "ffn_config")
    if ffn.get("ffn_type") == _DMOE:
        yield from _torch_dmoe_hits(ffn)
    if ffn.get("ffn_type") in _MEGABLOCKS and MEGABLOCKS_REQUIRED_KEY not in ffn:
        yield Hit(f"model.ffn_config.{MEGABLOCKS_REQUIRED_KEY}", f"{ffn['ffn_type']} needs "
                  f"ffn_config.{MEGABLOCKS_REQUIRED_KEY}, which LLM-Foundry's config_moe_args "
                  f"reads with no default: building the model raises KeyError",
                  fix=f"{MEGABLOCKS_REQUIRED_KEY}: 1 (no expert parallelism)")
    yield from _act_fn_hits(ffn)
    if ffn.get("ffn_type", MPT_FFN_DEFAULTS["ffn_type"]) in ("mptmlp", "mptglu"):
        for key in ffn:
            if isinstance(key, str) and key not in MPT_FFN_CONFIG_KEYS:
                yield Hit(join_key("model.ffn_config", key), f"{ffn.get('ffn_type', 'mptmlp')}'s "
                          f"builder takes no `{key}` (build_ffn passes it on): building the "
                          "model raises TypeError" + (belongs_under(key, "model.ffn_config")
                                                      or did_you_mean(key, MPT_FFN_CONFIG_KEYS)),
                          fix=move_fix(key, "model.ffn_config"))
    given, used = fc_type_name(ffn), fc_type_name(model) or "torch"
    if "fc_type" in ffn and given != used:
        yield Hit("model.ffn_config.fc_type", f"MPTConfig replaces ffn_config.fc_type "
                  f"({given!r:.40}) with the model's fc_type ({used!r:.40}): the FFN is built "
                  f"with {used!r:.40}",
                  severity="warning", fix="give fc_type once, at the top of the model section")


@rule("FP8042", "error", "MPT `attn_config` / `ffn_config` keys its attention class or FFN "
      "builder refuses (`attn_tpye`, `ffn_typ`) or needs (torch_dmoe's `moe_top_k`, ...), an `ffn_config.fc_type` MPT replaces, an "
      "`fc_type`, `ffn_type` or `norm_type` no registry holds (`TE`, `tee`, `te_ln_mpl`, "
      "`layer_norm`), an `ffn_act_fn` LLM-Foundry cannot resolve (`swiglu`, `swish`, `GELU`) "
      "or whose keywords its function refuses at the first forward (`{name: gelu, approximat: "
      "tanh}`) (did-you-mean, or where the key belongs)",
      why="MPTBlock passes every attn_config key but the position-encoding ones to the "
      "attention class (multihead_attention, multiquery_attention, grouped_query_attention; "
      "kv_n_heads only the last takes), and build_ffn every ffn_config key but ffn_type to "
      "mptmlp's or mptglu's builder; none takes **kwargs, so a misspelled key raises TypeError "
      "building the model. torch_dmoe's builder reads moe_num_experts, moe_top_k, mlp_type "
      "('mlp' or 'glu'), moe_jitter_eps, moe_normalize_expert_weights and "
      "uniform_expert_assignment with no default (KeyError when one is missing) and raises "
      "ValueError on any other key; a moe_top_k that is negative or above moe_num_experts "
      "builds, and the first forward raises RuntimeError (torch.topk), one that is no integer "
      "(but 1.0) TypeError; moe_top_k 0 trains without error with every MoE FFN adding zeros, "
      "its experts and router never trained; a moe_num_experts that is no whole number above 0 "
      "raises building the model (0: IndexError at the first forward); mb_moe and mb_dmoe need moe_world_size (KeyError in "
      "config_moe_args), and LLM-Foundry drops their keys megablocks' Arguments does not take "
      "(not judged: megablocks is not read); a moe_world_size above 1 (expert parallelism) "
      "with fsdp_config.use_orig_params off makes train's validate_config raise ValueError "
      "before anything is built, and one that does not divide the GPU count where it is known "
      "(`--gpus`, `compute.gpus`) makes config_megablocks_moe_args raise ValueError ('Invalid "
      "world size configuration') building the model. te_ln_mlp hands its extra keys to te.LayerNormMLP, "
      "and other registered classes take their own: not judged. MPTConfig "
      "replaces ffn_config.fc_type by the model's fc_type (a warning where they differ). "
      "fc_type is looked up as written in LLM-Foundry's fcs registry, whose names are lower "
      "case: `TE` raises RegistryError. In files, an fc_type or ffn_type that is neither "
      "LLM-Foundry's nor registered by an installed package's entry points (read from package "
      "metadata) raises RegistryError too: an error, a warning where the config's `code_paths` "
      "may register it; an attn_impl other than torch, flash (or our sdpa), or a rope_impl "
      "other than dail or hf with rope on, makes MPTConfig raise ValueError; a norm_type "
      "(looked up lower-cased) that neither LLM-Foundry's norms "
      "registry nor a package's entry point holds makes MPTModel raise NotImplementedError, "
      "judged alike. With `attn_impl: sdpa`, the attn_config keys our sdpa refuses "
      "(`attn_logit_softcapping`): foundry_fp8.attention makes MPTConfig raise "
      "NotImplementedError (fix: `attn_impl: torch`). mptmlp, mptglu, torch_dmoe and "
      "megablocks' FFNs resolve ffn_config.ffn_act_fn building the model: a mapping whose "
      "`name` is quick_gelu or a function of torch.nn.functional (case-sensitive), its other "
      "keys bound as keywords with functools.partial, so a keyword the function does not take "
      "(for the activations of TORCH_ACT_FN_KEYWORDS), or a gelu `approximate` other than "
      "none or tanh, builds and fails the first forward (TypeError, RuntimeError), and "
      "quick_gelu ignores them all (a warning); any other "
      "name raises ValueError, no name KeyError, a value no mapping AttributeError or "
      "TypeError. Hugging Face's activation names (swish, gelu_new) are not torch's: the "
      "message names the equivalent.",
      source=f"{FOUNDRY} llmfoundry/models/layers/blocks.py MPTBlock.__init__ "
      "(args_to_exclude_in_attn_class), llmfoundry/models/layers/attention.py, "
      "llmfoundry/models/layers/layer_builders.py build_ffn, llmfoundry/models/layers/ffn.py "
      "build_mptmlp, build_mptglu, build_torch_dmoe, llmfoundry/models/layers/dmoe.py "
      "DroplessMLP, llmfoundry/models/utils/config_moe_args.py config_megablocks_moe_args, "
      "llmfoundry/command_utils/train.py:143-157 validate_config, llmfoundry/models/layers/fc.py, "
      "llmfoundry/models/mpt/configuration_mpt.py _validate_config (ffn_config['fc_type']), "
      "llmfoundry/models/utils/config_defaults.py, llmfoundry/layers_registry.py (fcs, ffns, "
      "ffns_with_norm, ffns_with_megablocks: entry_points=True); foundry_fp8/sdpa_facts.py "
      "SDPA_REFUSED_ATTN_KEYS (read by foundry_fp8/attention.py enable_sdpa_for_mpt); "
      "llmfoundry/models/layers/ffn.py:68-91 resolve_ffn_act_fn (torch 2.7.0's "
      "torch.nn.functional; tests/test_lint2_model_values.py compares both); "
      "tests/test_lint_known.py builds each",
      fix="fix the spelling (the message names the closest key or name)", unresolved=True)
def mpt_sub_configs(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Hit]:
    model = section(config, "model")
    if not _is_mpt(model):
        return
    yield from _attn_config_hits(model)
    yield from _sdpa_refused_hits(model)
    yield from _ffn_config_hits(model)
    fc_type = fc_type_name(model)
    if isinstance(fc_type, str) and fc_type not in MPT_FC_TYPES \
            and fc_type.lower() in MPT_FC_TYPES:
        key = "model.fc_type.name" if isinstance(model.get("fc_type"), Mapping) else "model.fc_type"
        yield Hit(key, f"fc_type {fc_type!r} is no name of LLM-Foundry's fcs registry, which looks "
                  "it up as written: building the model raises RegistryError (did you mean "
                  f"`{fc_type.lower()}`?)")
    yield from _expert_parallel_hits(config, model, ctx)
    if ctx.scope == "file":  # in a run the model is built: its registries answered already
        yield from _unregistered_layers(config, model)


def _expert_parallel_hits(config: Mapping[str, Any], model: Mapping[str, Any],
                          ctx: LintContext) -> Iterator[Hit]:
    """megablocks' expert parallelism (ffn_config.moe_world_size above 1): train's
    validate_config refuses it without FSDP's use_orig_params before anything is built, and
    config_megablocks_moe_args refuses a world size it does not divide (or is above) when it
    builds the model; the world size judged where it is known (`ctx.gpus`)."""
    ffn = section(model, "ffn_config")
    size = as_int(ffn.get(MEGABLOCKS_REQUIRED_KEY))
    if ffn.get("ffn_type") not in _MEGABLOCKS or size is None or size <= 1:
        return
    fsdp = config.get("fsdp_config")
    if isinstance(fsdp, Mapping) and not fsdp.get("use_orig_params", True):
        yield Hit("fsdp_config.use_orig_params", f"moe_world_size {size} (expert parallelism) "
                  "with use_orig_params off: LLM-Foundry's train raises ValueError ('MoEs with "
                  "expert parallelism ... require `use_orig_params=True`') before anything is "
                  "built", fix="use_orig_params: true (or moe_world_size: 1)")
    if ctx.gpus is not None and (ctx.gpus < size or ctx.gpus % size):
        yield Hit(f"model.ffn_config.{MEGABLOCKS_REQUIRED_KEY}", f"moe_world_size {size} with "
                  f"{ctx.gpus_text()}: LLM-Foundry's config_megablocks_moe_args raises "
                  f"ValueError ('Invalid world size configuration: world_size={ctx.gpus} and "
                  f"moe_world_size={size}') building the model, after the tokenizer and the "
                  "data loaders", fix="moe_world_size: a divisor of the GPU count (1: no "
                  "expert parallelism)")


def _unregistered_layers(config: Mapping[str, Any], model: Mapping[str, Any]) -> Iterator[Hit]:
    """An fc_type, ffn_type or norm_type that neither LLM-Foundry nor an installed package
    registers (`tee`, `transformer_engine`, `te_ln_mpl`, `layer_norm`); a warning where
    `code_paths` may register it."""
    for key, (builtins, groups) in MPT_LAYER_REGISTRIES.items():
        name = fc_type_name(model) if key == "fc_type" else get(model, key)
        if not isinstance(name, str):
            continue
        names = builtins.union(*map(entry_point_names, groups))
        if name in names or (key == "fc_type" and name.lower() in MPT_FC_TYPES):
            continue  # `TE`: named above, in files and runs
        where = f"model.{key}" + (".name" if isinstance(model.get(key), Mapping) else "")
        registry = "fcs registry" if key == "fc_type" else "ffns registries"
        maybe = " (unless a module of `code_paths` registers it)" if "code_paths" in config \
            else ""
        yield Hit(where, f"{key.rpartition('.')[2]} {name!r:.60} is no name of LLM-Foundry's "
                  f"{registry} ({', '.join(sorted(names))}) nor of an installed "
                  f"plugin's: building the model raises RegistryError{maybe}"
                  + did_you_mean(name, names), severity="warning" if maybe else "error")
    norm_type = model.get("norm_type")
    names = frozenset(MPT_NORM_CLASSES) | entry_point_names(NORMS_GROUP)
    if isinstance(norm_type, str) and norm_type.lower() not in names:
        maybe = " (unless a module of `code_paths` registers it)" if "code_paths" in config \
            else ""
        yield Hit("model.norm_type", f"norm_type {norm_type!r:.60} is no name of LLM-Foundry's "
                  f"norms registry ({', '.join(sorted(names))}, looked up lower-cased) nor of an "
                  "installed plugin's: MPTModel raises NotImplementedError ('Requested norm type "
                  f"... is not implemented') building the model{maybe}"
                  + did_you_mean(norm_type.lower(), names),
                  severity="warning" if maybe else "error")


@rule("FP8029", "error", "MPT settings that need flash-attn where it is not installed (or too "
      "old): `loss_fn: fused_crossentropy` (MPT's default), alibi with attn_impl flash (MPT's "
      "default), rope with rope_impl dail (MPT's default), sliding_window_size, "
      "attn_logit_softcapping or attn_uses_sequence_id with attn_impl flash; in a run "
      "(`fp8_lint`), attn_impl flash itself and an hf_causal_lm's `use_flash_attention_2`; "
      "`ffn_config.ffn_type: mb_moe` or `mb_dmoe` where megablocks is not installed",
      why="ComposerMPTCausalLM defaults loss_fn to fused_crossentropy and raises 'Fused Cross "
      "Entropy is not installed' when flash_attn.losses.cross_entropy cannot be imported. "
      "MPTConfig refuses alibi with attn_impl flash below flash-attn 2.4.2 "
      "(NotImplementedError), rope with rope_impl dail below 2.0.1 (ImportError), "
      "sliding_window_size below 2.3.0, attn_logit_softcapping below 2.6.2 and "
      "attn_uses_sequence_id below 2.1.2 with attn_impl flash (NotImplementedError): each when "
      "LLM-Foundry builds the model, after the tokenizer and the data loaders. "
      "Judged against the packages where the check runs: an error in `fp8_lint` (the training "
      "machine), a warning in `foundry-fp8 lint` (which may run elsewhere). attn_impl flash "
      "(MPT's default) without flash-attn >= 2.0 builds, and the first forward raises "
      "NameError 'bert_padding': judged in `fp8_lint` only, on the machine that trains (in "
      "files every MPT config without attn_impl would warn wherever the linter runs); so is "
      "an hf_causal_lm's `use_flash_attention_2: true` or `attn_implementation: "
      "flash_attention_2`, for which ComposerHFCausalLM raises ValueError building the model "
      "without flash-attn >= 2.0. LLM-Foundry registers megablocks' FFNs, mb_moe and mb_dmoe "
      "(its own MoE YAMLs' ffn_type), only where `import megablocks` finds the module (a "
      "ModuleNotFoundError is swallowed): elsewhere build_ffn looks the name up in the `ffns` "
      "registry and raises RegistryError ('Available names: mptglu, mptmlp, torch_dmoe') "
      "building the model, after the tokenizer and the data loaders; judged alike (an "
      "installed package's entry point for the name counts as registering it), the fix the "
      "install setup.py's `megablocks` extra asks.",
      source=f"{FOUNDRY} llmfoundry/models/mpt/modeling_mpt.py ComposerMPTCausalLM.__init__; "
      "llmfoundry/models/mpt/configuration_mpt.py:308-376 _validate_config, "
      "llmfoundry/models/layers/attention.py is_flash_v2_installed, check_alibi_support; "
      "llmfoundry/models/utils/config_defaults.py (attn_impl flash, rope_impl dail); "
      "llmfoundry/models/mpt/modeling_mpt.py:32-38 (bert_padding imported only with "
      "flash-attn 2) and MPTModel.forward (gen_flash_attn_padding_info for attn_impl flash); "
      "llmfoundry/models/hf/hf_base.py:283-312 build_inner_model (use_flash_attention_2); "
      "llmfoundry/models/layers/ffn.py:30-34, 595-597 (mb_moe and mb_dmoe registered where "
      "megablocks imports), llmfoundry/models/layers/layer_builders.py build_ffn, setup.py "
      "extra_deps['megablocks']",
      fix="set model.loss_fn: torch_crossentropy, or install flash-attn on the training machine "
      "(megablocks' FFNs: install megablocks)")
def fused_cross_entropy(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Hit]:
    model = section(config, "model")
    snapshot = ctx.snapshot
    if snapshot is None:
        return
    severity: Literal["error", "warning"] = "error" if ctx.scope == "run" else "warning"
    if model.get("name") == HF_CAUSAL_LM_NAME and ctx.scope == "run":
        yield from _hf_flash_attention_2(model, snapshot.flash_attn)
    if not _is_mpt(model):
        return
    attn = section(model, "attn_config")
    refused = list(_flash_attn_settings(attn, snapshot.flash_attn, severity))
    yield from refused
    if not snapshot.flash_attn_cross_entropy \
            and model.get("loss_fn", "fused_crossentropy") == "fused_crossentropy":
        key = "model.loss_fn" if "loss_fn" in model else "model"
        said = "loss_fn fused_crossentropy" if "loss_fn" in model else \
            "no loss_fn, so MPT's default fused_crossentropy,"
        yield Hit(key, f"{said} needs flash-attn's cross entropy, which is not installed here: "
                  "LLM-Foundry raises when it builds the model", severity=severity)
    yield from _megablocks_ffn(model, severity)
    if ctx.scope == "run" and not refused:  # MPTConfig refuses those before any forward
        yield from _flash_attn_forward(attn, snapshot.flash_attn)


def megablocks_importable() -> bool:
    """Would `import megablocks` find a module here (what LLM-Foundry's ffn.py tries), without
    importing it (it imports torch)."""
    try:
        return util.find_spec(MEGABLOCKS_MODULE) is not None
    except Exception:  # a broken parent or finder: as LLM-Foundry's import, found nothing
        return False


def _megablocks_ffn(model: Mapping[str, Any],
                    severity: Literal["error", "warning"]) -> Iterator[Hit]:
    """ffn_type mb_moe or mb_dmoe (LLM-Foundry's MoE YAMLs) where megablocks is not installed:
    LLM-Foundry registers them only where `import megablocks` succeeds, so build_ffn looks the
    name up in `ffns` and raises RegistryError, after the tokenizer and the data loaders. An
    installed package's entry point for the name counts as registering it."""
    name = get(model, "ffn_config.ffn_type")
    groups = MPT_LAYER_REGISTRIES["ffn_config.ffn_type"][1]
    if name not in _MEGABLOCKS or megablocks_importable() \
            or any(name in entry_point_names(group) for group in groups):
        return
    yield Hit("model.ffn_config.ffn_type", f"ffn_type {name} is megablocks' MoE, which LLM-"
              "Foundry registers only where `import megablocks` succeeds (llmfoundry/models/"
              "layers/ffn.py), and megablocks is not installed here: building the model raises "
              f"RegistryError (\"Cant't find '{name}' in registry llmfoundry -> ffns\"), after "
              "the tokenizer and the data loaders", severity=severity,
              fix=f"{MEGABLOCKS_INSTALL} on the training machine, or ffn_type: torch_dmoe "
              "(LLM-Foundry's own dropless MoE, no megablocks)")


def _flash_attn_here(installed: str | None, version: Version | None) -> str:
    """What a flash-attn finding says of this machine's flash-attn (`installed`, parsed)."""
    return f"flash-attn here is {installed}" if version else "flash-attn is not installed here"


def _hf_flash_attention_2(model: Mapping[str, Any], installed: str | None) -> Iterator[Hit]:
    """`use_flash_attention_2: true` (or `attn_implementation: flash_attention_2`) of an
    hf_causal_lm without flash-attn 2: build_inner_model raises ValueError. Judged in a run
    only, as attn_impl flash: most GPU configs ask for it, wherever the linter runs."""
    version = parse_version(installed)
    if version is not None and version >= FLASH_ATTN_V2:
        return
    if model.get("use_flash_attention_2") is True:
        key = "model.use_flash_attention_2"
    elif model.get("attn_implementation") == "flash_attention_2":
        key = "model.attn_implementation"
    else:
        return
    here = _flash_attn_here(installed, version)
    yield Hit(key, f"{key.partition('.')[2]} needs flash-attn >= {dotted(FLASH_ATTN_V2)}, and "
              f"{here}: ComposerHFCausalLM raises ValueError ('flash-attention 2 is not "
              "installed') building the model, after the tokenizer and the data loaders",
              fix=f"drop {key.partition('.')[2]} (attn_implementation: sdpa "
              f"needs no flash-attn), or install flash-attn >= {dotted(FLASH_ATTN_V2)} on the "
              "training machine")


def _flash_attn_forward(attn: Mapping[str, Any], installed: str | None) -> Iterator[Hit]:
    """attn_impl flash (MPT's default) without flash-attn 2: the model builds and the first
    forward raises NameError 'bert_padding'. Judged in a run only, whose machine is the one that
    trains: in files every config without attn_impl would warn wherever the linter runs."""
    version = parse_version(installed)
    if attn.get("attn_impl", MPT_ATTN_IMPL_DEFAULT) != "flash" \
            or (version is not None and version >= FLASH_ATTN_V2):
        return
    said = "attn_impl flash" if "attn_impl" in attn else \
        "no attn_config.attn_impl, so MPT's default flash,"
    here = _flash_attn_here(installed, version)
    yield Hit("model.attn_config.attn_impl" if "attn_impl" in attn else "model", f"{said} needs "
              f"flash-attn >= {dotted(FLASH_ATTN_V2)}, and {here}: the model builds, then its "
              "first forward raises NameError: name 'bert_padding' is not defined "
              "(modeling_mpt.py imports it only where is_flash_v2_installed())",
              fix="set model.attn_config.attn_impl: torch (or sdpa), or install flash-attn >= "
              f"{dotted(FLASH_ATTN_V2)} on the training machine")


def _flash_attn_settings(attn: Mapping[str, Any], installed: str | None,
                         severity: Literal["error", "warning"]) -> Iterator[Hit]:
    """The attn_config settings MPTConfig refuses with the flash-attn installed here
    (FLASH_ATTN_NEEDS), as MPTConfig reads them after its defaults."""
    impl = attn.get("attn_impl", MPT_ATTN_IMPL_DEFAULT)
    version = parse_version(installed)
    on = {"alibi": bool(attn.get("alibi")),
          "attn_uses_sequence_id": bool(attn.get("attn_uses_sequence_id")),
          "rope": bool(attn.get("rope")) and attn.get("rope_impl", "dail") == "dail",
          "sliding_window_size": attn.get("sliding_window_size", -1) != -1,
          "attn_logit_softcapping": as_number(attn.get("attn_logit_softcapping")) is not None
          and attn["attn_logit_softcapping"] > 0}
    for setting, (least, raises, lines) in FLASH_ATTN_NEEDS.items():
        flash_only = setting != "rope"
        if not on[setting] or (flash_only and impl != "flash") \
                or (version is not None and version >= least):
            continue
        here = _flash_attn_here(installed, version)
        if setting == "rope":
            what = "rope with rope_impl dail" + ("" if "rope_impl" in attn else " (MPT's default)")
            key = "model.attn_config.rope_impl" if "rope_impl" in attn else "model.attn_config.rope"
            fix = "attn_config.rope_impl: hf (no flash-attn needed)"
        else:
            what = f"{setting} with attn_impl flash" + ("" if "attn_impl" in attn
                                                        else " (MPT's default)")
            key, fix = f"model.attn_config.{setting}", "attn_config.attn_impl: torch"
        yield Hit(key, f"{what} needs flash-attn >= {dotted(least)}, and {here}: MPTConfig "
                  f"raises {raises} building the model (configuration_mpt.py:{lines})",
                  severity=severity,
                  fix=f"{fix}, or install flash-attn >= {dotted(least)} on the training machine")


def norm_class(norm_type: str) -> tuple[str, str] | None:
    """(module, class) that defines the forward of the norm MPT builds for `norm_type`, which
    LLM-Foundry's norms registry looks up lower-cased: an installed package's entry point first
    (its `module:attr` from package metadata; a class of the package's own is not imported, so
    only torch's classes are known through it), else a class registered in this process (a
    run's code_paths: catalogue's table, read only where the process has imported it), else
    LLM-Foundry's own (`MPT_NORM_CLASSES`); None where none names a known class."""
    name = norm_type.lower()
    if (value := entry_point_value(NORMS_GROUP, name)) is not None:
        module, _, attr = value.partition("[")[0].strip().partition(":")
        where, _, cls = f"{module}.{attr}".strip(".").rpartition(".")
        return ("torch.nn.modules.normalization" if where in TORCH_NORM_EXPORTS else where, cls)
    table = getattr(sys.modules.get("catalogue"), "REGISTRY", None)
    key = ("llmfoundry", "norms", name)
    if isinstance(table, Mapping) and key in table:
        registered = table[key]
        if not isinstance(registered, type):
            return None  # a function building the norm: its class is not known until it runs
        owner = next((c for c in registered.__mro__ if "forward" in vars(c)), registered)
        return owner.__module__, owner.__qualname__
    return MPT_NORM_CLASSES.get(name)


def mpt_te_norm(model: Mapping[str, Any]) -> str | None:
    """TE's normalization that computes the model's norms (`filters.te_norm`, te_swap's own
    decision on the built norm: LayerNorm ones it converts and fuses, RMSNorm ones it fuses);
    None: another function, or a norm_type whose class is not known."""
    norm_type = mpt_value(model, "norm_type")
    found = norm_class(norm_type) if isinstance(norm_type, str) else None
    return te_norm(*found) if found else None


def _te_swap_fuses(model: Mapping[str, Any]) -> bool:
    """Whether te_swap's fuse_ln_mlp fuses this model's blocks, read from the config as
    `swap._fusable_mlp` reads a built block: an MPT whose MLP (mptmlp, torch linears, GELU or
    ReLU) follows a LayerNorm with a bias or an RMSNorm with a numeric eps, in a block of its own
    (not `fuse_norm_attn_norm`'s, whose norm_2 hands the MLP its output)."""
    norm = mpt_te_norm(model)
    return (_is_mpt(model) and get(model, "ffn_config.ffn_type") in (None, "mptmlp")
            and model.get("fuse_norm_attn_norm") is not True  # norm_2 is not the block's own
            and fc_type_name(model) in (None, "torch")
            and get(model, "ffn_config.ffn_act_fn.name") in (None, "gelu", "relu")
            and ((norm == "LayerNorm" and mpt_value(model, "no_bias") is not True)
                 or (norm == "RMSNorm" and mpt_value(model, "norm_eps") is not None)))


def _layernorm_mlps(config: Mapping[str, Any]) -> Iterator[tuple[str, str, str | None, bool]]:
    """(key, what builds it, fix, whether the run crashes) for each way this run would give
    LLM-Foundry's param init a te.LayerNormMLP: `ffn_type: te_ln_mlp` always (a crash);
    te_swap's fusion only on meta weights (it copies materialised ones), i.e. `init_device` meta
    or mixed under FSDP, where te_swap declines to fuse (swap._meta_init_reason) instead."""
    model = section(config, "model")
    if get(model, "ffn_config.ffn_type") == "te_ln_mlp":
        yield ("model.ffn_config.ffn_type", "ffn_type te_ln_mlp builds te.LayerNormMLP layers",
               None, True)
    swap = te_swap(config)
    device = model.get("init_device", "cpu")
    if swap is not None and swap.get("fuse_ln_mlp") is True and swap.get("backend") == "te" \
            and device in ("meta", "mixed") and isinstance(config.get("fsdp_config"), Mapping) \
            and _te_swap_fuses(model):
        yield ("algorithms.te_swap.fuse_ln_mlp", "te_swap's fuse_ln_mlp would build "
               f"te.LayerNormMLP layers on the meta device (init_device {device} under FSDP, "
               "i.e. on more than one GPU), which FSDP initialises through LLM-Foundry's "
               "param_init_fn; te_swap declines to fuse them there (its coverage table says "
               "why), so the MLPs run as separate te.Linear layers",
               "set model.init_device: cpu (te_swap then fuses initialised layers)", False)


@rule("FP8030", "error", "a te.LayerNormMLP for LLM-Foundry's param init (`ffn_type: "
      "te_ln_mlp`; te_swap's `fuse_ln_mlp` on meta weights): NameError `div_is_residual`",
      why="LLM-Foundry's te_layernorm_mlp_init divides fc2_weight by `div_is_residual`, a name "
      "it never receives (it takes **kwargs and deletes them). Every init_config scheme but "
      "`default_` reaches it through generic_param_init_fn_, when MPT initialises its blocks "
      "and when FSDP materialises meta-device blocks (init_device meta or mixed), so building "
      "the model raises NameError. `ffn_type: te_ln_mlp` always meets it (error); te_swap's "
      "fuse_ln_mlp would only on layers still on the meta device, where te_swap does not fuse "
      "(a warning: the fusion asked for does not happen). In every release from "
      f"{dotted(TE_LN_MLP_INIT_FAILS_FROM)} (PR #1096) to 0.22.0, and on main. Judged against "
      "the LLM-Foundry installed where the linter runs; a warning when it is not installed or "
      "a folder shadows it (FP8215). "
      "ffn_config_defaults, which MPT ignores, is FP8024's.",
      source=f"LLM-Foundry {TE_LN_MLP_INIT_SOURCE}: te_layernorm_mlp_init, reached from "
      f"generic_param_init_fn_; {FOUNDRY} llmfoundry/models/mpt/modeling_mpt.py "
      "MPTModel.__init__ and param_init_fn; "
      "https://github.com/mosaicml/llm-foundry/pull/1096 (commit 676ad7f9, first in v0.8.0; "
      f"the same at v0.21.0 and main 8c8dd48f); {COMPOSER} composer/distributed/"
      "dist_strategy.py prepare_fsdp_module (_param_init_fn); H200 run: "
      "benchmarks/results/mpt-1b-nvidia-h200-te-native.json (fp8-te-ln-mlp)",
      fix="drop ffn_type: te_ln_mlp (and fc_type: te, whose te.Linear layers te_swap does not "
      "fuse) and let te_swap build the fused layers: algorithms: {te_swap: {fuse_ln_mlp: true}} "
      "with model.init_device: cpu")
def te_layernorm_mlp_init(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Hit]:
    snapshot = ctx.snapshot
    scheme = section(section(config, "model"), "init_config").get("name", MPT_DEFAULT_INIT_SCHEME)
    if snapshot is None or (isinstance(scheme, str)
                            and scheme in INIT_SCHEMES_WITHOUT_MODULE_INITS):
        return
    fails = te_ln_mlp_init_fails(judged_version(snapshot, "llmfoundry"))
    if fails is False:
        return
    for key, what, fix, crashes in _layernorm_mlps(config):
        if fails:
            yield Hit(key, f"{what}, and LLM-Foundry {snapshot.llmfoundry}'s "
                      f"te_layernorm_mlp_init ({TE_LN_MLP_INIT_SOURCE}) divides fc2_weight by "
                      "`div_is_residual`, a name it never receives: "
                      + ("building the model raises NameError: name 'div_is_residual' is not "
                         "defined" if crashes else "it would raise NameError"),
                      severity="error" if crashes else "warning", fix=fix)
        else:
            yield Hit(key, f"{what}, and every LLM-Foundry from "
                      f"{dotted(TE_LN_MLP_INIT_FAILS_FROM)} (checked up to 0.22.0) raises "
                      "NameError 'div_is_residual' initialising them in te_layernorm_mlp_init "
                      f"({TE_LN_MLP_INIT_SOURCE}); LLM-Foundry here: "
                      f"{what_runs(snapshot, 'llmfoundry')}", severity="warning", fix=fix)


def _fed_lengths(config: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
    """(key, length) of each sequence length the run feeds the model: every loader's
    `dataset.max_seq_len` (text samples are that long; finetuning pads or packs up to it), and
    the length ICL pads its tasks to: a task's own `max_seq_len`, else `icl_seq_len` or else the
    top-level max_seq_len (train.py's `or`; eval passes its max_seq_len)."""
    for key, loader, _ in loader_sections(config):
        if "max_seq_len" in section(loader, "dataset"):
            yield f"{key}.dataset.max_seq_len", loader["dataset"]["max_seq_len"]
    tasks = config.get("icl_tasks")
    listed = tasks if isinstance(tasks, list) else []
    for index, task in enumerate(listed):
        if isinstance(task, Mapping) and "max_seq_len" in task:
            yield f"icl_tasks.{index}.max_seq_len", task["max_seq_len"]
    own = bool(listed) and all(isinstance(t, Mapping) and "max_seq_len" in t for t in listed)
    icl = "icl_seq_len" if config.get("icl_seq_len") else "max_seq_len"
    if tasks and not own and icl in config:
        yield icl, config[icl]


#: FP8061's and FP8313's sources and fix.
MPT_SEQ_LEN_SOURCE = (f"{FOUNDRY} llmfoundry/models/mpt/modeling_mpt.py MPTModel.forward (the "
                      "seq_len assert), llmfoundry/models/mpt/configuration_mpt.py (max_seq_len: "
                      "int = 2048), llmfoundry/data/text_data.py StreamingTextDataset, "
                      "llmfoundry/utils/builders.py build_icl_evaluators (a task's own "
                      "max_seq_len first), llmfoundry/eval/datasets/utils.py make_padded_input")
MPT_SEQ_LEN_FIX = "model.max_seq_len: ${variables.max_seq_len}, the length the loaders use"


@rule("FP8061", "error", "sequences longer than MPT's `model.max_seq_len` (default 2048): a "
      "loader's `dataset.max_seq_len`, or ICL's (a task's own, `icl_seq_len`, top-level "
      "`max_seq_len`)",
      why="MPTModel.forward asserts every input is at most the model's max_seq_len ('Cannot "
      "forward input with seq_len=S, this model only supports seq_len<=M'), whatever the "
      "position encoding, and MPTConfig's default is 2048: a model section that does not take "
      "the loaders' length (`max_seq_len: ${variables.max_seq_len}`) crashes at the first "
      "batch, after the model, the data and FSDP are set up (text samples are exactly the "
      "loader's length; the finetuning loader pads or packs to it), or at the first evaluation "
      "for an eval loader and ICL, which pads its tasks to a task's own max_seq_len, else "
      "icl_seq_len, else the top-level max_seq_len. A finetuning train loader that pads to "
      "the longest example (`pad_to_longest`, `allow_pad_trimming`, unpacked) makes a batch only "
      "as long as its longest example: a warning, as the crash waits for an example longer than "
      "the model's limit.",
      source=MPT_SEQ_LEN_SOURCE + ", llmfoundry/command_utils/train.py (icl_seq_len or "
      "max_seq_len)",
      fix=MPT_SEQ_LEN_FIX)
def sequences_past_mpt_max(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Hit]:
    yield from past_mpt_max(config, section(config, "model"), "model")


def past_mpt_max(config: Mapping[str, Any], model: Mapping[str, Any],
              prefix: str) -> Iterator[Hit]:
    """FP8061's and FP8313's finding for one model section at `prefix`: the first length past
    an MPT's max_seq_len."""
    limit = as_number(mpt_value(model, "max_seq_len")) if _is_mpt(model) else None
    if limit is None:
        return
    for key, length in _fed_lengths(config):
        if as_number(length) is not None and length > limit:
            where = join_key(prefix, "max_seq_len") if "max_seq_len" in model else prefix
            given = "" if "max_seq_len" in model else " (MPTConfig's default: the model section " \
                "gives none)"
            padding = _padded_to(config, length)[0] if key.startswith("train_loader") else None
            seq, when = ("S", f"at the first batch whose longest example has more than {limit} "
                         f"tokens (`{padding}`: a batch is as long as its longest example)") \
                if padding else (length, "at the first batch" if key.startswith("train_loader")
                                 else "at the first evaluation")
            yield Hit(where, f"{key} is {length}, above the model's max_seq_len {limit}{given}: "
                      f"MPTModel.forward asserts 'Cannot forward input with seq_len={seq}, this "
                      f"model only supports seq_len<={limit}' {when}",
                      severity="warning" if padding else None)
            return
