"""TransformerEngine on an H100: the TE #1190 regression, the case that still fails, our watch
for it, whether TE's recompute shortens the amax history, and checkpoint resume without TE's
pickled `_extra_state`.

Skipped without CUDA. Written against TE 2.20.2's sources; all passed on an H200 with TE 2.20.2
(2026-11-26). Failures print the update calls counted and the non-zero history rows, so one
run tells which expectation was wrong.
"""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch

from foundry_fp8.composer.state import (
    FP8State,
    recompute_settings,
    stale_backward_modules,
)
from foundry_fp8.fp8_meta import is_fp8_module, read_fp8_meta
from foundry_fp8.te.extra_state import without_pickled_extra_state

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def te():
    return pytest.importorskip("transformer_engine.pytorch")


def _recipe(history_len: int = 16):
    from transformer_engine.common.recipe import DelayedScaling, Format

    return DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=history_len,
                          amax_compute_algo="max")


def _autocast(te, recipe=None):
    """TE's FP8 autocast with `recipe` (`_recipe()` by default): `te.autocast(recipe=)` from TE
    2.9, `te.fp8_autocast(fp8_recipe=)` before (deprecated since 2.9: pytorch/quantization.py:766-776
    at v2.9, 941-961 in 2.20.2)."""
    recipe = recipe if recipe is not None else _recipe()
    if hasattr(te, "autocast"):
        return te.autocast(enabled=True, recipe=recipe)
    return te.fp8_autocast(enabled=True, fp8_recipe=recipe)


def _state_manager():
    """TE's FP8GlobalStateManager: in `quantization` from TE 2.9, `fp8` before."""
    try:
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager
    except ImportError:
        from transformer_engine.pytorch.fp8 import FP8GlobalStateManager
    return FP8GlobalStateManager


def _rows(history: torch.Tensor) -> list[int]:
    """Indices of the rows of an amax history that hold an amax (row 0: the one being recorded;
    an update rolls it to the last row and every other row one up)."""
    return (history.abs().sum(dim=1) > 0).nonzero().flatten().tolist()


def _describe(state: dict[str, torch.Tensor]) -> str:
    """One module's FP8 state in a line: non-zero history rows and scales."""
    return (f"fwd rows {_rows(state['fwd_amax_history'])} scale {state['fwd_scale'].tolist()}; "
            f"bwd rows {_rows(state['bwd_amax_history'])} scale {state['bwd_scale'].tolist()}")


def _differences(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                 where: str) -> list[str]:
    """The FP8 state tensors that are not bit-identical, each with both states described."""
    return [f"{where}: {key} differs (got {_describe(got)}; want {_describe(want)})"
            for key in ("fwd_amax_history", "fwd_scale", "bwd_amax_history", "bwd_scale")
            if not torch.equal(got[key], want[key])]


def _iterations(te, layer, forward, steps: int = 2):
    """Input gradient and FP8 state after each of `steps` iterations (same data every call)."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    results = []
    for step in range(steps):
        x = (torch.randn(32, 768, device="cuda", generator=generator) * (step + 1))
        x.requires_grad_()
        with _autocast(te):
            out = forward(layer, x)
        out.backward(torch.randn(out.shape, device="cuda", generator=generator))
        torch.cuda.synchronize()
        results.append((x.grad.clone(), read_fp8_meta(layer)))
    return results


@pytest.fixture(scope="module")
def layer(te):
    torch.manual_seed(0)
    return te.Linear(768, 768, device="cuda")


@pytest.fixture(scope="module")
def reference(te, layer):
    return _iterations(te, copy.deepcopy(layer), lambda m, x: m(x))


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_te_checkpoint_matches_no_checkpoint(te, layer, reference, use_reentrant):
    """#1190 regression on the installed TE: identical x.grad and FP8 state, forward amax
    history included.

    TE 2.20.2 recomputes in its own autocast (distributed.py:446-451 reentrant, 811-816
    non-reentrant) whose exit, outside any other, calls the forward update once more
    (quantization.py:772-782). On TE's default fused update that call changes nothing: the
    kernel rolls a slot's history and updates its scale only where its amax is non-zero
    (common/recipe/delayed_scaling.cu, kernel_bulk: `if (last_amax != 0.0f)`), and every forward
    amax is zero then (the recompute puts back the state it found, module/base.py:1643-1650,
    quantization.py:836-844). Only the unfused update rolls a zero row in:
    `test_te_recompute_unfused_shortens_history`.
    """
    got = _iterations(te, copy.deepcopy(layer), lambda m, x: te.distributed.checkpoint(
        m, x, use_reentrant=use_reentrant))
    problems = []
    for step, ((grad, state), (want_grad, want_state)) in enumerate(zip(got, reference,
                                                                         strict=True)):
        if not torch.equal(grad, want_grad):
            problems.append(f"step {step}: x.grad differs")
        problems += _differences(state, want_state, f"step {step}")
    assert not problems, "\n".join(problems)
    assert not torch.equal(reference[1][1]["bwd_scale"], torch.ones_like(
        reference[1][1]["bwd_scale"]))


def test_plain_torch_checkpoint_still_differs_and_is_caught(te, layer, reference):
    """Plain torch.utils.checkpoint around TE modules (reentrant, torch's old default) recomputes
    outside fp8_autocast. Our answer: Composer runs get te_checkpoint_wrapper set by fp8_state,
    and the watch reports this symptom."""
    got = _iterations(te, copy.deepcopy(layer), lambda m, x: torch.utils.checkpoint.checkpoint(
        m, x, use_reentrant=True))
    assert any(not torch.equal(g, want) for (g, _), (want, _) in zip(got, reference, strict=True))
    before, after = {"l": got[0][1]}, {"l": got[1][1]}
    assert stale_backward_modules(before, after, grads_nonzero={"l"}) == ["l"], (
        f"before: {_describe(got[0][1])}; after: {_describe(got[1][1])}")
    assert stale_backward_modules({"l": reference[0][1]}, {"l": reference[1][1]}, {"l"}) == []


def test_watch_catches_backward_updates_never_running(te, monkeypatch):
    """The #1190 symptom as TE <= 1.11 showed it, on the installed TE: backward amaxes recorded
    into row 0 but never rolled in (here TE's backward update calls are dropped). Gradients grow
    4x per step, so row 0 moves every step: the watch must look past it."""
    manager = _state_manager()
    update = manager.reduce_and_update_fp8_tensors.__func__

    def forward_only(cls, forward: bool = True):
        if forward:
            update(cls, forward)

    monkeypatch.setattr(manager, "reduce_and_update_fp8_tensors", classmethod(forward_only))
    recipe = _recipe(4)  # its own amax buffers: other tests' updates never see this layer
    torch.manual_seed(0)
    layer = te.Linear(768, 768, device="cuda")
    generator = torch.Generator(device="cuda").manual_seed(0)
    states = []
    for step in range(3):
        x = torch.randn(32, 768, device="cuda", generator=generator)
        with _autocast(te, recipe):
            out = layer(x)
        (out * 4.0 ** step).sum().backward()
        torch.cuda.synchronize()
        states.append({"l": read_fp8_meta(layer)})
    shown = "; ".join(f"step {i}: {_describe(s['l'])}, bwd row 0 "
                      f"{s['l']['bwd_amax_history'][0].tolist()}" for i, s in enumerate(states))
    for before, after in zip(states, states[1:], strict=False):
        assert stale_backward_modules(before, after, grads_nonzero={"l"}) == ["l"], shown


# -- does TE's recompute shorten the amax history? (README, Status) ---------------------------

BLOCKS, STEPS, HISTORY = 3, 6, 8


class _Block(torch.nn.Module):
    """Two TE Linears, a GELU between them, a residual: a transformer MLP's shape."""

    def __init__(self, te):
        super().__init__()
        self.a = te.Linear(256, 256, device="cuda")
        self.b = te.Linear(256, 256, device="cuda")

    def forward(self, x):
        return x + self.b(torch.nn.functional.gelu(self.a(x)))


def _rows_after(rolls_per_step: int) -> list[int]:
    """The non-zero rows of a HISTORY-row amax history after STEPS steps that each record an
    amax and then roll `rolls_per_step` times: a step's amax lands in the last row at its first
    roll, moves one row up at each further one and is dropped at row 0."""
    rows = (HISTORY - rolls_per_step * (k + 1) for k in range(STEPS))
    return sorted(row for row in rows if row >= 1)


@pytest.fixture
def update_calls(te, monkeypatch) -> dict[str, int]:
    """Counts of TE's delayed-scaling amax reduction and scale update calls
    (`FP8GlobalStateManager.reduce_and_update_fp8_tensors`, quantization.py:656-712; called at
    an outermost autocast's exit, quantization.py:782, and in the backward of the modules
    flagged for it, module/linear.py:1887-1889), by direction."""
    manager = _state_manager()
    update = manager.reduce_and_update_fp8_tensors.__func__
    calls = {"forward": 0, "backward": 0}

    def counting(cls, forward: bool = True):
        calls["forward" if forward else "backward"] += 1
        return update(cls, forward)

    monkeypatch.setattr(manager, "reduce_and_update_fp8_tensors", classmethod(counting))
    return calls


def _train_blocks(te, calls: dict[str, int], mode: str):
    """STEPS iterations of BLOCKS `_Block`s, each block under `te.distributed.checkpoint` (mode
    "reentrant" or "non-reentrant") or not ("none"); the loss under an autocast of its own, as
    Composer computes it. Inputs shrink 4x per step, so a shorter amax window gives other
    forward scales. Returns the update calls made, x.grad per step and every module's FP8
    state at the end."""
    recipe = _recipe(HISTORY)
    start = dict(calls)
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(_Block(te) for _ in range(BLOCKS))
    generator = torch.Generator(device="cuda").manual_seed(0)
    grads = []
    for step in range(STEPS):
        x = torch.randn(64, 256, device="cuda", generator=generator) * 4.0 ** -step
        x.requires_grad_()
        with _autocast(te, recipe):
            h = x
            for block in blocks:
                h = block(h) if mode == "none" else te.distributed.checkpoint(
                    block, h, use_reentrant=mode == "reentrant")
        with _autocast(te, recipe):
            loss = h.float().pow(2).mean()
        loss.backward()
        grads.append(x.grad.clone())
    torch.cuda.synchronize()
    made = {k: calls[k] - start[k] for k in calls}
    return made, grads, {name: read_fp8_meta(m) for name, m in blocks.named_modules()
                         if is_fp8_module(m)}


@pytest.mark.parametrize("mode", ["reentrant", "non-reentrant"])
def test_te_recompute_adds_no_forward_roll(te, update_calls, mode):
    """TE's default (fused) update: one extra forward update call per checkpointed block and
    step (the recompute's autocast exit), which rolls nothing and changes no scale, so the
    amax history keeps its full length; x.grad and all FP8 state bit-identical to running
    without checkpointing, each history rolled exactly once per step.

    Expected calls per step, TE 2.20.2: forward 2 (model and loss autocasts) + BLOCKS
    (recomputes); backward 1 non-reentrant (the original graph's first module,
    module/linear.py:1858-1862), one per recomputed module reentrant (each gets the flag back
    in the recompute phase, module/linear.py:320-327, distributed.py:268-271).
    """
    ref_calls, ref_grads, ref = _train_blocks(te, update_calls, "none")
    calls, grads, got = _train_blocks(te, update_calls, mode)
    want_calls = {"forward": (2 + BLOCKS) * STEPS,
                  "backward": (2 * BLOCKS if mode == "reentrant" else 1) * STEPS}
    one_roll_per_step = _rows_after(1)  # [2, ..., 7]
    problems = [f"step {i}: x.grad differs" for i, (a, b) in enumerate(zip(grads, ref_grads,
                                                                             strict=True))
                if not torch.equal(a, b)]
    for name in ref:
        problems += _differences(got[name], ref[name], name)
        for key in ("fwd_amax_history", "bwd_amax_history"):
            if _rows(got[name][key]) != one_roll_per_step:
                problems.append(f"{name}: {key} rows {_rows(got[name][key])}, want "
                                f"{one_roll_per_step} (one roll per step)")
    if ref_calls != {"forward": 2 * STEPS, "backward": STEPS}:
        problems.append(f"no checkpoint: update calls {ref_calls}, want "
                        f"{{'forward': {2 * STEPS}, 'backward': {STEPS}}}")
    if calls != want_calls:
        problems.append(f"{mode}: update calls {calls}, want {want_calls}")
    assert not problems, "\n".join(
        [f"update calls: {mode} {calls}, no checkpoint {ref_calls}"] + problems
        + [f"{name}: {_describe(got[name])}" for name in got])


def test_te_recompute_unfused_shortens_history(te, update_calls, monkeypatch):
    """The sensitivity check for the test above: with NVTE_UNFUSED_FP8_UPDATE=1 (read at every
    update, quantization.py:687-692) every forward update call rolls every module's history,
    a zero row where nothing was recorded (quantization.py:1067-1073). Without checkpointing
    the loss autocast already rolls one zero row per step (rows 2 apart); checkpointing adds
    BLOCKS more (only the last step's row left), and with shrinking inputs the forward scale
    differs (and so, from the second step on, every value; the backward still rolls once per
    step). If this fails, the test above could not have seen an extra roll."""
    monkeypatch.setenv("NVTE_UNFUSED_FP8_UPDATE", "1")
    ref_calls, _, ref = _train_blocks(te, update_calls, "none")
    calls, _, got = _train_blocks(te, update_calls, "non-reentrant")
    shown = "\n".join([f"update calls: non-reentrant {calls}, no checkpoint {ref_calls}"]
                      + [f"{name}: got {_describe(got[name])}; no checkpoint "
                         f"{_describe(ref[name])}" for name in ref])
    assert _rows(ref["0.a"]["fwd_amax_history"]) == _rows_after(2), shown  # [2, 4, 6]
    assert _rows(got["0.a"]["fwd_amax_history"]) == _rows_after(2 + BLOCKS), shown  # [3]
    assert not torch.equal(got["0.a"]["fwd_scale"], ref["0.a"]["fwd_scale"]), shown
    for state in (*ref.values(), *got.values()):  # backward: one update call per step either way
        assert _rows(state["bwd_amax_history"]) == _rows_after(1), shown


def test_a_fallback_region_keeps_the_runs_amax_compute_algo(te):
    """fp8_guard runs a layer in high precision inside the run's autocast; TE keys recipes by a
    text without `amax_compute_algo`, so a region given no recipe made the outermost exit update
    a `most_recent`, history-1024 run with TE's default `max` (quantization.py:675, 740-745).
    After a 100x input spike, `most_recent` must forget it at the next step."""
    from transformer_engine.common.recipe import DelayedScaling, Format

    from foundry_fp8.te.backend import te_high_precision

    recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=1024,
                            amax_compute_algo="most_recent")
    torch.manual_seed(0)
    first, second = te.Linear(64, 64).cuda(), te.Linear(64, 64).cuda()
    x = torch.randn(32, 64, device="cuda")
    for spike in (100.0, 1.0):
        with _autocast(te, recipe):
            hidden = first(x * spike)
            with te_high_precision(second):
                out = second(hidden)
        out.sum().backward()
    scale = first.fp8_meta["scaling_fwd"].scale[0].item()
    want = torch.tensor(448.0 / x.abs().max().item(), dtype=torch.float32).item()
    assert scale == pytest.approx(want, rel=1e-6), (scale, want, want / 100)


def test_guard_settings_on_installed_te(te):
    from foundry_fp8.te.probe import te_version

    fsdp = {"activation_checkpointing": True, "activation_checkpointing_reentrant": True}
    assert recompute_settings("amp_fp8", fsdp, 1, te_version(), emulated=False) == {
        "te_checkpoint_wrapper": True, "activation_checkpointing_reentrant": False}


def test_resume_without_unsafe_pickle(te, layer, tmp_path, monkeypatch):
    """TE's amax/scale survive a save/load through our state, with NVTE_ALLOW_UNSAFE_PICKLE_
    EXTRA_STATE unset; the next step matches the uninterrupted one bit for bit.

    Both forwards share one autocast: TE's delayed-scaling update at an autocast's exit
    updates every module it has registered (its global amax buffers), run or not.
    """
    monkeypatch.delenv("NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE", raising=False)
    trained = copy.deepcopy(layer)
    _iterations(te, trained, lambda m, x: m(x))
    model = torch.nn.Sequential(trained)
    if importlib.util.find_spec("transformer_engine.pytorch._extra_state") is not None:
        with pytest.raises(RuntimeError, match="NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE"):
            te.Linear(768, 768, device="cuda").load_state_dict(trained.state_dict())
    saver = FP8State()
    saver._model = model
    torch.save({"model": without_pickled_extra_state(model.state_dict()),
                "fp8": saver.state_dict()}, tmp_path / "ckpt.pt")

    torch.manual_seed(1)
    fresh = torch.nn.Sequential(te.Linear(768, 768, device="cuda"))
    assert is_fp8_module(fresh[0]) and read_fp8_meta(fresh[0]) == {}  # no state before forward
    checkpoint = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    fresh.load_state_dict(checkpoint["model"], strict=True)
    loader = FP8State()
    loader._model = fresh
    loader.load_state_dict(checkpoint["fp8"])  # applied at fresh[0]'s first FP8 forward

    x = torch.randn(32, 768, device="cuda")
    with _autocast(te):
        outs = [m(x) for m in (model, fresh)]
    assert torch.equal(outs[0], outs[1])
    restored = read_fp8_meta(fresh[0])
    assert restored.keys() == read_fp8_meta(model[0]).keys()
    for key, value in read_fp8_meta(model[0]).items():
        assert torch.equal(restored[key], value), key
