"""A run moved from FSDP1 to FSDP2 (`parallelism_config: {fsdp: FSDP2Config}`, what Composer
0.32 builds from `fsdp_config` under FSDP_VERSION=2, trainer.py `_parse_parallelism_config`):
real Composer Trainers on 2 gloo ranks with te_swap (emulated), fp8_state, fp8_stats and
fp8_guard. Checked where the user looks: a resume from the sharded checkpoint (FSDP2's default)
and from a full one trains on with the losses and FP8 scales and amax histories of the run
that did not stop, bit for bit; the optimizer steps the sharded parameters of te_swap's layers
(te_swap converts at INIT, before Composer's `fully_shard`); fp8_stats counts NaN/Inf in a
weight once though every rank sees it all-gathered. Reference for the counts: the elements the
test put in."""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

import pytest
import torch

from tests.ranks import init_rank, run_ranks

pytestmark = pytest.mark.slow  # real Composer Trainers on 2 spawned ranks: a minute or more

BATCHES, RESUME_AT = 6, 2
LAYER = "module.blocks.0"  # ComposerClassifier keeps the network as `module`
NANS, INFS = 1, 2  # put in the first weight's shard on rank 0


def _trainer(folder: str, state_dict_type: str, load_path: str | None = None,
             batches: int = BATCHES, callbacks: tuple = ()) -> Any:
    from composer import Trainer
    from composer.loggers import InMemoryLogger
    from composer.models import ComposerClassifier
    from composer.optim import DecoupledAdamW
    from composer.utils import dist
    from composer.utils.parallelism import FSDP2Config
    from torch.utils.data import DataLoader, TensorDataset

    from foundry_fp8.composer.guard import FP8Guard
    from foundry_fp8.composer.state import FP8State
    from foundry_fp8.composer.stats import FP8Stats
    from foundry_fp8.composer.te_swap import TESwap
    from tests.test_state_restore import TwoBlocks

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(16 * BATCHES, 16) * 3,
                         torch.randint(0, 16, (16 * BATCHES,)))
    loader = DataLoader(data, batch_size=8, sampler=dist.get_sampler(data, shuffle=False))
    model = ComposerClassifier(TwoBlocks(), num_classes=16)
    # built over the plain layers, as LLM-Foundry's train does (te_swap moves it to its own)
    optimizer = DecoupledAdamW(model.parameters(), lr=1e-2)
    return Trainer(
        model=model, optimizers=optimizer, seed=17, run_name="fsdp2",
        train_dataloader=loader, max_duration=f"{batches}ba",
        algorithms=[TESwap(backend="emulate", fp8_recipe={"amax_history_len": 4})],
        callbacks=[FP8State(), FP8Stats(interval="1ba"), FP8Guard(), *callbacks],
        loggers=[InMemoryLogger()],
        parallelism_config={"fsdp": FSDP2Config(state_dict_type=state_dict_type)},
        device="cpu", progress_bar=False, save_folder=folder, save_interval=f"{RESUME_AT}ba",
        save_overwrite=True, load_path=load_path)


def _fit(trainer: Any) -> dict[str, Any]:
    """Losses per batch and the FP8 state at the end (plain lists, for JSON)."""
    from composer import Callback

    from foundry_fp8.fp8_meta import fp8_modules, read_fp8_meta

    losses: dict[int, float] = {}

    class Losses(Callback):
        def after_train_batch(self, state, logger):
            losses[int(state.timestamp.batch)] = float(state.loss)

    trainer.state.callbacks.append(Losses())
    trainer.fit()
    meta = {n: {k: v.tolist() for k, v in read_fp8_meta(m).items()}
            for n, m in fp8_modules(trainer.state.model)}
    trainer.close()
    return {"losses": losses, "meta": meta}


def _worker(rank: int, rendezvous: str, folder: str, out: str) -> None:
    from composer import Callback
    from composer.loggers import InMemoryLogger

    from foundry_fp8.fault import find_layer

    init_rank(rank, rendezvous)
    result: dict[str, Any] = {}
    for kind in ("sharded", "full"):
        straight = _trainer(os.path.join(folder, kind), kind)
        model_params = list(straight.state.model.parameters())
        stepped = [p for g in straight.state.optimizers[0].param_groups for p in g["params"]]
        result[f"{kind}_optimizer"] = {
            "types": sorted({type(p).__name__ for p in stepped}),
            "model_params": [any(p is q for q in model_params) for p in stepped],
            "local_rows": [p.to_local().shape[0] for p in stepped if p.dim() == 2]}
        result[kind] = _fit(straight)
        saved = os.path.join(folder, kind, f"ep0-ba{RESUME_AT}"
                             + ("" if kind == "sharded" else "-rank0.pt"))
        result[f"{kind}_resumed"] = _fit(_trainer(os.path.join(folder, f"{kind}-resumed"),
                                                  kind, load_path=saved))

    class BadWeight(Callback):
        def batch_start(self, state, logger):
            weight = find_layer(state.model, LAYER).weight.to_local()  # this rank's shard
            if rank == 0:
                with torch.no_grad():
                    weight[0, :INFS] = float("inf")
                    weight[1, :NANS] = float("nan")

    bad = _trainer(os.path.join(folder, "bad"), "sharded", batches=1, callbacks=(BadWeight(),))
    bad.fit()
    [memory] = [d for d in bad.logger.destinations if isinstance(d, InMemoryLogger)]
    data = memory.data
    result["counts"] = {k: v[-1][1] for k, v in data.items() if "_count/weight/" in k}
    bad.close()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("fsdp2")
    run_ranks(_worker, tempfile.mkdtemp(dir=out), str(out), deadline_s=300)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.parametrize("kind", ["sharded", "full"])
def test_a_resumed_fsdp2_run_trains_on_bit_for_bit(ranks, kind):
    for rank in ranks:
        straight, resumed = rank[kind], rank[f"{kind}_resumed"]
        assert sorted(map(int, straight["losses"])) == list(range(BATCHES))
        assert sorted(map(int, resumed["losses"])) == list(range(RESUME_AT, BATCHES))
        assert {b: straight["losses"][b] for b in resumed["losses"]} == resumed["losses"]
        assert sorted(straight["meta"]) == [LAYER, "module.blocks.1"]  # no wrapper segment
        assert straight["meta"] == resumed["meta"]
        history = straight["meta"][LAYER]["fwd_amax_history"]
        assert len(history) == 4 and any(any(row) for row in history[1:])


@pytest.mark.parametrize("kind", ["sharded", "full"])
def test_the_optimizer_steps_the_sharded_fp8_layers(ranks, kind):
    for rank in ranks:
        seen = rank[f"{kind}_optimizer"]
        assert seen["types"] == ["DTensor"] and all(seen["model_params"])
        assert seen["local_rows"] == [8, 8]  # 16 output rows of each layer over 2 ranks


def test_a_weights_nan_inf_are_counted_once_over_ranks(ranks):
    """fp8_stats logs on rank 0 only; 1 NaN and 2 Infs, not 2 and 4."""
    assert ranks[1]["counts"] == {}
    assert ranks[0]["counts"] == {f"fp8_nan_count/weight/{LAYER}": NANS,
                                  f"fp8_inf_count/weight/{LAYER}": INFS,
                                  "fp8_nan_count/weight/module.blocks.1": 0,
                                  "fp8_inf_count/weight/module.blocks.1": 0}
