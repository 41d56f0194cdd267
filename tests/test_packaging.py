"""The package as a user installs it: a wheel built from this checkout, installed without `-e`
into a fresh venv, run from a folder outside the checkout.

Cheap but honest: the wheel goes in with `--no-deps`, and the venv reaches the other packages
through a `.pth` file naming a folder of links to this test venv's site-packages, minus our own
(editable) install. So the only foundry_fp8 it can import is the wheel's, and a file the wheel
lacks fails here. The wheel is built from a clean copy of the checkout (no build/ left over
from an earlier build, whose stale modules setuptools would pack) by pip's PEP 517 front end with
an isolated build environment, as `python -m build --wheel` does.
"""

from __future__ import annotations

import configparser
import email
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]
#: Our own install in the test venv (editable or not), left out of the fresh venv's view.
OURS = ("foundry_fp8", "foundry_fp8-", "__editable__.foundry_fp8", "__editable___foundry_fp8")
#: What a checkout holds besides its sources: never copied into the build.
NOT_SOURCES = shutil.ignore_patterns(".git", ".venv*", "build", "dist", "data", "runs", "wandb",
                                     "*.egg-info", "__pycache__", ".*_cache", ".hypothesis",
                                     "gpu-parts", ".gpu-*")


@dataclass(frozen=True)
class Installed:
    venv: Path
    wheel: Path
    work: Path  # an empty folder outside the checkout: the commands' working directory
    seconds: dict[str, float]

    @property
    def bin(self) -> Path:
        return self.venv / "bin"

    def run(self, *cmd: str, timeout: float = 300) -> subprocess.CompletedProcess:
        env = {**_without_checkout(), "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1"}
        return subprocess.run(cmd, cwd=self.work, env=env, capture_output=True, text=True,
                              timeout=timeout)

    def python(self, code: str) -> subprocess.CompletedProcess:
        return self.run(str(self.bin / "python"), "-c", textwrap.dedent(code))


def _without_checkout() -> dict[str, str]:
    """This environment minus a PYTHONPATH (a developer's `PYTHONPATH=$PWD`) that would show the
    checkout, and its foundry_fp8.egg-info, to the fresh venv."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    root = tmp_path_factory.mktemp("packaging")
    seconds: dict[str, float] = {}

    start = time.perf_counter()
    source, dist = root / "source", root / "dist"
    shutil.copytree(REPO, source, ignore=NOT_SOURCES)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                    "--wheel-dir", str(dist), str(source)], check=True, cwd=root)
    [wheel] = dist.glob("foundry_fp8-*.whl")
    seconds["build the wheel"] = time.perf_counter() - start

    start = time.perf_counter()
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    ours_site = Path(sysconfig.get_path("purelib"))
    others = root / "other-packages"
    others.mkdir()
    for entry in ours_site.iterdir():
        if not entry.name.startswith(OURS):
            (others / entry.name).symlink_to(entry)
    [new_site] = (venv / "lib").glob("python3*/site-packages")
    (new_site / "test-venv-packages.pth").write_text(f"{others}\n")
    # neither cwd nor PYTHONPATH the checkout: its foundry_fp8.egg-info would pass for an
    # installed foundry-fp8, and pip would install nothing
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"),
                    "install", "--quiet", "--no-deps", "--no-index", str(wheel)], check=True,
                   cwd=root, env=_without_checkout())
    assert (venv / "bin" / "foundry-fp8").is_file()
    seconds["fresh venv + install"] = time.perf_counter() - start
    work = root / "work"
    work.mkdir()
    return Installed(venv, wheel, work, seconds)


def test_the_wheel_holds_every_file_the_package_has(installed: Installed) -> None:
    """Every module and data file under foundry_fp8/ in the checkout (the MPT-1B YAMLs among
    them), nothing from tests/ or the repository's scripts."""
    names = set(zipfile.ZipFile(installed.wheel).namelist())
    shipped = {str(p.relative_to(REPO)) for p in (REPO / "foundry_fp8").rglob("*")
               if p.is_file() and "__pycache__" not in p.parts}
    assert shipped - names == set()
    assert {n for n in names if ".dist-info/" not in n} == shipped  # nothing stale or extra
    assert {"foundry_fp8/tools/yamls/mpt-1b-bf16.yaml",
            "foundry_fp8/tools/yamls/mpt-1b-fp8.yaml"} <= names
    assert not [n for n in names if n.startswith(("tests/", "scripts/", "benchmarks/"))]


def test_the_wheel_carries_the_license_its_metadata_names(installed: Installed) -> None:
    """QA 19: METADATA said `License: Apache-2.0` and the wheel (and the checkout) held no
    license text. The reference text is Apache's own LICENSE-2.0.txt as Accelerate, a dependency
    of LLM-Foundry, ships it unchanged."""
    from importlib import metadata

    wheel = zipfile.ZipFile(installed.wheel)
    [meta] = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    fields = email.message_from_bytes(wheel.read(meta))
    assert fields["License"] == "Apache-2.0" and fields.get_all("License-File") == ["LICENSE"]
    [shipped] = [n for n in wheel.namelist() if ".dist-info/" in n and n.endswith("/LICENSE")]
    [reference] = [f for f in metadata.files("accelerate") or [] if f.name == "LICENSE"]
    assert wheel.read(shipped).decode() == reference.read_text()
    assert (REPO / "LICENSE").read_text() == reference.read_text()


def test_the_installed_package_is_the_wheel_not_the_checkout(installed: Installed) -> None:
    done = installed.python("import foundry_fp8; print(foundry_fp8.__file__)")
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()).is_relative_to(installed.venv)


def test_cli_help_from_the_wheel(installed: Installed) -> None:
    done = installed.run(str(installed.bin / "foundry-fp8"), "--help")
    assert done.returncode == 0, done.stderr
    for command in ("lint", "report", "bench", "doctor", "tiny-data"):
        assert command in done.stdout


def test_lint_from_the_wheel(installed: Installed) -> None:
    """A clean YAML with our entries lints clean; a broken one exits 1 naming file, line and
    key: the linter finds our entries' options in the installed package."""
    good = installed.work / "good.yaml"
    good.write_text("precision: fp32\nalgorithms:\n  te_swap: {backend: emulate}\n"
                    "callbacks:\n  fp8_stats: {interval: 10ba}\n")
    bad = installed.work / "bad.yaml"
    bad.write_text("precision: fp32\ncallbacks:\n  fp8_stats:\n    interval: 10ba\n"
                   "    bogus_option: 1\n")
    lint = str(installed.bin / "foundry-fp8")
    done = installed.run(lint, "lint", str(good))
    assert done.returncode == 0, done.stdout + done.stderr
    done = installed.run(lint, "lint", str(bad), "--format", "json")
    assert done.returncode == 1, done.stdout + done.stderr
    [report] = json.loads(done.stdout)["files"]
    assert any(f["key"] == "callbacks.fp8_stats.bogus_option" and f["line"] == 5
               for f in report["findings"]), report


def test_llm_foundry_registries_find_our_entries_in_the_wheel(installed: Installed) -> None:
    done = installed.python("""
        import json
        from llmfoundry import registry
        from llmfoundry.layers_registry import attention_implementations
        found = {
            "te_swap": registry.algorithms.get("te_swap"),
            "fp8_stats": registry.callbacks.get("fp8_stats"),
            "fp8_state": registry.callbacks.get("fp8_state"),
            "fp8_guard": registry.callbacks.get("fp8_guard"),
            "fp8_lint": registry.callbacks_with_config.get("fp8_lint"),
            "jsonl": registry.loggers.get("jsonl"),
            "sdpa": attention_implementations.get("sdpa"),
        }
        import inspect
        print(json.dumps({name: inspect.getfile(obj) for name, obj in found.items()}))
    """)
    assert done.returncode == 0, done.stderr
    files = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(files) == {"te_swap", "fp8_stats", "fp8_state", "fp8_guard", "fp8_lint", "jsonl",
                          "sdpa"}
    for name, file in files.items():
        assert Path(file).is_relative_to(installed.venv), (name, file)


def test_a_missing_dependency_of_the_wheel_is_not_blamed_on_a_checkout(
        installed: Installed) -> None:
    """QA 18: the wheel installed with `--no-deps` and a dependency missing said 'run it with the
    Python of the environment foundry-fp8 is installed in ... (pip install -e <checkout>)', in
    that very environment, to a user with no checkout. It names the installed package and
    `pip check`, which lists what is missing."""
    (installed.work / "train.yaml").write_text("precision: amp_fp8\n")
    done = installed.run(str(installed.bin / "python"), "-c",
                         "import sys; sys.modules['omegaconf'] = None\n"  # its import fails
                         "from foundry_fp8.cli import main; sys.exit(main(['lint', 'train.yaml']))")
    package = installed.python("import os, foundry_fp8; "
                               "print(os.path.dirname(foundry_fp8.__file__))")
    assert (done.returncode, done.stdout, done.stderr.count("\n")) == (2, "", 1), done.stderr
    assert done.stderr.startswith("foundry-fp8: no module 'omegaconf' in "), done.stderr
    assert f"installed here ({package.stdout.strip()})" in done.stderr
    assert "-m pip check" in done.stderr and "<checkout>" not in done.stderr


def test_doctor_from_the_wheel_reads_this_environments_packages(installed: Installed) -> None:
    """The torch-free probe reads package metadata through the installed copy; the reference is
    importlib.metadata in the test's own interpreter, which shares these packages."""
    from importlib.metadata import version

    done = installed.run(str(installed.bin / "foundry-fp8"), "doctor", "--no-te-import",
                         "--format", "json")
    assert done.returncode in (0, 1), done.stderr
    env = json.loads(done.stdout)["environment"]
    assert (env["torch"], env["composer"], env["llmfoundry"]) == (
        version("torch"), version("mosaicml"), version("llm-foundry"))


#: What `foundry-fp8 lint` and `doctor` import besides the standard library (README: lint checks
#: a YAML "without torch"): the YAML loader, omegaconf for --override, regex for user patterns.
LINT_ONLY = ("PyYAML", "omegaconf", "regex")


def _with_requirements(names: tuple[str, ...]) -> list[str]:
    """`names` and what they require here, transitively, as pip would install them (markers
    judged for this Python, extras left out): omegaconf 2.2 (the oldest set) needs antlr4's
    runtime, which 2.4 bundles."""
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    found: dict[str, str] = {}
    todo = list(names)
    while todo:
        name = todo.pop()
        if canonicalize_name(name) in found:
            continue
        found[canonicalize_name(name)] = name
        for text in metadata.distribution(name).requires or []:
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return list(found.values())


def _where(lint_json: str) -> list[tuple[str, str | None, str, str, int | None]]:
    """Each finding of `lint --format json` as (path, file error, rule, key, line)."""
    return [(file["path"], file["error"], f["rule"], f["key"], f["line"])
            for file in json.loads(lint_json)["files"] for f in file["findings"]]


def test_lint_and_doctor_from_the_wheel_with_only_the_yaml_packages(installed: Installed,
                                                                  tmp_path: Path) -> None:
    """QA 20, a CI image that lints configs: the wheel with `--no-deps` beside PyYAML, omegaconf
    and regex only (no torch, Composer, LLM-Foundry, numpy) lints the corpus as the full
    environment does (its JSON is the reference). The doctor fails there, on purpose (FP8214):
    no training run can use foundry-fp8 without torch, Composer and LLM-Foundry; it exits 1
    with exactly those three errors, each naming setup.cfg's range."""
    from importlib import metadata

    venv, linked = tmp_path / "venv", tmp_path / "lint-only-packages"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    linked.mkdir()
    for name in _with_requirements(LINT_ONLY):
        dist = metadata.distribution(name)
        top = (dist.read_text("top_level.txt") or name).split()
        for entry in [*top, dist._path.name]:  # type: ignore[attr-defined]
            (linked / entry).symlink_to(dist._path.parent / entry)  # type: ignore[attr-defined]
    [site] = (venv / "lib").glob("python3*/site-packages")
    (site / "lint-only.pth").write_text(f"{linked}\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"),
                    "install", "--quiet", "--no-deps", "--no-index", str(installed.wheel)],
                   check=True, cwd=tmp_path, env=_without_checkout())
    corpus = ["train", "--override", "max_seq_len=2048", "--format", "json"]

    def lint(cli: list[str]) -> subprocess.CompletedProcess:
        return subprocess.run([*cli, "lint", *corpus], cwd=REPO / "tests" / "lint_corpus",
                              env=_without_checkout(), capture_output=True, text=True,
                              timeout=300)

    alone = lint([str(venv / "bin" / "foundry-fp8")])
    full = lint([sys.executable, "-m", "foundry_fp8"])
    assert alone.returncode == full.returncode == 1, alone.stderr
    # the same findings; words and severity differ where they judge the installed LLM-Foundry
    # (FP8030 is an error for a known version, a warning where none is installed)
    assert _where(alone.stdout) == _where(full.stdout) and len(_where(full.stdout)) > 20
    assert "Traceback" not in alone.stderr
    done = subprocess.run([str(venv / "bin" / "foundry-fp8"), "doctor", "--no-te-import",
                           "--format", "json"], env=_without_checkout(), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    report = json.loads(done.stdout)
    env = report["environment"]
    assert (env["torch"], env["composer"], env["llmfoundry"]) == (None, None, None)
    errors = {f["key"]: f["fix"] for f in report["findings"] if f["severity"] == "error"}
    assert {f["rule"] for f in report["findings"] if f["severity"] == "error"} == {"FP8214"}
    assert report["exit_reason"] == "foundry-fp8 doctor: exit 1 because of 3 errors: FP8214"
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    setup_cfg = {Requirement(line).name: Requirement(line) for line in
                 cfg["options"]["install_requires"].splitlines()
                 if line.strip() and not line.strip().startswith("#")}
    assert {key: Requirement(fix.removeprefix("pip install ").strip("'"))
            for key, fix in errors.items()} == {"torch": setup_cfg["torch"],
                                                "composer": setup_cfg["mosaicml"],
                                                "llmfoundry": setup_cfg["llm-foundry"]}


@pytest.mark.slow
def test_bench_runs_from_the_wheel_without_a_checkout(installed: Installed) -> None:
    """The MPT-1B YAMLs come from the package; the results land in the working directory."""
    done = installed.run(str(installed.bin / "foundry-fp8"), "bench", "--tiny", "--variants",
                         "bf16", "--warmup", "0", "--steps", "1", "--seq-len", "16", "--batch",
                         "2", timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads((installed.work / "mpt-tiny-cpu.json").read_text())
    assert [r["label"] for r in result["variants"]] == ["fp32"]
    assert result["versions"]["foundry_fp8"] is not None
    print("packaging timings (s):", {k: round(v, 1) for k, v in installed.seconds.items()})
