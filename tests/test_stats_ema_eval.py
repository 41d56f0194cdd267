"""fp8_stats and fp8_guard in a Composer run with EMA, an evaluation after every batch and gradient
accumulation. Composer's EMA swaps its averaged weights into the model in place for each
evaluation and each checkpoint (composer/algorithms/ema/ema.py: EVAL_START and the checkpoint
events swap them in, EVAL_END and the next BATCH_START swap the training weights back), and the
evaluation's forwards run on other data. The statistics must be those of the training forwards:
the training weights, every training micro-batch's input, no evaluation input; and a layer the
guard moved to high precision stays there through the swaps and evaluations.

Reference: the tensors the layers really get, captured by hooks of the test's own (training
forwards: grad enabled, train mode; evaluation forwards: the rest), reduced with plain torch."""

from __future__ import annotations

import torch
from composer import Trainer
from composer.algorithms import EMA
from composer.core import Callback, State
from composer.loggers import InMemoryLogger, Logger
from composer.models import ComposerClassifier
from torch.utils.data import DataLoader, TensorDataset

from foundry_fp8.composer.guard import FP8Guard
from foundry_fp8.composer.stats import FP8Stats
from foundry_fp8.composer.te_swap import TESwap
from foundry_fp8.fault import InjectOutlier
from foundry_fp8.fp8_meta import read_fp8_meta
from foundry_fp8.health import layer_key
from tests.test_emulate_ema import _Net

BATCH, MICROBATCH, FEATURES, BATCHES = 16, 8, 16, 6
WATCHED, FAULTY = "module.blocks.0", "module.blocks.1"  # as fp8_stats names them
EVAL_SCALE = 100.0  # evaluation inputs far above the training ones: fed in, they would show


class _Seen(Callback):
    """Per batch, layer 0's training weight at the batch's first micro-batch and its inputs'
    |max| per training micro-batch; the weights and inputs its evaluation forwards get; the
    faulty layer's FP8 amax history after each batch."""

    def __init__(self) -> None:
        self.weight: dict[int, float] = {}
        self.inputs: dict[int, list[float]] = {}
        self.eval_weights: list[float] = []
        self.eval_inputs: list[float] = []
        self.faulty_history: dict[int, torch.Tensor] = {}
        self._batch = 0

    def fit_start(self, state: State, logger: Logger) -> None:
        net = state.model.module

        def forward(module: torch.nn.Module, args: tuple) -> None:
            x, w = args[0].detach().abs().max().item(), module.weight.detach().abs().max().item()
            if module.training and torch.is_grad_enabled():
                self.weight.setdefault(self._batch, w)
                self.inputs.setdefault(self._batch, []).append(x)
            else:
                self.eval_weights.append(w)
                self.eval_inputs.append(x)

        net.blocks[0].register_forward_pre_hook(forward)
        self._faulty = net.blocks[1]

    def before_train_batch(self, state: State, logger: Logger) -> None:
        self._batch = int(state.timestamp.batch)

    def after_train_batch(self, state: State, logger: Logger) -> None:
        self.faulty_history[self._batch] = read_fp8_meta(self._faulty)["fwd_amax_history"].clone()


def test_ema_swaps_and_evaluations_stay_out_of_the_statistics_and_the_fallback(tmp_path):
    torch.manual_seed(0)
    x = torch.randn(BATCH * BATCHES, FEATURES).clamp(-3, 3)
    x[::MICROBATCH, 0] = 3.0  # one amax for every input: no overflow of delayed scaling in layer 0
    train = TensorDataset(x, torch.randint(0, 4, (BATCH * BATCHES,)))
    evaluation = TensorDataset(torch.randn(BATCH, FEATURES) * EVAL_SCALE,
                               torch.randint(0, 4, (BATCH,)))
    net, seen, memory = _Net(), _Seen(), InMemoryLogger()
    guard = FP8Guard(consecutive=1, max_fallback_share=0.6)  # one of the two FP8 layers
    Trainer(model=ComposerClassifier(net, num_classes=4),
            train_dataloader=DataLoader(train, batch_size=BATCH), max_duration=f"{BATCHES}ba",
            device_train_microbatch_size=MICROBATCH,
            optimizers=torch.optim.Adam(net.parameters(), lr=1e-3),
            algorithms=[TESwap(backend="emulate"), EMA(half_life="1ba")],
            eval_dataloader=DataLoader(evaluation, batch_size=BATCH), eval_interval="1ba",
            # a checkpoint after every batch: EMA's weights are in the model from each one to
            # the next batch's start
            save_folder=str(tmp_path), save_interval="1ba",
            callbacks=[FP8Stats(interval=1, image_interval=None), guard, seen,
                       InjectOutlier(layer=FAULTY.removeprefix("module."), start=0)],
            device="cpu", progress_bar=False, loggers=[memory]).fit()

    def logged(stat: str, tensor: str, layer: str = WATCHED) -> dict[int, float]:
        return {int(t.batch): v for t, v in memory.data[layer_key(stat, tensor, layer)]}

    # EMA's weights (from the second evaluation on: the first EMA copies the weights the second
    # batch trains) are not the training ones, and evaluations ran on their own inputs
    assert len(seen.eval_weights) == BATCHES
    assert set(seen.eval_weights[1:]).isdisjoint(seen.weight.values())
    assert min(seen.eval_inputs) > 10 * max(max(v) for v in seen.inputs.values())
    assert {b: len(v) for b, v in seen.inputs.items()} == {b: BATCH // MICROBATCH
                                                          for b in range(BATCHES)}
    # the training weight at each step, every training micro-batch's input, nothing of eval's
    assert logged("amax", "weight") == seen.weight
    assert logged("amax", "activation") == {b: max(v) for b, v in seen.inputs.items()}
    # the faulty layer fell back at step 1 (step 0 casts at delayed scaling's initial scale:
    # not judged) and ran in high precision from batch 2 on, through every EMA swap and
    # evaluation: its FP8 amax history, written by each FP8 forward, never moved again
    assert guard.core is not None and list(guard.core.fallbacks) == [FAULTY]
    assert [v for _, v in memory.data["fp8/guard/fallback_layers"]] == [0.0] + [1.0] * (
        BATCHES - 1)
    histories = [seen.faulty_history[b] for b in range(1, BATCHES)]
    assert all(torch.equal(h, histories[0]) for h in histories)
    assert not torch.equal(seen.faulty_history[0], torch.zeros_like(seen.faulty_history[0]))
