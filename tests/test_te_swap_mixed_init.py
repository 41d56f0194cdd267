"""te_swap under LLM-Foundry's `init_device: mixed` (FSDP): MPTModel builds local rank 0's
model on the CPU and every other rank's on the meta device (llmfoundry/models/mpt/
modeling_mpt.py, MPTModel.__init__). te_swap declines to fuse norm_2+MLP and to convert
LayerNorms on meta weights (LLM-Foundry's param_init_fn cannot initialise those TE modules), so
rank 0 alone fused and converted: FSDP then sharded a te.LayerNormMLP on rank 0 against two
nn.Linear on rank 1 (same sizes in the same order, so nothing failed; rank 1 trained its MLP
in high precision with exact GELU). Two gloo ranks run te_swap's INIT on the real MPT with a
stand-in TE; every rank must build the modules the meta rank builds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.ranks import init_rank, run_ranks

SECTION = {"d_model": 64, "n_heads": 4, "n_layers": 2, "expansion_ratio": 4, "max_seq_len": 16,
           "vocab_size": 128, "attn_config": {"attn_impl": "torch"},
           "loss_fn": "torch_crossentropy", "init_device": "mixed"}


def _worker(rank: int, rendezvous: str, out_dir: str, options: dict) -> None:
    from composer.core import Event, Precision, State
    from composer.devices import DeviceCPU
    from composer.loggers import Logger
    from llmfoundry.models.mpt import ComposerMPTCausalLM

    from foundry_fp8.composer.te_swap import TESwap
    from tests.fake_te import install_fake_te

    init_rank(rank, rendezvous)
    patch = pytest.MonkeyPatch()
    install_fake_te(patch)
    torch.manual_seed(0)
    model = ComposerMPTCausalLM(tokenizer=None, **SECTION)
    meta = model.model.transformer.blocks[0].ffn.up_proj.weight.is_meta
    state = State(model=model, rank_zero_seed=0, run_name="mixed", device=DeviceCPU(),
                  precision=Precision.AMP_FP8)
    algorithm = TESwap(backend="te", **options)
    algorithm.apply(Event.INIT, state, Logger(state))
    modules = [(name, type(m).__name__) for name, m in model.named_modules()]
    decisions = {d.name: [d.convert, d.reason] for d in algorithm.plan.decisions
                 if d.kind in ("ln_mlp", "layernorm")}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(
        {"meta": meta, "modules": modules, "decisions": decisions}))
    patch.undo()
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize("options", [{"fuse_ln_mlp": True}, {"convert_layernorm": True}],
                         ids=["fuse_ln_mlp", "convert_layernorm"])
def test_every_rank_of_a_mixed_init_builds_the_meta_ranks_modules(tmp_path, options):
    run_ranks(_worker, str(tmp_path), options, deadline_s=150)
    found = [tmp_path / f"rank{r}.json" for r in range(2)]
    assert all(p.exists() for p in found), "a rank did not finish"
    cpu, meta = (json.loads(p.read_text()) for p in found)
    assert (cpu["meta"], meta["meta"]) == (False, True)  # what mixed init gave each rank
    # the meta rank's own plan is the reference: it keeps what its init cannot fill
    assert meta["decisions"] and not any(convert for convert, _ in meta["decisions"].values())
    assert cpu["modules"] == meta["modules"]
    assert {n: c for n, (c, _) in cpu["decisions"].items()} == {
        n: c for n, (c, _) in meta["decisions"].items()}
    assert all(reason.startswith("not fused: init_device mixed" if "fuse_ln_mlp" in options
                                 else "init_device mixed")
               for _, reason in cpu["decisions"].values())
