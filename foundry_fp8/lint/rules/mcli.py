"""MCLI run configs around the train config: what MCLI hands the train script (`parameters`,
written to /mnt/config/parameters.yaml) and what tells an MCLI run config from a train config.
The `parameters` mapping itself is linted as the train or eval config it is."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from foundry_fp8.lint.known import TRAIN_CONFIG_KEYS
from foundry_fp8.lint.registry import Hit, LintContext, rule

#: Keys of an MCLI run config (mcli's RunConfig: `name`, `image`, `command`, `compute`,
#: `parameters`, `integrations`, `scheduling`, `env_variables`, `metadata`, `entrypoint`, and the
#: older `run_name`, `gpu_num`, `gpu_type`, `cluster`, `cpus`), as LLM-Foundry's mcli/ folder
#: uses them.
MCLI_KEYS = frozenset({"name", "image", "command", "compute", "integrations", "scheduling",
                       "env_variables", "gpu_num", "gpu_type", "cluster", "cpus", "entrypoint",
                       "run_name", "metadata", "parameters", "dependent_deployment"})
#: The keys that mark an MCLI run config: MCLI's keys that no train config has (`run_name` and
#: `metadata` are TrainConfig fields too; `name` is a train config's likeliest slip for
#: `run_name`), so a train config with `run_name` and a misspelled key stays a train config.
MCLI_MARKERS = MCLI_KEYS - TRAIN_CONFIG_KEYS - {"name"}
#: Where MCLI mounts `parameters` in the run (LLM-Foundry's mcli/*.yaml train from it).
PARAMETERS_FILE = "/mnt/config/parameters.yaml"


def is_mcli(data: Any) -> bool:
    """An MCLI run config: one of MCLI_MARKERS and no key only a train config has."""
    if not isinstance(data, Mapping):
        return False
    keys = {str(k) for k in data}
    return bool(keys & MCLI_MARKERS) and not keys & (TRAIN_CONFIG_KEYS - MCLI_KEYS)


def trains_from_parameters(data: Mapping[str, Any]) -> bool:
    """Its command (or entrypoint) reads the file MCLI writes `parameters` to."""
    return any(isinstance(data.get(key), str) and PARAMETERS_FILE in data[key]
               for key in ("command", "entrypoint"))


def _shown(value: Any) -> str:
    return "null" if value is None else f"{type(value).__name__} {value!r:.60}"


@rule("FP8401", "error", "an MCLI run config whose `parameters` is not a mapping, or that has "
      f"none although its command trains from {PARAMETERS_FILE}",
      why="MCLI writes `parameters` as given to /mnt/config/parameters.yaml, the file the "
      "command hands LLM-Foundry's train script (LLM-Foundry's mcli/*.yaml); train_from_yaml "
      "asserts the loaded config is a mapping (a number or a list fails; null or no "
      "`parameters` leaves the file empty or missing). An MCLI config without `parameters` "
      "whose command does not read that file has nothing to lint (skipped).",
      source="LLM-Foundry 0.22.0 llmfoundry/command_utils/train.py train_from_yaml (`assert "
      "isinstance(yaml_cfg, DictConfig)`); LLM-Foundry mcli/mcli-hf-eval.yaml ('injected as a "
      "YAML file: /mnt/config/parameters.yaml', `composer eval/eval.py "
      "/mnt/config/parameters.yaml`); mosaicml-cli RunConfig (`parameters: Dict[str, Any]`)",
      fix="write `parameters:` as the train config mapping (its keys indented under it)",
      family="mcli")
def parameters_not_a_config(data: Mapping[str, Any], ctx: LintContext) -> Iterator[Hit]:
    if "parameters" in data and data["parameters"] is not None:
        if not isinstance(data["parameters"], Mapping):
            yield Hit("parameters", f"`parameters` must be a mapping (the train config MCLI "
                      f"writes to {PARAMETERS_FILE}), got {_shown(data['parameters'])}")
    elif trains_from_parameters(data):
        key = "parameters" if "parameters" in data else \
            next(k for k in ("command", "entrypoint") if PARAMETERS_FILE in str(data.get(k)))
        yield Hit(key, f"the {key if key != 'parameters' else 'command'} trains from "
                  f"{PARAMETERS_FILE}, but this run config gives "
                  + ("`parameters: null`" if key == "parameters" else "no `parameters`")
                  + ": the script finds no train config there")
