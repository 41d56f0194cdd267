"""A sharded (DCP) checkpoint saved without fp8_guard or fp8_state, resumed by a run that has
them: the main use of fp8_guard (added after a divergence). Composer's sharded load has DCP fill
the state every callback reports before fit (composer/utils/checkpoint.py,
`load_sharded_checkpoint`), and DCP's default planner refused the key the checkpoint lacks:
`Missing key in checkpoint state_dict: state.callbacks.FP8Guard.decisions` stopped the 2-rank
FSDP2 resume of the tiny MPT. Checked through Composer's own `dist_cp_load` and
`FileSystemReaderWithValidation`, as its sharded load calls them, on 2 gloo ranks and on one."""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from composer.utils import ObjectStore, checkpoint
from torch import nn
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.api import CheckpointException

from foundry_fp8.composer import guard
from foundry_fp8.composer.guard import DECISIONS, FP8Guard
from foundry_fp8.composer.state import FP8State, FP8StateError
from foundry_fp8.emulate import EmulatedFP8Linear, fp8_autocast
from foundry_fp8.fp8_meta import read_fp8_meta, write_fp8_meta
from foundry_fp8.guard import Fallback
from foundry_fp8.recipe import FP8Recipe
from tests.ranks import init_rank, run_ranks
from tests.test_state_callback import SAVED, _LazyStateLinear

RECIPE = FP8Recipe(scaling="delayed", amax_history_len=4)


@pytest.fixture(autouse=True)
def _installed():
    """What the callbacks do at BEFORE_LOAD (each run's Trainer constructor)."""
    FP8Guard().before_load(None, None)  # type: ignore[arg-type]  # reads neither
    FP8State.accept_sharded_checkpoints()


def _fp8_state(layers: int, trained: bool) -> tuple[nn.Module, FP8State]:
    torch.manual_seed(0)
    model = nn.Sequential(*(EmulatedFP8Linear(8, 8) for _ in range(layers)))
    if trained:
        for _ in range(3):
            with fp8_autocast(recipe=RECIPE):
                model(torch.randn(4, 8)).sum().backward()
    callback = FP8State()
    callback._model, callback._recipe = model, RECIPE  # what its INIT sets from the run
    return model, callback


def _load(template: dict, folder: str) -> None:
    checkpoint.dist_cp_load(template, checkpoint.FileSystemReaderWithValidation(folder))


def _saved_and_loaded(saving: FP8State, loading: FP8State, folder) -> dict:
    """`saving`'s entry in a sharded checkpoint, read back into `loading`'s load template (what
    Composer hands fp8_state's load_state_dict)."""
    dcp.save({"state": {"callbacks": {"FP8State": saving.state_dict()}}}, checkpoint_id=folder,
             no_dist=True)
    template = {"state": {"callbacks": {"FP8State": loading.state_dict()}}}
    _load(template, str(folder))
    return template["state"]["callbacks"]["FP8State"]


def _save_two_ranks(folder) -> tuple[dict, dict]:
    """`reduce_amax: false` on 2 ranks, saved: rank 0 holds half rank 1's amax histories."""
    _, saving = _fp8_state(1, trained=True)
    full = saving.state_dict()["modules"]
    half = {n: {k: v / 2 if k.endswith("_amax_history") else v for k, v in t.items()}
            for n, t in full.items()}
    dcp.save({"state": {"callbacks": {"FP8State": {
        "modules": half, "ranks": [half, full], "recipe": RECIPE.as_config()}}}},
        checkpoint_id=folder, no_dist=True)
    return half, full


def test_a_checkpoint_saved_without_fp8_guard_and_fp8_state_loads_into_a_run_with_both(
        tmp_path, caplog):
    weight = torch.arange(4.0)
    dcp.save({"state": {"model": {"w": weight}, "callbacks": {"Other": {"n": torch.ones(1)}}}},
             checkpoint_id=tmp_path, no_dist=True)
    _, fp8_state = _fp8_state(2, trained=False)
    template = {"state": {"model": {"w": torch.zeros(4)}, "callbacks": {
        "Other": {"n": torch.zeros(1)}, "FP8Guard": FP8Guard().state_dict(),
        "FP8State": fp8_state.state_dict()}}}
    with caplog.at_level(logging.WARNING):
        _load(template, str(tmp_path))
    assert torch.equal(template["state"]["model"]["w"], weight)  # the rest loaded
    assert torch.equal(template["state"]["callbacks"]["Other"]["n"], torch.ones(1))
    # no entry: Composer calls neither callback's load_state_dict (composer/core/state.py)
    assert set(template["state"]["callbacks"]) == {"Other"}
    [said] = [r.getMessage() for r in caplog.records if r.name.startswith("foundry_fp8")]
    assert said.startswith(f"fp8_guard: {tmp_path} holds no fp8_guard state (saved without")


def test_another_key_the_checkpoint_lacks_is_still_refused(tmp_path):
    dcp.save({"state": {"model": {"w": torch.ones(2)}, "callbacks": {}}}, checkpoint_id=tmp_path,
             no_dist=True)
    template = {"state": {"model": {"w": torch.zeros(2), "v": torch.zeros(2)}, "callbacks": {
        "FP8Guard": FP8Guard().state_dict(), "SpeedMonitor": {"n": torch.zeros(1)}}}}
    with pytest.raises(CheckpointException, match=r"Missing key in checkpoint state_dict: state\.(model\.v"
                                        r"|callbacks\.SpeedMonitor\.n)") as refused:
        _load(template, str(tmp_path))
    assert not getattr(refused.value, "__notes__", None)  # the tokenizer's line is not added


def _tokenizer_json(called: bool) -> dict:
    """LLM-Foundry's tokenizer's tokenizer.json as Composer keeps it in state.integrations
    (HuggingFaceModel.get_metadata), before or after a call like its text datasets' own
    (llmfoundry/data/text_data.py: truncation=True, padding='max_length')."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(os.path.join(os.path.dirname(__file__), "..",
                                                           "data", "tokenizer-v512"))
    if called:
        tokenizer("some text", truncation=True, padding="max_length", max_length=8)
    return json.loads(tokenizer.backend_tokenizer.to_str())


def _integrations(called: bool) -> dict:
    """state.integrations as Composer saves it (HuggingFaceModel.get_metadata)."""
    return {"huggingface": {"tokenizer": {"tokenizer.json": {"content": _tokenizer_json(called)}}}}


def _lacking(template: dict, folder) -> set[str]:
    """The template's keys under state.integrations the checkpoint lacks, as DCP flattens them."""
    saved = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    return {k for k in flatten_state_dict(template)[0]
            if k.startswith("state.integrations.") and k not in saved}


@pytest.mark.parametrize("saved_called", [True, False])
def test_an_autoresume_with_the_tokenizer_saved_otherwise_loads_without_its_metadata(
        tmp_path, caplog, saved_called):
    """Seen with no foundry-fp8 callback too: a sharded autoresume of an LLM-Foundry run on raw
    text stopped on DCP's 'Missing key ... state.integrations.huggingface.tokenizer...truncation'
    (the tokenizer saved after its calls, the template built from a fresh one), and autoresume
    drops load_ignore_keys. With fp8_state in the run the load goes on without that entry, which
    Composer never reads back; the FP8 state and the model load bit for bit."""
    saved = _tokenizer_json(called=True)
    assert saved["truncation"] is not None and _tokenizer_json(called=False)["truncation"] is None
    _, saving = _fp8_state(1, trained=True)
    weight = torch.randn(4)
    dcp.save({"state": {"model": {"w": weight}, "integrations": _integrations(saved_called),
                        "callbacks": {"FP8State": saving.state_dict()}}},
             checkpoint_id=tmp_path, no_dist=True)
    _, loading = _fp8_state(1, trained=False)
    template = {"state": {"model": {"w": torch.zeros(4)},
                          "integrations": _integrations(not saved_called),
                          "callbacks": {"FP8State": loading.state_dict()}}}
    lacking = _lacking(template, tmp_path)
    assert lacking  # what DCP refuses
    with caplog.at_level(logging.WARNING):
        _load(template, str(tmp_path))  # no load_ignore_keys: what autoresume passes
    assert "integrations" not in template["state"]
    assert torch.equal(template["state"]["model"]["w"], weight)
    for name, saved_tensor in saving.state_dict()["modules"]["0"].items():
        assert torch.equal(template["state"]["callbacks"]["FP8State"]["modules"]["0"][name],
                           saved_tensor), name
    [said] = [r.getMessage() for r in caplog.records if r.name.startswith("foundry_fp8")]
    assert said.startswith(f"foundry-fp8: {tmp_path} holds Composer's tokenizer metadata saved "
                           f"differently from this run's (it lacks state.integrations.")
    named = said.split("(it lacks ")[1].split(":")[0]
    assert named in lacking and ".content.truncation" in named
    assert "loading it without state.integrations" in said


def test_a_key_the_checkpoint_lacks_besides_the_tokenizers_is_still_refused(tmp_path):
    dcp.save({"state": {"model": {"w": torch.ones(2)}, "integrations": _integrations(True)}},
             checkpoint_id=tmp_path, no_dist=True)
    template = {"state": {"model": {"w": torch.zeros(2), "v": torch.zeros(2)},
                          "integrations": _integrations(False)}}
    with pytest.raises(CheckpointException, match=r"Missing key in checkpoint state_dict: "
                       r"state\.model\.v\.") as refused:
        _load(template, str(tmp_path))
    assert not getattr(refused.value, "__notes__", None)


def _mixed_worker(rank: int, rendezvous: str, folder: str, out: str) -> None:
    init_rank(rank, rendezvous)
    FP8State.accept_sharded_checkpoints()
    dcp.save({"state": {"model": {"w": torch.ones(2)}, "integrations": _integrations(True)}},
             checkpoint_id=folder)
    model = {"w": torch.zeros(2)} if rank == 0 else {"w": torch.zeros(2), "v": torch.zeros(2)}
    template = {"state": {"model": model, "integrations": _integrations(False)}}
    try:
        _load(template, folder)
        result = {"loaded": True}
    except CheckpointException as error:
        result = {"notes": getattr(error, "__notes__", []),
                  "integrations": "integrations" in template["state"]}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def test_a_tokenizer_key_refused_with_another_rank_s_own_key_keeps_the_note(tmp_path):
    """Refused on one rank for the tokenizer, on the other for a key of its own: no rank drops
    the entry (both see the same gathered error), and the note says how to resume."""
    folder = tempfile.mkdtemp(dir=tmp_path)
    run_ranks(_mixed_worker, folder, str(tmp_path), deadline_s=120)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for result in results:
        [note] = result["notes"]
        assert note.startswith("foundry-fp8: not an FP8 problem: ")
        assert f"load_path: {folder} and load_ignore_keys: [state/integrations]" in note
        assert result["integrations"]


class _Bucket(ObjectStore):
    """An S3 bucket kept in a local folder: what Composer's sharded load of a remote checkpoint
    (an autoresume from a remote save_folder) reads through DistCPObjectStoreReader."""

    def __init__(self, root: str):
        self.root = root

    def get_uri(self, object_name: str) -> str:
        return f"s3://bucket/{object_name}"

    def download_object(self, object_name: str, filename: str | os.PathLike, overwrite: bool = False,
                        callback: Any = None) -> None:
        shutil.copyfile(os.path.join(self.root, object_name), filename)


def test_a_remote_checkpoint_is_named_by_its_uri_not_composer_s_download_folder(tmp_path, caplog):
    """The reader's `path` is the download folder `<tempdir>/checkpoints` Composer deletes when
    the load ends (composer/utils/checkpoint.py, load_sharded_checkpoint): a load_path to it
    resumes nothing. Our lines (this warning, the note, fp8_guard's 'holds no state') name the
    checkpoint's URI, what autoresume loaded (trainer.py: ar_object_store.get_uri)."""
    name = "run/checkpoints/ep0-ba4"
    dcp.save({"state": {"model": {"w": torch.ones(2)}, "integrations": _integrations(True)}},
             checkpoint_id=tmp_path / "bucket" / name, no_dist=True)
    template = {"state": {"model": {"w": torch.zeros(2)}, "integrations": _integrations(False)}}
    with tempfile.TemporaryDirectory(dir=tmp_path) as download:
        reader = checkpoint.DistCPObjectStoreReader(
            source_path=name, destination_path=os.path.join(download, "checkpoints"),
            object_store=_Bucket(str(tmp_path / "bucket")))
        assert str(reader.path) == os.path.join(download, "checkpoints")  # named before
        with caplog.at_level(logging.WARNING):
            checkpoint.dist_cp_load(template, reader)
    assert torch.equal(template["state"]["model"]["w"], torch.ones(2))
    [said] = [r.getMessage() for r in caplog.records if r.name.startswith("foundry_fp8")]
    assert said.startswith(f"foundry-fp8: s3://bucket/{name} holds Composer's tokenizer metadata")


def test_fp8_guards_saved_decisions_still_load(tmp_path):
    decisions = json.dumps({"fallbacks": [], "marker": 7})
    dcp.save({"state": {"callbacks": {"FP8Guard": {DECISIONS: decisions}}}},
             checkpoint_id=tmp_path, no_dist=True)
    template = {"state": {"callbacks": {"FP8Guard": FP8Guard().state_dict()}}}
    _load(template, str(tmp_path))
    assert template["state"]["callbacks"]["FP8Guard"] == {DECISIONS: decisions}


def test_an_fp8_module_the_checkpoint_lacks_is_fp8_states_own_one_line_error(tmp_path):
    """te_swap's layer selection changed on resume: a module in FP8 now without saved state.
    DCP refused its keys with a traceback; now fp8_state names it (a whole-file load's error),
    and the saved module's state is the one restored."""
    saved_model, saving = _fp8_state(1, trained=True)
    model, loading = _fp8_state(2, trained=False)
    entry = _saved_and_loaded(saving, loading, tmp_path)
    assert set(entry["modules"]) == {"0"}
    with pytest.raises(FP8StateError, match=r"1 in FP8 now without saved state: 1; 0 saved"):
        loading.load_state_dict(entry)
    loading.strict = False
    loading.load_state_dict(entry)
    restored, saved = read_fp8_meta(model[0]), read_fp8_meta(saved_model[0])
    assert saved["fwd_amax_history"].abs().sum() > 0
    for key, value in saved.items():
        if key.endswith("_amax_history"):  # row 0 is not restored (docs/fp8_state.md)
            assert torch.equal(restored[key][1:], value[1:]), key
        else:
            assert torch.equal(restored[key], value), key


def _two_rank_worker(rank: int, rendezvous: str, folder: str, out: str) -> None:
    init_rank(rank, rendezvous)
    FP8Guard().before_load(None, None)  # type: ignore[arg-type]
    dcp.save({"state": {"model": {"w": torch.full((2,), rank + 1.0)}}}, checkpoint_id=folder)
    template = {"state": {"model": {"w": torch.zeros(2)},
                          "callbacks": {"FP8Guard": FP8Guard().state_dict()}}}
    _load(template, folder)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"w": template["state"]["model"]["w"].tolist(),
                   "callbacks": sorted(template["state"]["callbacks"])}, f)


def test_two_gloo_ranks_load_a_checkpoint_saved_without_fp8_guard(tmp_path):
    folder = tempfile.mkdtemp(dir=tmp_path)
    run_ranks(_two_rank_worker, folder, str(tmp_path), deadline_s=120)
    # DCP keeps rank 0's copy of a tensor both ranks saved under one key
    assert [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)] == [
        {"w": [1.0, 1.0], "callbacks": []}] * 2


@pytest.mark.parametrize("strict", [True, False])
def test_a_te_module_before_its_first_forward_takes_its_saved_state(tmp_path, strict, caplog):
    """TE creates a module's scaling state in its first FP8 forward (TE 2.20
    pytorch/module/base.py `init_fp8_metadata`), after Composer's sharded load: fp8_state's
    template held no entry for it, its saved state stayed behind, and fp8_state took the module
    for one added to FP8 (strict: the resume stopped; else: fresh scales, silently wrong)."""
    saved_module = _LazyStateLinear(history_len=4)
    saved_module.fp8_on = True
    saved_module(torch.randn(2, 4))
    write_fp8_meta(saved_module, SAVED)
    saving = FP8State()
    saving._model, saving._recipe = nn.Sequential(saved_module), RECIPE
    module = _LazyStateLinear(history_len=4)  # a resumed run: no forward yet
    loading = FP8State(strict=strict)
    loading._model, loading._recipe = nn.Sequential(module), RECIPE
    entry = _saved_and_loaded(saving, loading, tmp_path)
    with caplog.at_level(logging.WARNING):
        loading.load_state_dict(entry)
    assert "differ" not in caplog.text
    assert read_fp8_meta(module) == {}  # TE's state comes with its first FP8 forward
    module.fp8_on = True
    module(torch.randn(2, 4))
    restored = read_fp8_meta(module)
    assert restored.keys() == SAVED.keys()
    for key, value in SAVED.items():
        assert torch.equal(restored[key], value), key


def test_per_rank_states_in_a_sharded_checkpoint_are_read(tmp_path, caplog):
    """`reduce_amax: false`: each rank's state differs and is saved under `ranks`. Before fit
    every rank's state is the same, so the template had no `ranks` and DCP restored rank 0's
    state everywhere; on another number of ranks nothing was combined. Here 2 saved ranks
    resume on 1: histories combined as TE's amax reduction would (elementwise max)."""
    half, full = _save_two_ranks(tmp_path)
    model, loading = _fp8_state(1, trained=False)
    template = {"state": {"callbacks": {"FP8State": loading.state_dict()}}}
    _load(template, str(tmp_path))
    with caplog.at_level(logging.WARNING):
        loading.load_state_dict(template["state"]["callbacks"]["FP8State"])
    assert "combined" in caplog.text
    restored = read_fp8_meta(model[0])
    for key in ("fwd_amax_history", "bwd_amax_history"):
        want = torch.maximum(half["0"][key], full["0"][key])[1:]  # row 0 is not restored
        assert torch.equal(restored[key][1:], want), key
        assert not torch.equal(want, half["0"][key][1:])  # rank 0's alone would differ


def test_a_saved_module_not_in_fp8_now_is_named_as_in_a_whole_file_load(tmp_path):
    """te_swap excludes a layer on resume (fp8_guard's "next time" YAML): DCP read only the
    modules the template asked for, so the saved one went unseen; a whole-file load names it."""
    _, saving = _fp8_state(2, trained=True)
    model, loading = _fp8_state(1, trained=False)
    entry = _saved_and_loaded(saving, loading, tmp_path)
    assert torch.equal(entry["modules"]["1"]["fwd_amax_history"],
                       saving.state_dict()["modules"]["1"]["fwd_amax_history"])
    with pytest.raises(FP8StateError, match=r"0 in FP8 now without saved state; 1 saved, not in "
                                            r"FP8 now: 1 \(set"):
        loading.load_state_dict(entry)


def test_a_checkpoint_saved_unsaved_says_it_holds_no_fp8_state(tmp_path, caplog):
    """fp8_state's save-time failure saves `unsaved: true` and no modules: the template never
    asked for `unsaved`, so the resume stopped blaming te_swap's selection ("2 in FP8 now
    without saved state: 0, 1") instead of the one line a whole-file load gives."""
    dcp.save({"state": {"callbacks": {"FP8State": {
        "modules": {}, "unsaved": True, "recipe": RECIPE.as_config()}}}},
        checkpoint_id=tmp_path, no_dist=True)
    model, loading = _fp8_state(2, trained=False)
    before = {n: read_fp8_meta(m) for n, m in model.named_children()}
    template = {"state": {"callbacks": {"FP8State": loading.state_dict()}}}
    _load(template, str(tmp_path))
    entry = template["state"]["callbacks"]["FP8State"]
    assert entry["unsaved"] is True
    with caplog.at_level(logging.WARNING):
        loading.load_state_dict(entry)
    assert "holds no FP8 state" in caplog.text and "differ" not in caplog.text
    for name, module in model.named_children():
        after = read_fp8_meta(module)
        assert all(torch.equal(after[k], v) for k, v in before[name].items()), name


def test_a_run_without_fp8_reads_an_fp8_runs_sharded_checkpoint(tmp_path):
    """fp8_state kept, FP8 off (recipe None): the template's `recipe: None` against the saved
    recipe's fields was DCP's `Missing key ... FP8State.recipe` traceback; now the saved
    recipe is read and the run without FP8 modules is named, as in a whole-file load."""
    _, saving = _fp8_state(1, trained=True)
    loading = FP8State()
    loading._model, loading._recipe = nn.Sequential(nn.Linear(8, 8)), None
    entry = _saved_and_loaded(saving, loading, tmp_path)
    assert entry["recipe"] == {"scaling": "delayed", "fp8_format": "HYBRID",
                               "amax_history_len": 4, "amax_compute_algo": "max", "margin": 0,
                               "reduce_amax": True}
    with pytest.raises(FP8StateError, match=r"holds the FP8 state of 1 modules, this run has no "
                                            r"FP8 module \(te_swap left out"):
        loading.load_state_dict(entry)


class _DotProductAttention(_LazyStateLinear):
    """TE 2.20's DotProductAttention: a TE module without `num_gemms` whose forward prepares 3
    GEMMs (attention/dot_product_attention/dot_product_attention.py, `prepare_forward_ctx(...,
    num_gemms=3)`): 9 forward and 6 backward scaling tensors."""

    def forward(self, x):
        self.init_fp8_metadata(num_gemms=3)
        return nn.Linear.forward(self, x)


def test_a_te_module_of_three_gemms_before_its_first_forward_takes_its_saved_state(tmp_path):
    """The template guessed 1 GEMM for DotProductAttention (3/2 tensors): DCP stopped the resume
    with `Size mismatch between saved torch.Size([9]) and current: torch.Size([3])`."""
    saved_module = _DotProductAttention(history_len=4)
    saved_module.fp8_on = True
    saved_module(torch.randn(2, 4))
    saved = {"fwd_scale": torch.arange(1.0, 10.0), "bwd_scale": torch.arange(1.0, 7.0),
             "fwd_amax_history": torch.zeros(4, 9), "bwd_amax_history": torch.zeros(4, 6)}
    saved["fwd_amax_history"][1:] = 0.5  # amax * scale (<= 4.5) well inside E4M3's 448
    write_fp8_meta(saved_module, saved)
    saving = FP8State()
    saving._model, saving._recipe = nn.Sequential(saved_module), RECIPE
    module = _DotProductAttention(history_len=4)  # a resumed run: no forward yet
    loading = FP8State()
    loading._model, loading._recipe = nn.Sequential(module), RECIPE
    loading.load_state_dict(_saved_and_loaded(saving, loading, tmp_path))
    module.fp8_on = True
    module(torch.randn(2, 4))
    restored = read_fp8_meta(module)
    assert {k: tuple(v.shape) for k, v in restored.items()} == {
        "fwd_scale": (9,), "fwd_amax_history": (4, 9), "bwd_scale": (6,),
        "bwd_amax_history": (4, 6)}
    for key, value in saved.items():
        assert torch.equal(restored[key], value), key


def test_a_changed_history_length_is_judged_as_in_a_whole_file_load(tmp_path, caplog):
    """amax_history_len 4 -> 8 on resume: DCP stopped with `Size mismatch ... [4, 3] ...
    [8, 3]`; a whole-file load refuses in one line (strict) or fits the history as TE's
    `adjust_amax_history_length` does: the first rows kept, zero rows appended."""
    _, saving = _fp8_state(1, trained=True)
    saved = saving.state_dict()
    dcp.save({"state": {"callbacks": {"FP8State": saved}}}, checkpoint_id=tmp_path, no_dist=True)
    model, loading = _fp8_state(1, trained=False)
    loading._recipe = FP8Recipe(scaling="delayed", amax_history_len=8)
    template = {"state": {"callbacks": {"FP8State": loading.state_dict()}}}
    _load(template, str(tmp_path))
    entry = template["state"]["callbacks"]["FP8State"]
    with pytest.raises(FP8StateError, match=r"recipe changed\?\): amax_history_len 4 -> 8"):
        loading.load_state_dict(entry)
    loading.strict = False
    with caplog.at_level(logging.WARNING):
        loading.load_state_dict(entry)
    assert "histories fitted to the new length" in caplog.text
    for key in ("fwd_amax_history", "bwd_amax_history"):
        want = saved["modules"]["0"][key]
        got = read_fp8_meta(model[0])[key]
        assert want[1:].abs().sum() > 0
        assert got.shape == (8, want.shape[1])
        assert torch.equal(got[1:4], want[1:4]), key
        assert not got[4:].any(), key


def test_per_rank_states_and_a_module_added_to_fp8_is_fp8_states_own_error(tmp_path):
    """`ranks` was cloned from the template's `modules`, so it asked for the added module too:
    DCP's `Missing key ... FP8State.ranks.0.1.fwd_scale` traceback."""
    half, full = _save_two_ranks(tmp_path)
    model, loading = _fp8_state(2, trained=False)
    template = {"state": {"callbacks": {"FP8State": loading.state_dict()}}}
    _load(template, str(tmp_path))
    entry = template["state"]["callbacks"]["FP8State"]
    assert [sorted(r) for r in entry["ranks"]] == [["0"], ["0"]]
    with pytest.raises(FP8StateError, match=r"1 in FP8 now without saved state: 1; 0 saved"):
        loading.load_state_dict(entry)
    loading.strict = False
    loading.load_state_dict(entry)
    want = torch.maximum(half["0"]["fwd_amax_history"], full["0"]["fwd_amax_history"])[1:]
    assert torch.equal(read_fp8_meta(model[0])["fwd_amax_history"][1:], want)


def test_a_failure_preparing_the_load_leaves_composers_load_as_it_was(tmp_path, monkeypatch,
                                                                     caplog):
    """Our own bug in the template's preparation must not stop the resume: one warning, and
    DCP loads the template untouched."""
    def broken(entry: dict, saved: dict) -> None:
        entry["n"] = "half done"
        raise KeyError("ours")

    monkeypatch.setattr(guard, "_ABSENT_OK", {**guard._ABSENT_OK, "Other": (None, broken)})
    dcp.save({"state": {"callbacks": {"Other": {"n": torch.ones(2)}}}}, checkpoint_id=tmp_path,
             no_dist=True)
    template = {"state": {"callbacks": {"Other": {"n": torch.zeros(2)}}}}
    with caplog.at_level(logging.WARNING):
        _load(template, str(tmp_path))
    assert torch.equal(template["state"]["callbacks"]["Other"]["n"], torch.ones(2))
    [said] = [r.getMessage() for r in caplog.records if r.name.startswith("foundry_fp8")]
    assert said.startswith("foundry-fp8: internal error preparing the sharded checkpoint load "
                           "(KeyError: 'ours')")


def test_a_subclass_of_fp8_state_is_accepted_under_its_own_name(tmp_path, monkeypatch):
    """Composer keeps a callback's entry under `type(callback).__qualname__`
    (composer/core/state.py): fp8_state registered `FP8State` whatever its class."""
    monkeypatch.setattr(guard, "_ABSENT_OK", dict(guard._ABSENT_OK))

    class MyState(FP8State):
        pass

    dcp.save({"state": {"model": {"w": torch.ones(2)}}}, checkpoint_id=tmp_path, no_dist=True)
    _, loading = _fp8_state(1, trained=False)
    mine = MyState()
    mine._model, mine._recipe = loading._model, RECIPE
    mine.accept_sharded_checkpoints()  # what its before_load does
    template = {"state": {"model": {"w": torch.zeros(2)},
                          "callbacks": {type(mine).__qualname__: mine.state_dict()}}}
    _load(template, str(tmp_path))
    assert template["state"]["callbacks"] == {}
    assert torch.equal(template["state"]["model"]["w"], torch.ones(2))


def test_fallbacks_of_a_subclass_of_fp8_guard_left_behind_are_named(caplog):
    """A checkpoint of a run with a subclass of fp8_guard, resumed without one: its entry is
    under the subclass's name, and fp8_state looked only under `FP8Guard`, saying nothing."""
    class MyGuard(FP8Guard):
        pass

    model, loading = _fp8_state(1, trained=False)
    fallen = Fallback(layer="blocks.0", step=3, flops_share=0.5, reasons=("underflow",))
    loading._loaded_entries = {
        "FP8State": loading.state_dict(),
        MyGuard.__qualname__: {DECISIONS: json.dumps({"fallbacks": [fallen.record()]})}}
    with caplog.at_level(logging.WARNING):
        loading._report_loaded_entries(SimpleNamespace(callbacks=[loading], load_path="ckpt"))
    assert [r.getMessage() for r in caplog.records] == [
        "fp8_state: ckpt: fp8_guard held 1 layer in high precision (blocks.0); this run has no "
        "fp8_guard, so they run in FP8 again"]
