"""Module names under DDP (2 CPU ranks, gloo): the same as in a single process, so fp8_state's
checkpoint keys and fp8_stats' `layers` regexes and metric names do not depend on the rank
count."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as torch_dist
from torch import nn

from foundry_fp8.emulate import EmulatedFP8Linear
from foundry_fp8.fp8_meta import canonical_modules, canonical_name, fp8_modules
from foundry_fp8.monitor import MonitorConfig, select_layers
from tests.ranks import init_rank, run_ranks

ANCHORED = MonitorConfig(layers=r"^model\.blocks\.0$")


class _Model(nn.Module):
    """Named like LLM-Foundry's models (`model.transformer...`), with a child called `module` as
    Composer's ComposerClassifier has: only DDP's own `module` segment may go."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.model = nn.Module()
        self.model.blocks = nn.ModuleList(EmulatedFP8Linear(8, 8) for _ in range(2))
        self.module = EmulatedFP8Linear(8, 8)

    def forward(self, x):
        return self.module(self.model.blocks[1](self.model.blocks[0](x)))


def _names(model: nn.Module) -> dict[str, list[str]]:
    return {"fp8_modules": [name for name, _ in fp8_modules(model)],
            "anchored": sorted(select_layers(model, ANCHORED)),
            "all": [name for name, _ in canonical_modules(model)]}


def _worker(rank: int, rendezvous: str, out_dir: str) -> None:
    init_rank(rank, rendezvous)
    try:
        ddp = nn.parallel.DistributedDataParallel(_Model())
        ddp(torch.randn(2, 8)).sum().backward()  # a real DDP step: the wrapper in use
        with open(f"{out_dir}/rank{rank}.json", "w") as f:
            json.dump({"raw": [n for n, _ in ddp.named_modules()], **_names(ddp)}, f)
    finally:
        torch_dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict[str, list[str]]]:
    out = tmp_path_factory.mktemp("names")
    run_ranks(_worker, str(out))
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_ddp_gives_the_names_of_a_single_process(ranks):
    single = _names(_Model())
    assert single["fp8_modules"] == ["model.blocks.0", "model.blocks.1", "module"]
    assert single["anchored"] == ["model.blocks.0"]
    for result in ranks:
        assert result["raw"][1:3] == ["module", "module.model"]  # DDP's prefix is there
        assert {k: result[k] for k in single} == single


def test_canonical_name_strips_only_ddps_own_segment():
    assert canonical_name("module.module", ddp=True) == "module"
    assert canonical_name("module.model.blocks.0", ddp=True) == "model.blocks.0"
    assert canonical_name("module.blocks.0") == "module.blocks.0"  # no DDP: a real child
    assert canonical_name("module._fsdp_wrapped_module.model._checkpoint_wrapped_module.blocks",
                          ddp=True) == "model.blocks"
    assert canonical_name("modules.x", ddp=True) == "modules.x"
