"""The stand-in TE (tests/fake_te.py) against the installed real TE, where one imports: the
same state_dict keys, shapes and dtypes, and the same verdict on every kind of `_extra_state`
a checkpoint can hand TE. Real TE builds no module without CUDA (`probe.te_builds_without_cuda`),
so its check is switched off here to build them on the CPU and the meta device; nothing runs a
TE kernel. Skipped where TE is absent (CI); run by the GPU kit's CPU rehearsal (TE 2.20.2 and
torch 2.11 on Python 3.12) and on any machine with TE."""

from __future__ import annotations

import io
import pickle

import pytest
import torch

from tests import fake_te as stand_in_te

MODULES = [
    ("Linear", stand_in_te._Linear, {"in_features": 32, "out_features": 64, "bias": True}),
    ("Linear", stand_in_te._Linear, {"in_features": 32, "out_features": 64, "bias": False}),
    *(("LayerNormMLP", stand_in_te._LayerNormMLP,
       {"hidden_size": 32, "ffn_hidden_size": 64, "bias": bias, "normalization": norm})
      for bias in (True, False) for norm in ("LayerNorm", "RMSNorm")),
]


@pytest.fixture
def te(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # TE's check, module/base.py:895
    return pytest.importorskip("transformer_engine.pytorch")


def _layout(module: torch.nn.Module) -> dict[str, tuple[tuple[int, ...], torch.dtype, str]]:
    return {k: (tuple(v.shape), v.dtype, type(v).__name__) for k, v in module.state_dict().items()}


@pytest.mark.parametrize("device", ["meta", "cpu"])
@pytest.mark.parametrize(("name", "fake", "kwargs"), MODULES)
def test_the_stand_in_s_modules_save_what_te_s_save(te, name, fake, kwargs, device):
    real = getattr(te, name)(**kwargs, params_dtype=torch.bfloat16, device=device)
    stand_in = fake(**kwargs, params_dtype=torch.bfloat16, device=device)
    assert _layout(stand_in) == _layout(real)
    assert [n for n, _ in stand_in.named_parameters()] == [n for n, _ in real.named_parameters()]
    assert stand_in.fp8_meta == real.fp8_meta and stand_in.fp8 is real.fp8 is False


def test_the_stand_in_s_layernorm_saves_what_te_s_saves(te):
    real = te.LayerNorm((32,), eps=1e-6, dtype=torch.bfloat16, device="meta")
    stand_in = stand_in_te._LayerNormOp((32,), eps=1e-6, dtype=torch.bfloat16, device="meta")
    assert _layout(stand_in) == _layout(real)


def _pickled(obj: object) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)


def _extra_states() -> dict[str, object]:
    from torch.distributed.checkpoint.state_dict import _EXTRA_STATE  # full-state-dict loads
    from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling

    delayed = {"recipe": DelayedScaling(), "scale_fwd": torch.ones(3),
               "amax_history_fwd": torch.zeros(4, 3), "scale_bwd": torch.ones(2),
               "amax_history_bwd": torch.zeros(4, 2), "extra_fp8_variables": {}}
    saved = io.BytesIO()
    torch.save(None, saved)
    return {"none": None, "empty": torch.empty(0, dtype=torch.uint8),
            "pickled None (fp8_state's)": _pickled(None), "pickled {}": _pickled({}),
            "delayed": _pickled(delayed),
            "TE 1.x, no recipe": _pickled({k: v for k, v in delayed.items() if k != "recipe"}),
            "current scaling": _pickled({"recipe": Float8CurrentScaling(),
                                         "extra_fp8_variables": {}}),
            "not a pickle": torch.tensor([1, 2, 3], dtype=torch.uint8), "BytesIO (TE 1.x)": saved,
            "torch's placeholder": _EXTRA_STATE(), "a dict": {"a": 1}}


def _verdict(module: torch.nn.Module, state: object) -> str:
    if isinstance(state, io.BytesIO):
        state.seek(0)
    try:
        module.set_extra_state(state)
    except RuntimeError as error:
        return "refused" if str(error).startswith("Refusing to load pickled") else str(error)
    return "ignored"


def test_the_stand_in_loads_and_refuses_the_extra_state_te_does(te, monkeypatch):
    """Without NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE (with it, real TE would restore the state on
    CUDA)."""
    monkeypatch.delenv(stand_in_te._UNSAFE_ENV, raising=False)
    verdicts = {label: (_verdict(te.Linear(32, 64, device="meta"), state),
                        _verdict(stand_in_te._Linear(32, 64, device="meta"), state))
                for label, state in _extra_states().items()}
    assert {label: real for label, (real, _) in verdicts.items()} == \
        {label: fake for label, (_, fake) in verdicts.items()}
    assert verdicts["delayed"][0] == "refused" and verdicts["current scaling"][0] == "ignored"


def test_the_stand_in_classifies_pickles_as_te_does(te):
    """`tests.fake_te._unsafe_pickle` is TE 2.20.2's `_classify_extra_state_pickle`
    (pytorch/_extra_state.py:113-187), no bytes at all included (l. 115-116: ignored)."""
    from transformer_engine.pytorch import _extra_state

    payloads = [b"", b"\x80", pickle.dumps(None), pickle.dumps([1, "recipe"])]
    payloads += [s.numpy().tobytes() for s in _extra_states().values()
                 if isinstance(s, torch.Tensor)]
    for data in payloads:
        real = _extra_state._classify_extra_state_pickle(data)
        assert stand_in_te._unsafe_pickle(data) == (
            real is _extra_state._PickledExtraStateAction.UNSAFE_LOAD), data[:40]


def test_the_stand_in_s_contract_as_read_in_te_2_20_2(fake_te):
    """The two points the checks above found the stand-in wrong on, kept where TE is absent:
    LayerNormMLP registers each GEMM's weight then its bias (pytorch/module/layernorm_mlp.py:
    2089-2149), so parameters() and an optimizer's order are TE's; no bytes at all are no
    state, not an unreadable pickle (pytorch/_extra_state.py:115-116)."""
    fake_te()
    import transformer_engine.pytorch as stand_in

    fused = stand_in.LayerNormMLP(32, 64, device="cpu")
    assert [n for n, _ in fused.named_parameters()] == [
        "layer_norm_weight", "layer_norm_bias", "fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias"]
    assert stand_in_te._unsafe_pickle(b"") is False and stand_in_te._unsafe_pickle(b"\x80") is True


@pytest.mark.parametrize("device", ["meta", "cpu"])
@pytest.mark.parametrize("bias", [True, False])
def test_te_backend_s_builders_pass_keywords_real_te_takes(te, device, bias):
    """`te.backend`'s builders with the installed TE: its constructors take every keyword we
    pass, and the parameters come over exactly (bf16, LayerNorm and RMSNorm, gelu and relu)."""
    from foundry_fp8.te import backend

    with torch.device(device):
        linear = torch.nn.Linear(32, 64, bias=bias, dtype=torch.bfloat16)
        norm = torch.nn.LayerNorm(32, eps=1e-6, dtype=torch.bfloat16)
        block = torch.nn.Module()
        block.norm_2, block.ffn = norm, torch.nn.Module()
        block.ffn.up_proj = torch.nn.Linear(32, 64, bias=bias, dtype=torch.bfloat16)
        block.ffn.down_proj = torch.nn.Linear(64, 32, bias=bias, dtype=torch.bfloat16)
    built = [(backend.make_te_linear(linear), linear),
             (backend.make_te_layernorm(norm), norm)]
    built += [(backend.make_te_layernorm_mlp(block, normalization, activation), None)
              for normalization in ("LayerNorm", "RMSNorm") for activation in ("gelu", "relu")]
    for new, src in built:
        assert type(new).__module__.startswith("transformer_engine.pytorch")
        assert all(p.device.type == device and p.dtype == torch.bfloat16 for p in new.parameters())
        if device == "cpu" and src is not None:
            assert all(torch.equal(getattr(new, n), p) for n, p in src.named_parameters())
    if device == "cpu":
        fused = built[2][0]
        assert len(backend.ln_mlp_sources(block, fused)) == (6 if bias else 4)
        assert all(torch.equal(dst, src) for src, dst in backend.ln_mlp_sources(block, fused))
