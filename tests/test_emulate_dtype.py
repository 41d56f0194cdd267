"""The FP8 state of a bfloat16 or float16 emulated model stays float32, as TE keeps it whatever
the module's dtype (TE 2.20 pytorch/quantization.py:1436-1442: `torch.ones`/`torch.zeros`,
float32): through `.to(dtype)`, `.half()`, `.bfloat16()` and FSDP's buffer casting. The scales
and histories are checked against TE's update written out by hand."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as torch_dist
from torch import nn

from foundry_fp8.emulate import EmulatedFP8Linear, fp8_autocast
from foundry_fp8.fp8_meta import read_fp8_meta
from foundry_fp8.recipe import FP8Recipe
from tests.ranks import init_rank, run_ranks
from tests.test_emulate_te import E4M3, E5M2, te_amax, te_scale

HISTORY = 4
SIZE = 64


def te_history(amaxes: list[float]) -> list[float]:
    """One history column after len(amaxes) < HISTORY updates: TE's fused update moves row 0 to
    the last row and shifts the others up, row 0 zeroed (delayed_scaling.cu:187-198), so the
    amaxes stand in order below the rows not reached yet."""
    return [0.0] * (HISTORY - len(amaxes)) + amaxes


def expected_state(x_amaxes: list[float], w_amax: float, g_amaxes: list[float]
                   ) -> dict[str, torch.Tensor]:
    """`read_fp8_meta`'s layout after one update per amax, by TE's formulas: input, weight and
    output (never cast) forward; grad output and grad input (never cast) backward."""
    steps = len(x_amaxes)
    return {
        "fwd_scale": torch.tensor([te_scale(E4M3, max(x_amaxes)), te_scale(E4M3, w_amax), 1.0]),
        "fwd_amax_history": torch.tensor(
            [te_history(x_amaxes), te_history([w_amax] * steps), te_history([])]).t(),
        "bwd_scale": torch.tensor([te_scale(E5M2, max(g_amaxes)), 1.0]),
        "bwd_amax_history": torch.tensor([te_history(g_amaxes), te_history([])]).t(),
    }


def _assert_state(layer: nn.Module, want: dict[str, torch.Tensor]) -> None:
    got = read_fp8_meta(layer)
    assert set(got) == set(want)
    for key, tensor in want.items():
        assert got[key].dtype == torch.float32, key
        assert torch.equal(got[key], tensor), (key, got[key], tensor)


CONVERSIONS: dict[str, Callable[[nn.Module], nn.Module]] = {
    "to(bfloat16)": lambda m: m.to(torch.bfloat16),
    "bfloat16()": lambda m: m.bfloat16(),
    "half()": lambda m: m.half(),
    "to(float16)": lambda m: m.to(dtype=torch.float16),
    "type(bfloat16)": lambda m: m.type(torch.bfloat16),  # converts integer buffers too
}


@pytest.mark.parametrize("convert", CONVERSIONS.values(), ids=CONVERSIONS.keys())
def test_scales_and_histories_stay_float32_in_a_low_precision_model(convert):
    """`.to(bfloat16)` used to cast the scales and histories: the first forward update then
    raised (`full_like(scale, float32 max)` in bfloat16), and every scale would have been
    rounded to 8 bits."""
    torch.manual_seed(0)
    layer = convert(EmulatedFP8Linear(SIZE, SIZE))
    dtype = layer.weight.dtype
    assert dtype != torch.float32
    recipe = FP8Recipe(amax_history_len=HISTORY)
    x_amaxes, g_amaxes = [], []
    for step, size in enumerate((0.03, 3.0, 0.7)):
        x = (torch.randn(16, SIZE) * size).to(dtype).requires_grad_()
        grad = (torch.randn(16, SIZE) * (step + 1)).to(dtype)
        with fp8_autocast(recipe=recipe):
            out = layer(x)
        out.backward(grad)
        x_amaxes.append(te_amax(x))
        g_amaxes.append(te_amax(grad))
    _assert_state(layer, expected_state(x_amaxes, te_amax(layer.weight), g_amaxes))
    assert set(layer.state_dict()) == {"weight", "bias"}  # the FP8 state is fp8_state's


def test_a_dtype_change_after_training_keeps_the_state_bit_for_bit():
    """Scales such as 448 / amax need float32's 24 bits: a round trip through bfloat16 or
    float16 (and back) leaves them as they were."""
    torch.manual_seed(0)
    layer = EmulatedFP8Linear(SIZE, SIZE)
    with fp8_autocast(recipe=FP8Recipe(amax_history_len=HISTORY)):
        layer(torch.randn(16, SIZE) * 0.3).sum().backward()
    before = read_fp8_meta(layer)
    assert before["fwd_scale"][0].item() != float(before["fwd_scale"][0].to(torch.bfloat16))
    for convert in (*CONVERSIONS.values(), lambda m: m.float(), lambda m: m.double()):
        convert(layer)
        for key, tensor in read_fp8_meta(layer).items():
            assert tensor.dtype == torch.float32 and torch.equal(tensor, before[key]), key


def _rank_tensor(rank: int, step: int, size: float) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(16, SIZE, generator=generator) * size * (rank + 1)


X_SIZES, G_SIZES = (0.03, 3.0, 0.7), (1.0, 5.0, 0.2)


def _fsdp_worker(rank: int, rendezvous: str, out_dir: str) -> None:
    """FSDP1 as Composer builds it for `mixed_precision: DEFAULT` under amp_bf16 (parameters
    and buffers in bfloat16, gradients reduced in float32)."""
    init_rank(rank, rendezvous)
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision

        torch.manual_seed(0)
        model = nn.Sequential(EmulatedFP8Linear(SIZE, SIZE))
        precision = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                   buffer_dtype=torch.bfloat16)
        fsdp = FullyShardedDataParallel(model, mixed_precision=precision,
                                        device_id=torch.device("cpu"), use_orig_params=True)
        for step, (x_size, g_size) in enumerate(zip(X_SIZES, G_SIZES, strict=True)):
            with fp8_autocast(recipe=FP8Recipe(amax_history_len=HISTORY)):
                out = fsdp(_rank_tensor(rank, step, x_size))
            out.backward(_rank_tensor(rank, 10 + step, g_size).to(out.dtype))
        torch.save(read_fp8_meta(model[0]), f"{out_dir}/rank{rank}.pt")
    finally:
        torch_dist.destroy_process_group()


def test_fsdp_buffer_casting_leaves_the_state_float32(tmp_path):
    """FSDP1's `MixedPrecision(buffer_dtype=bfloat16)` casts every floating-point buffer by
    `buffer.data = buffer.to(dtype)` (torch 2.7 fsdp/_runtime_utils.py:1625-1660), which no
    module hook sees; it made the scales bfloat16 and the first update raise. Both ranks hold
    TE's float32 state: amaxes of the bfloat16 operands FSDP casts to, MAX over the ranks."""
    run_ranks(_fsdp_worker, str(tmp_path), deadline_s=300)
    bf16 = torch.bfloat16
    torch.manual_seed(0)
    weight = EmulatedFP8Linear(SIZE, SIZE).weight.to(bf16)

    def amaxes(step_offset: int, sizes: tuple[float, ...]) -> list[float]:
        return [max(te_amax(_rank_tensor(rank, step_offset + step, size).to(bf16))
                    for rank in range(2)) for step, size in enumerate(sizes)]

    want = expected_state(amaxes(0, X_SIZES), te_amax(weight), amaxes(10, G_SIZES))
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for key, tensor in want.items():
            assert got[key].dtype == torch.float32 and torch.equal(got[key], tensor), (rank, key)
