"""HuggingFace Accelerate configs, and the DeepSpeed JSON they point to: FP8 settings that
Accelerate refuses, drops or overrides without a word.

Every fact below was read in Accelerate's sources (tags v0.34.2 to v1.14.0) and TE's; the rules'
`source` fields say where. How a config reaches TE: `accelerate launch` turns `mixed_precision`
into ACCELERATE_MIXED_PRECISION and each `fp8_config` key `k` into ACCELERATE_FP8_<K>
(commands/launch.py `_validate_launch_command`, utils/launch.py `setup_fp8_env`); the training
process's `Accelerator()` builds a `TERecipeKwargs` from those variables, and
`apply_fp8_autowrap` (utils/transformer_engine.py) gives TE's `DelayedScaling` only the values
that differ from TERecipeKwargs' own defaults (`KwargsHandler.to_kwargs`).

Rule checks read the mapping `lint_input(...)` builds; `lint_accelerate_file` is the impure
part (reading files, the installed Accelerate's version) that `foundry-fp8 lint` calls.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml

from foundry_fp8.lint.known import did_you_mean
from foundry_fp8.lint.load import LintInputError, key_positions, position_of
from foundry_fp8.lint.rules import Finding, LintContext, Rule, _section
from foundry_fp8.recipe import recipe_problems
from foundry_fp8.te.facts import dotted, parse_version

ACC = "Accelerate (huggingface/accelerate, tags v0.34.2-v1.14.0)"
TE = "TransformerEngine (NVIDIA/TransformerEngine, tags v1.0-v2.18)"

#: Top-level keys that mark an Accelerate config (`process_config` requires distributed_type;
#: `accelerate config` always writes compute_environment). LLM-Foundry YAMLs have neither.
ACCELERATE_MARKERS = ("compute_environment", "distributed_type")

#: `fp8_config` keys whose ACCELERATE_FP8_* variable something reads (TERecipeKwargs,
#: MSAMPRecipeKwargs, AORecipeKwargs, Accelerator.fp8_backend). Any other key is dropped.
FP8_CONFIG_KEYS = frozenset({
    "backend", "use_autocast_during_eval", "margin", "interval", "fp8_format", "format",
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
#: accelerate-yaml `deepspeed_config` keys refused next to `deepspeed_config_file`
#: (DeepSpeedPlugin._deepspeed_config_checks), plus a top-level `mixed_precision`.
DS_FILE_EXCLUSIVE = ("gradient_accumulation_steps", "gradient_clipping", "zero_stage",
                     "offload_optimizer_device", "offload_param_device",
                     "offload_param_nvme_path", "offload_optimizer_nvme_path",
                     "zero3_save_16bit_model")
DS_FILE_KEY = "deepspeed_config.deepspeed_config_file"

FP8_FROM_CONFIG_UNDER_DEEPSPEED = (1, 11)  # AcceleratorState keeps "fp8" under DeepSpeed
FP8_AUTO_BROKEN = ((1, 4), (1, 8))  # auto-created recipe never marked as an FP8 handler
DS_RECIPE_FROM_FP8_RECIPE_KWARGS_ONLY = (1, 4)  # TERecipeKwargs exists; DS path ignores it


def _text(value: Any) -> str:
    return str(value).strip().lower() if value is not None else ""


def _is_true(value: Any) -> bool:
    return _text(value) in ("true", "1", "yes")


def lint_input(accelerate: Mapping[str, Any] | None, deepspeed: Mapping[str, Any] | None = None,
               *, version: tuple[int, ...] | None = None, deepspeed_path: str | None = None,
               deepspeed_positions: Mapping[str, tuple[int, int]] | None = None,
               deepspeed_missing: str | None = None) -> dict[str, Any]:
    """What the rules read. `accelerate`: the Accelerate config ({} when linting a DeepSpeed
    JSON alone); `deepspeed`: the DeepSpeed JSON; `version`: the installed Accelerate (None:
    unknown); `deepspeed_path`/`deepspeed_positions`: where DeepSpeed keys are, for messages;
    `deepspeed_missing`: a `deepspeed_config_file` that could not be found."""
    return {"accelerate": accelerate or {}, "deepspeed": deepspeed, "version": version,
            "deepspeed_path": deepspeed_path, "deepspeed_positions": deepspeed_positions or {},
            "deepspeed_missing": deepspeed_missing}


def _fp8(acc: Mapping[str, Any]) -> bool:
    return _text(acc.get("mixed_precision")) == "fp8"


def _deepspeed(acc: Mapping[str, Any]) -> bool:
    return _text(acc.get("distributed_type")) == "deepspeed"


def _te_backend(acc: Mapping[str, Any]) -> bool:
    return _text(_section(acc, "fp8_config").get("backend")) in ("", "te")


def _ds_where(inp: Mapping[str, Any], ds_key: str) -> tuple[str, str]:
    """(finding key, message prefix) for a key of the DeepSpeed JSON: its own key when the JSON
    is the linted file, else the Accelerate file's `deepspeed_config_file` and the JSON's line."""
    if inp["accelerate"]:
        line = position_of(ds_key, dict(inp["deepspeed_positions"]))
        where = f"{inp['deepspeed_path']}:{line[0]}" if line else str(inp["deepspeed_path"])
        return DS_FILE_KEY, f"{where}: `{ds_key}` "
    return ds_key, f"`{ds_key}` "


def fp16_with_fp8(inp: Mapping[str, Any], _: LintContext) -> Iterator[Finding]:
    acc, ds = inp["accelerate"], inp["deepspeed"]
    if _fp8(acc) and ds is not None and _is_true(_section(ds, "fp16").get("enabled")):
        key, prefix = _ds_where(inp, "fp16.enabled")
        yield Finding("FP8101", "error", key,
                      f"{prefix}is true with mixed_precision fp8: Accelerate refuses it at "
                      "Accelerator() ('cannot be set to fp8 when fp16 is set in the DeepSpeed "
                      "config file'); FP8 runs on a bf16 base",
                      'set "fp16": {"enabled": false} and "bf16": {"enabled": true} (or "auto")')


def deepspeed_file_exclusive(inp: Mapping[str, Any], _: LintContext) -> Iterator[Finding]:
    acc = inp["accelerate"]
    ds_config = _section(acc, "deepspeed_config")
    if not ds_config.get("deepspeed_config_file"):
        return
    if acc.get("mixed_precision") is not None:
        yield Finding("FP8102", "error", "mixed_precision",
                      "with deepspeed_config_file, Accelerate refuses mixed_precision in the "
                      "Accelerate config (ValueError at Accelerator(): 'the following accelerate "
                      "config variables will be ignored')",
                      "remove it; set fp16/bf16 in the DeepSpeed JSON, and for FP8 run "
                      "`accelerate launch --mixed_precision fp8`")
    for name in DS_FILE_EXCLUSIVE:
        if name in ds_config:
            yield Finding("FP8102", "error", f"deepspeed_config.{name}",
                          f"with deepspeed_config_file, Accelerate refuses {name} in the "
                          "Accelerate config (ValueError at Accelerator())",
                          "set it in the DeepSpeed JSON instead")


def fp8_not_enabled(inp: Mapping[str, Any], _: LintContext) -> Iterator[Finding]:
    """FP8 asked for in the config but never reaching TE with this Accelerate version."""
    acc, version = inp["accelerate"], inp["version"]
    if not _fp8(acc):
        return
    shown = f"accelerate {dotted(version)}" if version else "accelerate"
    if _deepspeed(acc) and (version is None or version < FP8_FROM_CONFIG_UNDER_DEEPSPEED):
        yield Finding("FP8103", "error" if version else "warning", "mixed_precision",
                      f"under DeepSpeed, {shown}"
                      f"{'' if version else ' older than 1.11'} reports the DeepSpeed config's "
                      "bf16 as the mixed precision, so Accelerator() never enables FP8 from this "
                      "config: the run trains in BF16 with no error (accelerate #3360)",
                      "use accelerate>=1.11; older versions need an explicit "
                      "FP8RecipeKwargs(backend='TE') in Accelerator(kwargs_handlers=...) (1.0-1.3: "
                      "not even that), checked with has_transformer_engine_layers(model.module)")
    elif (not _deepspeed(acc) and version is not None
          and FP8_AUTO_BROKEN[0] <= version < FP8_AUTO_BROKEN[1]):
        yield Finding("FP8103", "error", "mixed_precision",
                      f"{shown} creates the FP8 recipe from this config but never marks it as "
                      "an FP8 handler, so no layer is converted to TE and no FP8 autocast runs: "
                      "the run trains without FP8, with no error",
                      "use accelerate>=1.8, or pass TERecipeKwargs(...) in "
                      "Accelerator(kwargs_handlers=...)")


def _custom(key: str, value: Any) -> bool:
    """Would TERecipeKwargs forward this value to TE (it differs from Accelerate's default)?"""
    default = TE_RECIPE_DEFAULTS[key]
    if key == "override_linear_precision":
        values = value if isinstance(value, (list, tuple)) else [value]
        return any(_is_true(v) for v in values)
    if isinstance(default, bool):
        return _is_true(value)
    if isinstance(default, str):
        return _text(value) != default.lower()
    return value != default and str(value) != str(default)


def _recipe_items(fp8_config: Mapping[str, Any]) -> dict[str, tuple[str, Any]]:
    """TE recipe key -> (fp8_config key, value) for the values Accelerate forwards to TE."""
    items = {}
    for name, value in fp8_config.items():
        key = "fp8_format" if name == "format" else str(name)
        if key in TE_RECIPE_DEFAULTS and _custom(key, value):
            items[key] = (str(name), value)
    return items


def deepspeed_recipe_ignored(inp: Mapping[str, Any], _: LintContext) -> Iterator[Finding]:
    acc, version = inp["accelerate"], inp["version"]
    if not (_fp8(acc) and _deepspeed(acc) and _te_backend(acc)):
        return
    if version is not None and version < DS_RECIPE_FROM_FP8_RECIPE_KWARGS_ONLY:
        return  # FP8 does not run under DeepSpeed there at all (FP8103)
    custom = _recipe_items(_section(acc, "fp8_config"))
    custom.pop("use_autocast_during_eval", None)
    if custom:
        names = ", ".join(name for name, _value in custom.values())
        yield Finding("FP8104", "warning", "fp8_config",
                      f"under DeepSpeed Accelerate builds TE's recipe only from the deprecated "
                      f"FP8RecipeKwargs, so this config's {names} never reach TE: it runs TE's "
                      "default DelayedScaling (HYBRID, amax_history_len 1024, max)",
                      "pass FP8RecipeKwargs(backend='TE', ...) with these values in "
                      "Accelerator(kwargs_handlers=...), or rely on TE's defaults")


def fp8_config_unknown_keys(inp: Mapping[str, Any], _: LintContext) -> Iterator[Finding]:
    for name in _section(inp["accelerate"], "fp8_config"):
        name = str(name)
        if name in FP8_CONFIG_KEYS:
            continue
        if name in QUESTIONNAIRE_NAMES:
            hint = (f"`accelerate config` writes {name}, but `accelerate launch` reads "
                    f"{QUESTIONNAIRE_NAMES[name]}")
            fix = f"rename it to {QUESTIONNAIRE_NAMES[name]}"
        else:
            hint, fix = "no part of Accelerate reads it", "fix the spelling" + did_you_mean(
                name, FP8_CONFIG_KEYS)
        yield Finding("FP8105", "warning", f"fp8_config.{name}",
                      f"fp8_config.{name} is silently dropped: {hint}", fix)


def most_recent_dropped(inp: Mapping[str, Any], _: LintContext) -> Iterator[Finding]:
    acc = inp["accelerate"]
    algo = _section(acc, "fp8_config").get("amax_compute_algo")
    if _te_backend(acc) and _text(algo) == "most_recent":
        yield Finding("FP8106", "warning", "fp8_config.amax_compute_algo",
                      "most_recent is Accelerate's default, and Accelerate forwards to TE only "
                      "values that differ from its defaults: TE uses its own default, max",
                      "write max (what runs); most_recent cannot be set through Accelerate")


def recipe_values(inp: Mapping[str, Any], _: LintContext) -> Iterator[Finding]:
    acc = inp["accelerate"]
    if not _te_backend(acc):
        return
    items = _recipe_items(_section(acc, "fp8_config"))
    for key in ("use_autocast_during_eval", "use_mxfp8_block_scaling"):
        items.pop(key, None)  # Accelerate's own switches, not TE recipe fields
    for problem in recipe_problems({key: value for key, (_name, value) in items.items()}):
        name = items[problem.key][0] if problem.key in items else problem.key
        yield Finding("FP8107", "error", f"fp8_config.{name}", problem.message, problem.fix)


def zero_stage_auto(inp: Mapping[str, Any], _: LintContext) -> Iterator[Finding]:
    ds = inp["deepspeed"]
    if ds is not None and _text(_section(ds, "zero_optimization").get("stage")) == "auto":
        key, prefix = _ds_where(inp, "zero_optimization.stage")
        yield Finding("FP8108", "warning", key,
                      f"{prefix}is auto: Accelerate fills it with its own zero_stage, 2 unless "
                      "`accelerate launch --zero_stage N` is given (the Accelerate config may "
                      "not set zero_stage next to a DeepSpeed file)",
                      "write the ZeRO stage you want (0-3)")


def deepspeed_file_missing(inp: Mapping[str, Any], _: LintContext) -> Iterator[Finding]:
    if inp["deepspeed_missing"]:
        yield Finding("FP8109", "warning", DS_FILE_KEY,
                      f"DeepSpeed config {inp['deepspeed_missing']} not found next to this file "
                      "or in the current directory, so it was not checked; Accelerate opens a "
                      "relative path from the directory `accelerate launch` runs in",
                      "use an absolute path, or lint from the launch directory")


#: Accelerate/DeepSpeed rules (ids FP81xx), for docs/rules.md. Checks read `lint_input(...)`.
ACCELERATE_RULES = [
    Rule("FP8101", "error", "Accelerate `mixed_precision: fp8` with DeepSpeed `fp16` enabled",
         "DeepSpeedPlugin.set_mixed_precision runs FP8 on a bf16 base and raises when the "
         "DeepSpeed JSON enables fp16. A bf16 block is what Accelerate itself adds for FP8, "
         "so it is not flagged.",
         f"{ACC} src/accelerate/utils/dataclasses.py DeepSpeedPlugin.set_mixed_precision",
         "disable fp16 in the DeepSpeed JSON", fp16_with_fp8),
    Rule("FP8102", "error", "`deepspeed_config_file` with mixed_precision or ZeRO settings in "
         "the Accelerate config",
         "The launcher records the Accelerate config's deepspeed_config keys (and "
         "mixed_precision) in ACCELERATE_CONFIG_DS_FIELDS; with a DeepSpeed file, "
         "_deepspeed_config_checks raises for mixed_precision, zero_stage, "
         "gradient_accumulation_steps, gradient_clipping, offload_* and zero3_save_16bit_model.",
         f"{ACC} src/accelerate/commands/launch.py launch_command; "
         "src/accelerate/utils/dataclasses.py DeepSpeedPlugin._deepspeed_config_checks",
         "move them to the DeepSpeed JSON; FP8 via `accelerate launch --mixed_precision fp8`",
         deepspeed_file_exclusive),
    Rule("FP8103", "error", "FP8 from the config never reaches TE with this Accelerate",
         "Under DeepSpeed, AcceleratorState.mixed_precision returned the DeepSpeed config's "
         "bf16 until 1.11 (fixed by PR #3688), so Accelerator() never enabled FP8 from a config "
         "(issue #3360, PR #3714); in 1.0-1.3 fp8_backend needed that same value, in 1.4-1.7 "
         "an auto-created recipe was never marked as an FP8 handler (any distributed type; "
         "fixed by PR #3611 in 1.8). Judged against the Accelerate installed where the linter "
         "runs; a warning when it is not installed.",
         f"{ACC} src/accelerate/state.py AcceleratorState.mixed_precision; "
         "src/accelerate/accelerator.py Accelerator.__init__ and fp8_backend; "
         "https://github.com/huggingface/accelerate/issues/3360; "
         "https://github.com/huggingface/accelerate/pull/3714",
         "upgrade Accelerate (1.11+ under DeepSpeed, 1.8+ otherwise)", fp8_not_enabled),
    Rule("FP8104", "warning", "FP8 recipe in `fp8_config` under DeepSpeed (ignored)",
         "_prepare_deepspeed wraps the model with apply_fp8_autowrap(model, "
         "self.fp8_recipe_handler): the recipe built from the config is a TERecipeKwargs "
         "(te_recipe_handler), so TE gets DelayedScaling() with its defaults. Since 1.4, "
         "still in 1.14.",
         f"{ACC} src/accelerate/accelerator.py Accelerator._prepare_deepspeed; "
         "src/accelerate/utils/transformer_engine.py apply_fp8_autowrap",
         "pass FP8RecipeKwargs(backend='TE', ...) to Accelerator()", deepspeed_recipe_ignored),
    Rule("FP8105", "warning", "`fp8_config` keys Accelerate never reads (did-you-mean)",
         "The launcher turns each fp8_config key k into ACCELERATE_FP8_<K>; only the names the "
         "recipe classes read have an effect. `accelerate config` itself writes "
         "amax_history_length, amax_compute_algorithm and optimization_level, which are "
         "dropped: the run uses the defaults (1024, most_recent, O2).",
         f"{ACC} src/accelerate/commands/config/cluster.py; src/accelerate/commands/launch.py "
         "_validate_launch_command; src/accelerate/utils/launch.py setup_fp8_env; "
         "src/accelerate/utils/dataclasses.py TERecipeKwargs/MSAMPRecipeKwargs.__post_init__",
         "use amax_history_len, amax_compute_algo, opt_level", fp8_config_unknown_keys),
    Rule("FP8106", "warning", "`fp8_config.amax_compute_algo: most_recent` (TE runs max)",
         "KwargsHandler.to_kwargs forwards only values that differ from TERecipeKwargs' "
         "defaults, and Accelerate's default is most_recent while TE's DelayedScaling default "
         "is max: asking for most_recent gives max.",
         f"{ACC} src/accelerate/utils/dataclasses.py KwargsHandler.to_kwargs, TERecipeKwargs; "
         f"{TE} transformer_engine/common/recipe/__init__.py DelayedScaling",
         "write max, or build the TE recipe yourself", most_recent_dropped),
    Rule("FP8107", "error", "`fp8_config` recipe values TE rejects (E5M2, removed keys)",
         "Accelerate passes non-default values to DelayedScaling: TE asserts 'Pure E5M2 "
         "training is not supported'; override_linear_precision is gone in TE 2.0 and interval "
         "in TE 2.2 (TypeError; interval was unused since 1.8). Values are checked by "
         "recipe.recipe_problems, as for te_swap's fp8_recipe.",
         f"{TE} transformer_engine/common/recipe/__init__.py DelayedScaling; "
         f"{ACC} src/accelerate/utils/transformer_engine.py apply_fp8_autowrap",
         "fp8_format HYBRID or E4M3; remove interval and override_linear_precision",
         recipe_values),
    Rule("FP8108", "warning", "DeepSpeed `zero_optimization.stage: auto`",
         "DeepSpeedPlugin fills an `auto` stage from its zero_stage, which is "
         "ACCELERATE_DEEPSPEED_ZERO_STAGE or 2; with a DeepSpeed file the Accelerate config "
         "cannot set zero_stage (FP8102), so `auto` silently means ZeRO-2.",
         f"{ACC} src/accelerate/utils/dataclasses.py DeepSpeedPlugin.__post_init__ and "
         "fill_match",
         "write the stage explicitly", zero_stage_auto),
    Rule("FP8109", "warning", "`deepspeed_config_file` not found",
         "HfDeepSpeedConfig opens the path from the launch directory; a file we cannot find "
         "is not checked.",
         f"{ACC} src/accelerate/utils/deepspeed.py HfDeepSpeedConfig.__init__",
         "use an absolute path", deepspeed_file_missing),
]


def lint_accelerate(inp: Mapping[str, Any]) -> list[Finding]:
    """All findings for one `lint_input(...)`."""
    context = LintContext(scope="file")
    return [finding for rule in ACCELERATE_RULES for finding in rule.check(inp, context)]


# -- reading files: the impure part -----------------------------------------------------------

def installed_accelerate() -> tuple[int, ...] | None:
    try:
        return parse_version(metadata.version("accelerate"))
    except Exception:
        return None


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise LintInputError(f"{path}: cannot read: {getattr(e, 'strerror', None) or e}") from None


def _json(path: Path, text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise LintInputError(f"{path}:{e.lineno}:{e.colno}: not valid JSON: {e.msg}") from None


def _positions(text: str) -> dict[str, tuple[int, int]]:
    try:
        return key_positions(yaml.compose(text, Loader=yaml.SafeLoader))[0]
    except yaml.YAMLError:  # JSON that YAML cannot read (tabs): findings lose their lines
        return {}


def _find_deepspeed(path: Path, name: str) -> Path | None:
    candidate = Path(name).expanduser()
    places = [candidate] if candidate.is_absolute() else [path.parent / candidate, candidate]
    return next((p for p in places if p.is_file()), None)


def lint_accelerate_file(path: Path) -> tuple[list[Finding], dict[str, tuple[int, int]]] | None:
    """(findings, key positions) for an Accelerate config or a DeepSpeed JSON; None for any
    other file (a train YAML). LintInputError (one line, naming file and line) when a file
    that is ours cannot be read or parsed."""
    if path.suffix.lower() != ".json":
        if not path.is_file():
            return None
        try:
            config = yaml.safe_load(_read(path))
        except (yaml.YAMLError, LintInputError):
            return None  # the train-YAML loader reports it
        if not (isinstance(config, Mapping) and any(k in config for k in ACCELERATE_MARKERS)):
            return None
        text = _read(path)
    else:
        text = _read(path)
        config = _json(path, text)
        if not isinstance(config, Mapping):
            raise LintInputError(f"{path}:1: a DeepSpeed or Accelerate config must be a JSON "
                                 "object")
    positions = _positions(text)
    if not any(k in config for k in ACCELERATE_MARKERS):  # a DeepSpeed JSON on its own
        return lint_accelerate(lint_input({}, config)), positions
    ds_name = _section(config, "deepspeed_config").get("deepspeed_config_file")
    deepspeed, ds_positions, missing, ds_path = None, {}, None, None
    if isinstance(ds_name, str) and ds_name:
        found = _find_deepspeed(path, ds_name)
        if found is None:
            missing = ds_name
        else:
            ds_text = _read(found)
            deepspeed, ds_positions, ds_path = _json(found, ds_text), _positions(ds_text), found
            if not isinstance(deepspeed, Mapping):
                raise LintInputError(f"{found}:1: a DeepSpeed config must be a JSON object")
    inp = lint_input(config, deepspeed, version=installed_accelerate(),
                     deepspeed_path=str(ds_path) if ds_path else None,
                     deepspeed_positions=ds_positions, deepspeed_missing=missing)
    return lint_accelerate(inp), positions
