"""`foundry-fp8 bench`'s upper bound on its sizes: a typo (`--seq-len 2048000`, a `--steps` or
`--batch` with extra zeros) is one line and exit 2 before anything is allocated, where it was
an OOM kill, a `can't allocate memory` in every variant, or hours of a swapping machine."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from foundry_fp8 import environment
from foundry_fp8.cli import build_parser, main
from foundry_fp8.tools import bench

LAPTOP = 16 * 2**30
H100 = 80 * 2**30


def _config(argv: list[str]) -> bench.BenchConfig:
    return bench.config_from_args(build_parser().parse_args(["bench", *argv]))


@pytest.mark.parametrize("argv, says", [
    (["--seq-len", "2048000"], "--seq-len 2048000 --batch 4 --micro-batch 4 --steps 6: the run "
     "needs at least 48.1 GB of host memory, more than the 16.0 GB here: 46.9 GB for one "
     "micro-batch's activations (4 x 2048000 tokens"),
    (["--steps", "100000000"], "381.5 GB for the synthetic batches (100000004 steps"),
    (["--batch", "100000000"], "x 100000000 sequences of 64 tokens"),
])
def test_a_size_typo_is_one_line_before_anything_runs(argv, says, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(bench, "memory_limit", lambda: LAPTOP, raising=False)  # old code: none
    monkeypatch.setattr(bench, "run_bench", lambda config, after_each: pytest.fail("ran"))
    assert main(["bench", "--tiny", *argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and says in err, err
    assert "lower --seq-len, --batch, --micro-batch or --steps" in err
    assert not list(tmp_path.iterdir())


def test_the_defaults_and_the_h200_setups_are_not_refused(monkeypatch):
    """The bound is a lower one: the H200's measured peaks (docs/bench.md: 53.1 GB bf16 at
    micro-batch 8, 86.4 GB at 16) lie above it, and the defaults fit a laptop and an H100."""
    monkeypatch.setattr(bench, "memory_limit", lambda: LAPTOP)
    _config(["--tiny"])
    for micro, peak in ((8, 53.1), (16, 86.4)):
        config = _config(["--micro-batch", str(micro)])
        [(_, needed)] = bench.least_memory(config)["GPU memory"]
        assert needed / 2**30 < peak
    bench._check_memory(_config([]), H100, "GPU memory")
    with pytest.raises(ValueError, match="of GPU memory, more than the 80.0 GB here"):
        bench._check_memory(dataclasses.replace(_config([]), seq_len=2048000), H100,
                            "GPU memory")


def test_the_tiny_bound_is_below_what_autograd_really_keeps():
    """The real sink: the tiny MPT built as the bench builds it, one micro-batch's forward
    and loss; the tensors autograd saves for backward, and the logits, are alive together, so
    the run's peak is at least their sum, which must not be below the bound (else the bench
    would refuse a run that fits)."""
    from llmfoundry.utils.builders import build_composer_model

    import foundry_fp8.attention  # noqa: F401  (attn_impl sdpa, as run_variant imports it)

    config = _config(["--tiny", "--variants", "bf16", "--seq-len", "128", "--batch", "2"])
    [(_, bound), _] = bench.least_memory(config)["host memory"]
    # the tiny MPT's shape, read off independently: 2 x 128 tokens x (logits and log-softmax
    # over 512 tokens + 2 layers x the 4 x 64 up-projection) x 4 bytes of fp32
    assert bound == 2 * 128 * (2 * 512 + 2 * 4 * 64) * 4
    model_cfg = dict(bench.load_config(bench.VARIANTS["bf16"], config)["model"])
    model = build_composer_model(model_cfg.pop("name"), model_cfg, tokenizer=None)
    batch = bench.synthetic_batches(1, 2, 128, 512, seed=0)[0]
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        outputs = model(batch)
        model.loss(outputs, batch)
    logits = outputs.logits.untyped_storage()
    storages[logits.data_ptr()] = logits.nbytes()
    assert sum(storages.values()) >= bound


def test_a_containers_memory_limit_is_the_one_that_counts(monkeypatch, tmp_path):
    physical = environment.memory_limit()
    assert physical is not None and physical > 2**20
    unset, limit = tmp_path / "memory.max", tmp_path / "memory.limit_in_bytes"
    unset.write_text("max\n")
    limit.write_text(f"{2**20}\n")
    monkeypatch.setattr(environment, "CGROUP_MEMORY_LIMITS", (unset, tmp_path / "absent"))
    assert environment.memory_limit() == physical
    monkeypatch.setattr(environment, "CGROUP_MEMORY_LIMITS", (unset, limit))
    assert environment.memory_limit() == 2**20


def test_an_unknown_memory_size_refuses_nothing():
    config = dataclasses.replace(bench.TINY_CONFIG, seq_len=2048000)
    bench._check_memory(config, None, "host memory")


def test_a_micro_batch_the_gpu_cannot_hold_is_one_line_before_the_run(monkeypatch, capsys,
                                                                       tmp_path):
    monkeypatch.setattr(bench, "memory_limit", lambda: 1024 * 2**30)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench, "gpu_memory", lambda: H100)
    monkeypatch.setattr(bench, "run_bench", lambda config, after_each: pytest.fail("ran"))
    assert main(["bench", "--seq-len", "2048000", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1, err
    assert "of GPU memory, more than the 80.0 GB here" in err and "4 x 2048000" not in err
    assert "for one micro-batch's activations (8 x 2048000 tokens" in err


def _yamls(tmp_path, old: str, new: str):
    for name in ("mpt-1b-bf16.yaml", "mpt-1b-fp8.yaml"):
        text = (bench.YAMLS / name).read_text()
        assert old in text
        (tmp_path / name).write_text(text.replace(old, new))
    return tmp_path


def test_a_model_key_that_does_not_resolve_is_one_line_naming_file_line_and_key(
        monkeypatch, capsys, tmp_path):
    """The linter's loader leaves `${oc.env:...}` to the run; the bench resolves the model
    section up front (for its memory bound), so an unset variable is one line, exit 2, where
    every variant failed on it in turn."""
    monkeypatch.delenv("FOUNDRY_FP8_UNSET", raising=False)
    yamls = _yamls(tmp_path, "  d_model: 2048\n", "  d_model: ${oc.env:FOUNDRY_FP8_UNSET}\n")
    monkeypatch.setattr(bench, "run_bench", lambda config, after_each: pytest.fail("ran"))
    assert main(["bench", "--tiny", "--variants", "bf16", "--yamls", str(yamls),
                 "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err == (f"foundry-fp8 bench: {yamls / 'mpt-1b-bf16.yaml'}:21: model.d_model: KeyError "
                   "raised while resolving interpolation: \"Environment variable "
                   "'FOUNDRY_FP8_UNSET' not found\"\n")


def test_sections_the_bound_does_not_read_are_left_to_the_run(monkeypatch, capsys, tmp_path):
    """Only the model section is resolved for the bound: an fsdp_config that is no mapping
    (which only --activation-checkpointing's update reads) gave an AttributeError traceback
    from the bound's first version; now the run's own checks come next (here: no GPU)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    yamls = _yamls(tmp_path, "fsdp_config:\n  sharding_strategy: FULL_SHARD\n",
                   "fsdp_config: nope\nunused:\n  sharding_strategy: FULL_SHARD\n")
    assert main(["bench", "--variants", "bf16", "--yamls", str(yamls),
                 "--activation-checkpointing", "--out", str(tmp_path / "out")]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err


def test_flash_attn_s_cross_entropy_keeps_no_log_softmax_so_the_bound_counts_none(tmp_path):
    """LLM-Foundry's default loss_fn (fused_crossentropy, flash-attn's) keeps no second copy of
    the logits: a user's YAML with it is judged on the logits alone."""
    yamls = _yamls(tmp_path, "  loss_fn: torch_crossentropy\n", "  loss_fn: fused_crossentropy\n")
    torch_ce = bench.least_memory(_config(["--variants", "bf16"]))["GPU memory"][0][1]
    fused = bench.least_memory(_config(["--variants", "bf16", "--yamls", str(yamls)]))
    assert torch_ce - fused["GPU memory"][0][1] == 8 * 2048 * 50368 * 2  # one bf16 copy less
