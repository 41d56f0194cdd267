"""FP8060: `tp_config: {strategy: ffn}` with TE layers at the FFN projections it shards. The
chain is run with LLM-Foundry's own ffn_tp_strategy on a real (tiny) MPT, te_swap's own
conversion on the TE stand-in (tests/fake_te.py: like TE's Linear, no nn.Linear) and torch's own
ColwiseParallel/RowwiseParallel, which refuse what is not an nn.Linear before touching a mesh."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from foundry_fp8.lint.cli import lint_file

CORPUS = Path(__file__).parent / "lint_corpus"
#: A clean te_swap run of the corpus, with LLM-Foundry's ffn tensor parallelism added.
BASE = yaml.safe_load((CORPUS / "train" / "mpt-125m-te-swap.yaml").read_text())
BASE["tp_config"] = {"strategy": "ffn", "tensor_parallel_degree": 2}
#: te_swap options that keep the FFN projections the ffn strategy shards out of TE.
KEEP_FFN = r"\.ffn\.(up|down)_proj$"


def _tiny_mpt():
    from llmfoundry.models.mpt import ComposerMPTCausalLM

    return ComposerMPTCausalLM(d_model=64, n_heads=4, n_layers=2, expansion_ratio=4,
                               max_seq_len=16, vocab_size=64, init_device="cpu",
                               attn_config={"attn_impl": "torch"},
                               loss_fn="torch_crossentropy")


def _tp_wrap_refuses(swap: dict | None, fake_te) -> bool:
    """LLM-Foundry's plan on the model as built, te_swap's conversion (Event.INIT), then each
    planned style on the module now at that name, as Composer's prepare_tp_module applies it."""
    from llmfoundry.tp.ffn_tp_strategy import ffn_tp_strategy
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from foundry_fp8.options import build
    from foundry_fp8.swap import convert_to_fp8

    fake_te("2.8.0")
    model = _tiny_mpt()
    plan = ffn_tp_strategy(model)
    if swap is not None:
        convert_to_fp8(model, build("te_swap", swap))
    modules = dict(model.named_modules())
    for name, style in plan.items():
        if isinstance(style, (ColwiseParallel, RowwiseParallel)):
            try:
                style._apply(modules[name], None)
            except NotImplementedError:
                return True
            except Exception:  # an nn.Linear gets past the type check to the missing mesh
                continue
    return False


def _lint(tmp_path: Path, config: dict, gpus: int | None = None) -> list[tuple[str, str]]:
    path = tmp_path / "tp.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    entry = lint_file(path, gpus=gpus)
    assert entry["error"] is None
    return [(f["key"], f["severity"]) for f in entry["findings"] if f["rule"] == "FP8060"]


@pytest.mark.parametrize(("swap", "refused"), [
    ({}, True),                                          # te_swap's defaults: every block linear
    ({"exclude": KEEP_FFN}, False),                      # the projections left in torch
    ({"include": r"\.ffn\.up_proj$"}, True),             # only up_proj: still refused
    ({"backend": "emulate"}, False),                     # emulated layers are nn.Linear
])
def test_te_swap_under_tensor_parallelism(tmp_path, fake_te, swap, refused):
    assert _tp_wrap_refuses({**swap, "min_gemm_size": 0}, fake_te) == refused
    config = copy.deepcopy(BASE)
    config["algorithms"]["te_swap"] = swap
    assert _lint(tmp_path, config) == ([("tp_config.strategy", "error")] if refused else [])


def test_the_model_s_own_te_linears_under_tensor_parallelism(tmp_path, fake_te):
    """fc_type te: MPTMLP builds up_proj/down_proj as te.Linear (swapped in here for the
    stand-in, as LLM-Foundry's FC registry would build them)."""
    from llmfoundry.tp.ffn_tp_strategy import ffn_tp_strategy
    from torch.distributed.tensor.parallel import ColwiseParallel

    fake_te("2.8.0")
    import transformer_engine.pytorch as te

    model = _tiny_mpt()
    plan = ffn_tp_strategy(model)
    for block in model.model.transformer.blocks:
        block.ffn.up_proj = te.Linear(64, 256, device="cpu")
    name = next(n for n, s in plan.items() if isinstance(s, ColwiseParallel))
    with pytest.raises(NotImplementedError, match="only support nn.Linear"):
        plan[name]._apply(dict(model.named_modules())[name], None)
    config = copy.deepcopy(BASE)
    del config["algorithms"]["te_swap"]
    config["model"]["fc_type"] = "te"
    assert _lint(tmp_path, config) == [("tp_config.strategy", "error")]
    assert _lint(tmp_path, config, gpus=1) == []  # LLM-Foundry drops tp_config on one GPU


def test_te_ln_mlp_has_nothing_for_the_ffn_strategy(tmp_path, fake_te):
    from llmfoundry.tp.ffn_tp_strategy import ffn_tp_strategy

    fake_te("2.8.0")
    import transformer_engine.pytorch as te

    model = _tiny_mpt()
    for block in model.model.transformer.blocks:
        block.ffn = te.LayerNormMLP(64, 256, device="cpu")
    with pytest.raises(RuntimeError, match="requires `model` to have layers"):
        ffn_tp_strategy(model)
    config = copy.deepcopy(BASE)
    del config["algorithms"]["te_swap"]
    config["model"]["ffn_config"] = {"ffn_type": "te_ln_mlp"}
    assert _lint(tmp_path, config) == [("tp_config.strategy", "error")]


def test_no_tensor_parallelism_or_no_te_is_quiet(tmp_path):
    plain = copy.deepcopy(BASE)
    del plain["tp_config"]
    assert _lint(tmp_path, plain) == []
    bf16 = copy.deepcopy(BASE)
    del bf16["algorithms"]["te_swap"]
    bf16["precision"] = "amp_bf16"
    assert _lint(tmp_path, bf16) == []
