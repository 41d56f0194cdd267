"""The te_swap `exclude` that fp8_stats' warnings, fp8_guard's reasons and "Next time" YAML and
`foundry-fp8 report` advise keeps exactly the flagged layer out of FP8 (QA advice, s25), and the
report sees a run's exclude written on te_swap's module names. `re.escape(layer) + '$'` had no
left edge and te_swap searches it in every module name (`filters.search`): a flagged top-level
`fc` also kept every `layers.<n>.fc` and `up_fc`, a root `nn.Sequential`'s child `1` every
`mlp.1` and `mlp.11`, and `layers.5.fc` the vision tower's `vision.layers.5.fc`. Each advice is
followed as a user follows it: the printed YAML, read back with a YAML reader, given to
te_swap's own plan (`swap.plan_swap`) on the model the monitor watched."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import yaml
from torch import nn

from foundry_fp8.filters import search
from foundry_fp8.guard import static_yaml
from foundry_fp8.health.rules import Flag, HealthTracker
from foundry_fp8.monitor import FP8Monitor, MonitorConfig, Schedule
from foundry_fp8.options import SwapConfig
from foundry_fp8.report.markdown import Finding, excluded_together, not_converted, swap_excluded
from foundry_fp8.swap import plan_swap
from tests.three_blocks import kept_by_te_swap

EXCLUDE = f"{SwapConfig.PATH}.exclude"
N = 12  # blocks, and children of each block's nn.Sequential: 1 is a prefix of 10 and 11


def _linear() -> nn.Linear:
    return nn.Linear(16, 16)


class Stacks(nn.Module):
    """12 blocks (`layers.<n>`) of `fc`, `up_fc` and a 12-layer `mlp` Sequential, a vision
    tower's 12 blocks of `fc` (`vision.layers.<n>.fc`), and a top-level `fc` (an output head)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.ModuleDict({
            "fc": _linear(), "up_fc": _linear(),
            "mlp": nn.Sequential(*(_linear() for _ in range(N)))}) for _ in range(N))
        self.vision = nn.Module()
        self.vision.layers = nn.ModuleList(nn.ModuleDict({"fc": _linear()}) for _ in range(N))
        self.fc = _linear()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.vision.layers:
            x = block["fc"](x)
        for block in self.layers:
            x = block["mlp"](block["up_fc"](block["fc"](x)))
        return self.fc(x)


class Front(nn.Module):
    """A wrapper holding `inner` under `name`, as Composer's ComposerMPTCausalLM holds the model
    (`model.`) and MPTForCausalLM its `transformer.`; te_swap plans on the wrapped names."""

    def __init__(self, name: str, inner: nn.Module) -> None:
        super().__init__()
        self.name = name
        setattr(self, name, inner)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(self, self.name)(x)


def _sequential_root() -> nn.Module:
    """Composer's `model.` around an nn.Sequential: `model.0`, `model.1`, `model.2.layers...`."""
    return Front("model", nn.Sequential(_linear(), _linear(), Stacks()))


def _hf_like() -> nn.Module:
    """ComposerHFCausalLM's `model.` around a Hugging Face model's own `model.`: the keys keep
    the second (`model.layers.5.fc`)."""
    return Front("model", Front("model", Stacks()))


def _mpt_like() -> nn.Module:
    """ComposerMPTCausalLM: `model.transformer.layers.5.fc`, the keys `layers.5.fc`."""
    return Front("model", Front("transformer", Stacks()))


def _te_swap_option(warning: str) -> dict[str, object]:
    """The te_swap option a warning tells the user to set, read with a YAML reader."""
    text = (warning.rsplit("Change: ", 1)[1] if "Change: " in warning else
            warning.rsplit("where te_swap would convert it: ", 1)[1].removesuffix(")"))
    [(path, value)] = yaml.safe_load(text).items()
    assert path.startswith(f"{SwapConfig.PATH}."), warning
    return {path.removeprefix(f"{SwapConfig.PATH}."): value}


def _flag_live(model: nn.Module, name: str) -> str:
    """fp8_stats' live warning on the layer te_swap names `name`, whose weight holds an outlier
    (current scaling flushes the rest of it to 0): its key's name is the monitor's own."""
    torch.manual_seed(0)
    layer = model.get_submodule(name)
    with torch.no_grad():
        layer.weight[0, 0] = 1e6
    warned: list[str] = []
    monitor = FP8Monitor(model, MonitorConfig(tensors=("weight",)), on_warning=warned.append,
                         schedule=Schedule(interval=1))
    monitor.start_step(0)
    model(torch.randn(4, 16)).sum().backward()
    monitor.finish_step()
    [warning] = [w for w in warned if f"layer '{monitor.short[name]}'" in w]
    return warning


CASES: list[tuple[Callable[[], nn.Module], str]] = [
    (Stacks, "fc"),  # `fc$` kept the 36 block layers ending in fc
    (Stacks, "layers.5.fc"),  # kept vision.layers.5.fc too
    (_sequential_root, "model.1"),  # key `1`: `1$` kept every mlp.1 and mlp.11
    (_sequential_root, "model.2.layers.5.mlp.1"),
    (_hf_like, "model.model.layers.5.up_fc"),  # key `model.layers.5.up_fc`
    (_mpt_like, "model.transformer.fc"),  # key `fc`
]


@pytest.mark.parametrize(("build", "name"), CASES)
def test_the_live_advice_keeps_exactly_the_flagged_layer_out_of_fp8(build, name):
    model = build()
    change = _te_swap_option(_flag_live(model, name))
    assert set(change) == {"exclude"}, change  # no edge block: block 5 of 12, or none
    before, after = kept_by_te_swap(model, {}), kept_by_te_swap(model, change)
    assert after == before | {name}, sorted(after - before - {name})[:5]
    # te_swap's own search, on every module name (containers included)
    assert {n for n, _ in model.named_modules() if search(EXCLUDE, change["exclude"], n)} == {name}


def test_fp8_guards_next_time_yaml_keeps_exactly_its_layers_and_the_runs_own():
    """fp8_guard's "Next time" YAML (and the report's): the layers in the keys' names, joined to
    the run's exclude. It also shortened the keys' names again: `model.layers.5.fc` (a Hugging
    Face model in Composer) became `layers\\.5\\.fc$`, which `vision.layers.5.fc` matched too, and
    `model.fc` `fc$`, every block's `fc` and `up_fc`."""
    model = _hf_like()
    runs = r"^model\.model\.vision\.layers\.1\."  # the run's own, on te_swap's names
    text = static_yaml(["model.layers.5.fc", "model.fc"], runs)  # the keys' names
    options = yaml.safe_load(text)["algorithms"]["te_swap"]
    before = kept_by_te_swap(model, {})
    assert kept_by_te_swap(model, options) == before | {
        "model.model.layers.5.fc", "model.model.fc", "model.model.vision.layers.1.fc"}
    assert {n for n, _ in model.named_modules() if search(EXCLUDE, options["exclude"], n)} == {
        "model.model.layers.5.fc", "model.model.fc", "model.model.vision.layers.1.fc"}


#: Runs' te_swap excludes as users write them: on te_swap's names, on the keys', the advice.
RUN_EXCLUDES = [r"^model\.transformer\.layers\.1\.", r"^model\.transformer\.layers\.5\.fc$",
                r"layers\.1\.up_fc$", r"vision\.layers\.[2-4]\.fc"]


@pytest.mark.parametrize("exclude", RUN_EXCLUDES)
def test_the_report_sees_every_layer_the_runs_exclude_kept_out(exclude):
    """The report's `swap_excluded` (its no-change note, the joined exclude) on the layers as the
    keys name them agrees with te_swap's decision on the run's module names, layer by layer."""
    model = _mpt_like()
    keys = FP8Monitor(model, MonitorConfig(tensors=("weight",))).short  # te_swap name -> key
    plan = plan_swap(model, SwapConfig(backend="emulate", exclude=exclude))
    excluded = {keys[d.name] for d in plan.decisions if d.reason == "matched by exclude"}
    assert excluded  # the exclude keeps something out
    assert {keys[d.name] for d in plan.decisions if swap_excluded(keys[d.name], exclude)} == excluded


def _whatif_finding(layer: str) -> Finding:
    """A what-if flag on `layer` (a layer te_swap did not convert), with the real advice."""
    [flag] = HealthTracker().update(10, {(layer, "weight"): {"underflow_pct": 50.0}},
                                    whatif={(layer, "weight")})[(layer, "weight")]
    assert isinstance(flag, Flag) and flag.yaml_key.startswith(EXCLUDE), flag.yaml_key
    return Finding(flag, 10, 1, 1, whatif=1, worst_whatif=True)


def test_the_report_does_not_advise_again_what_an_exclude_on_te_swaps_names_kept_out():
    runs = r"^model\.transformer\.layers\.5\.fc$"  # te_swap's name of `layers.5.fc`
    kept, other = _whatif_finding("layers.5.fc"), _whatif_finding("layers.6.fc")
    note = not_converted(kept, {}, runs)
    assert note is not None and not note[1] and "no change" in note[0], note
    text = excluded_together([kept, other], {}, runs)
    assert text is not None
    joined = yaml.safe_load(text)["algorithms"]["te_swap"]["exclude"]
    model = _mpt_like()
    assert kept_by_te_swap(model, {"exclude": joined}) == kept_by_te_swap(model, {}) | {
        "model.transformer.layers.5.fc", "model.transformer.layers.6.fc"}
    assert joined.count("layers") == 2, joined  # layers.5.fc said once, the run's
