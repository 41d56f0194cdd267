"""LLM-Foundry eval configs (`scripts/eval/yamls`: a `models:` list, no train loader), read by
`eval_from_yaml`. The train rules that read sections eval configs share (precision, fsdp_config,
callbacks, loggers) register `also=("eval",)`; these are the eval config's own, and the twins of
the train rules about the model section, run on each model an eval config builds."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from foundry_fp8.lint.config import is_fp8, native_te_layers
from foundry_fp8.lint.known import (
    EVAL_CONFIG_KEYS,
    EVAL_MODEL_KEYS,
    EVAL_MODEL_REQUIRED_KEYS,
    EVAL_POPPED_MODEL_KEYS,
    EVAL_REQUIRED_KEYS,
    EVAL_SCALAR_TYPES,
    EVAL_SECTION_SHAPES,
    FOUNDRY_FSDP_KEEPS_MASTER_DTYPES,
    MPT_MODEL_NAMES,
    TRAIN_CONFIG_KEYS,
    did_you_mean,
)
from foundry_fp8.lint.registry import Hit, LintContext, join_key, rule
from foundry_fp8.lint.rules.fsdp import (
    AMP_FP8_DTYPE_SOURCE,
    LOW_PARAM_DTYPES,
    flash_note,
    fsdp_param_dtype,
)
from foundry_fp8.lint.rules.model import (
    HF_CAUSAL_LM_SOURCE,
    MPT_SEQ_LEN_FIX,
    MPT_SEQ_LEN_SOURCE,
    fractional_ffn_hidden,
    hf_model_key_hits,
    model_key_hits,
    mpt_refuses_values,
    mpt_sub_configs,
    past_mpt_max,
)
from foundry_fp8.lint.rules.ours import sdpa_without_our_entries
from foundry_fp8.lint.rules.train import (
    FOUNDRY,
    filled_key_hits,
    loader_sections,
    null_name_hit,
    scalar_type_hits,
    shape_hits,
    shown,
    unnamed,
)

EVAL_SOURCE = f"{FOUNDRY} llmfoundry/command_utils/eval.py"
#: Keys an eval config reads at the top level before any model is built: the sections a train
#: rule about the model section also reads (our entries' sections, `code_paths`, `precision`).
_SHARED = ("precision", "callbacks", "loggers", "code_paths")
#: Eval-only keys that, next to a top-level `model:`, mark the train.py shape of an eval config.
_EVAL_MARKERS = frozenset({"model_name", "icl_tasks", "icl_tasks_str", "eval_gauntlet",
                           "eval_gauntlet_str"})


def is_eval_config(config: Any) -> bool:
    """An eval config: a `models:` list, which no train config has; or the train.py shape
    `allow_toplevel_keys` turns into one (a top-level `model:` with eval keys and no key only
    a train config takes)."""
    if not isinstance(config, Mapping):
        return False
    if isinstance(config.get("models"), list):
        return True
    keys = {k for k in config if isinstance(k, str)}
    return "model" in keys and bool(keys & _EVAL_MARKERS) \
        and not keys & (TRAIN_CONFIG_KEYS - EVAL_CONFIG_KEYS - EVAL_MODEL_KEYS)


def eval_models(config: Mapping[str, Any]) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """(key, entry) for each model the eval builds: `models.N` and its entry, or, in the
    train.py shape, "" and the config itself (whose `model`, `tokenizer`, `model_name` and
    `load_path` `allow_toplevel_keys` moves into `models: [...]`)."""
    models = config.get("models")
    if isinstance(models, list):
        for index, item in enumerate(models):
            if isinstance(item, Mapping):
                yield join_key("models", index), item
    elif "model" in config:
        yield "", {k: config[k] for k in EVAL_MODEL_KEYS if k in config}


def _twin(check: Callable[[Mapping[str, Any], LintContext], Iterable[Hit]],
          config: Mapping[str, Any], ctx: LintContext) -> Iterator[Hit]:
    """A train rule's check on each eval model, as the train config it is built like: its
    `model` with the top-level sections eval_from_yaml shares (`_SHARED`); the hits' `model.`
    keys are the entry's."""
    for where, entry in eval_models(config):
        view = {k: config[k] for k in _SHARED if k in config}
        view["model"] = entry.get("model")
        for hit in check(view, ctx):
            key = f"{where}.{hit.key}" if where and hit.key.split(".")[0] == "model" \
                else hit.key
            yield Hit(key, hit.message, hit.severity, hit.fix)


@rule("FP8301", "error", "unknown top-level keys of an eval config (did-you-mean)",
      why="eval_from_yaml builds EvalConfig with make_dataclass_and_log_config, which raises "
      "'Unused parameters [...] found in cfg' for any top-level key that is not an EvalConfig "
      "field (train-only keys such as `algorithms` or `train_loader` included). Without "
      "`models:`, the model entry's keys (`model`, `tokenizer`, `model_name`, `load_path`) may "
      "stand at the top level (allow_toplevel_keys moves them into `models`); next to "
      "`models:`, a top-level `model` raises 'Please specify either model or models'.",
      source=f"{EVAL_SOURCE} evaluate, allow_toplevel_keys; "
      "llmfoundry/utils/config_utils.py EvalConfig, EVAL_CONFIG_KEYS",
      fix="fix the spelling, or move the value under `variables:`", family="eval",
      scope="file", unresolved=True)
def unknown_eval_keys(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Hit]:
    listed, single = "models" in config, "model" in config
    for key in config:
        # next to both `model` and `models`, the ValueError about `model` comes first
        if not isinstance(key, str) or key in EVAL_CONFIG_KEYS or (
                key in EVAL_MODEL_KEYS and (not listed or (single and key != "model"))):
            continue
        if key == "model":
            yield Hit("model", "an eval config with both `model` and `models` is refused "
                      "('Please specify either model or models in the config, not both')",
                      fix="move this model into the `models:` list")
            continue
        train_only = " (a train config key; eval configs do not take it)" \
            if key in TRAIN_CONFIG_KEYS else did_you_mean(key, EVAL_CONFIG_KEYS)
        yield Hit(join_key("", key), f"LLM-Foundry's eval config refuses unknown top-level key `{key}`"
                  + train_only)


@rule("FP8302", "error", "model keys MPT silently ignores, in an eval config's `models:` "
      "(`master_weights_dtype` included)",
      why="Each `models.N.model` is built like a train config's model section (FP8024): a key "
      "MPTConfig does not name is kept as an unused attribute. A warning, an error when the "
      "ignored value asks for TE layers. `master_weights_dtype` too: evaluate_model pops only "
      "`name` and calls build_composer_model without master_weights_dtype, so MPTConfig keeps it "
      "and the model is evaluated with float32 parameters (with an fsdp_config, "
      "process_init_device still reads it: FP8307).",
      source=f"{EVAL_SOURCE} evaluate_model:114-120 (model.pop('name'), build_composer_model "
      "without master_weights_dtype); llmfoundry/models/mpt/configuration_mpt.py MPTConfig.__init__",
      fix="fix the spelling (the message names the closest MPT key) or remove the key",
      family="eval", unresolved=True)
def eval_model_keys(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Hit]:
    for where, entry in eval_models(config):
        model = entry.get("model")
        if not isinstance(model, Mapping):
            continue
        prefix = join_key(where, "model") if where else "model"
        yield from model_key_hits(model, prefix)
        master = model.get("master_weights_dtype")
        if master is not None and str(model.get("name")) in MPT_MODEL_NAMES:
            yield Hit(join_key(prefix, "master_weights_dtype"), f"eval does not build the model in "
                      f"master_weights_dtype {master!r:.20}: evaluate_model hands it to MPTConfig, "
                      "which keeps it as an unused attribute, so the parameters stay float32",
                      severity="warning", fix="remove it (evaluate in 16 bits with precision "
                      "amp_bf16, or fsdp_config.mixed_precision DEFAULT or PURE without it)")


@rule("FP8308", "error", "an `hf_causal_lm` model key ComposerHFCausalLM does not take, in an "
      "eval config's `models:` (`master_weights_dtype` included; FP8046 for eval configs)",
      why="evaluate_model pops only `name` from each model section and build_composer_model hands "
      "the rest to ComposerHFCausalLM as keywords: `master_weights_dtype`, which train pops, "
      "raises TypeError 'unexpected keyword argument' here, as do MPT's keys (`fc_type: te`), "
      "once the tokenizer and the ICL data are built and after the models listed before it "
      "have been evaluated.",
      source=f"{EVAL_SOURCE} evaluate_model:114-120 (model.pop('name')); {HF_CAUSAL_LM_SOURCE}",
      fix="remove the key", family="eval", unresolved=True)
def eval_hf_model_keys(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Hit]:
    for where, entry in eval_models(config):
        model = entry.get("model")
        if isinstance(model, Mapping):
            yield from hf_model_key_hits(model, join_key(where, "model") if where else "model",
                                         EVAL_POPPED_MODEL_KEYS)


@rule("FP8303", "error", "an eval config with `precision: amp_fp8` and a model without TE "
      "layers (FP8001 for eval configs)",
      why="eval_from_yaml hands the top-level precision to each model's Trainer, and Composer's "
      "amp_fp8 only enters TE's fp8_autocast, which changes TE modules alone: a model without "
      "TE layers (no `fc_type: te`, no `ffn_type: te_ln_mlp`; an eval config takes no "
      "algorithms, so no te_swap) evaluates without FP8, and the scores are not FP8's. Models "
      "with TE layers: FP8307.",
      source=f"{EVAL_SOURCE} evaluate (precision=eval_config.precision), evaluate_model; "
      "Composer 0.32.1 composer/core/precision.py get_precision_context, "
      "composer/trainer/trainer.py _eval_loop (get_precision_context(..., "
      "fp8_autocast_enabled=False))",
      fix="give the model TE layers (`model.fc_type: te`), or evaluate with amp_bf16",
      family="eval")
def eval_fp8_without_te_layers(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Hit]:
    if not is_fp8(config):
        return
    for where, entry in eval_models(config):
        model = entry.get("model")
        if isinstance(model, Mapping) and not native_te_layers({"model": model}):
            name = entry.get("model_name", model.get("name"))
            yield Hit(join_key(where, "model") if where else "model",
                      f"precision amp_fp8, but model {name!r:.60} has no TE layer (no fc_type: "
                      "te, no ffn_type: te_ln_mlp; eval configs take no te_swap): it is "
                      "evaluated without FP8")


def _eval_dtype(config: Mapping[str, Any], master: str | None,
                keeps: tuple[str, Any] | None) -> tuple[str | None, str]:
    """(dtype, why) every eval forward of one model computes in under amp_fp8, TE layers
    included: FSDP's param_dtype (eval_from_yaml keeps fsdp_config on any GPU count), else the
    float32 LLM-Foundry's eval builds models in, whatever their `master_weights_dtype` (`master`);
    `keeps`: the first model, up to this one, whose master_weights_dtype made process_init_device
    rewrite the shared fsdp_config to param_dtype None (key, value); dtype None where Composer
    cannot read the mixed precision (FP8012)."""
    ignored = "" if master is None else (
        f"; eval ignores its master_weights_dtype {master!r:.20}: evaluate_model hands it to the "
        "model class, not to build_composer_model")
    given = config.get("fsdp_config")
    if not isinstance(given, Mapping):
        return "float32", ("the dtype LLM-Foundry builds models in: no fsdp_config lowers it"
                           + ignored)
    if keeps is not None:
        return "float32", (f"process_init_device sets the eval's one fsdp_config param_dtype to None "
                           f"for {keeps[0]}: {keeps[1]!r:.20}, so FSDP keeps the parameters' "
                           "float32" + ignored)
    dtype = fsdp_param_dtype(given.get("mixed_precision", "DEFAULT"))
    return dtype, ("FSDP's param_dtype from fsdp_config.mixed_precision" if dtype in
                   LOW_PARAM_DTYPES else "fsdp_config.mixed_precision keeps float32") + ignored


@rule("FP8307", "warning", "an eval config with `precision: amp_fp8` and a model with TE layers "
      "(evaluated with FP8 off, in the activation dtype)",
      why="Composer's eval loop runs every eval forward with fp8_autocast_enabled=False (TE's "
      "FP8 needs batch sizes eval data does not keep), and amp_fp8 adds no torch autocast: TE "
      "layers and the rest compute in the parameters' dtype, float32 as LLM-Foundry builds "
      "models unless the eval config's fsdp_config lowers it (DEFAULT or PURE: bfloat16). Eval "
      "ignores `model.master_weights_dtype` (evaluate_model builds the model without it, float32), "
      "yet process_init_device still sets the fsdp_config's param_dtype to None for "
      f"{', '.join(sorted(FOUNDRY_FSDP_KEEPS_MASTER_DTYPES))}, for that model and, the eval's one fsdp_config "
      "being shared, every later one: float32 then, whatever mixed_precision says. The "
      "scores are that dtype's, not FP8's; amp_fp8 still needs TE and an FP8 GPU. amp_bf16 "
      "runs the forward in torch.autocast bf16, which TE layers follow: bf16 numerics.",
      source=f"{EVAL_SOURCE} evaluate:299-324 (precision=eval_config.precision, "
      "parallelism_config {'fsdp': eval_config.fsdp_config}, the same dict for every model), "
      "evaluate_model:102-120 (process_init_device(model, fsdp_config); build_composer_model "
      "without master_weights_dtype, which stays in cfg), llmfoundry/utils/config_utils.py "
      "process_init_device:601-622 (small_dtypes: param_dtype None); Composer 0.32.1 composer/trainer/trainer.py "
      f"_eval_loop:3443-3447 (fp8_autocast_enabled=False, and its comment on the activation "
      f"dtype); {AMP_FP8_DTYPE_SOURCE}",
      fix="evaluate with precision amp_bf16 (bf16 numerics, TE layers included); keep amp_fp8 "
      "only to reproduce what a train run's evaluation reports", family="eval")
def eval_fp8_with_te_layers(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Hit]:
    if not is_fp8(config):
        return
    keeps: tuple[str, Any] | None = None
    for where, entry in eval_models(config):
        model = entry.get("model")
        master = model.get("master_weights_dtype") if isinstance(model, Mapping) else None
        fsdp_config = config.get("fsdp_config")
        if keeps is None and isinstance(fsdp_config, Mapping) and fsdp_config \
                and isinstance(master, str) and master in FOUNDRY_FSDP_KEEPS_MASTER_DTYPES:
            keeps = (join_key(join_key(where, "model"), "master_weights_dtype"), master)
        dtype, why = _eval_dtype(config, master, keeps)
        if dtype is not None and isinstance(model, Mapping) \
                and native_te_layers({"model": model}):
            name = entry.get("model_name", model.get("name"))
            yield Hit(join_key(where, "model") if where else "model",
                      f"precision amp_fp8, but Composer evaluates with FP8 autocast off and "
                      f"amp_fp8 adds no torch autocast: model {name!r:.60} computes in {dtype} "
                      f"({why}), TE layers included, so its scores are {dtype}'s, not FP8's"
                      + (flash_note({"model": model}) if dtype == "float32" else ""))


@rule("FP8304", "error", "`attn_impl: sdpa` in an eval model with none of our entries in the "
      "config (FP8041 for eval configs)",
      why="As FP8041: MPTConfig raises 'Unknown attn_impl=sdpa' unless foundry_fp8.attention "
      "was imported before the model is built. evaluate() builds the loggers, and "
      "evaluate_model the callbacks, before build_composer_model, so one of our entries under "
      "`loggers:` or `callbacks:` imports it in time; a warning with `code_paths`.",
      source=f"{EVAL_SOURCE} evaluate (code_paths, build_logger), evaluate_model "
      "(build_callback before build_composer_model)",
      fix="add one of our entries, such as `callbacks: {fp8_lint: {}}`, or import "
      "foundry_fp8.attention from a `code_paths` file; or use attn_impl flash or torch",
      family="eval")
def eval_sdpa_without_our_entries(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Hit]:
    yield from _twin(sdpa_without_our_entries, config, ctx)


@rule("FP8305", "error", "MPT `attn_config` / `ffn_config` keys MPT refuses, an "
      "`ffn_config.fc_type` it replaces, `fc_type: TE`, in an eval model (FP8042 for eval "
      "configs)",
      why="Each eval model is built with build_composer_model like a train config's model "
      "section, so FP8042's TypeError and RegistryError happen there too, after the tokenizer "
      "and the ICL data are built.",
      source=f"{EVAL_SOURCE} evaluate_model (build_composer_model); FP8042's sources",
      fix="fix the spelling (the message names the closest key or name)", family="eval",
      unresolved=True)
def eval_mpt_sub_configs(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Hit]:
    yield from _twin(mpt_sub_configs, config, ctx)


@rule("FP8311", "error", "MPT model values MPT refuses when it builds, in an eval model "
      "(FP8035 and FP8032 for eval configs: numbers written as strings, sizes that are not whole "
      "numbers, d_model not divisible by n_heads, kv_n_heads not dividing n_heads, qk_ln with "
      "qk_gn, kv_dim with fused_qkv, a fractional d_model * expansion_ratio)",
      why="Each eval model is built with build_composer_model like a train config's model "
      "section, so MPTConfig and MPT's layers raise there as in training, after the tokenizer "
      "and the ICL data are built.",
      source=f"{EVAL_SOURCE} evaluate_model (build_composer_model); FP8035's and FP8032's "
      "sources", fix="as FP8035 and FP8032 say", family="eval")
def eval_mpt_values(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Hit]:
    yield from _twin(mpt_refuses_values, config, ctx)
    yield from _twin(fractional_ffn_hidden, config, ctx)


@rule("FP8306", "error", "a `models:` entry with a key evaluate_model does not take "
      "(`precision` included), or without `model`, `tokenizer` or `model_name`; a top-level "
      "`model:` without `tokenizer`",
      why="evaluate() calls evaluate_model(..., precision=..., **model_cfg) for each entry of "
      "`models:`: a key that is not one of its parameters raises TypeError (unexpected "
      "keyword), one it already passes, such as `precision`, raises TypeError (multiple "
      "values: precision is the config's, per model it cannot be set), and a missing "
      "`model`, `tokenizer` or `model_name` raises TypeError (missing argument), after the "
      "models listed before it have been evaluated. In train.py's shape (a top-level "
      "`model:`), allow_toplevel_keys raises ValueError without a `tokenizer` (or with null); "
      "`model_name` defaults to `model.name` there.",
      source=f"{EVAL_SOURCE} evaluate, evaluate_model's signature, allow_toplevel_keys:208-223",
      fix="keep `model_name`, `model`, `tokenizer` and `load_path` in each entry; set "
      "`precision` once at the top level", family="eval", unresolved=True)
def eval_model_entry_keys(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Hit]:
    models = config.get("models")
    if "model" in config and models is None and config.get("tokenizer") is None:
        yield Hit("model", "a top-level `model:` without `tokenizer`: LLM-Foundry's "
                  "allow_toplevel_keys raises ValueError 'When specifying model, \"tokenizer\" "
                  "must be provided in the config'", fix="add a top-level `tokenizer:` "
                  "(`name:` and `kwargs:`, as in a train config)")
    for where, entry in eval_models(config) if isinstance(models, list) else ():
        for key in entry:
            if isinstance(key, str) and key not in EVAL_MODEL_KEYS:
                hint = " (set it once at the top level: it applies to every model)" \
                    if key in EVAL_CONFIG_KEYS else did_you_mean(key, EVAL_MODEL_KEYS)
                yield Hit(join_key(where, key), f"evaluate_model does not take `{key}` from a "
                          f"`models:` entry: TypeError when this model is evaluated" + hint)
        missing = [k for k in EVAL_MODEL_REQUIRED_KEYS if k not in entry]
        if missing:
            yield Hit(where, f"this `models:` entry has no {', '.join(f'`{k}`' for k in missing)}"
                      ": evaluate_model raises TypeError (missing argument)")


@rule("FP8309", "error", "an eval config's eval loader, model or tokenizer without `name`, or "
      "with a null or empty one",
      why="evaluate_model builds each model's tokenizer by `tokenizer['name']` (an empty "
      "tokenizer section too: eval reads it unconditionally), its eval loaders through "
      "build_dataloader's `cfg.pop('name')` and its model by `model.pop('name')`: KeyError "
      "'name' when absent. A null or empty name is looked up as a name: no registry holds it "
      "(RegistryError) and transformers finds no tokenizer by it. Each fails before that model "
      "is evaluated, after the models listed before it have been. FP8053 for train configs.",
      source=f"{EVAL_SOURCE} evaluate_model:71 (tokenizer_cfg['name']), :75-83 "
      "(build_evaluators), :114 (model.pop('name')); llmfoundry/data/dataloader.py:31 "
      "build_dataloader; tests/test_lint_names_eval.py runs evaluate() on each case",
      fix="add `name:` (a loader: text or finetuning; a model: its registered name; a "
      "tokenizer: a Hugging Face name or path)", family="eval")
def eval_sections_without_name(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Hit]:
    for key, loader, _ in loader_sections(config):
        how = unnamed(loader)
        if how == "absent":
            yield Hit(key, f"`{key}` has no `name`: LLM-Foundry's eval raises KeyError 'name' in "
                      "build_dataloader before it evaluates the first model")
        elif how:
            yield null_name_hit(key, "loader", how, "llmfoundry eval")
    for where, entry in eval_models(config):
        for part in ("tokenizer", "model"):
            value = entry.get(part)
            how = unnamed(value) if isinstance(value, Mapping) else None
            key = join_key(where, part) if where else part
            if how == "absent":
                read = "tokenizer_cfg['name']" if part == "tokenizer" else "model.pop('name')"
                yield Hit(key, f"`{key}` has no `name`: LLM-Foundry's eval raises KeyError "
                          f"'name' at `{read}` before it evaluates this model")
            elif how:
                yield null_name_hit(key, part, how, "llmfoundry eval")


@rule("FP8310", "error", "an eval config with an eval loader and more than one model",
      why="evaluate() hands the same eval loader section to evaluate_model for each model, and "
      "build_eval_loaders/build_dataloader pop `label` (a list's items) and `name` from it "
      "while building the first model's evaluators: the second model's build raises KeyError "
      "'label' (a list) or 'name' (a single eval_loader), after the first model has been "
      "evaluated (LLM-Foundry 0.22.0; ICL tasks alone are rebuilt fine).",
      source=f"{EVAL_SOURCE} evaluate:300-330 (eval_loader_config for every model), "
      "evaluate_model:75; llmfoundry/utils/builders.py:116 build_eval_loaders "
      "(eval_config.pop('label')); llmfoundry/data/dataloader.py:31 build_dataloader "
      "(cfg.pop('name')); tests/test_lint_names_eval.py runs evaluate() with two models",
      fix="evaluate one model per eval config (one `llmfoundry eval` run per model), or drop "
      "the eval loader and keep icl_tasks", family="eval")
def eval_loader_with_several_models(config: Mapping[str, Any],
                                    ctx: LintContext) -> Iterator[Hit]:
    models = config.get("models")
    count = sum(isinstance(m, Mapping) for m in models) if isinstance(models, list) else 0
    # evaluate(): `eval_config.eval_loader or eval_config.eval_loaders`
    key = "eval_loader" if config.get("eval_loader") else "eval_loaders"
    loaders = config.get(key)
    if count < 2 or not isinstance(loaders, (Mapping, list)) or not loaders:
        return
    popped = "label" if isinstance(loaders, list) else "name"
    yield Hit(key, f"an eval loader and {count} models: LLM-Foundry's eval pops the loader's "
              f"`{popped}` building the first model's evaluators, so the second model "
              f"(`models.1`) raises KeyError '{popped}' after the first has been evaluated")


@rule("FP8312", "error", "an eval config EvalConfig refuses before any model is built: "
      "`models`, `max_seq_len` or `device_eval_batch_size` absent, a key "
      "that is not a string, a section or setting of a shape or type EvalConfig refuses "
      "(`models: [null]`, `callbacks: [a]`, `seed: 1.5`, `log_config: maybe`, "
      "`metadata: {a: [1]}`, in train.py's shape a top-level `model:` that is no mapping), or a "
      "key LLM-Foundry fills itself next to its source",
      why="evaluate() builds EvalConfig with make_dataclass_and_log_config, as train builds "
      "TrainConfig (FP8022, FP8036, FP8038 there): it asserts that top-level keys are strings, "
      "refuses `eval_loaders` next to `eval_loader` (and `_str` keys next to theirs), then "
      "omegaconf's structured config refuses a section whose shape its field type does not "
      "admit and a setting its type does not take (the same conversions as TrainConfig's), "
      "`metadata` being `dict[str, str]`: a null, list or mapping value is refused; it reads "
      "every field, so a required one absent (`models`, unless a top-level `model:` gives it, "
      "`max_seq_len`, `device_eval_batch_size`) raises MissingMandatoryValue. In train.py's "
      "shape, allow_toplevel_keys first reads `cfg.get('model').get('name')` (AttributeError "
      "for a model that is no mapping). All before the "
      "first model is built. `precision` is FP8011's, a `???` FP8036's.",
      source=f"{FOUNDRY} llmfoundry/utils/config_utils.py EvalConfig, "
      f"make_dataclass_and_log_config; {EVAL_SOURCE} evaluate, allow_toplevel_keys; "
      "tests/test_l23_eval_field_types.py compares each field with LLM-Foundry's eval loader",
      fix="write the key, section or setting in the shape or type the message names, or add "
      "the absent key", family="eval", scope="file")
def eval_config_types(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Hit]:
    for key in EVAL_REQUIRED_KEYS:
        # an eval config has `models:`, or a top-level `model:` that allow_toplevel_keys moves
        if key not in config and key != "models":
            yield Hit(key, f"`{key}` is absent: LLM-Foundry's eval refuses the config before "
                      f"building anything (MissingMandatoryValue: Missing mandatory value: {key})",
                      fix=f"add `{key}`")
    if "models" not in config and "model" in config and not isinstance(config["model"], Mapping):
        yield Hit("model", f"a top-level `model:` that is not a mapping ({shown(config['model'])})"
                  ": LLM-Foundry's allow_toplevel_keys reads its `name` with .get() "
                  "(AttributeError) before building anything",
                  fix="write model as a mapping (`name:` and the model's settings)")
    yield from shape_hits(config, EVAL_SECTION_SHAPES)
    yield from scalar_type_hits(config, EVAL_SCALAR_TYPES, frozenset({"precision"}), "EvalConfig")
    yield from filled_key_hits(config)


@rule("FP8313", "error", "an eval config's MPT shorter than the sequences its evaluation feeds "
      "it: ICL's length (a task's own, else the top-level `max_seq_len`) or an eval loader's "
      "`dataset.max_seq_len` (FP8061 for eval configs)",
      why="evaluate_model hands the eval config's top-level max_seq_len to ICL "
      "(icl_seq_len=max_seq_len), which pads every task to it unless the task gives its own, "
      "and never to the model: each `models` entry (or the train.py shape's top-level `model`) "
      "builds its MPT from its own model section, MPTConfig's default 2048 where it gives no "
      "max_seq_len. MPTModel.forward asserts 'Cannot forward input with seq_len=S, this model "
      "only supports seq_len<=M' at that model's first evaluation, after its checkpoint is "
      "loaded and the models listed before it were evaluated.",
      source=MPT_SEQ_LEN_SOURCE + ", llmfoundry/command_utils/eval.py evaluate_model "
      "(icl_seq_len=max_seq_len, build_composer_model(cfg=model))",
      fix=MPT_SEQ_LEN_FIX, family="eval")
def eval_sequences_past_mpt_max(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Hit]:
    for where, entry in eval_models(config):
        model = entry.get("model")
        if isinstance(model, Mapping):
            yield from past_mpt_max(config, model, join_key(where, "model") if where else "model")
