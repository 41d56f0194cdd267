"""fp8_state under 2 CPU ranks (gloo): state that differs per rank is saved and restored per
rank, and combined for another rank count; state that is the same on every rank is saved
once."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as torch_dist
from torch import nn

from foundry_fp8.composer.state import FP8State
from foundry_fp8.emulate import EmulatedFP8Linear, fp8_autocast
from foundry_fp8.fp8_meta import read_fp8_meta
from foundry_fp8.recipe import FP8Recipe
from tests.ranks import init_rank, run_ranks


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(EmulatedFP8Linear(16, 16), EmulatedFP8Linear(16, 16))


def _train(model: nn.Module, data_seed: int) -> None:
    """Per-rank data; without `reduce_amax` (which would give every rank the same amaxes, as TE)
    the ranks' FP8 states differ when their data does."""
    generator = torch.Generator().manual_seed(data_seed)
    for _ in range(2):
        with fp8_autocast(recipe=FP8Recipe(amax_history_len=4, reduce_amax=False)):
            out = model(torch.randn(4, 16, generator=generator) * (1 + data_seed))
        out.sum().backward()


def _worker(rank: int, rendezvous: str, out_dir: str) -> None:
    init_rank(rank, rendezvous)
    try:
        for mode, data_seed in (("differ", rank), ("same", 0)):
            model = _model()
            _train(model, data_seed)
            saver = FP8State()
            saver._model = model
            saved = saver.state_dict()
            target = _model()
            loader = FP8State()
            loader._model = target
            loader.load_state_dict(saved)
            torch.save({"saved": saved, "own": [read_fp8_meta(m) for m in model],
                        "restored": [read_fp8_meta(m) for m in target]},
                       f"{out_dir}/{mode}-rank{rank}.pt")
        # saved with reduce_amax off (as trained), resumed on as many ranks with it on
        model = _model()
        _train(model, rank)
        saver = FP8State()
        saver._model, saver._recipe = model, FP8Recipe(amax_history_len=4, reduce_amax=False)
        saved = saver.state_dict()
        target = _model()
        loader = FP8State()  # the default, strict
        loader._model, loader._recipe = target, FP8Recipe(amax_history_len=4)
        try:
            loader.load_state_dict(saved)
            error = None
        except ValueError as refused:
            error = str(refused)
        torch.save({"saved": saved, "own": [read_fp8_meta(m) for m in model], "error": error,
                    "restored": [read_fp8_meta(m) for m in target]},
                   f"{out_dir}/reduced-rank{rank}.pt")
    finally:
        torch_dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, list[dict]]:
    """Both scenarios in one 2-process run (starting the processes dominates the cost)."""
    out = tmp_path_factory.mktemp("ranks")
    run_ranks(_worker, str(out))
    return {mode: [torch.load(out / f"{mode}-rank{r}.pt", weights_only=False) for r in range(2)]
            for mode in ("differ", "same", "reduced")}


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_per_rank_state_saved_and_restored_per_rank(results):
    results = results["differ"]
    saved = results[0]["saved"]
    assert len(saved["ranks"]) == 2
    assert not _equal(results[0]["own"][0], results[1]["own"][0])  # ranks really differ
    for rank, result in enumerate(results):
        # every rank wrote the same complete state (sharded saves dedupe to the lowest rank)
        assert _equal(result["saved"]["modules"]["0"], saved["modules"]["0"])
        assert _equal(result["saved"]["ranks"][1]["1"], saved["ranks"][1]["1"])
        for own, restored in zip(result["own"], result["restored"], strict=True):
            assert _equal(own, restored)  # each rank got its own state back
        assert _equal(saved["ranks"][rank]["0"], result["own"][0])



def test_a_single_process_resumes_a_2_rank_checkpoint_combined(results, caplog):
    """Under the default `strict`: the ranks' states combined as TE's amax reduction would, and
    said so in the log."""
    saved = results["differ"][0]["saved"]
    target = _model()
    callback = FP8State()
    callback._model = target
    with caplog.at_level(logging.WARNING, logger="foundry_fp8.composer.state"):
        callback.load_state_dict(saved)
    assert "on each of its 2 ranks, this run has 1: every rank gets them combined as TE's amax " \
           "reduction would" in caplog.text
    for i, module in enumerate(target):
        own = [result["own"][i] for result in results["differ"]]
        restored = read_fp8_meta(module)
        for direction in ("fwd", "bwd"):
            history = torch.maximum(own[0][f"{direction}_amax_history"],
                                    own[1][f"{direction}_amax_history"])
            assert torch.equal(restored[f"{direction}_amax_history"][1:], history[1:])
            assert torch.equal(restored[f"{direction}_scale"],
                               torch.minimum(own[0][f"{direction}_scale"],
                                             own[1][f"{direction}_scale"]))
        # the scale is the one TE computes from the combined history (E4M3 forward, E5M2
        # backward), where an amax was recorded
        amax = restored["fwd_amax_history"][1:].amax(0)
        seen = amax > 0
        assert torch.allclose(restored["fwd_scale"][seen], 448.0 / amax[seen], rtol=1e-6)


def test_reduce_amax_turned_on_combines_the_ranks_on_as_many_ranks(results):
    """`reduce_amax` false -> true is no change of the state's layout: the default `strict` took
    it for a recipe change and refused the resume. With the amaxes reduced from now on, each
    rank's own history would keep its own scales for `amax_history_len` steps, which reduction
    never gives: every rank gets the ranks' states combined, as TE's reduction would have made
    them (elementwise max of the histories, the smallest scale)."""
    results = results["reduced"]
    assert len(results[0]["saved"]["ranks"]) == 2
    own = [result["own"] for result in results]
    assert not _equal(own[0][0], own[1][0])  # the ranks really differ
    for result in results:
        assert result["error"] is None
        for i, restored in enumerate(result["restored"]):
            for direction in ("fwd", "bwd"):
                history = torch.maximum(own[0][i][f"{direction}_amax_history"],
                                        own[1][i][f"{direction}_amax_history"])
                assert torch.equal(restored[f"{direction}_amax_history"][1:], history[1:])
                assert torch.equal(restored[f"{direction}_scale"],
                                   torch.minimum(own[0][i][f"{direction}_scale"],
                                                 own[1][i][f"{direction}_scale"]))


def test_same_state_on_every_rank_is_saved_once(results):
    for result in results["same"]:
        assert "ranks" not in result["saved"]
        for own, restored in zip(result["own"], result["restored"], strict=True):
            assert _equal(own, restored)
