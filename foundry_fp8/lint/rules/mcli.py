"""MCLI run configs around the train config: what MCLI hands the train script (`parameters`,
written to /mnt/config/parameters.yaml) and what tells an MCLI run config from a train config.
The `parameters` mapping itself is linted as the train or eval config it is."""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

from foundry_fp8.environment import Snapshot
from foundry_fp8.lint.known import TRAIN_CONFIG_KEYS
from foundry_fp8.lint.registry import Finding, Hit, LintContext, rule, run_rules
from foundry_fp8.lint.rules.environment import Environment
from foundry_fp8.lint.rules.train import shown
from foundry_fp8.packages import parse_requirement

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
    """Its command (or entrypoint) hands the file MCLI writes `parameters` to a train or eval
    script (`_train_arguments`); a line that only copies or prints the file trains nothing."""
    return any(_train_arguments(data.get(key)) is not None for key in ("command", "entrypoint"))


def command_overrides(data: Mapping[str, Any]) -> list[str]:
    """The arguments the `command:` gives the train (or eval) script after
    /mnt/config/parameters.yaml: the script merges every one into that config
    (`train_from_yaml(yaml_path, args_list=sys.argv[2:])`, om.from_cli: `KEY=VALUE`, or KEY
    alone, set to null). A word the shell expands (`$NL`, `${X}`, `$(...)`, a backquote) is
    left out: its value is the run's environment's, not the file's."""
    words = _train_arguments(data.get("command")) or []
    return [text for text, expands in words if not expands]


#: Characters that end an unquoted shell word and start an operator (bash's metacharacters
#: less blanks): `;`, `&`, `|`, `(`, `)`, and the redirections `<`, `>`.
_OPERATORS = frozenset(";&|()<>")
#: What a backslash escapes inside double quotes (bash manual, Double Quotes).
_DOUBLE_QUOTE_ESCAPES = frozenset('$`"\\\n')
#: What makes a `$` an expansion (bash manual, Shell Parameter Expansion, Special Parameters;
#: `$[...]`, bash's old arithmetic expansion, which it still expands).
_EXPANDED_AFTER_DOLLAR = re.compile(r"[A-Za-z0-9_{(\[@*#?$!'\"-]")
#: The expansions read through their closing, whatever they hold (blanks, quotes).
_OPENINGS = ("$(", "${", "$[")
#: Each opening's closing.
_CLOSING = {"(": ")", "{": "}", "[": "]"}


def _train_arguments(command: Any) -> list[tuple[str, bool]] | None:
    """The arguments after PARAMETERS_FILE of the first simple command of `command` (a shell
    script) that hands it to a train or eval script (the word before it ends in `.py`, or is
    `llmfoundry train|eval`), each with whether the shell expands it; None when none does."""
    if not isinstance(command, str) or PARAMETERS_FILE not in command:
        return None
    for words in _simple_commands(command):
        at = _parameters_at([text for text, _ in words])
        if at is not None:
            return words[at + 1:]
    return None


def _parameters_at(texts: list[str]) -> int | None:
    """Where a simple command's words hand PARAMETERS_FILE to a train or eval script (the word
    before it ends in `.py`, or is `llmfoundry train|eval`); None when they do not."""
    for i, text in enumerate(texts[1:], 1):
        script = texts[i - 1]
        if text == PARAMETERS_FILE and (script.endswith(".py") or (
                script in ("train", "eval") and i > 1 and texts[i - 2] == "llmfoundry")):
            return i
    return None


def _simple_commands(script: str) -> Iterator[list[tuple[str, bool]]]:
    """The words of each simple command of a shell script as bash splits them: quotes and
    backslashes removed, each with whether it expands (`$`, `$(...)`, `${...}` or a backquote
    outside single quotes). A command ends at a newline or a control operator (`;`, `&`, `&&`,
    `|`, `||`, `(`, `)`); a redirection (`>`, `2>&1`, `&> log`: a digit glued to it is its
    file descriptor) drops itself and its target word, no other. A comment starts at an
    unquoted `#` that begins a word, not inside one. An unclosed quote or expansion ends the
    script without its line: bash reads a line's commands whole and refuses to run it.
    A here-document's body is no command. Not read as bash does: brace (`{a,b}`) and tilde
    expansion, `$'...'` (left out as expanding), process substitution `<(...)`, a `case` pattern's
    unmatched `)` inside `$(...)`."""
    line: list[list[tuple[str, bool]]] = []  # commands bash runs only once the line is read
    words: list[tuple[str, bool]] = []
    last = (-1, -1)  # where the last word kept starts and ends: `2` of `2>` is no argument
    heredocs: list[tuple[str, bool]] = []  # this line's `<<DELIMITER`s, `<<-` strips tabs
    i, n = 0, len(script)
    while i < n:
        c = script[i]
        if c == "\\" and script.startswith("\\\n", i):  # a line continued
            i += 2
        elif c in " \t":
            i += 1
        elif c == "#":  # a word starts here: a comment to the end of the line
            i = script.find("\n", i)
            i = n if i < 0 else i
        elif c in "<>" or script.startswith("&>", i):
            if words and last[1] == i and script[last[0]:i].isdigit():
                words.pop()  # `2>`: the digits glued to it are its file descriptor
            start, i = i, i + 1
            while i < n and script[i] in "<>&|":
                i += 1
            tabs = script[start:i] == "<<" and script.startswith("-", i)  # `<<-`
            i += tabs
            while i < n and script[i] in " \t":
                i += 1
            if i < n and script[i] != "\n" and script[i] not in _OPERATORS:
                word = _word(script, i)  # the redirection's target: no argument
                if word is None:
                    return
                if script[start:i].rstrip(" \t-") == "<<":
                    heredocs.append((word[0], tabs))
                i = word[2]
        elif c == "\n" or c in _OPERATORS:
            if words:
                line.append(words)
            words = []
            i += 2 if script.startswith(("&&", "||"), i) else 1
            if c == "\n":
                yield from line
                line = []
                for delimiter, tabs in heredocs:  # their bodies follow: no commands
                    i = _heredoc_end(script, i, delimiter, tabs)
                heredocs = []
        else:
            word = _word(script, i)
            if word is None:
                return
            text, expands, end = word
            words.append((text, expands))
            last, i = (i, end), end
    if words:
        line.append(words)
    yield from line


def _heredoc_end(script: str, i: int, delimiter: str, tabs: bool) -> int:
    """Where the here-document whose body starts at `i` ends: after its line that is
    `delimiter` (leading tabs stripped for `<<-`); bash reads to the end without one."""
    while i < len(script):
        end = script.find("\n", i)
        end = len(script) if end < 0 else end
        text = script[i:end]
        i = end + 1
        if (text.lstrip("\t") if tabs else text) == delimiter:
            break
    return i


def _word(script: str, i: int) -> tuple[str, bool, int] | None:
    """The shell word starting at `i`: its text, whether it expands, and where it ends; None
    for an unclosed quote or expansion."""
    out: list[str] = []
    expands = False
    n = len(script)
    while i < n and script[i] not in " \t\n" and script[i] not in _OPERATORS:
        c = script[i]
        if c == "`" or script.startswith(_OPENINGS, i):
            end = _expansion_end(script, i)
            if end is None:
                return None
            out.append(script[i:end])
            expands, i = True, end
        elif script.startswith("$'", i):  # ANSI-C quoting: left out as expanding
            end = _ansi_c_end(script, i + 2)
            if end is None:
                return None
            out.append(script[i:end])
            expands, i = True, end
        elif c == "'":
            end = script.find("'", i + 1)
            if end < 0:
                return None
            out.append(script[i + 1:end])
            i = end + 1
        elif c == '"':
            i += 1
            while i < n and script[i] != '"':
                if script[i] == "`" or script.startswith(_OPENINGS, i):
                    end = _expansion_end(script, i)
                    if end is None:
                        return None
                    out.append(script[i:end])
                    expands, i = True, end
                    continue
                if script.startswith("\\\n", i):  # a line continued, inside quotes too
                    i += 2
                    continue
                if script[i] == "\\" and i + 1 < n and script[i + 1] in _DOUBLE_QUOTE_ESCAPES:
                    i += 1
                expands = expands or _expands(script, i)
                out.append(script[i])
                i += 1
            if i >= n:
                return None
            i += 1
        elif c == "\\":
            if script.startswith("\\\n", i):
                i += 2
                continue
            out.append(script[i + 1:i + 2] or c)  # the script's last character: kept
            i += 2
        else:
            expands = expands or _expands(script, i)
            out.append(c)
            i += 1
    return "".join(out), expands, i


def _expands(script: str, i: int) -> bool:
    """A `$` at `i` that bash expands: one a name, a digit, `{`, `(` or a special parameter
    follows; else (`a=$`, `$/`) it stays text. `$'...'` and `$"..."` count as expanding."""
    return script[i] == "$" and bool(_EXPANDED_AFTER_DOLLAR.match(script, i + 1))


def _expansion_end(script: str, i: int) -> int | None:
    """Where the expansion opening at `i` (`$(...)`, `$((...))`, `${...}`, a backquote) ends,
    read through what it nests (quotes, parentheses, other expansions) as bash reads it to its
    closing; None when it is not closed. A loop over a stack of closings, not recursion: a
    file may nest thousands."""
    closing = ["`"] if script[i] == "`" else [_CLOSING[script[i + 1]]]
    j, n = i + (1 if closing[0] == "`" else 2), len(script)
    while j < n:
        c, inside = script[j], closing[-1]
        if c == "\\":
            j += 2
            continue
        j += 1
        if c == inside:
            closing.pop()
            if not closing:
                return j
        elif c == "$" and script.startswith("'", j) and inside != '"':
            end = _ansi_c_end(script, j + 1)
            if end is None:
                return None
            j = end
        elif c == "'" and inside != '"':
            end = script.find("'", j)
            if end < 0:
                return None
            j = end + 1
        elif c == "$" and j < n and script[j] in _CLOSING:
            closing.append(_CLOSING[script[j]])
            j += 1
        elif c == "`" or (c == '"' and inside != '"') or (c == "(" and inside == ")"):
            closing.append(")" if c == "(" else c)
    return None


def _ansi_c_end(script: str, i: int) -> int | None:
    """Where the `$'...'` whose text starts at `i` ends: after its closing quote, a backslash
    escaping the next character (`\\'` too: bash manual, ANSI-C Quoting); None when unclosed."""
    n = len(script)
    while i < n:
        if script[i] == "\\":
            i += 2
        elif script[i] == "'":
            return i + 1
        else:
            i += 1
    return None


def mcli_gpus(data: Mapping[str, Any]) -> int | None:
    """How many GPUs an MCLI run config asks for: `compute.gpus`, or the older `gpu_num`."""
    compute = data.get("compute")
    value = compute.get("gpus") if isinstance(compute, Mapping) else data.get("gpu_num")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def mcli_env(data: Mapping[str, Any]) -> dict[str, str]:
    """The environment an MCLI run config gives its train script: `env_variables`, a mapping of
    names to values (mcli 0.5+) or the older list of `{key: NAME, value: VALUE}` items
    (mosaicml-cli's EnvVarTranslation), then what its `command:` exports before the train call
    (`export NAME=VALUE`, `NAME=VALUE composer train.py ...`). Values as the run sees them,
    strings; items of neither shape, and words the shell expands from what is unknown here, are
    left out."""
    given = data.get("env_variables")
    if isinstance(given, Mapping):
        pairs = list(given.items())
    elif isinstance(given, list):
        pairs = [(item.get("key"), item.get("value")) for item in given
                 if isinstance(item, Mapping)]
    else:
        pairs = []
    env = {str(k): "" if v is None else str(v) for k, v in pairs
           if isinstance(k, str) and not isinstance(v, (Mapping, list))}
    merged = {**env, **_command_exports(data.get("command"), env)}
    return {k: v for k, v in merged.items() if v is not None}


_ASSIGNMENT = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)=(.*)", re.DOTALL)
#: `$NAME`, `${NAME}`, `${NAME-default}`, `${NAME:-default}` (a default without expansions).
_PARAMETER = re.compile(r"\$(?:(?P<bare>[A-Za-z_][A-Za-z0-9_]*)|\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)"
                        r"(?:(?P<colon>:?)-(?P<default>[^}$`\\\"']*))?\})")


def _expanded(text: str, env: Mapping[str, str | None]) -> str | None:
    """What bash makes of a parameter expansion `text` (unquoted or in double quotes) from the
    run's environment as known so far (`env`); None where that is unknown: another form, or a
    variable the run config does not set (the image's environment may)."""
    parameter = _PARAMETER.fullmatch(text[1:-1] if text[:1] == text[-1:] == '"' else text)
    if parameter is None:
        return None
    value = env.get(parameter["bare"] or parameter["name"])
    if parameter["default"] is not None and (value is None or parameter["colon"] and not value):
        return parameter["default"] if value is not None else None
    return value


def _command_exports(command: Any, given: Mapping[str, str] | None = None
                     ) -> dict[str, str | None]:
    """NAME -> value a shell script puts in the train (or eval) call's environment: its
    `export NAME=VALUE` commands before that call, and the assignments leading the call itself
    (bash passes both to the command it runs), over `given` (`env_variables`); an expansion of a
    variable set there or before (`export FSDP_VERSION=${FSDP_VERSION:-2}`) as bash expands it,
    None for any other (the run's, unknown here)."""
    if _train_arguments(command) is None:
        return {}
    env: dict[str, str | None] = dict(given or {})
    for words in _simple_commands(command):
        texts = [text for text, _ in words]
        leading = words[1:] if texts[0] == "export" else []
        trains = _parameters_at(texts) is not None
        if trains:
            leading = list(itertools.takewhile(lambda w: _ASSIGNMENT.fullmatch(w[0]), words))
        for text, expands in leading:
            assignment = _ASSIGNMENT.fullmatch(text)
            if assignment and not expands:
                env[assignment.group(1)] = assignment.group(2)
            elif assignment:
                env[assignment.group(1)] = _expanded(assignment.group(2), env)
        if trains:
            break
    return {k: v for k, v in env.items() if given is None or k not in given or v != given[k]}


@rule("FP8401", "error", "an MCLI run config whose `parameters` is not a mapping, or that has "
      f"none although its command trains from {PARAMETERS_FILE}",
      why="MCLI writes `parameters` as given to /mnt/config/parameters.yaml, the file the "
      "command hands LLM-Foundry's train script (LLM-Foundry's mcli/*.yaml); train_from_yaml "
      "asserts the loaded config is a mapping (a number or a list fails; null or no "
      "`parameters` leaves the file empty or missing; `{}` fails at the first key train reads, "
      "global_train_batch_size). An MCLI config without `parameters` "
      "whose command does not read that file has nothing to lint (skipped).",
      source="LLM-Foundry 0.22.0 llmfoundry/command_utils/train.py train_from_yaml (`assert "
      "isinstance(yaml_cfg, DictConfig)`); LLM-Foundry mcli/mcli-hf-eval.yaml ('injected as a "
      "YAML file: /mnt/config/parameters.yaml', `composer eval/eval.py "
      "/mnt/config/parameters.yaml`); mosaicml-cli RunConfig (`parameters: Dict[str, Any]`)",
      fix="write `parameters:` as the train config mapping (its keys indented under it)",
      family="mcli")
def parameters_not_a_config(data: Mapping[str, Any], ctx: LintContext) -> Iterator[Hit]:
    params = data.get("parameters")
    if params is not None and not isinstance(params, Mapping):
        yield Hit("parameters", f"`parameters` must be a mapping (the train config MCLI "
                  f"writes to {PARAMETERS_FILE}), got {shown(params)}")
    elif not params and trains_from_parameters(data):
        key = "parameters" if "parameters" in data else \
            next(k for k in ("command", "entrypoint") if _train_arguments(data.get(k)) is not None)
        yield Hit(key, f"the {key if key != 'parameters' else 'command'} trains from "
                  f"{PARAMETERS_FILE}, but this run config gives "
                  + ("no `parameters`" if key != "parameters" else "`parameters: null`"
                     if params is None else "an empty `parameters`")
                  + ": the script finds no train config there")


@rule("FP8402", "warning", "a key an MCLI run config gives twice in one mapping (MCLI keeps the "
      "last)",
      why="MCLI reads a run config with yaml.safe_load, which keeps the last of a key given "
      "twice in one mapping and drops the others without a word; MCLI then writes `parameters` "
      "with that value alone, so the run trains with the last one, while LLM-Foundry's own "
      "reader (omegaconf) refuses the same file. The linter judges the value MCLI keeps.",
      source="mosaicml-cli 0.7.5 mcli/utils/utils_yaml.py load_yaml (yaml.safe_load), "
      "mcli/utils/utils_config.py from_file; PyYAML constructor.py construct_mapping (a later "
      "key overwrites)",
      fix="delete the copy you did not mean (the message names both lines)", family="mcli")
def duplicate_keys(data: Mapping[str, Any], ctx: LintContext) -> Iterator[Hit]:
    for key, dropped, kept in ctx.duplicates:
        yield Hit(key, f"`{key.rpartition('.')[2]}` is given twice in this mapping (lines "
                  f"{dropped} and {kept}): MCLI's reader keeps line {kept} and silently drops "
                  f"line {dropped}, and the linter judges line {kept}")


@dataclass(frozen=True)
class Pin:
    """A version the run config installs: `field` of `foundry_fp8.environment.Snapshot` it sets,
    the version text, and the key of the file that pins it."""

    field: str
    version: str
    key: str
    package: str = ""


#: pip names (normalized: lower case, `-` for `_` and `.`) of what version-dependent rules read,
#: with the Snapshot fields a pin sets. `transformer-engine==X` alone is TE's metapackage alone;
#: a `git_repo`/`git+` install of TE's repository builds TE from source into that one
#: distribution, with no separate torch extension or core package.
PINNED_PACKAGES: dict[str, tuple[str, ...]] = {
    "transformer-engine": ("te",),
    "transformer-engine-torch": ("te_torch",),
    "transformer-engine-cu12": ("te_core",),
    "transformer-engine-cu13": ("te_core",),
    "llm-foundry": ("llmfoundry",),
    "mosaicml": ("composer",),
    "torch": ("torch",),
}
#: What `transformer-engine[pytorch]==X` installs besides the metapackage: the torch extension
#: and the core package at X (TE's setup.py pins its extras to its own version).
TE_PYTORCH_EXTRA = ("te_torch", "te_core")
#: GitHub repositories whose ref (`git_branch`, `git_commit`, `@ref`) names a release.
PINNED_REPOS = {"nvidia/transformerengine": "transformer-engine",
                "mosaicml/llm-foundry": "llm-foundry", "mosaicml/composer": "mosaicml"}
#: The rules that judge the versions installed where the linter runs, with the Snapshot fields
#: each reads: for an MCLI run config that pins them, they judge the pinned versions, and say so.
PIN_RULES: dict[str, tuple[str, ...]] = {
    "FP8027": ("te",), "FP8030": ("llmfoundry",), "FP8031": ("composer", "torch"),
    "FP8204": ("te",), "FP8205": ("te", "te_torch", "te_core"), "FP8207": ("te",),
    "FP8208": ("te",),
}
_GIT_URL = re.compile(r"github\.com[/:]([\w.-]+/[\w.-]+?)(?:\.git)?@([\w.+-]+)")
#: MosaicML's images name the torch they ship first (`mosaicml/pytorch:2.1.0_cu121-...`,
#: `mosaicml/llm-foundry:2.6.0_cu124-latest`).
_MOSAIC_IMAGE = re.compile(r"^mosaicml/(?:pytorch|llm-foundry)[\w-]*:(\d+\.\d+\.\d+)")


def _release(ref: Any) -> str | None:
    """The release a git ref names (`v2.8`, `release_v2.8`, `v0.22.0`), None for others."""
    match = re.fullmatch(r"(?:release_)?v?(\d+\.\d+(?:\.\d+)?)", str(ref)) if ref else None
    return match.group(1) if match else None


def _requirement_pins(text: str, key: str) -> Iterator[Pin]:
    for token in text.split():
        token = token.strip("'\"")
        found = parse_requirement(token)
        if found and found.marker is None and len(found.clauses) == 1 \
                and found.clauses[0][0] == "==":
            name, version = found.distribution, found.clauses[0][1]
            extra = name == "transformer-engine" and "pytorch" in found.extras
            for field in PINNED_PACKAGES.get(name, ()) + (TE_PYTORCH_EXTRA if extra else ()):
                yield Pin(field, version, key, name)
            continue
        url = _GIT_URL.search(token)
        package = PINNED_REPOS.get(url.group(1).lower()) if url else None
        version = _release(url.group(2)) if url else None
        if package and version:
            for field in PINNED_PACKAGES[package]:
                yield Pin(field, version, key)


def pins(data: Mapping[str, Any]) -> list[Pin]:
    """The versions an MCLI run config installs: `pip_packages` integrations, `git_repo`
    integrations at a release ref, `pip install` lines of its command, and the torch of a
    MosaicML image; a later pin of a field wins, as the later install does."""
    found: list[Pin] = []
    image = data.get("image")
    match = _MOSAIC_IMAGE.match(image) if isinstance(image, str) else None
    if match:
        found.append(Pin("torch", match.group(1), "image"))
    integrations = data.get("integrations")
    for index, item in enumerate(integrations if isinstance(integrations, list) else []):
        if not isinstance(item, Mapping):
            continue
        kind = item.get("integration_type")
        if kind == "pip_packages" and isinstance(item.get("packages"), list):
            for n, package in enumerate(item["packages"]):
                if isinstance(package, str):
                    found += _requirement_pins(package, f"integrations.{index}.packages.{n}")
        elif kind == "git_repo" and isinstance(item.get("git_repo"), str):
            package = PINNED_REPOS.get(item["git_repo"].lower().removesuffix(".git"))
            ref = next((k for k in ("git_commit", "git_branch") if item.get(k)), None)
            version = _release(item.get(ref)) if ref else None
            if package and ref and version:
                found += [Pin(field, version, f"integrations.{index}.{ref}")
                          for field in PINNED_PACKAGES[package]]
    for key in ("command", "entrypoint"):
        text = data.get(key)
        if isinstance(text, str) and "pip" in text:
            found += [pin for line in text.splitlines() if "pip" in line and "install" in line
                      for pin in _requirement_pins(line, key)]
    return list({pin.field: pin for pin in found}.values())


def unjudged_rules(pinned: Mapping[str, Pin]) -> frozenset[str]:
    """The PIN_RULES a run config's pins leave without the versions they judge. A run that pins
    torch (its image's, or a `pip install torch==X`) or LLM-Foundry but not Composer gets the
    Composer its image ships or pip resolves for them, not the linting machine's; pip resolves
    one whose own torch pin holds that torch (Composer 0.32.1 requires torch>=2.6.0,<2.7.1,
    FP8031's range; LLM-Foundry 0.16.0 pins Composer 0.28 with torch 2.5.1), so FP8031 cannot
    be told for it."""
    return frozenset({"FP8031"}) if pinned.keys() & {"torch", "llmfoundry"} \
        and "composer" not in pinned else frozenset()


def pinned_note(fields: tuple[str, ...], pinned: Mapping[str, Pin]) -> str:
    """What a version-dependent finding judged: the versions this run config pins."""
    used: dict[tuple[str, str], Pin] = {}
    for field in fields:
        if field in pinned:  # one mention per pin (transformer-engine[pytorch] sets three)
            used.setdefault((pinned[field].key, pinned[field].version), pinned[field])
    return "; judged against " + ", ".join(
        f"{_LABELS[p.field]} {p.version} as this run config pins it (`{p.key}`)"
        for p in used.values()) if used else ""


_LABELS = {"te": "TransformerEngine", "te_torch": "transformer-engine-torch",
           "te_core": "TransformerEngine's core package", "llmfoundry": "LLM-Foundry",
           "composer": "Composer", "torch": "torch"}


#: The environment rules that judge TE's packages and version alone (not the machine's GPU or
#: imports): run on the TE an MCLI run config pins.
PINNED_ENVIRONMENT_RULES = frozenset({"FP8204", "FP8205", "FP8207", "FP8208"})


def _pinned_te(pinned: Mapping[str, Pin]) -> dict[str, Any]:
    """Every TE field of Snapshot for the TE a run config pins (none pinned: nothing): the
    linting machine's TE packages are not the run's. `te_pure_wheel`: the metapackage comes
    from PyPI (a pip requirement), not from a source build."""
    te = {f: p for f, p in pinned.items() if f.startswith("te")}
    if not te:
        return {}
    core, meta = te.get("te_core"), te.get("te")
    return {"te": meta.version if meta else None,
            "te_torch": te["te_torch"].version if "te_torch" in te else None,
            "te_core": core.version if core else None,
            "te_core_package": core.package if core and core.package
            != "transformer-engine" else None,
            "te_pure_wheel": meta is not None and meta.package == "transformer-engine"}


def pinned_snapshot(snapshot: Snapshot | None, pinned: Mapping[str, Pin]) -> Snapshot | None:
    """The machine the run gets: `snapshot` (where the linter runs) with the pinned versions."""
    if snapshot is None or not pinned:
        return snapshot
    return replace(snapshot, **{f: p.version for f, p in pinned.items()
                                if not f.startswith("te")}, **_pinned_te(pinned))


def pinned_te_findings(config: Mapping[str, Any], pinned: Mapping[str, Pin],
                       context: LintContext) -> list[Finding]:
    """PINNED_ENVIRONMENT_RULES on the TE packages the run config pins (none pinned: nothing;
    `foundry-fp8 lint` does not judge its own machine's TE), keyed at the pin for FP8204 and
    FP8205 and at `parameters.<key>` for the others. FP8204 is an error here: it reports only
    for a run that uses TE, which cannot start."""
    te = _pinned_te(pinned)
    if not te:
        return []
    where = next(p for f, p in sorted(pinned.items(), key=lambda i: i[0] != "te_torch")
                 if f.startswith("te")).key
    return [replace(f, key=where if f.key == "transformer_engine" else f"parameters.{f.key}",
                    severity="error")
            for f in run_rules("environment", Environment(Snapshot(python="", **te), config,
                                                          pinned=True), context,
                               only=lambda r: r.id in PINNED_ENVIRONMENT_RULES)]
