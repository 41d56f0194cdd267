"""Rules are registered where they are defined: `@rule(...)` on the check function carries the
id, severity, summary, why, source and fix, in the style of TE's debug features (one class
per feature, registered where it is defined). docs/rules.md and SARIF's rule list read this
registry; nothing else holds a rule id or a fix. No torch here.

A check yields `Hit`s: the key, the message, and only where they differ from the rule's, a
milder severity or a fix for this occurrence; `Rule.findings` turns them into `Finding`s. A key
whose value is `${oc.env:...}` holds that text, not a value the run would see: only rules
registered with `unresolved=True` speak about it, those that report such keys and those that
judge key names (an unknown key is wrong whatever its value).
"""

from __future__ import annotations

import json
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

Severity = Literal["error", "warning", "info"]
SEVERITIES: tuple[Severity, ...] = ("error", "warning", "info")

#: The input each family's checks read, in the order docs/rules.md lists them.
FAMILIES = {
    "train": "LLM-Foundry train YAMLs",
    "eval": "LLM-Foundry eval YAMLs",
    "mcli": "MCLI run configs",
    "accelerate": "Accelerate and DeepSpeed configs",
    "environment": "The environment (`foundry-fp8 doctor`, `fp8_lint`)",
}


@dataclass(frozen=True)
class Finding:
    rule: str
    severity: Severity
    key: str  # dotted key path (`join_key`)
    message: str
    fix: str
    #: The rule's own check raised (our bug): this finding says so, at no key, in place of the
    #: rest of its hits; `fp8_lint` logs it rather than stopping the run on it.
    crashed: bool = False


@dataclass(frozen=True)
class Hit:
    """What a check found; `severity` and `fix` default to the rule's."""

    key: str
    message: str
    severity: Severity | None = None
    fix: str | None = None


@dataclass(frozen=True)
class LintContext:
    """What the config alone does not say.

    `scope`: "file" for a YAML as written; "run" for the config LLM-Foundry hands to
    `fp8_lint` (its logged config, which also holds flattened `metadata` keys and its own
    additions, so rules about the file's top-level keys do not apply). `fsdp_version`: the
    FSDP Composer will use (Composer picks 2 only when the environment has FSDP_VERSION=2).
    `env_keys`: keys whose value uses `${oc.env:...}` in the file. `snapshot`: this machine's
    `foundry_fp8.environment.Snapshot` for rules that depend on what is installed (None: not
    probed, such rules stay quiet). `wandb_mode`: W&B's mode from the environment (WANDB_MODE,
    WANDB_DISABLED), which the config's `init_kwargs.mode` overrides; None: not set.
    `gpus`: how many GPUs the run trains on where the file says so (an MCLI run config's
    `compute.gpus`) or the command line does (`foundry-fp8 lint --gpus N`); None: not known;
    `gpus_said`: where, as messages quote it. `duplicates`: (dotted key, line dropped, line
    kept) of each key an MCLI run config gives twice in one mapping (`drop_duplicate_keys`). `interpolated`: the top-level names the file's
    `${...}` read (a value kept at the top level for interpolation, older LLM-Foundry's way).
    `family`: the rules' family `run_rules` runs (an eval config's run of a train rule
    registered `also=("eval",)` says "eval": LLM-Foundry's eval keeps what its train drops).
    `missing_keys`: keys whose value is omegaconf's `???` (`mandatory_keys`, filled by `run_rules`
    for train and eval configs): only FP8036 and rules registered with `unresolved=True` speak
    about them, so a `???` gets one finding, not one per rule that reads it as text.
    `environ`: the run's environment (scope "run": `fp8_lint` inside the run), for rules whose
    verdict it decides as it decides the run's own callbacks' (FP8051 with fp8_stats); None: not
    known (`foundry-fp8 lint` judges the file alone).
    """

    scope: Literal["file", "run"] = "file"
    fsdp_version: int = 1
    env_keys: tuple[str, ...] = ()
    snapshot: Any = None
    wandb_mode: str | None = None
    missing_keys: tuple[str, ...] | None = None
    gpus: int | None = None
    gpus_said: str = ""
    duplicates: tuple[tuple[str, int, int], ...] = ()
    interpolated: frozenset[str] = frozenset()
    family: str = "train"
    environ: Mapping[str, str] | None = field(default=None, hash=False)

    def gpus_text(self) -> str:
        """Where `gpus` comes from, as a message quotes it (`compute.gpus: 1`, `--gpus 1`)."""
        return self.gpus_said or f"`compute.gpus: {self.gpus}`"


Check = Callable[[Any, LintContext], Iterable[Hit]]

#: Findings one rule reports for one input before it stops with a finding that says so: a real
#: config has a handful, and a generated one with 60,000 unknown keys must neither print 60,000
#: rows nor spend a minute spelling did-you-means for them.
MAX_HITS = 100


@dataclass(frozen=True)
class Rule:
    id: str
    severity: Severity  # the most severe level it reports
    summary: str  # what it catches, one line
    rationale: str
    source: str  # where the fact was verified
    fix: str
    check: Check
    family: str = "train"
    scope: Literal["any", "file"] = "any"
    also: tuple[str, ...] = ()  # other families whose inputs this check reads alike
    unresolved: bool = False  # it judges key names, or `${oc.env:...}` values themselves

    def findings(self, data: Any, context: LintContext) -> list[Finding]:
        """Its hits as findings; a check that raises (our bug, on input it did not expect) keeps
        the hits it made before and adds one error finding naming the rule and the error, so
        the other rules' findings are not lost with it."""
        hidden = context.env_keys + (context.missing_keys or ())
        hits: list[Hit] = []
        failure: list[Finding] = []
        try:
            for hit in self.check(data, context):
                if not self.unresolved and _under(hit.key, hidden):
                    continue
                if len(hits) == MAX_HITS:
                    failure.append(self._stopped(hit))
                    break
                hits.append(hit)
        except Exception as e:
            failure.append(self._crashed(e))
        return [Finding(self.id, hit.severity or self.severity, hit.key, hit.message,
                        hit.fix or self.fix) for hit in hits] + failure

    def _stopped(self, hit: Hit) -> Finding:
        return Finding(self.id, hit.severity or self.severity, hit.key,
                       f"{self.id} has {MAX_HITS} findings in this input and stops here; more "
                       f"may follow from this key on ({hit.message})", hit.fix or self.fix)

    def _crashed(self, error: Exception) -> Finding:
        frame = traceback.extract_tb(error.__traceback__)[-1]
        return Finding(self.id, "error", "", f"{self.id}'s check failed on this config "
                       f"({type(error).__name__} at {Path(frame.filename).name}:{frame.lineno}: "
                       f"{first_line(error)}); this is a foundry-fp8 bug, and the other rules' "
                       "findings stand", "report it with this config to foundry-fp8; "
                       f"meanwhile {self.id} ({self.summary.replace('`', '')}) is not checked",
                       crashed=True)


def _under(key: str, parents: tuple[str, ...]) -> bool:
    return any(key == p or key.startswith(f"{p}.") for p in parents)


_REGISTRY: dict[str, Rule] = {}


def rule(id: str, severity: Severity, summary: str, *, why: str, source: str, fix: str,
         family: str = "train", scope: Literal["any", "file"] = "any",
         also: tuple[str, ...] = (), unresolved: bool = False) -> Callable[[Check], Check]:
    """Register the decorated check as rule `id` (each id once); `also` names other families
    (eval configs) whose input the check reads the same way; `unresolved`: its hits at keys
    holding `${oc.env:...}` are kept (see the module's docstring)."""
    if family not in FAMILIES or not set(also) <= set(FAMILIES):
        raise ValueError(f"unknown rule family {family!r}")

    def register(check: Check) -> Check:
        if id in _REGISTRY:
            raise ValueError(f"rule {id} registered twice")
        _REGISTRY[id] = Rule(id, severity, summary, why, source, fix, check, family, scope, also,
                             unresolved)
        return check

    return register


def rules_of(family: str) -> list[Rule]:
    """The registered rules of one family, in id order (import `foundry_fp8.lint.rules` first
    for all of them: registration happens when a rule's module is imported)."""
    return sorted((r for r in _REGISTRY.values() if r.family == family), key=lambda r: r.id)


def rules_for(family: str) -> list[Rule]:
    """The rules that judge one family's input, in id order: its own and those of other families
    registered with `also=(family,)` (the train rules an eval config shares sections with)."""
    return sorted((r for r in _REGISTRY.values() if r.family == family or family in r.also),
                  key=lambda r: r.id)


def run_rules(family: str, data: Any, context: LintContext,
              only: Callable[[Rule], bool] | None = None) -> list[Finding]:
    """Every finding of the rules that judge one family's input (`rules_for`) on `data`."""
    if family in ("train", "eval") and context.missing_keys is None:
        context = replace(context, missing_keys=tuple(mandatory_keys(data)))
    if context.family != family:
        context = replace(context, family=family)
    return [f for r in rules_for(family) if only is None or only(r)
            for f in r.findings(data, context)]


#: omegaconf's value for "not given yet" (omegaconf.MISSING): a config keeps it as this string.
MISSING = "???"


def mandatory_keys(config: Any) -> list[str]:
    """Dotted keys (list items by index) whose value is omegaconf's `???`, in file order; none
    below `variables` (LLM-Foundry reads a variable only through an interpolation, which fails
    to resolve on a `???`)."""
    found: list[str] = []
    stack: list[tuple[str, Iterator[tuple[Any, Any]]]] = [("", _items(config))]
    while stack:  # depth first, in file order, without recursion
        prefix, items = stack[-1]
        step = next(items, None)
        if step is None:
            stack.pop()
            continue
        path = join_key(prefix, step[0])
        if isinstance(step[1], str) and step[1] == MISSING:
            found.append(path)
        elif isinstance(step[1], (Mapping, list)) and path != "variables":
            stack.append((path, _items(step[1])))
    return found


def _items(node: Any) -> Iterator[tuple[Any, Any]]:
    return iter(node.items()) if isinstance(node, Mapping) else \
        iter(enumerate(node)) if isinstance(node, list) else iter(())


def section(config: Any, key: str) -> Mapping[str, Any]:
    """A sub-mapping, or an empty one when absent or of the wrong type (never crash on input)."""
    value = config.get(key) if isinstance(config, Mapping) else None
    return value if isinstance(value, Mapping) else {}


def first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0][:300] if lines else type(error).__name__


def join_key(prefix: str, key: Any) -> str:
    """The dotted path of `key` under `prefix` ('' at the top level). A key holding a dot (or
    starting with a quote) is written quoted, as JSON writes a string: the top-level key
    `"model.d_model"` and `model`'s `d_model` are different keys and must not share a path."""
    text = str(key)
    part = json.dumps(text, ensure_ascii=False) if "." in text or text.startswith('"') else text
    return f"{prefix}.{part}" if prefix else part


def parent_key(key: str) -> str:
    """A dotted path without its last part ('' for a top-level key), reading quoted parts
    (`join_key`) whole; a path that is not `join_key`'s still gives a shorter one."""
    return ".".join(split_key(key)[:-1])


def split_key(key: str) -> list[str]:
    """A dotted path's parts as written (a quoted part keeps its quotes: `join_key`'s)."""
    parts, start = [], 0
    while start < len(key):
        end = key.find(".", start)
        if key.startswith('"', start):
            try:
                end = json.JSONDecoder().raw_decode(key, start)[1]
            except ValueError:  # an unclosed quote: the rest is one part
                end = len(key)
        end = len(key) if end < 0 else end
        parts.append(key[start:end])
        start = end + 1
    return parts
