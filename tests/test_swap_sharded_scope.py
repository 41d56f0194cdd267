"""Which sharded loads te_swap's cross-layout planner (composer/plain.py `load_sharded_plain`)
acts on: every one into its own Trainer's state, whenever it runs, and no other.

Before, Composer's `dist_cp_load` was swapped from te_swap's INIT for one call, undone at
AFTER_LOAD: a load outside that window (Composer's LoadCheckpoint callback at `after_load`)
met DCP's "Missing key"; a Trainer that failed before its load, or fp8_state wrapping
`dist_cp_load` on top of it (guard.py `accept_absent_state`, at BEFORE_LOAD), left the swap
in place, and a later Trainer without te_swap had its load renamed by the first one's model.
And where the checkpoint lacks torch 2.7's Adam `decoupled_weight_decay` (saved by torch
2.6, Composer 0.31), Composer's `dist_cp_load` retried with a partial-load planner of its own
(composer/utils/checkpoint.py, 0.31-0.32): the renamed weights were silently not loaded.

Real Composer Trainers, one gloo rank, FSDP2 sharded, `te` backend on tests/fake_te.py; the
reference is the saving run's own parameters (and Adam moments) at the save, by MPT's names.
"""

from __future__ import annotations

import pickle

import pytest
import torch

from tests.test_swap_sharded_layout import FUSED, PLAIN, _by_plain_name, _trainer, one_rank_env


@pytest.fixture
def fused_checkpoint(tmp_path, one_rank_group, fake_te, monkeypatch):
    """(a fused run's sharded checkpoint folder, its parameters and Adam moments by MPT's
    names)."""
    fake_te()
    one_rank_env(monkeypatch)
    saving = _trainer(tmp_path / "saved", FUSED, monkeypatch, mlp_decay=0.25)
    saving.fit()
    expected = _by_plain_name(saving)
    saving.close()
    return tmp_path / "saved" / "ep0-ba2", expected


def _composer_dist_cp_load(monkeypatch) -> None:
    """Composer's own `dist_cp_load` in place for this test, as in a fresh process (fp8_state's
    wrapper, process-wide, may be there from an earlier test)."""
    from composer.utils import checkpoint

    load = checkpoint.dist_cp_load
    while hasattr(load, "__wrapped__"):
        load = load.__wrapped__
    monkeypatch.setattr(checkpoint, "dist_cp_load", load)


@pytest.mark.filterwarnings("ignore")
def test_another_trainers_load_is_left_as_composer_does_it(tmp_path, fused_checkpoint,
                                                           monkeypatch):
    from foundry_fp8.composer.state import FP8State

    _composer_dist_cp_load(monkeypatch)
    folder, _ = fused_checkpoint
    # a te_swap Trainer that fails in its own load (its load_path does not exist)
    with pytest.raises(FileNotFoundError):
        _trainer(tmp_path / "failed", PLAIN, monkeypatch, load_path=str(tmp_path / "absent"))
    # a Trainer without te_swap: a plain model refuses the fused checkpoint, as Composer does
    with pytest.raises(BaseException, match="Missing key in checkpoint state_dict"):
        _trainer(tmp_path / "other", None, monkeypatch, load_path=str(folder))
    # a te_swap Trainer with fp8_state (which wraps dist_cp_load at BEFORE_LOAD), closed
    _trainer(tmp_path / "closed", PLAIN, monkeypatch, callbacks=(FP8State(),)).close()
    with pytest.raises(BaseException, match="Missing key in checkpoint state_dict"):
        _trainer(tmp_path / "later", None, monkeypatch, load_path=str(folder))


@pytest.mark.filterwarnings("ignore")
def test_a_load_checkpoint_callback_after_load_reads_the_other_layout(tmp_path, fused_checkpoint,
                                                                      monkeypatch):
    """LLM-Foundry's `callbacks: {load_checkpoint: {load_path, load_weights_only, event}}`
    (Composer's LoadCheckpoint) loads at the event it is given, here after the Trainer's own."""
    from composer.callbacks import LoadCheckpoint

    folder, (expected, _) = fused_checkpoint
    loading = _trainer(tmp_path / "b", PLAIN, monkeypatch, callbacks=(LoadCheckpoint(
        load_path=str(folder), load_weights_only=True, event="after_load"),))
    params, _ = _by_plain_name(loading)
    assert sorted(params) == sorted(expected)
    for name, value in expected.items():
        assert torch.equal(params[name], value), name
    loading.close()


@pytest.mark.filterwarnings("ignore")
def test_a_checkpoint_without_adams_decoupled_weight_decay_resumes_in_the_other_layout(
        tmp_path, fused_checkpoint, monkeypatch):
    """torch 2.6's Adam has no `decoupled_weight_decay` param-group key (Composer 0.31 runs on
    it); taken out of the checkpoint's DCP metadata, as such a checkpoint lacks it."""
    folder, (expected, expected_moments) = fused_checkpoint
    metadata_file = folder / ".metadata"
    metadata = pickle.loads(metadata_file.read_bytes())
    dropped = [k for k in metadata.state_dict_metadata if k.endswith(".decoupled_weight_decay")]
    assert dropped  # torch 2.7's DecoupledAdamW saved it
    for key in dropped:
        del metadata.state_dict_metadata[key]
        metadata.planner_data.pop(key, None)
    metadata_file.write_bytes(pickle.dumps(metadata))

    resuming = _trainer(tmp_path / "b", PLAIN, monkeypatch, load_path=str(folder), batches=3)
    assert resuming.state.timestamp.batch.value == 2
    params, moments = _by_plain_name(resuming)
    for name, value in expected.items():
        assert torch.equal(params[name], value), name
    for name, state in expected_moments.items():
        for key, value in state.items():
            assert torch.equal(moments[name][key], value), (name, key)
    groups = resuming.state.optimizers[0].param_groups
    assert [g["weight_decay"] for g in groups] == [1e-5, 0.25]
    assert all(g["decoupled_weight_decay"] is True for g in groups)  # DecoupledAdamW's own
    resuming.close()
