"""LLM-Foundry eval configs (`scripts/eval/yamls`: a `models:` list, no train loader), read by
`eval_from_yaml`. The train rules that read sections eval configs share (precision, fsdp_config,
callbacks, loggers) register `also=("eval",)`; these are the eval config's own."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from foundry_fp8.lint.known import EVAL_CONFIG_KEYS, TRAIN_CONFIG_KEYS, did_you_mean
from foundry_fp8.lint.registry import Hit, LintContext, join_key, rule
from foundry_fp8.lint.rules.model import model_key_hits
from foundry_fp8.lint.rules.train import FOUNDRY


def is_eval_config(config: Any) -> bool:
    """An eval config: a `models:` list, which no train config has."""
    return isinstance(config, Mapping) and isinstance(config.get("models"), list)


@rule("FP8301", "error", "unknown top-level keys of an eval config (did-you-mean)",
      why="eval_from_yaml builds EvalConfig with make_dataclass_and_log_config, which raises "
      "'Unused parameters [...] found in cfg' for any top-level key that is not an EvalConfig "
      "field (train-only keys such as `algorithms` or `train_loader` included).",
      source=f"{FOUNDRY} llmfoundry/command_utils/eval.py evaluate; "
      "llmfoundry/utils/config_utils.py EvalConfig, EVAL_CONFIG_KEYS",
      fix="fix the spelling, or move the value under `variables:`", family="eval",
      scope="file", unresolved=True)
def unknown_eval_keys(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Hit]:
    for key in config:
        if not isinstance(key, str) or key in EVAL_CONFIG_KEYS:
            continue
        train_only = " (a train config key; eval configs do not take it)" \
            if key in TRAIN_CONFIG_KEYS else did_you_mean(key, EVAL_CONFIG_KEYS)
        yield Hit(join_key("", key), f"LLM-Foundry's eval config refuses unknown top-level key `{key}`"
                  + train_only)


@rule("FP8302", "error", "model keys MPT silently ignores, in an eval config's `models:`",
      why="Each `models.N.model` is built like a train config's model section (FP8024): a key "
      "MPTConfig does not name is kept as an unused attribute. A warning, an error when the "
      "ignored value asks for TE layers.",
      source=f"{FOUNDRY} llmfoundry/command_utils/eval.py evaluate_model (build_composer_model);"
      " llmfoundry/models/mpt/configuration_mpt.py MPTConfig.__init__",
      fix="fix the spelling (the message names the closest MPT key) or remove the key",
      family="eval", unresolved=True)
def eval_model_keys(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Hit]:
    models = config.get("models")
    for index, item in enumerate(models if isinstance(models, list) else []):
        model = item.get("model") if isinstance(item, Mapping) else None
        if isinstance(model, Mapping):
            yield from model_key_hits(model, f"models.{index}.model")
