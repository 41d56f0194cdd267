"""Lint rules for LLM-Foundry train configs: pure Python over a resolved dict, no torch.

Each rule is a function `(config, context) -> findings`, registered in RULES with its id, the
severity it reports at most, what it catches, why (with the source the fact was verified in)
and the usual fix. `docs/rules.md` is generated from RULES (`python -m foundry_fp8.lint.docs`).
Our entries' options are checked by `foundry_fp8.lint.values` with the option dataclasses the
constructors build (`foundry_fp8.options`), so the linter and the run agree.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from foundry_fp8.lint.entries import NO_DEFAULT, UNREADABLE, our_entries
from foundry_fp8.lint.known import (
    FILLED_KEYS,
    FP8_DTYPE_NAMES,
    FSDP2_CONFIG_KEYS,
    FSDP_CONFIG_KEYS,
    MAPPING,
    MAPPINGS,
    MIXED_PRECISION_DTYPE_KEYS,
    MIXED_PRECISION_MODES,
    MPT_DEFAULTS,
    NULL,
    PRECISIONS,
    REENTRANT_DEFAULT,
    SCALARS,
    SECTION_SHAPES,
    STRING,
    TEXT_LOADER_DEFAULTS,
    TORCH_DTYPE_NAMES,
    TRAIN_CONFIG_KEYS,
    did_you_mean,
)
from foundry_fp8.lint.values import option_problems
from foundry_fp8.shapes import dim_fits_fp8, tokens_fit_fp8

Severity = Literal["error", "warning", "info"]
SEVERITIES: tuple[Severity, ...] = ("error", "warning", "info")


@dataclass(frozen=True)
class Finding:
    rule: str
    severity: Severity
    key: str  # dotted key path
    message: str
    fix: str


@dataclass(frozen=True)
class LintContext:
    """What the config alone does not say.

    `scope`: "file" for a YAML as written; "run" for the config LLM-Foundry hands to
    `fp8_lint` (its logged config, which also holds flattened `metadata` keys and its own
    additions, so rules about the file's top-level keys do not apply). `fsdp_version`: the
    FSDP Composer will use (Composer picks 2 only when the environment has FSDP_VERSION=2).
    `env_keys`: keys whose value uses `${oc.env:...}` in the file.
    """

    scope: Literal["file", "run"] = "file"
    fsdp_version: int = 1
    env_keys: tuple[str, ...] = ()


@dataclass(frozen=True)
class Rule:
    id: str
    severity: Severity  # the most severe level it reports
    summary: str  # what it catches, one line
    rationale: str
    source: str  # where the fact was verified
    fix: str
    check: Callable[[Mapping[str, Any], LintContext], Iterator[Finding]]
    scope: Literal["any", "file"] = "any"


def fsdp_version_from_env(environ: Mapping[str, str]) -> int:
    """The FSDP version Composer's Trainer will use (trainer.py, `_parse_parallelism_config`)."""
    return 2 if environ.get("FSDP_VERSION", "1") == "2" else 1


# -- reading the config without ever crashing on odd input -----------------------------------

def _get(config: Any, path: str) -> Any:
    node: Any = config
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


def _section(config: Any, key: str) -> Mapping[str, Any]:
    """A sub-mapping, or an empty one when absent or of the wrong type (never crash on input)."""
    value = config.get(key) if isinstance(config, Mapping) else None
    return value if isinstance(value, Mapping) else {}


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _precision(config: Mapping[str, Any]) -> str:
    value = config.get("precision", "amp_bf16")  # TrainConfig's default
    return value.lower() if isinstance(value, str) else ""


def _is_fp8(config: Mapping[str, Any]) -> bool:
    return _precision(config) == "amp_fp8"


def _fc_type_name(model: Mapping[str, Any]) -> Any:
    fc_type = model.get("fc_type")
    return fc_type.get("name") if isinstance(fc_type, Mapping) else fc_type


def _native_te_layers(config: Mapping[str, Any]) -> bool:
    """The model itself builds TE layers: `fc_type: te` (either form) or `te_ln_mlp`."""
    model = _section(config, "model")
    return (_fc_type_name(model) == "te"
            or _get(model, "ffn_config.ffn_type") == "te_ln_mlp")


def _te_swap(config: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """te_swap's options (defaults filled in from its signature), None when not used."""
    algorithms = _section(config, "algorithms")
    if "te_swap" not in algorithms:
        return None
    entry = our_entries().get(("algorithms", "te_swap"))
    defaults = {n: o.default for n, o in entry.options.items()
                if o.default not in (NO_DEFAULT, UNREADABLE)} if entry else {}
    given = algorithms["te_swap"]
    return {**defaults, **(given if isinstance(given, Mapping) else {})}


def _has_fp8_layers(config: Mapping[str, Any]) -> bool:
    return _native_te_layers(config) or _te_swap(config) is not None


def _fsdp(config: Mapping[str, Any]) -> Mapping[str, Any]:
    return _section(config, "fsdp_config")


def _recomputes(fsdp: Mapping[str, Any]) -> bool:
    """Composer wraps blocks for recompute with either setting (dist_strategy.py)."""
    return bool(fsdp.get("activation_checkpointing") or fsdp.get("activation_cpu_offload"))


def _fp8_state_fixes_recompute(config: Mapping[str, Any]) -> bool:
    """fp8_state sets te_checkpoint_wrapper and non-reentrant recompute at INIT (FSDP1, TE)."""
    return "fp8_state" in _section(config, "callbacks")


# -- rules ------------------------------------------------------------------------------------

def fp8_without_fp8_layers(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Finding]:
    if _is_fp8(config) and not _has_fp8_layers(config):
        yield Finding("FP8001", "error", "precision",
                      "precision amp_fp8, but no layer would run in FP8 (no fc_type: te, no "
                      "ffn_type: te_ln_mlp, no te_swap algorithm)",
                      "add `algorithms: {te_swap: {}}` or `model.fc_type: te`")


def recompute_without_te_checkpoint(config: Mapping[str, Any],
                                    ctx: LintContext) -> Iterator[Finding]:
    fsdp = _fsdp(config)
    if not (_is_fp8(config) and ctx.fsdp_version == 1 and fsdp.get("activation_checkpointing")
            and not fsdp.get("te_checkpoint_wrapper")):
        return
    fix = "set fsdp_config.te_checkpoint_wrapper: true and activation_checkpointing_reentrant: false"
    if _fp8_state_fixes_recompute(config):
        yield Finding("FP8002", "info", "fsdp_config.activation_checkpointing",
                      "fp8_state switches on te_checkpoint_wrapper with non-reentrant recompute at "
                      "INIT (FSDP1 and TE >= 1.12; otherwise it refuses the run)", fix)
    else:
        yield Finding("FP8002", "error", "fsdp_config.activation_checkpointing",
                      "activation checkpointing with FP8 recomputes TE layers outside the FP8 "
                      "autocast (the recompute differs from the forward)", fix)


def _reentrant(config: Mapping[str, Any]) -> bool:
    """The reentrant setting Composer ends up with. Composer defaults it to true;
    LLM-Foundry's validate_config turns an explicit true into false for `fc_type: te` (the
    string only) or a `te` ffn_type when activation_checkpointing is on."""
    fsdp = _fsdp(config)
    value = fsdp.get("activation_checkpointing_reentrant", REENTRANT_DEFAULT)
    model = _section(config, "model")
    foundry_sees_te = (model.get("fc_type", "torch") == "te"
                       or "te" in str(_get(model, "ffn_config.ffn_type") or "mptmlp"))
    if value is True and "activation_checkpointing_reentrant" in fsdp and foundry_sees_te \
            and fsdp.get("activation_checkpointing") is True:
        return False
    return bool(value)


def te_wrapper_reentrant(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Finding]:
    fsdp = _fsdp(config)
    if not (_is_fp8(config) and ctx.fsdp_version == 1 and fsdp.get("te_checkpoint_wrapper")
            and _recomputes(fsdp) and _reentrant(config)):
        return
    fix = "set fsdp_config.activation_checkpointing_reentrant: false"
    if _fp8_state_fixes_recompute(config):
        yield Finding("FP8003", "info", "fsdp_config.te_checkpoint_wrapper",
                      "fp8_state sets activation_checkpointing_reentrant: false at INIT", fix)
    else:
        yield Finding("FP8003", "error", "fsdp_config.te_checkpoint_wrapper",
                      "te_checkpoint_wrapper needs non-reentrant checkpointing, and Composer "
                      "defaults activation_checkpointing_reentrant to true (it asserts at FSDP "
                      "wrapping)", fix)


def te_ln_mlp_with_act_fn(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Finding]:
    ffn = _section(_section(config, "model"), "ffn_config")
    if ffn.get("ffn_type") == "te_ln_mlp" and "ffn_act_fn" in ffn:
        yield Finding("FP8004", "error", "model.ffn_config.ffn_act_fn",
                      "te_ln_mlp does not take ffn_act_fn (LLM-Foundry raises 'Transformer "
                      "Engine block does not support custom activation functions')",
                      "remove ffn_act_fn; to pick TE's activation, set ffn_config.activation "
                      "(passed to te.LayerNormMLP, default gelu)")


def _ffn_hidden(model: Mapping[str, Any], d_model: int) -> tuple[str, int] | None:
    """(key, size) of the FFN hidden size as LLM-Foundry resolves it (ffn.py,
    resolve_ffn_hidden_size): ffn_config.ffn_hidden_size, else d_model * expansion_ratio."""
    given = _int(_get(model, "ffn_config.ffn_hidden_size"))
    if given is not None:
        return "model.ffn_config.ffn_hidden_size", given
    ratio = model.get("expansion_ratio", MPT_DEFAULTS["expansion_ratio"])
    if isinstance(ratio, (int, float)) and not isinstance(ratio, bool):
        hidden = d_model * ratio
        if float(hidden).is_integer():
            return "model.expansion_ratio", int(hidden)
    return None


def gemm_dims(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Finding]:
    swap = _te_swap(config)
    native = _native_te_layers(config)
    if not (native or swap is not None):
        return
    model = _section(config, "model")
    d_model = _int(model.get("d_model", MPT_DEFAULTS["d_model"]))
    if d_model is None:
        return
    if not dim_fits_fp8(d_model):
        yield Finding("FP8005", "error", "model.d_model",
                      f"d_model {d_model} is not divisible by 16, as TE's FP8 GEMMs require"
                      + ("" if native else " (te_swap would keep every block layer out of FP8)"),
                      "use a multiple of 16")
    hidden = _ffn_hidden(model, d_model)
    if hidden and not dim_fits_fp8(hidden[1]):
        if native:
            yield Finding("FP8005", "error", hidden[0], f"FFN hidden size {hidden[1]} is not "
                          "divisible by 16, as TE's FP8 GEMMs require",
                          "choose expansion_ratio / ffn_hidden_size giving a multiple of 16")
        else:
            yield Finding("FP8005", "warning", hidden[0], f"FFN hidden size {hidden[1]} is not "
                          "divisible by 16: te_swap keeps the FFN layers in high precision",
                          "choose expansion_ratio / ffn_hidden_size giving a multiple of 16")
    vocab = _int(model.get("vocab_size", MPT_DEFAULTS["vocab_size"]))
    converts_head = (swap is not None and swap.get("keep_lm_head") is False
                     and model.get("tie_word_embeddings") is False)
    if converts_head and vocab is not None and not dim_fits_fp8(vocab):
        yield Finding("FP8005", "warning", "model.vocab_size",
                      f"vocab_size {vocab} is not divisible by 16: te_swap keeps the LM head in "
                      "high precision although keep_lm_head is false", "pad vocab_size to a "
                      "multiple of 16 (MPT's default 50368 is one)")


def tokens_per_microbatch(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Finding]:
    swap = _te_swap(config)
    te_layers = _native_te_layers(config) or (swap is not None and swap.get("backend") == "te")
    if not (_is_fp8(config) and te_layers):
        return
    micro = _int(config.get("device_train_microbatch_size"))
    seq = _int(config.get("max_seq_len"))
    if micro is not None and seq is not None and not tokens_fit_fp8(micro * seq):
        yield Finding("FP8006", "error", "device_train_microbatch_size",
                      f"{micro} x {seq} tokens per micro-batch is not divisible by 8, as TE's FP8 "
                      "GEMMs require", "choose a micro-batch size or max_seq_len that fixes it")


#: Keys that configs written for older Composer / LLM-Foundry or for DeepSpeed carry, which
#: this Composer/LLM-Foundry refuses; the message says what replaced them.
RETIRED_TOP_LEVEL = {
    "precision_config": (
        "LLM-Foundry 0.22's train config has no precision_config (Composer's Trainer argument "
        "is not reachable from the YAML)",
        "give the FP8 recipe as `algorithms: {te_swap: {fp8_recipe: {...}}}`"),
    "deepspeed_config": (
        "Composer 0.32 has no DeepSpeed support left and LLM-Foundry 0.22's train config has no "
        "deepspeed_config", "shard with `fsdp_config` instead"),
}
RETIRED_FSDP = {
    "device_mesh": (
        "Composer raises: giving the device mesh in the FSDP config was deprecated in 0.24.0",
        "use data_parallel_shard_degree and/or data_parallel_replicate_degree"),
}


def retired_keys(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Finding]:
    for key, (message, fix) in RETIRED_TOP_LEVEL.items():
        if key in config:
            yield Finding("FP8007", "error", key, message, fix)
    if ctx.fsdp_version == 1:
        for key, (message, fix) in RETIRED_FSDP.items():
            if key in _fsdp(config):
                yield Finding("FP8007", "error", f"fsdp_config.{key}", message, fix)


def recipe_keys(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Finding]:
    yield from _option_findings(config, "FP8008", ("recipe",))


def unknown_top_level_keys(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Finding]:
    for key in config:
        if not isinstance(key, str):
            continue  # FP8022: keys must be strings
        if key not in TRAIN_CONFIG_KEYS and key not in RETIRED_TOP_LEVEL:
            yield Finding("FP8009", "error", key,
                          f"LLM-Foundry 0.22 refuses unknown top-level key `{key}`"
                          + did_you_mean(key, TRAIN_CONFIG_KEYS),
                          "fix the spelling, or move the value under `variables:`")


def _item_fits(item: Any, shape: str) -> bool:
    """An item of a list section: a mapping, or a scalar omegaconf makes a string (bool too)."""
    return isinstance(item, Mapping) if shape == MAPPINGS else isinstance(item, (str, int, float))


def _shape_fits(value: Any, shape: str) -> bool:
    if shape == NULL:
        return value is None
    if shape == STRING:
        return isinstance(value, str)
    if shape == MAPPING:
        return isinstance(value, Mapping)
    return isinstance(value, list) and all(_item_fits(v, shape) for v in value)


def _shown(value: Any) -> str:
    return "null" if value is None else f"{type(value).__name__} {value!r:.60}"


def _wrong_shape(key: str, value: Any, shapes: tuple[str, ...]) -> Finding:
    listed = next((s for s in shapes if s in (MAPPINGS, SCALARS)), None)
    if listed and isinstance(value, list):  # the list is fine, one of its items is not
        bad = next(i for i, v in enumerate(value) if not _item_fits(v, listed))
        item = "a mapping" if listed == MAPPINGS else "a string"
        return Finding("FP8022", "error", f"{key}.{bad}", f"each item of `{key}` must be {item}, "
                       f"got {_shown(value[bad])}", f"write item {bad} of {key} as {item}")
    what = shapes[0] if len(shapes) == 1 else f"{', '.join(shapes[:-1])} or {shapes[-1]}"
    return Finding("FP8022", "error", key, f"`{key}` must be {what}, got {_shown(value)}",
                   f"write {key} as {shapes[0]}")


def _non_string_keys(prefix: str, mapping: Mapping[Any, Any]) -> Iterator[Finding]:
    for key in mapping:
        if not isinstance(key, str):
            yield Finding("FP8022", "error", f"{prefix}{key}",
                          f"key `{key}` is read as {type(key).__name__}, not a string (YAML reads "
                          "unquoted numbers, true/false, yes/no and on/off so); LLM-Foundry's "
                          "config keys must be strings", "quote the key")


def section_shapes(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Finding]:
    """Sections whose YAML shape TrainConfig refuses, keys that are not strings where
    LLM-Foundry reads them (top level, a section's own keys), and keys it fills itself."""
    yield from _non_string_keys("", config)
    for key, shapes in SECTION_SHAPES.items():
        value = config.get(key)
        if key not in config or any(_shape_fits(value, shape) for shape in shapes):
            mappings = [value] if isinstance(value, Mapping) else \
                value if _shape_fits(value, MAPPINGS) else []
            for index, mapping in enumerate(mappings):
                prefix = f"{key}." if isinstance(value, Mapping) else f"{key}.{index}."
                yield from _non_string_keys(prefix, mapping)
        else:
            yield _wrong_shape(key, value, shapes)
    for key, (source, even_null) in FILLED_KEYS.items():
        if key in config and source in config and (even_null or config[source] is not None):
            yield Finding("FP8022", "error", key,
                          f"LLM-Foundry fills `{key}` from `{source}` itself and refuses both in "
                          "one config ('should not be set')", f"remove {key}; give it as {source}")


def unknown_fsdp_keys(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Finding]:
    known = FSDP_CONFIG_KEYS if ctx.fsdp_version == 1 else FSDP2_CONFIG_KEYS
    other = FSDP2_CONFIG_KEYS if ctx.fsdp_version == 1 else FSDP_CONFIG_KEYS
    retired = RETIRED_FSDP if ctx.fsdp_version == 1 else {}
    for key in _fsdp(config):
        key = str(key)
        if key in known or key in retired or (ctx.fsdp_version == 2 and key in TE_FSDP_FLAGS):
            continue  # FP8015 reports te_* flags under FSDP2
        if key in other:
            yield Finding("FP8010", "warning", f"fsdp_config.{key}",
                          f"only FSDP{3 - ctx.fsdp_version} reads `{key}`; Composer ignores it "
                          f"under FSDP{ctx.fsdp_version}",
                          "remove it, or run the FSDP version that reads it (FSDP_VERSION)")
        else:
            yield Finding("FP8010", "error", f"fsdp_config.{key}",
                          f"Composer's FSDP{ctx.fsdp_version} config has no `{key}`; it would be "
                          "silently ignored" + did_you_mean(key, known),
                          "fix the spelling or remove the key")


def precision_value(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Finding]:
    if "precision" in config and _precision(config) not in PRECISIONS:
        value = config["precision"]
        yield Finding("FP8011", "error", "precision",
                      f"Composer has no precision {value!r}" + did_you_mean(str(value).lower(),
                                                                            PRECISIONS),
                      f"use one of {', '.join(PRECISIONS)} (amp_fp8 for FP8)")


def fsdp_mixed_precision(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Finding]:
    fsdp = _fsdp(config)
    if "mixed_precision" not in fsdp:
        return
    value = fsdp["mixed_precision"]
    key = "fsdp_config.mixed_precision"
    if isinstance(value, str):
        if value.upper() not in MIXED_PRECISION_MODES:
            yield Finding("FP8012", "error", key, f"Composer cannot interpret mixed_precision "
                          f"{value!r}" + did_you_mean(value.upper(), MIXED_PRECISION_MODES),
                          "use DEFAULT, PURE, FULL or a {param_dtype, reduce_dtype, buffer_dtype} "
                          "mapping")
        return
    if not isinstance(value, Mapping):
        yield Finding("FP8012", "error", key, f"Composer cannot interpret mixed_precision "
                      f"{value!r}", "use DEFAULT, PURE, FULL or a dtype mapping")
        return
    for name, dtype in value.items():
        sub = f"{key}.{name}"
        if name not in MIXED_PRECISION_DTYPE_KEYS:
            yield Finding("FP8012", "error", sub, f"Composer reads only "
                          f"{', '.join(MIXED_PRECISION_DTYPE_KEYS)}; `{name}` is ignored"
                          + did_you_mean(str(name), MIXED_PRECISION_DTYPE_KEYS),
                          "fix the spelling or remove the key")
        elif dtype is not None and dtype not in TORCH_DTYPE_NAMES:
            yield Finding("FP8012", "error", sub, f"Composer does not know dtype {dtype!r}",
                          "use float32, bfloat16 or float16")
        elif dtype in FP8_DTYPE_NAMES:
            yield Finding("FP8012", "warning", sub, f"{name} {dtype!r} means bfloat16: FSDP "
                          "never keeps or communicates parameters in FP8 (only TE layers compute "
                          "in FP8)", f"write {name}: bfloat16 to say what happens")


def emulated_recompute(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Finding]:
    swap = _te_swap(config)
    fsdp = _fsdp(config)
    if swap is not None and swap.get("backend") == "emulate" and _recomputes(fsdp):
        key = "fsdp_config.activation_checkpointing" if fsdp.get("activation_checkpointing") \
            else "fsdp_config.activation_cpu_offload"
        yield Finding("FP8013", "error", key,
                      "FSDP activation checkpointing recomputes te_swap's emulated FP8 layers "
                      "outside te_swap's FP8 autocast (fp8_state refuses this run)",
                      "turn it off, or checkpoint blocks with foundry_fp8.emulate.fp8_checkpoint")


#: FSDPConfig flags Composer reads only under amp_fp8 and only in FSDP1 (dist_strategy.py).
TE_FSDP_FLAGS = ("te_checkpoint_wrapper", "te_shard_fp8_weight")


def te_fsdp_flags_without_fp8(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Finding]:
    if _is_fp8(config):
        return
    for key in TE_FSDP_FLAGS:
        if _fsdp(config).get(key):
            yield Finding("FP8014", "warning", f"fsdp_config.{key}",
                          f"Composer ignores {key} unless precision is amp_fp8",
                          "remove it, or set precision: amp_fp8")


def te_flags_need_fsdp1(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Finding]:
    if ctx.fsdp_version != 2:
        return
    fsdp = _fsdp(config)
    if _is_fp8(config) and _has_fp8_layers(config) and fsdp.get("activation_checkpointing"):
        yield Finding("FP8015", "error", "fsdp_config.activation_checkpointing",
                      "FSDP_VERSION=2: Composer's FSDP2 recompute is not TE-aware and it has no "
                      "te_checkpoint_wrapper, so TE layers are recomputed outside FP8",
                      "run FSDP1 (unset FSDP_VERSION) or turn activation_checkpointing off")
    for key in TE_FSDP_FLAGS:
        if fsdp.get(key):
            yield Finding("FP8015", "warning", f"fsdp_config.{key}",
                          f"FSDP_VERSION=2: Composer drops {key} (FSDP1 only)",
                          "run FSDP1 (unset FSDP_VERSION) or remove it")


def fc_type_dict(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Finding]:
    fc_type = _section(config, "model").get("fc_type")
    if isinstance(fc_type, Mapping) and fc_type.get("name") == "te":
        yield Finding("FP8016", "warning", "model.fc_type",
                      "LLM-Foundry's validate_config compares fc_type with the string 'te': in "
                      "mapping form it warns 'fp8 only supported for te.Linear layers' and skips "
                      "its reentrant-checkpointing fix for TE layers",
                      "write `fc_type: te` unless you pass te.Linear arguments; then set "
                      "fsdp_config.activation_checkpointing_reentrant: false yourself")


def oc_env_interpolation(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Finding]:
    for key in ctx.env_keys:
        yield Finding("FP8017", "error", key,
                      "`llmfoundry train` (train_from_yaml) clears omegaconf's oc.env resolver, "
                      "so ${oc.env:...} fails to resolve",
                      "put the value in the YAML or pass it as a command-line override "
                      "(`llmfoundry train x.yaml key=value`)")


_LOADERS = ("train_loader", "eval_loader")


def _text_loaders(config: Mapping[str, Any]) -> Iterator[tuple[str, Mapping[str, Any]]]:
    for name in (*_LOADERS, "eval_loaders"):
        value = config.get(name)
        items = [(name, value)] if isinstance(value, Mapping) else \
            [(f"{name}.{i}", v) for i, v in enumerate(value)] if isinstance(value, list) else []
        for key, loader in items:
            if isinstance(loader, Mapping) and loader.get("name") == "text":
                yield key, loader


def text_loader_without_workers(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Finding]:
    # build_text_dataloader (llmfoundry/data/text_data.py) defaults prefetch_factor=2 and
    # persistent_workers=True; torch's DataLoader refuses both with num_workers=0.
    for key, loader in _text_loaders(config):
        if loader.get("num_workers") != 0:
            continue
        wanted = {"prefetch_factor": "null", "persistent_workers": "false"}
        for option, default in TEXT_LOADER_DEFAULTS.items():
            value = loader.get(option, default)
            # torch refuses any prefetch_factor but None, and any truthy persistent_workers
            if (value is not None) if option == "prefetch_factor" else bool(value):
                where = f"{key}.{option}" if option in loader else f"{key}.num_workers"
                yield Finding("FP8018", "error", where,
                              f"text loader with num_workers: 0 needs {option}: "
                              f"{wanted[option]} (LLM-Foundry's default is {default}; torch's "
                              "DataLoader raises)", f"set {key}.{option}: {wanted[option]}")


def _entry_items(config: Mapping[str, Any]) -> Iterator[tuple[str, Any, Any]]:
    """(key, entry, options) for each of our entries the config uses."""
    for (section, name), entry in our_entries().items():
        block = _section(config, section)
        if name in block:
            yield f"{section}.{name}", entry, block[name]


def _option_findings(config: Mapping[str, Any], rule: str,
                     kinds: tuple[str, ...]) -> Iterator[Finding]:
    """Our entries' option problems of these kinds (foundry_fp8.lint.values)."""
    for key, entry, options in _entry_items(config):
        if isinstance(options, Mapping):
            for problem in option_problems(entry, options):
                if problem.kind in kinds:
                    yield Finding(rule, "error", f"{key}.{problem.option}", problem.message,
                                  problem.fix)


def entry_options_unknown(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Finding]:
    for key, entry, options in _entry_items(config):
        if options is not None and not isinstance(options, Mapping):
            yield Finding("FP8019", "error", key, f"{entry.name}'s options must be a mapping, "
                          f"got {type(options).__name__}", f"write `{entry.name}: {{}}`")
    yield from _option_findings(config, "FP8019", ("unknown", "reserved"))


def entry_option_types(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Finding]:
    yield from _option_findings(config, "FP8020", ("type",))


def entry_option_values(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Finding]:
    yield from _option_findings(config, "FP8023", ("value",))


def te_swap_without_amp_fp8(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Finding]:
    swap = _te_swap(config)
    if swap is not None and swap.get("backend") == "te" and not _is_fp8(config) \
            and _precision(config) in PRECISIONS:
        yield Finding("FP8021", "error", "algorithms.te_swap",
                      f"te_swap's backend te converts layers to TE, which computes in FP8 only "
                      f"under precision amp_fp8, not {_precision(config)}; te_swap refuses the "
                      "run at INIT", "set precision: amp_fp8, or te_swap backend: emulate")


COMPOSER = "Composer 0.32.1"
FOUNDRY = "LLM-Foundry 0.22.0"

RULES = [
    Rule("FP8001", "error", "`precision: amp_fp8` with nothing that would run in FP8",
         "Composer's amp_fp8 only enters TE's fp8_autocast, which changes TE modules alone; with "
         "no TE layer the run trains without FP8 behind one warning.",
         f"{COMPOSER} composer/core/precision.py get_precision_context; {FOUNDRY} "
         "llmfoundry/command_utils/train.py validate_config ('fp8 only supported for te.Linear "
         "layers'); foundry_fp8/swap.py would_run_fp8",
         "add `algorithms: {te_swap: {}}` or `model.fc_type: te`", fp8_without_fp8_layers),
    Rule("FP8002", "error", "FSDP activation checkpointing with FP8 but no `te_checkpoint_wrapper`",
         "Without te_checkpoint_wrapper Composer recomputes blocks with torch's checkpoint, "
         "which runs TE modules outside fp8_autocast: the recompute differs from the forward. "
         "Reported as info when fp8_state is in the callbacks, which sets it at INIT.",
         f"{COMPOSER} composer/distributed/dist_strategy.py prepare_fsdp_module; TE PR "
         "https://github.com/NVIDIA/TransformerEngine/pull/24 (recompute outside fp8_autocast); "
         "TE issue https://github.com/NVIDIA/TransformerEngine/issues/1190; "
         "foundry_fp8/composer/state.py recompute_settings",
         "fsdp_config: {te_checkpoint_wrapper: true, activation_checkpointing_reentrant: false}",
         recompute_without_te_checkpoint),
    Rule("FP8003", "error", "`te_checkpoint_wrapper` with reentrant checkpointing "
         "(Composer's default)",
         "Composer asserts 'TE checkpoint only works with non-reentrant checkpointing' when it "
         "wraps blocks under amp_fp8, and FSDPConfig defaults activation_checkpointing_reentrant "
         "to true. LLM-Foundry flips an explicit true to false only for `fc_type: te` (string) "
         "or a te ffn_type. Info when fp8_state is in the callbacks (it sets it at INIT).",
         f"{COMPOSER} composer/distributed/dist_strategy.py prepare_fsdp_module and "
         f"composer/utils/parallelism.py FSDPConfig; {FOUNDRY} llmfoundry/command_utils/train.py "
         "validate_config",
         "fsdp_config.activation_checkpointing_reentrant: false", te_wrapper_reentrant),
    Rule("FP8004", "error", "`ffn_type: te_ln_mlp` with `ffn_act_fn`",
         "LLM-Foundry raises for ffn_act_fn with te_ln_mlp; te.LayerNormMLP picks its "
         "activation from its own `activation` argument (default gelu), which LLM-Foundry "
         "passes through from ffn_config.",
         f"{FOUNDRY} llmfoundry/models/mpt/configuration_mpt.py _validate_config and "
         "llmfoundry/models/layers/ffn.py build_te_ln_mlp; TE 2.8 "
         "transformer_engine/pytorch/module/layernorm_mlp.py LayerNormMLP.__init__",
         "remove ffn_act_fn (or set ffn_config.activation)", te_ln_mlp_with_act_fn),
    Rule("FP8005", "error", "GEMM dims (d_model, FFN hidden size, vocab when te_swap converts "
         "the LM head) that break TE's FP8 shape rule",
         "TE asserts before an FP8 GEMM that the input's and weight's last dim is divisible by "
         "16 and the product of the other dims by 8. TE layers the model builds itself "
         "(fc_type: te, te_ln_mlp) then fail at the first forward (error); te_swap keeps such "
         "layers in high precision (warning), and with d_model off no block layer is left.",
         "TE 2.8 transformer_engine/pytorch/utils.py assert_dim_for_fp8_exec (called by Linear, "
         f"LayerNormLinear, LayerNormMLP); {FOUNDRY} llmfoundry/models/layers/ffn.py "
         "resolve_ffn_hidden_size; foundry_fp8/shapes.py, foundry_fp8/swap.py _gemm_reason",
         "use multiples of 16", gemm_dims),
    Rule("FP8006", "error", "tokens per micro-batch not divisible by 8 with TE layers in FP8",
         "A GEMM input is (micro-batch x max_seq_len, features): TE asserts the leading dims' "
         "product is divisible by 8.",
         "TE 2.8 transformer_engine/pytorch/utils.py assert_dim_for_fp8_exec",
         "pick device_train_microbatch_size and max_seq_len whose product is a multiple of 8",
         tokens_per_microbatch),
    Rule("FP8007", "error", "keys this Composer / LLM-Foundry no longer accept "
         "(`precision_config`, `deepspeed_config`, `fsdp_config.device_mesh`)",
         "LLM-Foundry refuses top-level keys outside its TrainConfig; Composer removed DeepSpeed "
         "and raises on a device mesh in the FSDP config. The message names the replacement "
         "(for precision_config: our te_swap fp8_recipe).",
         f"{FOUNDRY} llmfoundry/utils/config_utils.py TrainConfig and "
         f"make_dataclass_and_log_config; {COMPOSER} composer/utils/parallelism.py "
         "FSDPConfig.__init__, composer/trainer/trainer.py (no deepspeed_config); "
         "https://github.com/mosaicml/composer/pull/3732 (DeepSpeed removed)",
         "see the message", retired_keys),
    Rule("FP8008", "error", "FP8 recipe problems in te_swap's `fp8_recipe` or fp8_stats' "
         "`recipe` (pure E5M2, keys TE removed such as `interval`, unknown keys and values)",
         "Shared with foundry_fp8.recipe, which te_swap's and fp8_stats' option dataclasses "
         "use (fp8_stats' `recipe` is a scaling name or a recipe mapping), so the linter and "
         "the run agree. margin and amax_history_len have bounds (recipe.MAX_MARGIN, "
         "MAX_HISTORY).",
         "foundry_fp8/recipe.py recipe_problems (TE's DelayedScaling; TE 2.20 "
         "transformer_engine/common/recipe/delayed_scaling.cu:300 for the margin); "
         "foundry_fp8/options.py Recipe",
         "see the message", recipe_keys),
    Rule("FP8009", "error", "unknown top-level keys (did-you-mean)",
         "LLM-Foundry raises 'Unused parameters [...] found in cfg' for any top-level key that "
         "is not a TrainConfig field.",
         f"{FOUNDRY} llmfoundry/utils/config_utils.py make_dataclass_and_log_config, TrainConfig",
         "fix the spelling or move the value under `variables:`", unknown_top_level_keys,
         scope="file"),
    Rule("FP8010", "error", "unknown `fsdp_config` keys (did-you-mean)",
         "FSDPConfig.__init__ sets every keyword as an attribute, so a misspelled key (say "
         "`activation_checkpointing_reentrnt`) is silently ignored. Keys only the other FSDP "
         "version reads are warnings.",
         f"{COMPOSER} composer/utils/parallelism.py FSDPConfig, FSDP2Config.from_compatible_attrs",
         "fix the spelling or remove the key", unknown_fsdp_keys),
    Rule("FP8011", "error", "`precision` that Composer does not know (did-you-mean)",
         "Composer's Precision enum has fp32, amp_fp16, amp_bf16 and amp_fp8 (any case); "
         "anything else fails when the Trainer is built.",
         f"{COMPOSER} composer/core/precision.py Precision",
         "precision: amp_fp8 (or amp_bf16, amp_fp16, fp32)", precision_value),
    Rule("FP8012", "error", "FSDP `mixed_precision` Composer cannot interpret, or FP8 dtypes in it",
         "get_mixed_precision accepts DEFAULT, PURE, FULL or a mapping of param_dtype, "
         "reduce_dtype and buffer_dtype (other keys are ignored) and raises on other values; "
         "FP8 dtype names become bfloat16 (warning).",
         f"{COMPOSER} composer/distributed/mosaic_parallelism.py get_mixed_precision, "
         "_get_torch_dtype",
         "DEFAULT (the usual choice with amp_fp8), PURE or FULL", fsdp_mixed_precision),
    Rule("FP8013", "error", "FSDP activation checkpointing with te_swap's emulated backend",
         "The emulated FP8 autocast is entered around the model's forward, so a recompute in "
         "backward runs outside it; fp8_state refuses such runs.",
         "foundry_fp8/composer/te_swap.py (_enter/_exit hooks), foundry_fp8/composer/state.py "
         "recompute_settings",
         "turn FSDP activation checkpointing off; use foundry_fp8.emulate.fp8_checkpoint",
         emulated_recompute),
    Rule("FP8014", "warning", "`te_checkpoint_wrapper` / `te_shard_fp8_weight` without amp_fp8",
         "Composer reads both only when precision is amp_fp8; otherwise they do nothing.",
         f"{COMPOSER} composer/distributed/dist_strategy.py prepare_fsdp_module",
         "remove them, or set precision: amp_fp8", te_fsdp_flags_without_fp8),
    Rule("FP8015", "error", "FP8 FSDP settings under FSDP2 (FSDP_VERSION=2)",
         "Only FSDPConfig (FSDP1) has te_checkpoint_wrapper and te_shard_fp8_weight; under "
         "FSDP_VERSION=2 Composer drops them with a warning and recomputes with torch's "
         "checkpoint wrapper. The CLI reads FSDP_VERSION from its environment, as Composer does.",
         f"{COMPOSER} composer/trainer/trainer.py _parse_parallelism_config, "
         "composer/utils/parallelism.py FSDP2Config, composer/distributed/prepare_distributed.py",
         "use FSDP1 for FP8 with activation checkpointing", te_flags_need_fsdp1),
    Rule("FP8016", "warning", "`fc_type: {name: te}` (mapping form)",
         "MPT accepts the mapping, but LLM-Foundry's validate_config compares fc_type with the "
         "string 'te': it warns that fp8 needs te.Linear layers and does not make TE "
         "checkpointing non-reentrant.",
         f"{FOUNDRY} llmfoundry/command_utils/train.py validate_config, "
         "llmfoundry/models/mpt/configuration_mpt.py",
         "`fc_type: te`", fc_type_dict),
    Rule("FP8017", "error", "`${oc.env:...}` interpolations",
         "train_from_yaml calls omegaconf's clear_resolver('oc.env') before loading the YAML, so "
         "`llmfoundry train` fails with 'Unsupported interpolation type oc.env'.",
         f"{FOUNDRY} llmfoundry/command_utils/train.py train_from_yaml",
         "write the value, or pass it as a command-line override", oc_env_interpolation,
         scope="file"),
    Rule("FP8018", "error", "text loader with `num_workers: 0` but prefetch/persistent workers",
         "build_text_dataloader defaults prefetch_factor to 2 and persistent_workers to true, "
         "and torch's DataLoader raises for either with num_workers 0.",
         f"{FOUNDRY} llmfoundry/data/text_data.py build_text_dataloader; torch 2.7.0 "
         "torch/utils/data/dataloader.py DataLoader.__init__",
         "prefetch_factor: null and persistent_workers: false", text_loader_without_workers),
    Rule("FP8019", "error", "unknown options of our entries (te_swap, fp8_stats, fp8_state, "
         "fp8_lint, jsonl) (did-you-mean)",
         "LLM-Foundry passes an entry's mapping as keyword arguments, so an unknown option fails "
         "at construction. The option lists are the fields of our option dataclasses.",
         f"foundry_fp8/options.py ENTRIES; {FOUNDRY} "
         "llmfoundry/utils/builders.py build_callback (reserved train_config)",
         "fix the spelling", entry_options_unknown),
    Rule("FP8020", "error", "options of our entries with the wrong type (a `Literal` value "
         "outside its choices, `\"true\"` for a bool, `true` for an int)",
         "Checked by each option's declared check; a Literal admits only its values, a bool "
         "only true/false, an int neither a bool nor a float.",
         "foundry_fp8/options.py (the option dataclasses' fields)",
         "give a value of the annotated type", entry_option_types),
    Rule("FP8021", "error", "te_swap's `te` backend (its default) without amp_fp8",
         "TE layers compute in FP8 only inside Composer's amp_fp8 autocast; te_swap refuses the "
         "run at INIT when nothing would run in FP8.",
         "foundry_fp8/composer/te_swap.py TESwap._convert, foundry_fp8/swap.py would_run_fp8",
         "precision: amp_fp8, or te_swap backend: emulate", te_swap_without_amp_fp8),
    Rule("FP8022", "error", "a section in a shape LLM-Foundry refuses (`callbacks:` as a list, "
         "`icl_tasks:` as a mapping), a key that is not a string, or a key LLM-Foundry fills "
         "itself (`eval_loaders` next to `eval_loader`)",
         "make_dataclass_and_log_config builds TrainConfig through omegaconf's structured "
         "config, which refuses a section whose shape its field type does not admit "
         "(`dict[str, Any]`: a mapping with string keys; `list[dict[str, Any]]`; `list[str]`), "
         "and asserts that top-level keys are strings. It first accepts a list `eval_loader` "
         "(as eval_loaders) and a string `icl_tasks` or `eval_gauntlet` (a path, as "
         "icl_tasks_str / eval_gauntlet_str), refusing those filled keys next to their source.",
         f"{FOUNDRY} llmfoundry/utils/config_utils.py TrainConfig, "
         "make_dataclass_and_log_config, forbid_config_key; omegaconf 2.4 OmegaConf.structured",
         "write the section in one of the shapes the message names", section_shapes),
    Rule("FP8023", "error", "option values of our entries that their constructors refuse "
         "(negative counts, thresholds out of range, fp8_stats' `end` not after its `start`, "
         "regexes that do not compile, unknown choices such as `fail_on: warning`, unknown "
         "`{placeholders}` in paths)",
         "LLM-Foundry builds algorithms, callbacks and loggers before training, so a value of "
         "the right type that the constructor refuses still stops the run. Each option's "
         "check is declared once, on its field of a frozen options dataclass "
         "(foundry_fp8/options.py), which every constructor builds first, so the linter and "
         "the run agree; every wrong item of a list is reported at its own key.",
         "foundry_fp8/options.py (TESwapOptions, SwapConfig, FP8StatsOptions, Schedule, "
         "MonitorConfig, FP8StateOptions, FP8LintOptions, JSONLOptions); "
         f"{COMPOSER} composer/core/time.py Time.from_timestring (batch intervals read alike)",
         "see the message", entry_option_values),
]


def lint_config(config: Mapping[str, Any], context: LintContext | None = None) -> list[Finding]:
    """All findings for a resolved train config."""
    context = context or LintContext()
    if not isinstance(config, Mapping):
        return []
    return [finding for rule in RULES
            if rule.scope == "any" or context.scope == "file"
            for finding in rule.check(config, context)]
