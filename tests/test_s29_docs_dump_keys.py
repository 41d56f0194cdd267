"""The keys of an fp8_stats dump file, as docs/fp8_stats.md's "Tensor dumps" names them, are
the keys a real dump holds: the page named the scales `<layer>/<tensor>/scale` (the metric keys'
short layer name), but they sit under the full module name, as the tensors do, so a script
written from the page looked them up under names the file does not have."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from foundry_fp8.emulate import EmulatedFP8Linear, fp8_autocast
from foundry_fp8.monitor import FP8Monitor, MonitorConfig, Schedule
from foundry_fp8.recipe import FP8Recipe

DOC = Path(__file__).resolve().parents[1] / "docs" / "fp8_stats.md"


def _documented_keys() -> list[str]:
    """The backticked key patterns (`<module>/<tensor>`, ...) of the "Tensor dumps" paragraph."""
    [paragraph] = re.findall(r"^Tensor dumps:.*?\n\n", DOC.read_text(), flags=re.M | re.S)
    return [k for k in re.findall(r"`([^`]+)`", paragraph) if "<tensor>" in k]


def test_a_dump_holds_the_keys_the_page_names(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Module()
    model.transformer = nn.Module()  # full module names `transformer.blocks.0`, metric keys `blocks.0`
    model.transformer.blocks = nn.ModuleList([EmulatedFP8Linear(8, 16)])
    monitor = FP8Monitor(model, MonitorConfig(dump_folder=tmp_path),
                         schedule=Schedule(interval=100, dump_steps=[0]))
    monitor.start_step(0)
    with fp8_autocast(recipe=FP8Recipe()):
        out = model.transformer.blocks[0](torch.randn(4, 8))
    out.pow(2).sum().backward()
    monitor.finish_step()
    [path] = tmp_path.iterdir()
    with safe_open(str(path), "pt") as dump:
        keys, tensors = set(dump.keys()), json.loads(dump.metadata()["tensors"])
    patterns = _documented_keys()
    assert patterns  # the paragraph still names them
    expected = {pattern.replace("<module>", module).replace("<layer>", about["layer"])
                .replace("<tensor>", tensor)
                for key, about in tensors.items() for module, tensor in [key.split("/")]
                for pattern in patterns}
    assert keys == expected
