"""`foundry-fp8 lint cfg.yaml --override KEY=VALUE...`: the config as `llmfoundry train cfg.yaml
KEY=VALUE...` (or `composer train.py`) will run it, its command-line overrides merged in. The
reference is LLM-Foundry's own reading (llmfoundry/command_utils/train.py train_from_yaml):
`om.load`, `om.merge(yaml_cfg, om.from_cli(args_list))`, then resolution."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from foundry_fp8.cli import main
from foundry_fp8.lint.load import LintInputError, load_config, read_overrides
from foundry_fp8.lint.rules.mcli import command_overrides

HANG_GUARD_S = 60

#: A zoo file's shape: `variables`, an anchor and merge keys for the loaders, interpolations.
ZOO = """\
variables:
  max_seq_len: 2048
  data_local: ./c4
max_seq_len: ${variables.max_seq_len}
train_loader: &loader
  name: text
  dataset: &ds
    local: ${variables.data_local}
    split: train
    max_seq_len: ${variables.max_seq_len}
  drop_last: true
eval_loader:
  <<: *loader
  dataset:
    <<: *ds
    split: val
model:
  name: mpt_causal_lm
  d_model: 2048
  n_heads: 16
  n_layers: 24
  expansion_ratio: 4
  max_seq_len: ${variables.max_seq_len}
  vocab_size: 50368
  loss_fn: torch_crossentropy
tokenizer: {name: EleutherAI/gpt-neox-20b}
optimizer: {name: decoupled_adamw, lr: 1.0e-4, betas: [0.9, 0.95]}
scheduler: {name: cosine_with_warmup, t_warmup: 100ba}
max_duration: 10ba
global_train_batch_size: 64
device_train_microbatch_size: 8
precision: amp_bf16
fsdp_config: {mixed_precision: PURE}
algorithms:
  te_swap: {backend: emulate}
"""


def _line_of(text: str, key_text: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1)
                if line.lstrip().startswith(key_text))


def _foundry_reads(path: Path, args: list[str]) -> dict:
    """The config LLM-Foundry's train_from_yaml trains from, resolved."""
    with open(path) as f:
        yaml_cfg = OmegaConf.load(f)
    return OmegaConf.to_container(OmegaConf.merge(yaml_cfg, OmegaConf.from_cli(args)),
                                  resolve=True)


@pytest.mark.parametrize("args", [
    ["precision=amp_fp8", "model.n_layers=2"],
    ["variables.max_seq_len=512", "variables.data_local=/data/c4"],  # through interpolation
    ["eval_loader.dataset.split=test", "optimizer.betas=[0.8,0.9]"],  # into a merge key's copy
    ["model={n_layers: 4, d_model: 256}", "callbacks.fp8_lint={}"],  # mappings merge key by key
    [r"model\.d_model=3"],  # omegaconf's escaped dot: a top-level key holding a dot
])
def test_overrides_give_the_config_llm_foundry_trains_from(tmp_path, args):
    path = tmp_path / "zoo.yaml"
    path.write_text(ZOO)
    loaded = load_config(path, overrides=read_overrides(args))
    assert loaded.config == _foundry_reads(path, args)


def test_a_finding_an_override_causes_names_it_at_the_files_key(tmp_path, capsys):
    path = tmp_path / "zoo.yaml"
    path.write_text(ZOO)
    assert main(["lint", str(path), "--format", "json"]) == 0  # as written: nothing wrong
    capsys.readouterr()
    code = main(["lint", str(path), "--format", "json", "--override", "model.d_model=2056",
                 "model.attn_config.attn_tpye=torch"])
    [entry] = json.loads(capsys.readouterr().out)["files"]
    assert code == 1, entry
    found = {(f["rule"], f["key"]): f for f in entry["findings"]}
    d_model = found["FP8005", "model.d_model"]
    assert d_model["line"] == _line_of(ZOO, "d_model:")  # the key the file writes
    assert d_model["message"].endswith("(set by --override model.d_model=2056)")
    # a key only the override writes has no line in the file: not its parent's (model:)
    n_heads = found["FP8035", "model.n_heads"]  # at a key the file's value still holds
    assert n_heads["line"] == _line_of(ZOO, "n_heads:") and "--override" not in n_heads["message"]
    typo = found["FP8042", "model.attn_config.attn_tpye"]  # MPT's TypeError building it
    assert typo["line"] is None  # not model's line: the file has no attn_config
    assert typo["message"].endswith("(set by --override model.attn_config.attn_tpye=torch)")


def test_an_override_filling_a_missing_key_satisfies_the_run(tmp_path, capsys):
    """FP8038 judges the merged config: max_duration given on the command line is there."""
    path = tmp_path / "zoo.yaml"
    path.write_text(ZOO.replace("max_duration: 10ba\n", ""))
    assert main(["lint", str(path), "--format", "json"]) == 1
    assert "FP8038" in capsys.readouterr().out
    assert main(["lint", str(path), "--format", "json", "--override", "max_duration=10ba"]) == 0


def test_an_mcli_run_configs_parameters_take_the_overrides(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text("name: r\nimage: mosaicml/llm-foundry:2.7.0_cu128-latest\ncompute: {gpus: 8}"
                    "\ncommand: composer train/train.py /mnt/config/parameters.yaml\n"
                    "parameters:\n" + "".join(f"  {line}\n" for line in ZOO.splitlines()))
    assert main(["lint", str(path), "--format", "json", "--override", "model.n_heads=0"]) == 1
    [entry] = json.loads(capsys.readouterr().out)["files"]
    [finding] = [f for f in entry["findings"] if f["key"] == "parameters.model.n_heads"]
    assert finding["rule"] == "FP8035" and finding["line"] == _line_of(path.read_text(),
                                                                        "n_heads:")


def _lint(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "foundry_fp8.cli", "lint", *args],
                          capture_output=True, text=True, timeout=HANG_GUARD_S, check=False)


@pytest.mark.parametrize(("args", "said"), [
    # omegaconf refuses to merge a mapping into the file's list (TypeError in train_from_yaml)
    (["optimizer.betas.x=1"], ":{betas}: --override optimizer.betas.x=1: cannot merge"),
    (["a=[1,"], "--override a=[1,: omegaconf cannot read it"),
    # a config path after --override: from_dotlist would read it as a key set to null
    (["precision=amp_fp8", "other.yaml"], "--override 'other.yaml': not KEY=VALUE"),
])
def test_a_bad_override_is_one_line_and_exit_2(tmp_path, args, said):
    path = tmp_path / "zoo.yaml"
    path.write_text(ZOO)
    done = _lint(str(path), "--override", *args)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    [line] = done.stderr.splitlines()
    assert said.format(betas=_line_of(ZOO, "optimizer:")) in line
    if "cannot merge" in said:  # omegaconf's own refusal, as LLM-Foundry meets it
        with pytest.raises(TypeError, match="Cannot merge incompatible container types"):
            _foundry_reads(path, args)


def test_read_overrides_refuses_what_from_dotlist_refuses_together():
    """Each reads alone; together omegaconf's from_dotlist (as om.from_cli) raises."""
    with pytest.raises(ValueError):
        OmegaConf.from_dotlist(["a=[1]", "a.b=2"])
    with pytest.raises(LintInputError, match="--override a=.1., --override a.b=2: omegaconf cannot read "
                       "them together"):
        read_overrides(["a=[1]", "a.b=2"])


def _mcli(tmp_path: Path, command: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text("name: r\nimage: mosaicml/llm-foundry:2.7.0_cu128-latest\ncompute: {gpus: 8}"
                    f"\ncommand: |\n  cd llm-foundry/scripts\n  {command}\n  echo done\n"
                    "parameters:\n" + "".join(f"  {line}\n" for line in ZOO.splitlines()))
    return path


def test_an_mcli_commands_own_overrides_are_merged_as_train_py_merges_them(tmp_path, capsys):
    """`composer train/train.py /mnt/config/parameters.yaml KEY=VALUE...`: train.py hands
    sys.argv[2:] to train_from_yaml, so the run trains with them (and `--override`'s after)."""
    args = ["model.n_heads=0", "variables.max_seq_len=512"]
    path = _mcli(tmp_path, "composer train/train.py /mnt/config/parameters.yaml "
                 + " ".join(args) + " 2>&1 | tee log.txt")
    assert main(["lint", str(path), "--format", "json", "--override", "max_duration=5ba"]) == 1
    [entry] = json.loads(capsys.readouterr().out)["files"]
    [finding] = [f for f in entry["findings"] if f["key"] == "parameters.model.n_heads"]
    assert finding["rule"] == "FP8035" and finding["line"] == _line_of(path.read_text(),
                                                                        "n_heads:")
    assert finding["message"].endswith("(set by `command:`'s model.n_heads=0)")
    params = tmp_path / "parameters.yaml"  # what MCLI writes to /mnt/config/parameters.yaml
    params.write_text(ZOO)
    reference = _foundry_reads(params, [*args, "max_duration=5ba"])
    run = yaml.safe_load(path.read_text())  # MCLI's own reader
    assert command_overrides(run) == args  # up to the shell's `2>&1 | tee`
    loaded = load_config(path, subtree="parameters",
                         overrides=read_overrides(["max_duration=5ba"], command_overrides(run)))
    assert loaded.config == reference and reference["model"]["max_seq_len"] == 512
    assert command_overrides({"command": "composer train.py /mnt/config/parameters.yaml"}) == []


def test_an_mcli_command_override_omegaconf_refuses_is_one_line_at_the_command(tmp_path):
    path = _mcli(tmp_path, "composer train/train.py /mnt/config/parameters.yaml 'a=[1,'")
    done = _lint(str(path))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    [line] = done.stderr.splitlines()
    assert line.startswith(f"error: {path}:{_line_of(path.read_text(), 'command:')}: "
                           "`command:`'s a=[1,: omegaconf cannot read it")


def test_a_key_omegaconf_cannot_split_is_one_line_as_any_it_refuses(tmp_path, monkeypatch,
                                                                    capsys):
    """A key opening a `[` it never closes: omegaconf's from_dotlist (train_from_yaml's
    om.from_cli) raises a plain IndexError (omegaconf.py:1429), so LLM-Foundry cannot read the
    override; a file's own such key loads there, and lints."""
    with pytest.raises(IndexError):
        OmegaConf.from_dotlist(["[=1"])
    path = tmp_path / "zoo.yaml"
    path.write_text(ZOO)
    done = _lint(str(path), "--override", "[=1")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.splitlines() == ["error: --override [=1: omegaconf cannot read it: "
                                        "list index out of range"]
    run = _mcli(tmp_path, f"composer train/train.py {P} [x=1")
    done = _lint(str(run))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    [line] = done.stderr.splitlines()
    assert line == (f"error: {run}:{_line_of(run.read_text(), 'command:')}: `command:`'s [x=1: "
                    "omegaconf cannot read it: list index out of range")
    monkeypatch.setenv("FP8_QA_DIR", "/data")
    path.write_text(ZOO.replace("variables:\n", 'variables:\n  "[": ${oc.env:FP8_QA_DIR}\n'))
    assert OmegaConf.to_container(OmegaConf.load(path), resolve=True)["variables"]["["] == "/data"
    assert main(["lint", str(path), "--format", "json"]) == 1
    findings = json.loads(capsys.readouterr().out)["files"][0]["findings"]
    # LLM-Foundry clears the oc.env resolver: the file's one finding, at the key
    assert [(f["rule"], f["key"], f["line"]) for f in findings] == [("FP8017", "variables.[", 2)]


def test_a_files_oc_env_value_at_a_key_omegaconf_splits_otherwise_stays_at_that_key(
        tmp_path, monkeypatch, capsys):
    """The linted config keeps an `${oc.env:...}` value as its text at its own key: a key
    OmegaConf.update splits by its own grammar (`a[` as `a`, `m.x` as `m`, `x`) wrote the
    text over another key's value or into a new key; omegaconf's own load is the reference."""
    monkeypatch.setenv("FP8_QA_DIR", "/data")
    path = tmp_path / "zoo.yaml"
    path.write_text('variables:\n  a: 5\n  "a[": ${oc.env:FP8_QA_DIR}\n'
                    '  "m.x": ${oc.env:FP8_QA_DIR}\n"[": ${oc.env:FP8_QA_DIR}\n')
    resolved = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    assert resolved == {"variables": {"a": 5, "a[": "/data", "m.x": "/data"}, "[": "/data"}
    text = "${oc.env:FP8_QA_DIR}"
    assert load_config(path).config == {"variables": {"a": 5, "a[": text, "m.x": text}, "[": text}
    assert main(["lint", str(path), "--format", "json"]) == 1
    findings = json.loads(capsys.readouterr().out)["files"][0]["findings"]
    assert [(f["rule"], f["line"]) for f in findings if f["rule"] == "FP8017"] == [
        ("FP8017", 3), ("FP8017", 4), ("FP8017", 5)]


def _bash_hands_train_py(tmp_path: Path, command: str, env: dict[str, str]) -> list[str]:
    """What bash itself gives the train script after /mnt/config/parameters.yaml: `composer`
    and `llmfoundry` replaced by functions that write their arguments out."""
    out = tmp_path / "argv"
    out.write_bytes(b"")
    record = 'for a in "$@"; do printf "%s\\0" "$a"; done >> "$ARGV_OUT"'
    prelude = (f'composer() {{ [ "$2" = /mnt/config/parameters.yaml ] && shift 2 && {record}; }}\n'
               f'llmfoundry() {{ [ "$2" = /mnt/config/parameters.yaml ] && shift 2 && {record}; }}'
               "\ncp() { :; }\ncat() { :; }\ncd() { :; }\n")
    subprocess.run(["bash", "-c", prelude + command], cwd=tmp_path, capture_output=True,
                   env={"PATH": "/usr/bin:/bin", "ARGV_OUT": str(out), **env},
                   timeout=HANG_GUARD_S, check=False)
    return out.read_bytes().decode().split("\0")[:-1]


P = "/mnt/config/parameters.yaml"


@pytest.mark.parametrize("command", [
    # only the line that hands the file to the train script: not the one that copies it
    f"cat {P}\ncd llm-foundry/scripts\ncomposer train/train.py {P} model.n_heads=0",
    f"cp {P} /tmp/p.yaml\ncomposer train/train.py /tmp/p.yaml",
    # shell operators glued to the last word end the arguments
    f"cd llm-foundry/scripts && composer train/train.py {P} max_duration=10ba; echo done",
    f"composer train/train.py {P} a=1&&echo x",
    f"composer train/train.py {P} a=1|tee log.txt",
    f"composer train/train.py {P} a=1 b=2 2>&1 | tee log.txt",
    f"composer train/train.py {P} a=1 2 >log.txt",  # a 2 apart from `>` is an argument
    # `#` inside a word is no comment; at a word's start it is
    f"composer train/train.py {P} run_name=exp#1 model.n_heads=0 #c=3",
    # quotes and continued lines as bash reads them
    f"llmfoundry train {P} \\\n  'a b=2' x\\ y=3 \"c=[1, \\\"2\\\"]\" 'd=${{variables.y}}' \"e=$X\"",
    # what the shell expands is the run's environment's: left out
    f"composer train/train.py {P} model.n_layers=$NL e=${{NL}}x f=`echo $NL` g=\"$NL\" h=1",
    # a substitution is one word through its closing, whatever it holds (blanks, `(`, quotes)
    f"composer train/train.py {P} run_name=`printf %s-%s $NL rev-parse` a=1",
    f"composer train/train.py {P} run_name=$(printf %s-%s $NL x) a=1 b=$(( ${{#NL}} + 1 )) "
    "c=\"$(echo \"$NL) x\")\" d=2 \"e=$(echo $(echo $NL) ')')\" f=2",
    f"composer train/train.py {P} a=1 \"b=`echo \"$NL\"`\" c=3 ${{NL:-a b}}x d=4 e=$ f=\\",
    # bash's old arithmetic `$[...]`, through its closing; `$'...'` inside a substitution
    f"composer train/train.py {P} a=1 i=$[ ${{#NL}} + 1 ]x b=2 j=$[${{#NL}}*2] \"k=$[ ${{#NL}} ]\" "
    f"c=3 \"$(echo $NL $'it\\'s)')\" d=4",
    # a redirection drops its target word, not the words after it
    f"composer train/train.py {P} a=1 > log b=2 2>&1 c=3 &> log d=5 2>/dev/null e=6 >>log f=7",
    f"composer train/train.py {P} a=1 x=\"2\">log e=5 22>log f=6 \"3\">log g=7",
    # an unclosed quote or substitution: bash runs none of its line
    f"composer train/train.py {P} a=1 'b=2",
    f"composer train/train.py {P} a=1; echo \"x",
    f"composer train/train.py {P} a=1 $(echo b=2",
    # a here-document's body is no command; a continued line inside double quotes
    f"cat <<EOF > x.yaml\nit's\nEOF\ncat <<-'E' >y\n\tb=1 'c\n\tE\ncomposer train/train.py {P} \"a=1\\\n2\"",
])
def test_an_mcli_commands_overrides_are_the_words_bash_hands_the_train_script(tmp_path,
                                                                                  command):
    one = _bash_hands_train_py(tmp_path, command, {"NL": "one", "X": "one"})
    other = _bash_hands_train_py(tmp_path, command, {"NL": "other", "X": "other"})
    assert command_overrides({"command": command}) == [a for a, b in zip(one, other, strict=True)
                                                       if a == b]


def test_an_ansi_c_quoted_word_is_left_out_and_the_words_after_it_kept(tmp_path):
    """`$'it\\'s'`: a backslash escapes the quote inside it, so bash hands the train script every
    word; the `$'...'` word itself is left out as expanding (its escapes are not decoded)."""
    command = f"composer train/train.py {P} a=1 n=$'it\\'s' b=2 $'x' c=3"
    assert _bash_hands_train_py(tmp_path, command, {}) == ["a=1", "n=it's", "b=2", "x", "c=3"]
    assert command_overrides({"command": command}) == ["a=1", "b=2", "c=3"]


def test_a_command_that_only_copies_the_parameters_file_trains_nothing_from_it(tmp_path, capsys):
    """`cp /mnt/config/parameters.yaml /tmp/p.yaml` then training from /tmp/p.yaml: the copy's
    `/tmp/p.yaml` is no override (it was FP8009 `parameters./tmp/p`)."""
    path = tmp_path / "run.yaml"
    path.write_text("name: r\nimage: mosaicml/llm-foundry:2.7.0_cu128-latest\ncompute: {gpus: 8}"
                    f"\ncommand: |\n  cp {P} /tmp/p.yaml\n  composer train/train.py /tmp/p.yaml\n"
                    "parameters:\n" + "".join(f"  {line}\n" for line in ZOO.splitlines()))
    assert main(["lint", str(path), "--format", "json"]) == 0, capsys.readouterr().out


@pytest.mark.parametrize(("override", "rule", "key"), [
    ("a.b.c=1", "FP8009", "a"),  # the unknown top-level key is only the override's parent
    ("model.attn_config.x.y=1", "FP8042", "model.attn_config.x"),
])
def test_a_finding_at_a_key_only_an_override_beneath_it_writes_names_it_and_has_no_line(
        tmp_path, capsys, override, rule, key):
    """It stood at the `parameters:` (or `model:`) line, which writes nothing of it."""
    path = tmp_path / "zoo.yaml"
    path.write_text(ZOO)
    merged, own = _foundry_reads(path, [override]), yaml.safe_load(ZOO)
    first, _, rest = key.partition(".")
    assert first not in own or rest.split(".")[0] not in own[first]  # the file writes none of it
    assert OmegaConf.select(OmegaConf.create(merged), key) is not None  # the run has it
    assert main(["lint", str(path), "--format", "json", "--override", override]) == 1
    [entry] = json.loads(capsys.readouterr().out)["files"]
    [finding] = [f for f in entry["findings"] if f["key"] == key]
    assert finding["rule"] == rule and finding["line"] is None
    assert finding["message"].endswith(f"(set by --override {override})")


@pytest.mark.parametrize("args", [["variables=null"], ["model.n_heads=0", "variables=null"]])
def test_a_resolution_error_only_the_overrides_cause_names_the_one_that_does(tmp_path, args):
    path = tmp_path / "zoo.yaml"
    path.write_text(ZOO)
    _foundry_reads(path, [])  # the file alone resolves
    _foundry_reads(path, args[:1] if len(args) > 1 else [])
    with pytest.raises(OmegaConfBaseException, match="max_seq_len"):  # LLM-Foundry's own fails
        _foundry_reads(path, args)
    done = _lint(str(path), "--override", *args)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    [line] = done.stderr.splitlines()
    assert "cannot resolve key max_seq_len" in line
    assert line.endswith("(caused by --override variables=null: the file alone resolves)")


@pytest.mark.parametrize(("item", "top"), [("~foo", "~foo"), ("~model.n_heads", "~model")])
def test_a_hydra_deletion_is_said_as_the_key_omegaconf_reads(tmp_path, item, top):
    """omegaconf's from_dotlist (om.from_cli) has no `~KEY`: the `~` is part of the key."""
    assert top in OmegaConf.to_container(OmegaConf.from_dotlist([item]))
    path = tmp_path / "zoo.yaml"
    path.write_text(ZOO)
    done = _lint(str(path), "--override", item)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    [line] = done.stderr.splitlines()
    assert f"it sets `{item}` to null, under a top-level key `{top}` that LLM-Foundry" in line


def test_naming_the_override_loads_the_config_once_per_override(tmp_path, monkeypatch):
    """Each override is tried alone, once: a tried one that fails does not search again (it
    did, with all of them, until Python's recursion limit: 374 loads for one override)."""
    path = tmp_path / "zoo.yaml"
    path.write_text(ZOO)
    args = ["model.n_heads=0", "a=1", "variables=null", "b=2"]
    with pytest.raises(OmegaConfBaseException, match="max_seq_len"):  # LLM-Foundry's own fails
        _foundry_reads(path, args)
    loads = []

    def counted(*a, **k):
        loads.append(a)
        return load_config(*a, **k)

    monkeypatch.setattr("foundry_fp8.lint.load.load_config", counted)
    with pytest.raises(LintInputError, match=r"\(caused by --override variables=null: the file "):
        load_config(path, overrides=read_overrides(args))
    # the file alone, each override alone, and the failing one's file alone again
    assert len(loads) <= 1 + len(args) + 1


def test_a_key_error_of_ours_while_loading_is_said_as_our_bug(tmp_path, monkeypatch, capsys):
    """omegaconf's own key errors are ConfigKeyError (an OmegaConfBaseException): a plain
    KeyError inside load_config is ours, and was said as the file's bad input (exit 2)."""
    from omegaconf.errors import ConfigKeyError

    assert issubclass(ConfigKeyError, OmegaConfBaseException)
    path = tmp_path / "zoo.yaml"
    path.write_text(ZOO)

    def broken(*args: object) -> dict:
        raise KeyError("ours")

    monkeypatch.setattr("foundry_fp8.lint.load._holds_interpolation", lambda value: True)
    monkeypatch.setattr("foundry_fp8.lint.load._resolved_again", broken)
    assert main(["lint", str(path)]) != 0
    assert "this is a foundry-fp8 bug: please report it" in capsys.readouterr().err


def test_a_command_substitution_in_the_command_gives_no_override(tmp_path, capsys):
    """`run_name=`git rev-parse --short HEAD`` is one word to bash (its output, the run's):
    its inner words were overrides (FP8009 `parameters.rev-parse`, `parameters.--short`)."""
    path = _mcli(tmp_path, f"composer train/train.py {P} run_name=`git rev-parse --short HEAD` "
                 "tag=$(date +%s) model.n_heads=0")
    assert main(["lint", str(path), "--format", "json"]) == 1
    [entry] = json.loads(capsys.readouterr().out)["files"]
    assert {f["key"] for f in entry["findings"]} == {"parameters.model.n_heads"}
