"""FP8Monitor's tensor dumps (safetensors, size cap, a failed write) and its fit-end summary of
worst values."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from foundry_fp8.emulate import EmulatedFP8Linear, fp8_autocast
from foundry_fp8.health import layer_key
from foundry_fp8.monitor import FP8Monitor, MonitorConfig, Schedule
from foundry_fp8.recipe import FP8Recipe


def _train_steps(tmp_path, steps: int, dump_max_mb: float = 64.0, dump_steps=(1,),
                 interval: int = 100):
    """Steps 0..steps-1 with a dump at step 1 of layer '0' only; returns what the layer saw at
    step 1 (captured by our own hooks), the metrics per step, the warnings and the model."""
    torch.manual_seed(0)
    model = nn.Sequential(EmulatedFP8Linear(8, 16), nn.Linear(16, 4))
    config = MonitorConfig(dump_layers="^0$", dump_folder=tmp_path, dump_max_mb=dump_max_mb)
    warned: list[str] = []
    monitor = FP8Monitor(model, config, on_warning=warned.append,
                         schedule=Schedule(interval=interval, dump_steps=dump_steps))
    seen: dict[str, torch.Tensor] = {}
    logged = {}
    for step in range(steps):
        x = torch.randn(5, 8) * (step + 1)
        monitor.start_step(step)
        with fp8_autocast(recipe=FP8Recipe(amax_history_len=4)):
            hidden = model[0](x)
        if step == 1:
            seen.update({"0/activation": x.clone(), "0/weight": model[0].weight.detach().clone()})
            hidden.register_hook(lambda g: seen.__setitem__("0/gradient", g.clone()))
        model[1](hidden).pow(2).sum().backward()
        logged[step] = monitor.finish_step()
    return seen, logged, warned, model


def test_dump_round_trips_the_tensors_and_scales_the_layer_saw(tmp_path):
    seen, logged, warned, model = _train_steps(tmp_path, 3)
    assert sorted(logged) == [0, 1, 2] and logged[2] == {}  # step 1 logs because it dumps
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["step0000001-rank0.safetensors"]
    dump = load_file(tmp_path / files[0])
    assert sorted(dump) == sorted([*seen, *(f"{k}/scale" for k in seen)])  # layer '1' excluded
    for key, tensor in seen.items():
        assert torch.equal(dump[key], tensor), key
        assert dump[f"{key}/scale"].item() == logged[1][layer_key("scale", *key.split("/")[::-1])]
    # the delayed scales in force at step 1: from step 0's amaxes, not 1
    assert dump["0/activation/scale"].item() == pytest.approx(
        448.0 / logged[0][layer_key("amax", "activation", "0")])
    assert not any("left out" in w for w in warned)


def test_dump_stops_at_the_cap_and_names_what_it_left_out(tmp_path):
    activation_bytes = 5 * 8 * 4 + 4  # the first tensor the hooks see, and its scale
    _, _, warned, _ = _train_steps(tmp_path, 2, dump_max_mb=activation_bytes / 2**20)
    dump = load_file(tmp_path / "step0000001-rank0.safetensors")
    assert sorted(dump) == ["0/activation", "0/activation/scale"]
    [message] = [w for w in warned if "left out" in w]
    assert "0/weight, 0/gradient" in message


def test_a_dump_that_cannot_be_written_is_skipped_and_statistics_go_on(tmp_path):
    """safetensors raises its own SafetensorError (not an OSError) for a write that fails: here
    a folder stands where step 1's file goes (as a full disk or a lost mount would fail it)."""
    (tmp_path / "step0000001-rank0.safetensors").mkdir()
    _, logged, warned, _ = _train_steps(tmp_path, 4, dump_steps=(1, 2), interval=1)
    [message] = [w for w in warned if "not written" in w]
    assert "step0000001-rank0.safetensors" in message and "statistics go on" in message
    assert all(layer_key("cos_sim", "activation", "0") in logged[step] for step in range(4))
    assert load_file(tmp_path / "step0000002-rank0.safetensors")  # the next dump is written


def test_monitor_summary_covers_every_logged_step():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8))
    monitor = FP8Monitor(model, MonitorConfig(), on_warning=lambda _: None)
    cos = []
    for outlier in (1.0, 1e4, 10.0):
        x = torch.randn(4, 8)
        x[0, 0] = outlier  # the larger the outlier, the more of the rest current scaling loses
        monitor.start_step()
        model(x).sum().backward()
        cos.append(monitor.finish_step()[layer_key("cos_sim", "activation", "0")])
    assert monitor.tracker.worst[("0", "activation")]["cos_sim"] == min(cos) < max(cos)
    assert "| 0 | activation (what-if) |" in monitor.summary()  # a plain nn.Linear


def test_dump_steps_need_a_folder():
    with pytest.raises(ValueError, match="dump_folder"):
        FP8Monitor(nn.Linear(2, 2), MonitorConfig(), schedule=Schedule(dump_steps=(3,)))


def test_dump_file_says_what_each_tensor_is(tmp_path):
    """The file alone (safetensors' own reader, no foundry_fp8) names each tensor's layer, FP8
    format (HYBRID: E5M2 for the gradient) and whether its scale cast it; with the scale and
    format, torch's own FP8 cast redoes the layer's round trip."""
    import json

    from safetensors import safe_open

    seen, logged, _, _ = _train_steps(tmp_path, 2)
    with safe_open(str(tmp_path / "step0000001-rank0.safetensors"), "pt") as f:
        meta = f.metadata()
        tensors = json.loads(meta["tensors"])
        x, scale = f.get_tensor("0/activation"), f.get_tensor("0/activation/scale")
    assert tensors == {"0/activation": {"layer": "0", "format": "e4m3", "scale": "cast"},
                       "0/weight": {"layer": "0", "format": "e4m3", "scale": "cast"},
                       "0/gradient": {"layer": "0", "format": "e5m2", "scale": "cast"}}
    assert "tensor * scale" in meta["about"]
    scaled = (x * scale).clamp(-448, 448)
    back = scaled.to(torch.float8_e4m3fn).float() / scale
    cos = torch.nn.functional.cosine_similarity(back.flatten(), x.flatten(), dim=0)
    assert cos.item() == pytest.approx(logged[1][layer_key("cos_sim", "activation", "0")],
                                       abs=1e-6)


class _Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.Wqkv = EmulatedFP8Linear(8, 8)


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = _Attn()


class _MPTLike(nn.Module):
    """Module names as LLM-Foundry's ComposerMPTCausalLM has them:
    `model.transformer.blocks.<i>.attn.Wqkv`."""

    def __init__(self):
        super().__init__()
        self.model = nn.Module()
        self.model.transformer = nn.Module()
        self.model.transformer.blocks = nn.ModuleList([_Block(), _Block()])

    def forward(self, x):
        for block in self.model.transformer.blocks:
            x = block.attn.Wqkv(x)
        return x


def _dump_mpt_like(folder, dump_layers: str, dump_max_mb: float = 64.0):
    """Steps 0 and 1 (dump at 1); the warnings said at construction and after, the files."""
    torch.manual_seed(0)
    model = _MPTLike()
    warned: list[str] = []
    monitor = FP8Monitor(model, MonitorConfig(dump_layers=dump_layers, dump_folder=folder,
                                              dump_max_mb=dump_max_mb),
                         on_warning=warned.append, schedule=Schedule(dump_steps=(1,)))
    at_start = list(warned)
    for step in range(2):
        monitor.start_step(step)
        with fp8_autocast(recipe=FP8Recipe()):
            model(torch.randn(4, 8)).sum().backward()
        monitor.finish_step()
    return at_start, warned[len(at_start):], monitor.dumped, sorted(folder.iterdir())


def test_dump_layers_is_searched_in_the_full_module_names_as_layers_is(tmp_path):
    """`blocks\\.0\\.` finds block 0's layer in `model.transformer.blocks.0.attn.Wqkv`; read back
    by safetensors' own reader, the file holds its 3 tensors under that name, and the metadata
    gives the metric keys' `blocks.0.attn.Wqkv`."""
    import json

    from safetensors import safe_open

    at_start, later, dumped, files = _dump_mpt_like(tmp_path, r"blocks\.0\.")
    assert at_start == [] and later == []
    full = "model.transformer.blocks.0.attn.Wqkv"
    assert dict(_MPTLike().named_modules())[full] is not None
    with safe_open(str(files[0]), "pt") as f:
        keys = sorted(f.keys())
        tensors = json.loads(f.metadata()["tensors"])
    assert keys == sorted(f"{full}/{t}{s}" for t in ("activation", "weight", "gradient")
                          for s in ("", "/scale"))
    assert {v["layer"] for v in tensors.values()} == {"blocks.0.attn.Wqkv"}
    assert dumped == [(files[0], 3)]


def test_a_dump_layers_regex_matching_no_layer_warns_once_when_built_and_writes_no_file(
        tmp_path):
    """`^blocks\\.0\\.`, copied from the metric keys' `blocks.0.attn.Wqkv`, finds nothing in the
    full names: one warning when the monitor is built (FIT_START) that names both forms; no
    empty safetensors file at the dump step and nothing for the console to call saved."""
    at_start, later, dumped, files = _dump_mpt_like(tmp_path, r"^blocks\.0\.")
    assert at_start == [
        "callbacks.fp8_stats.dump_layers: '^blocks\\.0\\.' matches none of the 2 watched "
        "layers, so dump_steps [1] save nothing (fix: a regex that re.search finds in their "
        "full module names, as layers is: model.transformer.blocks.0.attn.Wqkv, "
        "model.transformer.blocks.1.attn.Wqkv (the metric keys shorten them to "
        "blocks.0.attn.Wqkv, blocks.1.attn.Wqkv))"]
    assert later == [] and dumped == [] and files == []


def test_a_cap_that_leaves_every_tensor_out_writes_no_file_and_says_so(tmp_path):
    """dump_max_mb below the first tensor (block 0's activation, 4 x 8 float32 = 128 bytes,
    plus its 4-byte scale): one warning with the sizes, no empty file."""
    at_start, later, dumped, files = _dump_mpt_like(tmp_path, r"blocks\.0\.", dump_max_mb=1e-4)
    assert at_start == [] and dumped == [] and files == []
    first = 4 * 8 * 4 + 4
    assert later == [
        f"fp8 dump {tmp_path / 'step0000001-rank0.safetensors'} not written: dump_max_mb=0.0001 "
        f"holds none of its 3 tensors (the first, model.transformer.blocks.0.attn.Wqkv/"
        f"activation, takes {first / 2**20:.3g} MiB with its scale; raise dump_max_mb)"]


def test_a_dump_step_where_the_selected_layers_do_not_run_writes_no_file_and_says_so(tmp_path):
    """Block 1 is selected but the step runs block 0 only (as an early exit would)."""
    model = _MPTLike()
    warned: list[str] = []
    monitor = FP8Monitor(model, MonitorConfig(dump_layers=r"blocks\.1\.", dump_folder=tmp_path),
                         on_warning=warned.append, schedule=Schedule(dump_steps=(0,)))
    monitor.start_step(0)
    with fp8_autocast(recipe=FP8Recipe()):
        model.model.transformer.blocks[0].attn.Wqkv(torch.randn(4, 8)).sum().backward()
    monitor.finish_step()
    assert list(tmp_path.iterdir()) == [] and monitor.dumped == []
    assert warned == [f"fp8 dump {tmp_path / 'step0000000-rank0.safetensors'} not written: none "
                      "of the 1 layers dump_layers selects ran in this step"]
