"""The model section: keys MPT silently ignores, TE layer choices, GEMM shapes, the loss, and
LLM-Foundry's init of te.LayerNormMLP."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from foundry_fp8.lint.config import as_int, fc_type_name, get, native_te_layers, te_swap
from foundry_fp8.lint.known import (
    FOUNDRY_MODEL_KEYS,
    HF_CONFIG_KEYS,
    MPT_ATTRIBUTES_READ,
    MPT_CONFIG_KEYS,
    MPT_DEFAULTS,
    MPT_MODEL_NAMES,
    did_you_mean,
)
from foundry_fp8.lint.registry import Hit, LintContext, rule, section
from foundry_fp8.lint.rules.train import COMPOSER, FOUNDRY, TE28
from foundry_fp8.shapes import dim_fits_fp8
from foundry_fp8.te.facts import (
    INIT_SCHEMES_WITHOUT_MODULE_INITS,
    MPT_DEFAULT_INIT_SCHEME,
    TE_LN_MLP_INIT_FAILS_FROM,
    TE_LN_MLP_INIT_SOURCE,
    dotted,
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
    ratio is no number."""
    ratio = model.get("expansion_ratio", MPT_DEFAULTS["expansion_ratio"])
    if get(model, "ffn_config.ffn_hidden_size") is not None \
            or not isinstance(ratio, (int, float)) or isinstance(ratio, bool):
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


@rule("FP8005", "error", "GEMM dims (d_model, FFN hidden size, vocab when te_swap converts "
      "the LM head) that break TE's FP8 shape rule",
      why="TE asserts before an FP8 GEMM that the input's and weight's last dim is divisible "
      "by 16 and the product of the other dims by 8. TE layers the model builds itself "
      "(fc_type: te, te_ln_mlp) then fail at the first forward (error); te_swap keeps such "
      "layers in high precision (warning), and with d_model off no block layer is left.",
      source=f"{TE28} transformer_engine/pytorch/utils.py assert_dim_for_fp8_exec (called by "
      f"Linear, LayerNormLinear, LayerNormMLP); {FOUNDRY} llmfoundry/models/layers/ffn.py "
      "resolve_ffn_hidden_size; foundry_fp8/shapes.py, foundry_fp8/swap.py _gemm_reason",
      fix="use multiples of 16 (d_model, expansion_ratio / ffn_hidden_size, vocab_size)")
def gemm_dims(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Hit]:
    swap = te_swap(config)
    native = native_te_layers(config)
    if not (native or swap is not None):
        return
    model = section(config, "model")
    d_model = as_int(model.get("d_model", MPT_DEFAULTS["d_model"]))
    if d_model is None:
        return
    if not dim_fits_fp8(d_model):
        yield Hit("model.d_model", f"d_model {d_model} is not divisible by 16, as TE's FP8 "
                  "GEMMs require" + ("" if native else " (te_swap would keep every block layer "
                                                       "out of FP8)"))
    hidden = _ffn_hidden(model, d_model)
    if hidden and not dim_fits_fp8(hidden[1]):
        if native:
            yield Hit(hidden[0], f"FFN hidden size {hidden[1]} is not divisible by 16, as TE's "
                      "FP8 GEMMs require")
        else:
            yield Hit(hidden[0], f"FFN hidden size {hidden[1]} is not divisible by 16: te_swap "
                      "keeps the FFN layers in high precision", severity="warning")
    vocab = as_int(model.get("vocab_size", MPT_DEFAULTS["vocab_size"]))
    converts_head = (swap is not None and swap.get("keep_lm_head") is False
                     and model.get("tie_word_embeddings") is False)
    if converts_head and vocab is not None and not dim_fits_fp8(vocab):
        yield Hit("model.vocab_size", f"vocab_size {vocab} is not divisible by 16: te_swap keeps "
                  "the LM head in high precision although keep_lm_head is false",
                  severity="warning")


@rule("FP8032", "error", "MPT's `d_model * expansion_ratio` not a whole number",
      why="Every MPT FFN (MPTMLP, te_ln_mlp, the MoE FFNs) takes its hidden size from "
      "resolve_ffn_hidden_size, which raises '`d_model * expansion_ratio` must be an integer' "
      "unless ffn_config.ffn_hidden_size is given: the model is never built.",
      source=f"{FOUNDRY} llmfoundry/models/layers/ffn.py resolve_ffn_hidden_size (from "
      "MPTMLP.__init__, build_te_ln_mlp, build_torch_dmoe, mb_setup_args)",
      fix="an expansion_ratio whose product with d_model is whole, or ffn_config.ffn_hidden_size")
def fractional_ffn_hidden(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Hit]:
    model = section(config, "model")
    d_model = as_int(model.get("d_model", MPT_DEFAULTS["d_model"]))
    hidden = _ratio_hidden(model, d_model) if _is_mpt(model) and d_model is not None else None
    if hidden is not None and not _whole(hidden):
        yield Hit("model.expansion_ratio", f"d_model * expansion_ratio is {hidden}, not a whole "
                  "number: LLM-Foundry raises '`d_model * expansion_ratio` must be an integer' "
                  "building the model")


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


@rule("FP8024", "error", "model keys MPT silently ignores (did-you-mean)",
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
        hint = did_you_mean(key, known)
        if _asks_for_te(value):
            yield Hit(f"{prefix}.{key}", f"MPT ignores `{key}`, so the TE layers it asks for are "
                      "never built and FP8 does not run as written" + hint)
        else:
            yield Hit(f"{prefix}.{key}", f"MPT ignores `{key}` (kept as an unused attribute)"
                      + hint, severity="warning")


@rule("FP8029", "error", "`loss_fn: fused_crossentropy` (MPT's default) without flash-attn's "
      "cross entropy installed",
      why="ComposerMPTCausalLM defaults loss_fn to fused_crossentropy and raises 'Fused Cross "
      "Entropy is not installed' when flash_attn.losses.cross_entropy cannot be imported. "
      "Judged against the packages where the check runs: an error in `fp8_lint` (the training "
      "machine), a warning in `foundry-fp8 lint` (which may run elsewhere).",
      source=f"{FOUNDRY} llmfoundry/models/mpt/modeling_mpt.py ComposerMPTCausalLM.__init__",
      fix="set model.loss_fn: torch_crossentropy, or install flash-attn on the training machine")
def fused_cross_entropy(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Hit]:
    model = section(config, "model")
    snapshot = ctx.snapshot
    if not _is_mpt(model) or snapshot is None \
            or snapshot.flash_attn_cross_entropy:
        return
    if model.get("loss_fn", "fused_crossentropy") != "fused_crossentropy":
        return
    key = "model.loss_fn" if "loss_fn" in model else "model"
    said = "loss_fn fused_crossentropy" if "loss_fn" in model else \
        "no loss_fn, so MPT's default fused_crossentropy,"
    yield Hit(key, f"{said} needs flash-attn's cross entropy, which is not installed here: "
              "LLM-Foundry raises when it builds the model",
              severity="error" if ctx.scope == "run" else "warning")


#: MPT's norm types that are nn.LayerNorm subclasses (llmfoundry/models/layers/norm.py), the
#: only norms te_swap fuses; MPT's default is low_precision_layernorm.
_LAYERNORMS = ("layernorm", "low_precision_layernorm")


def _te_swap_fuses(model: Mapping[str, Any]) -> bool:
    """Whether te_swap's fuse_ln_mlp fuses this model's blocks, read from the config as
    `swap._fusable_mlp` reads a built block: an MPT whose MLP (mptmlp, torch linears, GELU)
    follows a LayerNorm with a bias."""
    return (_is_mpt(model) and get(model, "ffn_config.ffn_type") in (None, "mptmlp")
            and fc_type_name(model) in (None, "torch")
            and get(model, "ffn_config.ffn_act_fn.name") in (None, "gelu")
            and model.get("norm_type", _LAYERNORMS[1]) in _LAYERNORMS
            and model.get("no_bias") is not True)


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
      "the LLM-Foundry installed where the linter runs; a warning when it is not installed. "
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
      "with model.init_device: cpu (docs/te_swap.md)")
def te_layernorm_mlp_init(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Hit]:
    snapshot = ctx.snapshot
    scheme = section(section(config, "model"), "init_config").get("name", MPT_DEFAULT_INIT_SCHEME)
    if snapshot is None or (isinstance(scheme, str)
                            and scheme in INIT_SCHEMES_WITHOUT_MODULE_INITS):
        return
    fails = te_ln_mlp_init_fails(snapshot.llmfoundry)
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
                      f"{snapshot.llmfoundry or 'not installed'}", severity="warning", fix=fix)
