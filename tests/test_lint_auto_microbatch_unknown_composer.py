"""FP8031 where the linter runs without Composer (a CI job with the wheel alone, or an MCLI file
whose image pins torch): with a torch inside Composer's range every Composer foundry-fp8
installs with defines unshard_with_sync, so there is nothing to say. It said "raises ... unless
torch>=2.6.0,<2.7.1; here Composer not installed, torch 2.7.0", contradicting itself.

"Every Composer foundry-fp8 installs with" is the floor the installed foundry-fp8's metadata
sets (setup.cfg's, `Snapshot.stack_ranges`); unknown (a checkout, not installed) or older than
the releases the rule was read from, the warning stays."""

from __future__ import annotations

import configparser
import importlib.util
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from foundry_fp8.environment import Snapshot
from foundry_fp8.lint.cli import lint_file
from foundry_fp8.lint.known import AUTO_MICROBATCH_CHECKED_FROM
from foundry_fp8.te.facts import parse_version

ROOT = Path(__file__).resolve().parent.parent
MCLI = ROOT / "tests/lint_corpus/mcli/mcli-auto-microbatch-fsdp.yaml"
TRAIN = {"device_train_microbatch_size": "auto", "fsdp_config": {"sharding_strategy": "FULL_SHARD"},
         "max_seq_len": 128, "global_train_batch_size": 8,
         "model": {"name": "mpt_causal_lm", "d_model": 64, "n_heads": 4, "n_layers": 2},
         "precision": "amp_bf16", "max_duration": "10ba"}


def _defines_unshard_with_sync(monkeypatch: pytest.MonkeyPatch, torch_version: str) -> bool:
    """The reference: the installed Composer's _patch_pytorch, run as under `torch_version`."""
    import torch

    spec = importlib.util.find_spec("composer.trainer._patch_pytorch")
    monkeypatch.setattr(torch, "__version__", torch_version)
    namespace: dict = {"__name__": "composer_patch_pytorch_copy"}
    exec(compile(Path(spec.origin).read_text(), spec.origin, "exec"), namespace)
    return "unshard_with_sync" in namespace


def _setup_cfg_mosaicml() -> str:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    [mosaicml] = [r.strip() for r in cfg["options"]["install_requires"].split("\n")
                  if r.strip().startswith("mosaicml[")]
    return mosaicml


#: The ranges an installed foundry-fp8's metadata carries: setup.cfg's Composer requirement.
SETUP_CFG = (("mosaicml", _setup_cfg_mosaicml()),)


def _rows(path: Path, torch: str | None,
          ranges: tuple[tuple[str, str], ...] = SETUP_CFG) -> list[tuple[str, str]]:
    snapshot = Snapshot(python="3.11", torch=torch, composer=None, stack_ranges=ranges)
    return [(f["rule"], f["severity"]) for f in lint_file(path, 1, snapshot)["findings"]
            if f["rule"] == "FP8031"]


def test_setup_cfgs_composer_floor_is_one_fp8031_checked():
    """Why an unknown Composer may be judged by torch alone: the oldest foundry-fp8 installs
    with is no older than the first release the rule's range was read from."""
    floor = Requirement(_setup_cfg_mosaicml()).specifier
    assert [s.version for s in floor if s.operator == ">="] == ["0.31.0"]
    assert parse_version("0.31.0") >= AUTO_MICROBATCH_CHECKED_FROM
    assert Snapshot(python="3.11", stack_ranges=SETUP_CFG).stack_floor("mosaicml") == (0, 31, 0)


@pytest.mark.parametrize(("ranges", "quiet"), [
    (SETUP_CFG, True),
    ((("mosaicml", "mosaicml[wandb]>=0.30.0,<0.33"),), False),  # 0.30 was never read
    ((("mosaicml", "mosaicml>0.31.0"),), True),
    ((("torch", "torch>=2.7.0,<2.8"),), False),  # no Composer floor
    ((), False),  # a checkout, not installed: no metadata, no floor
])
def test_without_composer_the_installed_floor_decides(tmp_path, ranges, quiet):
    """The floor is the installed foundry-fp8's, not a constant standing in for setup.cfg:
    a wheel built with an older floor, or none known, keeps the warning (torch 2.7.0 is inside
    unshard_with_sync's range; whether Composer 0.30 defines it was never read)."""
    import yaml

    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(TRAIN))
    assert _rows(path, "2.7.0", ranges) == ([] if quiet else [("FP8031", "warning")])


@pytest.mark.parametrize(("torch", "quiet"), [
    ("2.7.0", True), ("2.6.0", True), ("2.7.0+cu126", True),
    ("2.7.1", False), ("2.11.0+cu130", False), ("2.5.1", False),
])
def test_without_composer_a_known_torch_decides(monkeypatch, tmp_path, torch, quiet):
    import yaml

    assert _defines_unshard_with_sync(monkeypatch, torch) is quiet
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(TRAIN))
    assert _rows(path, torch) == ([] if quiet else [("FP8031", "warning")])
    assert _rows(path, None) == [("FP8031", "warning")]  # torch unknown too: still a warning


@pytest.mark.parametrize("torch", [None, "2.11.0+cu130"])
def test_mcli_file_pinning_torch_270_without_composer_is_quiet(monkeypatch, torch):
    """The QA's reproduction: the file's image pins torch 2.7.0, whatever torch is here."""
    assert _defines_unshard_with_sync(monkeypatch, "2.7.0")
    assert _rows(MCLI, torch) == []
