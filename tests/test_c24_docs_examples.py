"""What a user pastes from README.md and docs/*.md works as written. Every ```yaml block parses,
lints without errors and builds each of its `algorithms`/`callbacks`/`loggers` entries through
LLM-Foundry's own registries with exactly its keys (a key our classes do not take is a
TypeError at the run's start); every inline `entry: {...}` or `section.entry.option: value`
snippet builds (ours) or binds to the class's signature (Composer's loggers); a bare
`option: value` on an entry's own page is a value that entry takes, and the ones the docs give
as refused are refused; every `foundry-fp8 ...` command parses with the CLI's own parser, every
`make` target is in the Makefile, every `python <script>` exists. Parsing, linting and
construction only: no training."""

from __future__ import annotations

import contextlib
import copy
import inspect
import io
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from foundry_fp8.cli import build_parser
from foundry_fp8.lint.cli import lint_file
from foundry_fp8.options import ENTRIES

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BASE = ROOT / "yamls" / "mpt-tiny-cpu.yaml"  # what a fragment is merged into
SECTIONS = ("algorithms", "callbacks", "loggers")
#: The page that documents each entry: a bare `option: value` there is that entry's option.
PAGES = {"fp8_stats.md": "fp8_stats", "fp8_guard.md": "fp8_guard", "fp8_state.md": "fp8_state",
         "te_swap.md": "te_swap", "emulation.md": "te_swap", "lint.md": "fp8_lint",
         "reliability.md": "jsonl"}
#: Bare snippets the docs give as refused or as a placeholder, not as something to paste.
NOT_TAKEN = {("fp8_stats.md", "start: '10ba'"),  # "is refused, naming the key"
             ("lint.md", "fail_on: warning"),  # FP8023's example of a refused value
             ("fp8_guard.md", "repromote_after: N")}  # N: the count the sentence goes on with


def _where(doc: Path, text: str, offset: int) -> str:
    return f"{doc.relative_to(ROOT)}:{text.count(chr(10), 0, offset) + 1}"


def fenced(doc: Path) -> list[tuple[str, str, str]]:
    """(info string, body, where) of each fenced block."""
    text = doc.read_text()
    return [(m[1], m[2], _where(doc, text, m.start()))
            for m in re.finditer(r"^```([^\n]*)\n(.*?)^```", text, flags=re.M | re.S)]


def spans(doc: Path) -> list[tuple[str, str]]:
    """(inline code, where) outside the fenced blocks (blanked, keeping the line numbers); a
    span wrapped over lines (`te_swap: {backend:` / `emulate}`) is read as one line."""
    text = re.sub(r"^```.*?^```", lambda m: "\n" * m[0].count("\n"), doc.read_text(),
                  flags=re.M | re.S)
    return [(re.sub(r"\s*\n\s*", " ", m[1]), _where(doc, text, m.start()))
            for m in re.finditer(r"(?<!`)`([^`]+)`(?!`)", text)]


def yaml_blocks() -> list[tuple[str, str]]:
    return [(body, where) for doc in DOCS for info, body, where in fenced(doc)
            if info.split()[:1] == ["yaml"]]


def command_lines() -> list[tuple[str, str]]:
    """Each shell command of the bash blocks (comments dropped, split at `|`, `&&`, `;`) and of
    the inline code spans, with where it is."""
    found = []
    for doc in DOCS:
        for info, body, where in fenced(doc):
            if info.split()[:1] == ["bash"]:
                path, line = where.rsplit(":", 1)
                found += [(cmd, f"{path}:{int(line) + 1 + n}")
                          for n, text in enumerate(body.splitlines())
                          for cmd in re.split(r"\s*(?:\|\||&&|\||;)\s*",
                                              re.sub(r"(^|\s)#.*", "", text))]
        found += [(cmd, where) for code, where in spans(doc)
                  for cmd in re.split(r"\s*(?:\|\||&&|\||;)\s*", code)]
    return [(cmd.strip(), where) for cmd, where in found if cmd.strip()]


def _merged(base: dict[str, Any], fragment: dict[str, Any]) -> dict[str, Any]:
    """`fragment` added to `base` as a user adds it to their YAML: its entries replace the
    base's entries of the same name, its other keys the base's."""
    config = copy.deepcopy(base)
    for key, value in fragment.items():
        if key in SECTIONS and isinstance(value, dict):
            config[key] = {**(config.get(key) or {}), **value}
        else:
            config[key] = value
    return config


def config_of(block: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the train config a block is pasted into, the sections whose entries it sets): a whole
    config as it is, te_swap options (the recipe block) into the base's te_swap, any other
    fragment added to the base."""
    if "model" in block:
        return block, block
    base = yaml.safe_load(BASE.read_text())
    if set(block) <= set(ENTRIES["te_swap"].option_names()):
        swap = {"algorithms": {"te_swap": {**base["algorithms"]["te_swap"], **block}}}
        return _merged(base, swap), swap
    return _merged(base, block), block


@pytest.fixture
def registries(fake_te, monkeypatch):
    """LLM-Foundry's registries, on a stand-in TE (te_swap's `backend: te` checks TE at
    construction) and without fp8_lint's machine rules: the blocks are for an H100, this is a
    CPU machine, and the config's own findings are what is checked."""
    from llmfoundry import registry

    import foundry_fp8.composer.lint as lint_callback

    fake_te()
    monkeypatch.setattr(lint_callback, "environment_findings", lambda snapshot, config: [])
    return registry


def build(registry: Any, section: str, name: str, options: dict[str, Any],
          config: dict[str, Any]) -> Any:
    """Entry `name` of `section` built as LLM-Foundry's builders build it (`callbacks_with_
    config` ones get the resolved train config); not ours: its signature takes the keys."""
    from omegaconf import OmegaConf

    if section == "callbacks" and name in registry.callbacks_with_config:
        resolved = OmegaConf.to_container(OmegaConf.create(config), resolve=True)
        return registry.callbacks_with_config.get(name)(train_config=resolved, **options)
    cls = getattr(registry, section).get(name)
    if name not in ENTRIES:
        return inspect.signature(cls).bind(**options)
    return cls(**options)


def test_the_extraction_reads_the_docs():
    """The readers above find what the docs hold (a reworded fence must be read, not skipped)."""
    assert {where.split(":")[0] for _, where in BLOCKS} >= {
        "README.md", "docs/cpu_try.md", "docs/fp8_guard.md", "docs/te_swap.md"}
    subcommands = {shlex.split(cmd)[1] for cmd, _ in command_lines()
                   if cmd.startswith("foundry-fp8 ") and len(shlex.split(cmd)) > 2}
    assert subcommands >= {"lint", "report", "doctor", "tiny-data"}
    assert len(INLINE) >= 8 and len(page_options()) >= 40


BLOCKS = yaml_blocks()


@pytest.mark.parametrize(("body", "where"), BLOCKS, ids=[where for _, where in BLOCKS])
def test_yaml_block_lints_and_builds(body, where, registries, tmp_path):
    block = yaml.safe_load(body)
    config, entries = config_of(block)
    path = tmp_path / "pasted.yaml"
    path.write_text(body if config is block else yaml.safe_dump(config, sort_keys=False))
    report = lint_file(path)
    assert report["error"] is None, where
    assert [f"{f['rule']} {f['key']}: {f['message']}" for f in report["findings"]
            if f["severity"] == "error"] == [], where
    for section in SECTIONS:
        for name, options in (entries.get(section) or {}).items():
            build(registries, section, name, dict(options or {}), config)


def _parsed(code: str) -> Any:
    """`code` as YAML, None where it is prose (a message, a pattern, a tag example such as
    `x: !!bool maybe`, on which PyYAML raises KeyError)."""
    try:
        return yaml.safe_load(code)
    except (yaml.YAMLError, ValueError, LookupError):
        return None


def _message(value: Any) -> bool:
    """Whether a value holds words (`callbacks.fp8_stats.end: must be greater than start`):
    an error message quoted, not an option to paste."""
    if isinstance(value, dict):
        return any(_message(v) for v in value.values())
    return isinstance(value, str) and " " in value


def _nested(path: list[str], value: Any) -> Any:
    return value if not path else {path[0]: _nested(path[1:], value)}


def inline_entries() -> list[tuple[str, str, str, dict[str, Any]]]:
    """(section, entry, where, options) of each inline `section: {entry: {...}}`,
    `entry: {...}` (ours) and `section.entry.key...: value` that parses as YAML; those with
    `...` or `<placeholders>` left out (a shape, not something to paste), and messages."""
    found = []
    for doc in DOCS:
        for code, where in spans(doc):
            parsed = _parsed(code)
            if "..." in code or "<" in code or not isinstance(parsed, dict) or len(parsed) != 1:
                continue
            [(key, value)] = parsed.items()
            path = str(key).split(".")
            if path[0] in ENTRIES and len(path) == 1:
                path = [ENTRIES[key].section, key]
            if path[0] not in SECTIONS:
                continue
            if len(path) == 1:
                items = list(value.items()) if isinstance(value, dict) else []
            else:
                items = [(path[1], _nested(path[2:], value))]
            found += [(path[0], name, where, options or {}) for name, options in items
                      if (options is None or isinstance(options, dict))
                      and not _message(options)]
    return found


INLINE = inline_entries()


@pytest.mark.parametrize(("section", "name", "where", "options"), INLINE,
                         ids=[f"{where}:{name}" for _, name, where, _ in INLINE])
def test_inline_entry_snippet_builds(section, name, where, options, registries):
    config = yaml.safe_load(BASE.read_text())
    build(registries, section, name, options, config)


def page_options() -> list[tuple[str, str, str, dict[str, Any]]]:
    """(entry, code, where, mapping) of each bare `option: value` on an entry's own page whose
    key is an option of that entry."""
    found = []
    for doc in DOCS:
        entry = PAGES.get(doc.name)
        for code, where in spans(doc) if entry else []:
            parsed = _parsed(code)
            if (isinstance(parsed, dict) and len(parsed) == 1
                    and next(iter(parsed)) in ENTRIES[entry].option_names()):
                found.append((entry, code, where, parsed))
    return found


def test_bare_options_on_an_entrys_page_are_values_it_takes():
    wrong, refused = [], set()
    for entry, code, where, mapping in page_options():
        name = Path(where.split(":")[0]).name
        problems = ENTRIES[entry].problems(mapping)
        if (name, code) in NOT_TAKEN:
            refused.add((name, code))
            assert problems, f"{where}: `{code}` is given as refused, but {entry} takes it"
        elif problems:
            wrong.append(f"{where}: `{code}`: {entry}.{problems[0].key} {problems[0].detail}")
    assert wrong == []
    assert refused == NOT_TAKEN  # each exception is still in the docs


def _parse(words: list[str]) -> str | None:
    """Why the CLI's parser refuses `foundry-fp8 <words>`, or None."""
    out = io.StringIO()
    try:
        with contextlib.redirect_stderr(out), contextlib.redirect_stdout(out):
            _, unknown = build_parser().parse_known_args(words)
    except SystemExit as stop:
        return f"exit {stop.code}: {out.getvalue().strip().splitlines()[-1:]}"
    return f"unrecognized {unknown}" if unknown else None


def test_foundry_fp8_commands_parse():
    parser = build_parser()
    [group] = [a for a in parser._actions if a.dest == "command"]
    wrong, parsed = [], 0
    for cmd, where in command_lines():
        if not re.match(r"foundry-fp8 [\w-]+(\s|$)", cmd):
            continue  # `foundry-fp8: interrupted`, `foundry-fp8 doctor: checking`: messages
        words = shlex.split(cmd)[1:]
        if words[0] not in group.choices:
            wrong.append(f"{where}: `{cmd}`: no subcommand {words[0]!r}")
        elif "[" in cmd:  # a usage line: `report RUN_FOLDER [--out DIR] ...`
            options = {o for a in group.choices[words[0]]._actions for o in a.option_strings}
            wrong += [f"{where}: `{cmd}`: no option {o}" for o in
                      re.findall(r"--[\w-]+", cmd) if o not in options]
        elif len(words) > 1:  # a bare `foundry-fp8 lint` names the subcommand
            rest = [w for w in words if w not in ("-h", "--help")]
            if (why := _parse(rest) if len(rest) > 1 or rest == words else None):
                wrong.append(f"{where}: `{cmd}`: {why}")
            parsed += 1
    assert wrong == []
    assert parsed >= 15


def test_make_targets_and_scripts_exist():
    targets = set(re.findall(r"^([\w.-]+):", (ROOT / "Makefile").read_text(), flags=re.M))
    wrong, seen = [], 0
    for cmd, where in command_lines():
        words = cmd.split()
        if words[0] == "make" and len(words) > 1:
            seen += 1
            wrong += [f"{where}: make {t}: no such target" for t in words[1:]
                      if not t.startswith("-") and "=" not in t and t not in targets]
        elif re.fullmatch(r"(\.venv/bin/)?python3?", words[0]) and len(words) > 1 \
                and words[1].endswith(".py") and not (ROOT / words[1]).is_file():
            wrong.append(f"{where}: {words[1]} is not in the repository")
    assert wrong == []
    assert seen >= 5
