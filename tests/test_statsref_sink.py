"""What fp8_stats writes to the JSONL sink, against TE's definitions applied to the very tensors
it measured: a real Composer run (te_swap's emulated delayed-scaling FP8, HYBRID) dumps each
watched tensor with its scale at every step; every logged statistic of every layer and tensor is
then recomputed from the dump with `tests.test_numerics_te_stats.te_stats` (written from TE's
stats_computation.py, not from our code), in the format TE casts that tensor in (E5M2 for the
gradient), and the delayed scales from TE's rule on the dumped amaxes (`fp8_max / max(amax
history)`, rounded once). A NaN and an Inf in the last batch's input are counted and left out,
as documented (docs/emulation.md, "Statistics and TE's debug API")."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from foundry_fp8.health import INITIAL_SCALE, layer_key
from foundry_fp8.jsonl import read_jsonl
from foundry_fp8.numerics import FP8_MAX
from tests.test_numerics import f32
from tests.test_numerics_te_stats import te_amax, te_current_scale, te_stats
from tests.two_linears import TwoLinears

STEPS = 3
FORMATS = {"activation": "e4m3", "weight": "e4m3", "gradient": "e5m2"}  # HYBRID
DELAYED, WHATIF = "module.blocks.0", "module.blocks.1"  # te_swap leaves the 4x16 layer out


def _train(folder: Path) -> None:
    from composer import Callback, Trainer
    from composer.models import ComposerClassifier
    from torch.utils.data import DataLoader, TensorDataset

    from foundry_fp8.composer.jsonl_logger import JSONLLogger
    from foundry_fp8.composer.stats import FP8Stats
    from foundry_fp8.composer.te_swap import TESwap

    class Poison(Callback):
        """A NaN and an Inf in one sample of the last batch's input."""

        def after_dataloader(self, state, logger) -> None:
            if int(state.timestamp.batch) == STEPS - 1:
                inputs, targets = state.batch
                inputs = inputs.clone()
                inputs[0, 3], inputs[0, 5] = math.nan, math.inf
                state.batch = (inputs, targets)

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(8 * STEPS, 16) * 3, torch.randint(0, 4, (8 * STEPS,)))
    trainer = Trainer(model=ComposerClassifier(TwoLinears(), num_classes=4), run_name="r",
                      train_dataloader=DataLoader(data, batch_size=8), max_duration=f"{STEPS}ba",
                      algorithms=[TESwap(backend="emulate")],
                      callbacks=[FP8Stats(interval=1, dump_steps=list(range(STEPS)),
                                          dump_folder=str(folder / "dumps")), Poison()],
                      loggers=[JSONLLogger()], device="cpu", progress_bar=False,
                      log_to_console=False)
    trainer.fit()
    trainer.close()


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[dict[int, dict], dict[int, dict[str, torch.Tensor]]]:
    folder = tmp_path_factory.mktemp("statsref")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(folder)
        _train(folder)
    logged = {step: m for step, m in read_jsonl(folder / "runs" / "r" / "metrics.jsonl")
              if any(k.startswith("fp8_amax/") for k in m)}
    dumps = {step: load_file(folder / "dumps" / f"step{step:07d}-rank0.safetensors")
             for step in range(STEPS)}
    return logged, dumps


def _finite(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1)[torch.isfinite(x.reshape(-1))]


@pytest.mark.parametrize("step", range(STEPS))
@pytest.mark.parametrize("layer", [DELAYED, WHATIF])
@pytest.mark.parametrize("tensor", list(FORMATS))
def test_every_logged_statistic_is_tes_on_the_tensor_measured(run, step, layer, tensor):
    logged, dumps = run
    got = {k.split("/")[0].removeprefix("fp8_"): v for k, v in logged[step].items()
           if k.endswith(f"/{tensor}/{layer}")}
    x = dumps[step][f"{layer}/{tensor}"].reshape(-1)
    scale = dumps[step][f"{layer}/{tensor}/scale"].item()
    fmt, fp8_max = FORMATS[tensor], FP8_MAX[FORMATS[tensor]]
    finite = _finite(x)
    te = te_stats(finite, fmt, scale)
    assert got["nan_count"] == int(torch.isnan(x).sum())
    assert got["inf_count"] == int(torch.isinf(x).sum())
    assert got["amax"] == te["cur_amax"]
    assert got["amin"] == finite.abs()[finite != 0].min().item()
    assert got["underflow_pct"] == te["underflows%"]
    if layer == DELAYED or got["inf_count"]:  # TE's overflows% is delayed scaling's
        assert got["overflow_pct"] == te["overflows%"]
    else:  # a current scale clips nothing beyond the rounding to fp8_max (documented)
        assert got["overflow_pct"] == 0.0
    assert got["mse"] == pytest.approx(te["mse"], rel=1e-6)
    assert got["scale"] == scale and f32(1.0 / got["scale"]) == te["scale_inv"]
    assert got["current_scale"] == te_current_scale(te["cur_amax"], fmt)
    assert got["scale_ratio"] == pytest.approx(scale / got["current_scale"], rel=1e-12)
    xd = finite.double()  # cos_sim and rel_mse from the round trip, cast by torch
    q = (finite.float() * scale).clamp(-fp8_max, fp8_max).to(
        {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[fmt])
    r = (q.float() * torch.tensor(te["scale_inv"])).double()
    assert got["cos_sim"] == pytest.approx(
        (xd @ r / (xd.norm() * r.norm())).item(), rel=1e-6)
    assert got["rel_mse"] == pytest.approx(((xd - r).square().sum() / xd.square().sum()).item(),
                                           rel=1e-5)


@pytest.mark.parametrize("tensor", list(FORMATS))
def test_the_delayed_scales_are_tes_from_the_amaxes_before(run, tensor):
    """TE's delayed scaling casts step k with `fp8_max / max(amax of steps < k)` (history 1024,
    `max`), its first cast with scale 1; the what-if layer (current scaling) with its own."""
    logged, dumps = run
    fmt = FORMATS[tensor]
    amaxes = [te_amax(dumps[s][f"{DELAYED}/{tensor}"].reshape(-1).tolist()) for s in range(STEPS)]
    for step in range(STEPS):
        got = logged[step][layer_key("scale", tensor, DELAYED)]
        want = 1.0 if step == 0 else te_current_scale(max(amaxes[:step]), fmt)
        assert got == want, (step, got, want)
        assert logged[step].get(layer_key(INITIAL_SCALE, tensor, DELAYED), 0) == (step == 0)
        whatif = dumps[step][f"{WHATIF}/{tensor}"].reshape(-1)
        assert logged[step][layer_key("scale", tensor, WHATIF)] == te_current_scale(
            te_amax(whatif.tolist()), fmt)
