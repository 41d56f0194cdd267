"""`foundry-fp8 bench --tiny` end to end on CPU (one run for the module), plus its pure parts.
No speed assertions: the numbers are checked for consistency with each other and with
LLM-Foundry's flops formula, never against expected speeds."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import sys
from pathlib import Path

import pytest
import torch

from foundry_fp8.cli import main
from foundry_fp8.tools import bench

RUNNABLE_ON_CPU = ["bf16", "fp8-te-swap", "fp8-te-swap-stats100", "fp8-te-swap-stats1"]
STEPS = 8


@pytest.fixture(scope="module")
def tiny_result(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    assert main(["bench", "--tiny", "--warmup", "1", "--steps", str(STEPS), "--out", str(out)]) == 0
    result = json.loads((out / "mpt-tiny-cpu.json").read_text())
    return result, (out / "mpt-tiny-cpu.md").read_text(), out


def test_json_has_the_issue_shape(tiny_result):
    result, _, out = tiny_result
    assert {"gpu", "date", "versions", "variants"} <= set(result)
    assert isinstance(result["gpu"], str) and isinstance(result["date"], str)
    assert result["versions"]["torch"] == torch.__version__
    assert [v["name"] for v in result["variants"]] == RUNNABLE_ON_CPU
    for row in result["variants"]:
        for key in ("tokens_per_s", "mfu", "peak_mem_gb", "loss", "ratio_to_bf16"):
            assert isinstance(row[key], float) and math.isfinite(row[key]), (row["name"], key)
        # what actually ran on CPU, not what the YAML says (the GPU's bf16 / amp_fp8)
        te_swap = bench.VARIANTS[row["name"]].te_swap
        assert row["precision"] == ("fp32 + emulated FP8" if te_swap else "fp32")
        assert row["label"] == (f"{row['name']} (emulated)" if te_swap else "fp32")
        assert row["tokens_per_s"] > 0 and row["peak_mem_gb"] > 0
        assert 0 < row["attention_share"] < 1
    # the TE-native variants cannot run without TE: listed with a reason, no numbers invented
    assert {s["name"]: s["reason"] for s in result["skipped"]} == {
        "fp8-fc-te": "needs TransformerEngine layers (no CPU emulation)",
        "fp8-te-ln-mlp": "needs TransformerEngine layers (no CPU emulation)",
        "fp8-te-swap-fused": "needs TransformerEngine layers (no CPU emulation)"}
    assert result["failed"] == []
    assert not list(out.glob("mpt-1b-*"))  # a tiny run never writes GPU result names


def test_ratio_and_mfu_follow_llm_foundry_formula(tiny_result):
    """MFU recomputed here from LLM-Foundry's formula with an independent parameter count:
    flops/token = 3 * (2 * params + n_layers * 4 * d_model * seq_len)."""
    from llmfoundry.models.mpt import MPTConfig, MPTForCausalLM

    result, _, _ = tiny_result
    seq, m = result["setup"]["seq_len"], bench.TINY_MODEL
    params = sum(p.numel() for p in MPTForCausalLM(MPTConfig(
        d_model=m["d_model"], n_heads=m["n_heads"], n_layers=m["n_layers"], expansion_ratio=4,
        max_seq_len=seq, vocab_size=m["vocab_size"], attn_config={"attn_impl": "torch"},
    )).parameters())
    flops_per_token = 3 * (2 * params + m["n_layers"] * 4 * m["d_model"] * seq)
    rows = {r["name"]: r for r in result["variants"]}
    for name, row in rows.items():
        peak = 989e12 if name == "bf16" else 1979e12
        assert row["mfu_peak_tflops"] * 1e12 == peak
        assert row["mfu"] == pytest.approx(flops_per_token * row["tokens_per_s"] / peak, rel=1e-9)
        assert row["hfu"] == row["mfu"]  # no activation checkpointing
        assert row["ratio_to_bf16"] == pytest.approx(
            row["tokens_per_s"] / rows["bf16"]["tokens_per_s"], rel=1e-12)
    assert rows["bf16"]["ratio_to_bf16"] == 1.0


def test_losses_fall_and_stats_do_not_change_training(tiny_result):
    """Synthetic n-gram batches are learnable; every variant starts from the same weights, and
    fp8_stats only observes, so the te_swap runs with and without it train identically."""
    rows = {r["name"]: r for r in tiny_result[0]["variants"]}
    for row in rows.values():
        assert row["loss"] < row["loss_first_timed_step"] - 0.05, row["name"]
    swap = rows["fp8-te-swap"]
    for name in ("fp8-te-swap-stats100", "fp8-te-swap-stats1"):
        assert rows[name]["loss"] == pytest.approx(swap["loss"], rel=1e-6)
    # FP8 emulation perturbs, but only slightly, the same model on the same batches
    assert swap["loss_first_timed_step"] == pytest.approx(rows["bf16"]["loss_first_timed_step"],
                                                          rel=0.02)


def test_markdown_table_lists_every_variant(tiny_result):
    result, md, _ = tiny_result
    table = [line for line in md.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| variant | precision | tokens/s | x fp32 | MFU |")
    assert not any(line.startswith("| bf16 |") for line in table)  # no fp32 run called bf16
    for row in result["variants"]:
        line = next(line for line in table
                    if line.startswith(f"| {row['label']} | {row['precision']} |"))
        assert f"{row['tokens_per_s']:,.0f}" in line and f"{row['loss']:.3f}" in line
    assert sum("not run" in line for line in table) == len(result["skipped"]) == 3
    assert "989 TFLOP/s for bf16, 1979 TFLOP/s for fp8" in md


def test_the_markdown_names_what_ran_and_no_none(tiny_result):
    """QA 18: a CPU run's header read `driver None, ... TE None`. Each version is the installed
    distribution's (importlib.metadata, the reference); an absent one says `not installed`."""
    from importlib.metadata import PackageNotFoundError, version

    def installed(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    _, md, _ = tiny_result
    header = md.splitlines()[2]
    assert "None" not in header and "driver" not in header, header  # --tiny asks no nvidia-smi
    for label, dist in (("TE", "transformer-engine"), ("Composer", "mosaicml"),
                        ("LLM-Foundry", "llm-foundry"), ("foundry-fp8", "foundry-fp8")):
        assert f"{label} {installed(dist)}," in header or \
            f"{label} {installed(dist)};" in header, (label, header)


def test_synthetic_batches_are_ngram_sequences():
    batches = bench.synthetic_batches(3, batch=2, seq_len=20, vocab=50, seed=5, ngram=4, bank=6)
    again = bench.synthetic_batches(3, batch=2, seq_len=20, vocab=50, seed=5, ngram=4, bank=6)
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(batches, again, strict=True))
    ids = torch.cat([b["input_ids"] for b in batches])
    assert ids.shape == (6, 20) and torch.equal(batches[0]["labels"], batches[0]["input_ids"])
    grams = {tuple(seq[i:i + 4].tolist()) for seq in ids for i in range(0, 20, 4)}
    assert len(grams) <= 6  # every aligned 4-token chunk comes from the 6-gram bank


def test_bad_arguments_are_one_line_errors(capsys, tmp_path):
    with pytest.raises(SystemExit):
        main(["bench", "--tiny", "--variants", "bf16,nope"])
    assert "unknown nope; choose from bf16" in capsys.readouterr().err
    assert main(["bench", "--tiny", "--steps", "0", "--out", str(tmp_path)]) == 2
    assert "--steps must be >= 1, got 0" in capsys.readouterr().err


def _fp32_params_gib() -> float:
    """GiB of MPT-1B's parameters as the bench builds it (fp32: FSDP's PURE mixed precision
    keeps fp32 shards), counted on the meta device: 1,315,950,592 parameters, 4.90 GiB."""
    from llmfoundry.utils.builders import build_composer_model

    import foundry_fp8.attention  # noqa: F401  (attn_impl sdpa, as bench.run_variant)

    model_cfg = dict(bench.load_config(bench.VARIANTS["bf16"], bench.BenchConfig())["model"])
    with torch.device("meta"):
        model = build_composer_model(model_cfg.pop("name"), model_cfg, tokenizer=None)
    return sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30


@pytest.mark.gpu
def test_h100_bf16_and_te_variant(tmp_path):
    """On a GPU with TE: MPT-1B, bf16, fc_type te and te_swap (on a meta-initialised model under
    FSDP, as the YAML has it), a few steps; checks the GPU path produces sane, self-consistent
    numbers (not targets)."""
    assert main(["bench", "--variants", "bf16,fp8-fc-te,fp8-te-swap", "--warmup", "3",
                 "--steps", "5", "--batch", "8", "--out", str(tmp_path)]) == 0
    result = json.loads(next(tmp_path.glob("mpt-1b-*.json")).read_text())
    assert result["versions"]["driver"] and result["versions"]["transformer_engine"]
    rows = {r["name"]: r for r in result["variants"]}
    assert set(rows) == {"bf16", "fp8-fc-te", "fp8-te-swap"}, (result["skipped"],
                                                                result["failed"])
    params_gib = _fp32_params_gib()
    for row in rows.values():
        assert 0 < row["mfu"] < 1 and row["peak_mem_gb"] > 1 and math.isfinite(row["loss"])
        # at FIT_START the variant's own model is on the GPU (Composer wraps FSDP in the
        # Trainer's __init__, trainer.py:1611, 1805-1806 in 0.32.1; FULL_SHARD on one rank keeps
        # every fp32 parameter): what earlier variants left on top is at most the data
        assert params_gib <= row["start_mem_gb"] < params_gib + 1, (row, params_gib)
    assert rows["fp8-fc-te"]["precision"] == rows["fp8-te-swap"]["precision"] == "amp_fp8"


def test_each_variant_frees_its_model(monkeypatch):
    """Composer's atexit hook would keep every closed Trainer's model alive; six MPT-1B variants
    in one process only fit on one GPU if each is freed before the next."""
    import gc
    import weakref

    # A first import of Composer inside run_variant leaves that import's frame chain alive (a
    # module deep in it keeps a frame), which pins run_variant's locals: import first, as every
    # variant after the first in a real bench does (alone, this test failed without it).
    import composer.algorithms  # noqa: F401
    import composer.core.engine  # noqa: F401
    import llmfoundry.utils.builders  # noqa: F401
    from tqdm import tqdm

    refs = []
    count = bench.flops_per_token

    def remember(model, seq_len):
        refs.append(weakref.ref(model))
        return count(model, seq_len)

    monkeypatch.setattr(bench, "flops_per_token", remember)
    config = bench.BenchConfig(variants=("bf16",), tiny=True, seq_len=32, batch=2, warmup=1,
                               steps=1, profile_steps=0)
    with tqdm(disable=True) as bar:
        row = bench.run_variant(bench.VARIANTS["bf16"], config, bar)
    gc.collect()
    assert refs[0]() is None and row["attention_share"] is None  # profiling was off


def test_an_unwritable_out_folder_is_a_one_line_error_before_the_run(capsys, tmp_path,
                                                                    monkeypatch):
    def must_not_run(config):
        raise AssertionError("the benchmark ran although its results could not be written")

    monkeypatch.setattr(bench, "run_bench", must_not_run)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert main(["bench", "--tiny", "--variants", "bf16", "--out", str(blocker / "out")]) == 2
    out = capsys.readouterr().err
    assert out.startswith(f"foundry-fp8 bench: --out {blocker / 'out'}: cannot create")
    assert len(out.strip().splitlines()) == 1 and "Traceback" not in out


def _unwritable_folder(tmp_path) -> Path:
    """A folder this process cannot create a file in: a 0o555 one, or for root (whom modes do
    not stop) /sys, which the kernel keeps free of new files."""
    folder = tmp_path / "read-only"
    folder.mkdir(mode=0o555)
    for candidate in (folder, Path("/sys")):
        try:
            (candidate / "probe").open("x").close()
        except OSError:
            return candidate
        (candidate / "probe").unlink()
    pytest.skip("no folder here refuses this process a new file")


def test_an_existing_read_only_out_folder_is_refused_before_the_run(capsys, tmp_path,
                                                                    monkeypatch):
    """QA 20: `--out` an existing folder the user cannot write in (a read-only working
    directory in a container) ran every variant and said only at the end 'results not
    written: Permission denied'."""
    monkeypatch.setattr(bench, "run_bench", lambda config, after_each: pytest.fail("ran"))
    folder = _unwritable_folder(tmp_path)
    assert main(["bench", "--tiny", "--variants", "bf16", "--out", str(folder)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"foundry-fp8 bench: --out {folder}: cannot write in the folder: ")
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def _fake_run_variant(variant, config, bar):
    """A bf16 row without training; te_swap variants crash as a broken GPU kernel would."""
    if variant.te_swap:
        raise RuntimeError("CUDA error: an illegal memory access was encountered\nmore detail")
    return {"name": variant.name, "label": variant.label(config.tiny), "precision": "fp32",
            "tokens_per_s": 1000.0, "mfu": 0.1,
            "hfu": 0.1, "mfu_peak_tflops": 989.0, "peak_mem_gb": 1.0, "loss": 1.0,
            "loss_first_timed_step": 2.0, "attention_share": None, "micro_batch": 4,
            "what": variant.what}


def test_a_failed_variant_fails_the_run_after_the_others_are_written(capsys, tmp_path,
                                                                    monkeypatch):
    """A crash is not a skip: the results of the variants that ran are written, the failure is
    recorded with its reason, printed in one line, and the exit is non-zero."""
    monkeypatch.setattr(bench, "run_variant", _fake_run_variant)
    assert main(["bench", "--tiny", "--variants", "bf16,fp8-fc-te,fp8-te-swap",
                 "--out", str(tmp_path)]) == 1
    result = json.loads((tmp_path / "mpt-tiny-cpu.json").read_text())
    assert [r["name"] for r in result["variants"]] == ["bf16"]
    assert result["skipped"] == [{"name": "fp8-fc-te",
                                  "reason": "needs TransformerEngine layers (no CPU emulation)"}]
    [failed] = result["failed"]
    assert failed["name"] == "fp8-te-swap"
    assert failed["reason"] == "RuntimeError: CUDA error: an illegal memory access was encountered"
    assert "Traceback" in failed["traceback"] and "_fake_run_variant" in failed["traceback"]
    md = (tmp_path / "mpt-tiny-cpu.md").read_text()
    assert f"| fp8-te-swap | FAILED: {failed['reason']} |" in md
    assert "| fp8-fc-te | not run: needs TransformerEngine layers" in md
    out = capsys.readouterr().err
    assert out.strip().splitlines()[-1] == (
        "foundry-fp8 bench: fp8-te-swap failed: RuntimeError: CUDA error: an illegal memory "
        "access was encountered")
    assert "Traceback" not in out


def test_skipped_variants_alone_do_not_fail_the_run(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "run_variant", _fake_run_variant)
    assert main(["bench", "--tiny", "--variants", "bf16,fp8-fc-te", "--out", str(tmp_path)]) == 0
    assert main(["bench", "--tiny", "--variants", "fp8-fc-te", "--out", str(tmp_path)]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "foundry-fp8 bench: no variant ran (see 'not run' above)")


def test_yamls_folder_without_the_yamls_is_a_one_line_error(capsys, tmp_path):
    (tmp_path / "mpt-1b-bf16.yaml").write_text((bench.YAMLS / "mpt-1b-bf16.yaml").read_text())
    assert main(["bench", "--tiny", "--variants", "bf16,fp8-te-swap", "--yamls", str(tmp_path),
                 "--out", str(tmp_path)]) == 2
    out = capsys.readouterr().err
    assert out == (f"foundry-fp8 bench: --yamls {tmp_path}: no mpt-1b-fp8.yaml there (the bench "
                   "reads mpt-1b-bf16.yaml and mpt-1b-fp8.yaml; the package ships both)\n")


def test_yamls_naming_a_file_says_it_is_no_folder(capsys, tmp_path):
    """QA 19: `--yamls mpt-1b-fp8.yaml` (the file, not its folder) said "no mpt-1b-bf16.yaml
    there", as if the folder lacked one."""
    given = tmp_path / "mpt-1b-fp8.yaml"
    given.write_text((bench.YAMLS / "mpt-1b-fp8.yaml").read_text())
    assert main(["bench", "--tiny", "--yamls", str(given), "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        f"foundry-fp8 bench: --yamls {given}: a file, not a folder (--yamls names the folder "
        "holding mpt-1b-bf16.yaml and mpt-1b-fp8.yaml)\n")


def test_results_go_to_the_current_directory_by_default(tmp_path, monkeypatch):
    """Not into the checkout or site-packages: where the user runs it. (fp8-fc-te does not run
    on CPU, so nothing trains; the results still get written.)"""
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "--tiny", "--variants", "fp8-fc-te"]) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mpt-tiny-cpu.json", "mpt-tiny-cpu.md"]


def test_prints_and_logs_go_above_the_progress_bar(capsys):
    """Each line the variants emit starts on a line of its own, after tqdm cleared its bar:
    the text after the line's last carriage return is the message alone, never `bar...message`.
    Handlers made before (holding the real stderr, as Transformers' does) and during the run
    both land there."""
    from tqdm import tqdm

    early, late = logging.getLogger("test_bench.early"), logging.getLogger("test_bench.late")
    early.addHandler(logging.StreamHandler(sys.stderr))
    try:
        with tqdm(total=4, desc="bench", file=sys.stderr, mininterval=0) as bar, \
                bench._above_the_bar():
            bar.update(1)
            print("a printed table row")
            bar.update(1)
            early.warning("a warning through an early handler")
            late.addHandler(logging.StreamHandler())  # defaults to sys.stderr at this point
            late.warning("a warning through a handler made during the run")
            bar.update(2)
    finally:
        early.handlers.clear()
        late.handlers.clear()
    captured = capsys.readouterr()
    assert "a printed table row" in captured.out.split("\n")
    err_lines = [segment.split("\r")[-1] for segment in captured.err.split("\n")]
    for message in ("a warning through an early handler",
                    "a warning through a handler made during the run"):
        assert message in err_lines, captured.err


def test_results_are_on_disk_after_each_variant(tmp_path, monkeypatch):
    """A bench killed by a time limit (a 10-minute device call) keeps the variants it finished:
    when the second variant starts, the first one's row is already in the JSON and markdown."""
    seen_on_disk = []

    def run_variant(variant, config, bar):
        path = tmp_path / "mpt-tiny-cpu.json"
        seen_on_disk.append([r["name"] for r in json.loads(path.read_text())["variants"]]
                            if path.exists() else None)
        return _fake_run_variant(bench.VARIANTS["bf16"], config, bar) | {"name": variant.name}

    monkeypatch.setattr(bench, "run_variant", run_variant)
    assert main(["bench", "--tiny", "--variants", "bf16,fp8-te-swap,fp8-te-swap-stats1",
                 "--out", str(tmp_path)]) == 0
    assert seen_on_disk == [None, ["bf16"], ["bf16", "fp8-te-swap"]]
    final = json.loads((tmp_path / "mpt-tiny-cpu.json").read_text())
    assert [r["name"] for r in final["variants"]] == ["bf16", "fp8-te-swap", "fp8-te-swap-stats1"]
    assert final["pending"] == [] and "not reached" not in (tmp_path / "mpt-tiny-cpu.md").read_text()


def test_results_left_by_an_interrupted_bench_name_the_variants_not_reached(tmp_path,
                                                                          monkeypatch, capsys):
    """Ctrl-C in the second variant: the files on disk hold the first variant's row and say
    that the other two asked for were not reached, rather than passing for a one-variant run."""
    def run_variant(variant, config, bar):
        if variant.name != "bf16":
            raise KeyboardInterrupt
        return _fake_run_variant(variant, config, bar)

    monkeypatch.setattr(bench, "run_variant", run_variant)
    assert main(["bench", "--tiny", "--variants", "bf16,fp8-te-swap,fp8-te-swap-stats1",
                 "--out", str(tmp_path)]) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == "foundry-fp8: interrupted"
    result = json.loads((tmp_path / "mpt-tiny-cpu.json").read_text())
    assert [r["name"] for r in result["variants"]] == ["bf16"]
    assert result["pending"] == ["fp8-te-swap", "fp8-te-swap-stats1"]
    md = (tmp_path / "mpt-tiny-cpu.md").read_text()
    for name in ("fp8-te-swap", "fp8-te-swap-stats1"):
        assert f"| {name} | not reached: " in md


def test_stats_cost_is_the_every_batch_rows_extra_time_over_the_interval():
    """0.5 s a step without fp8_stats, 1.5 s with it logging every batch: 1 s extra each
    logging step, 1 s per 100 steps of 0.5 s = 2 % at the default interval of 100."""
    rows = [{"name": "fp8-te-swap", "label": "a", "tokens_per_s": 4096 / 0.5},
            {"name": "fp8-te-swap-stats1", "label": "b", "tokens_per_s": 4096 / 1.5}]
    text = "".join(bench.stats_cost_lines({"variants": rows,
                                           "setup": {"batch": 2, "seq_len": 2048}}))
    assert "1.500 s against 0.500 s" in text and "+1.000 s" in text and "2.00 %" in text
    assert bench.stats_cost_lines({"variants": rows[:1], "setup": {}}) == []


@pytest.mark.parametrize(("torch_version", "refused"), [("2.11.0+cu130", True), ("2.7.0", False)])
def test_auto_micro_batch_is_refused_in_one_line_where_composer_would_raise(
        monkeypatch, capsys, tmp_path, torch_version, refused):
    """The H200 run: Composer 0.32.1 + torch 2.11 + FSDP raised NameError for every variant.
    Now the bench says so before building anything (FP8031's fact); torch 2.7.0 is fine."""
    from importlib import metadata

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "NVIDIA H200")
    monkeypatch.setattr(torch, "__version__", torch_version)
    monkeypatch.setattr(metadata, "version",
                        lambda name: {"mosaicml": "0.32.1"}.get(name, "0"))
    monkeypatch.setattr(bench, "run_bench", lambda config, after_each: pytest.fail("ran"))
    if refused:
        assert main(["bench", "--micro-batch", "auto", "--out", str(tmp_path)]) == 2
        out = capsys.readouterr().err
        assert len(out.strip().splitlines()) == 1 and "unshard" not in out
        assert "_patch_pytorch.py:30" in out and "--micro-batch 8" in out
    else:
        with pytest.raises(pytest.fail.Exception, match="ran"):
            main(["bench", "--micro-batch", "auto", "--out", str(tmp_path)])


def test_a_fifo_where_a_result_goes_is_one_line_before_the_run(tmp_path):
    """Opening a FIFO to write waits for a reader forever: refused in one line before anything
    runs (a subprocess with a timeout, so a hang fails instead of hanging the suite)."""
    import os
    import subprocess

    os.mkfifo(tmp_path / "mpt-tiny-cpu.json")
    done = subprocess.run([sys.executable, "-m", "foundry_fp8.cli", "bench", "--tiny",
                           "--variants", "fp8-fc-te", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr == (f"foundry-fp8 bench: --out {tmp_path}: "
                           f"{tmp_path / 'mpt-tiny-cpu.json'}: a FIFO (named pipe), not a regular "
                           "file: remove it, or write elsewhere\n")
    assert not (tmp_path / "mpt-tiny-cpu.md").exists()


_BAD_YAML_RUN = """
import sys
from foundry_fp8.cli import main
code = main(["bench", "--variants", "bf16,fp8-te-swap", "--yamls", sys.argv[1], "--out",
             sys.argv[1]])
print(code, "torch" in sys.modules)
"""


@pytest.mark.parametrize(("bf16", "fp8", "says"), [
    ("model: [\n", None, "mpt-1b-bf16.yaml:2:1: "),
    ("optimizer: {name: decoupled_adamw}\n", None,
     "mpt-1b-bf16.yaml:1: model: missing (the bench builds the model from it)"),
    (None, "model: {name: mpt_causal_lm, vocab_size: 8}\noptimizer: {name: adamw}\n"
           "precision: amp_fp8\nalgorithms:\n  gradient_clipping: 3\n",
     "mpt-1b-fp8.yaml:5: algorithms.gradient_clipping: expected a mapping, got 3"),
    (None, "model: {name: mpt_causal_lm, vocab_size: 8}\noptimizer: {name: adamw}\n"
           "precision: amp_fp8\nalgorithms:\n  gradient_clipping: {}\n",
     "mpt-1b-fp8.yaml:4: algorithms.te_swap: missing (the fp8-te-swap variant reads it)"),
], ids=["not-yaml", "no-model", "clipping-not-a-mapping", "no-te-swap"])
def test_a_bad_yaml_is_one_line_naming_file_and_line_before_any_heavy_import(tmp_path, bf16,
                                                                              fp8, says):
    """Checked up front, as the bench will read it: not after torch, Composer and LLM-Foundry
    have loaded (half a minute) inside the first variant, and not as a bare KeyError."""
    import subprocess

    for name, text in (("bf16", bf16), ("fp8", fp8)):
        (tmp_path / f"mpt-1b-{name}.yaml").write_text(
            text if text is not None else (bench.YAMLS / f"mpt-1b-{name}.yaml").read_text())
    done = subprocess.run([sys.executable, "-c", _BAD_YAML_RUN, str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.stdout == "2 False\n", done.stdout + done.stderr[-2000:]
    assert done.stderr.startswith(f"foundry-fp8 bench: {tmp_path}/{says}"), done.stderr
    assert done.stderr.count("\n") == 1


@pytest.mark.parametrize("tiny", [False, True])
def test_the_shipped_yamls_pass_the_up_front_check(tiny):
    for yaml in ("bf16", "fp8"):
        variants = [v for v in bench.VARIANTS.values() if v.yaml == yaml]
        bench.check_yaml(bench.YAMLS / f"mpt-1b-{yaml}.yaml", variants, tiny)


def test_results_that_cannot_be_saved_mid_run_are_one_line_at_the_end(capsys, tmp_path,
                                                                      monkeypatch):
    """A full disk while the results are saved after a variant: the bench goes on, and the
    final save says why in one line (it raised out of the bench as a traceback)."""
    import errno

    def full(result, out):
        raise OSError(errno.ENOSPC, "No space left on device", str(out / "mpt-tiny-cpu.json"))

    monkeypatch.setattr(bench, "run_variant", _fake_run_variant)
    monkeypatch.setattr(bench, "write_results", full)
    assert main(["bench", "--tiny", "--variants", "bf16,fp8-fc-te", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.endswith(f"foundry-fp8 bench: --out {tmp_path}: results not written: [Errno 28] "
                        f"No space left on device: '{tmp_path / 'mpt-tiny-cpu.json'}'\n"), err
    assert "Traceback" not in err


def _config(argv: list[str]) -> bench.BenchConfig:
    from foundry_fp8.cli import build_parser

    return bench.config_from_args(build_parser().parse_args(["bench", *argv]))


def test_tiny_records_no_activation_checkpointing_since_it_runs_none():
    """QA: `--tiny --activation-checkpointing` (ignored: no FSDP on CPU, as --help says) was
    recorded as `activation checkpointing True` in the JSON and the markdown."""
    tiny = _config(["--tiny", "--activation-checkpointing"])
    assert bench.load_config(bench.VARIANTS["fp8-te-swap"], tiny)["fsdp_config"] is None
    assert tiny.activation_checkpointing is False
    assert bench._result(tiny, [], [], [])["setup"]["activation_checkpointing"] is False
    assert _config(["--activation-checkpointing"]).activation_checkpointing is True


@pytest.mark.parametrize(("argv", "ran"), [
    (["--tiny"], 4),  # the default micro-batch 8 over --tiny's batch of 4
    (["--tiny", "--batch", "16", "--micro-batch", "6"], 6),
    (["--batch", "2"], 2),
])
def test_the_micro_batch_recorded_is_the_one_composer_runs(argv, ran):
    """QA: `--tiny` recorded micro-batch 8 (JSON `setup` and each row, the markdown) for steps
    of 4 sequences, which Composer runs unsplit; the record is now the size of Composer's own
    split of such a batch (`_default_split_batch`, with the size asked for)."""
    from composer.core.data_spec import _default_split_batch

    config = _config(argv)
    batch = bench.synthetic_batches(1, config.batch, config.seq_len, 512, 17)[0]
    asked = int(argv[argv.index("--micro-batch") + 1]) if "--micro-batch" in argv else 8
    with pytest.warns(UserWarning) if asked > config.batch else contextlib.nullcontext():
        first = _default_split_batch(batch, asked)[0]
    assert config.micro_batch == len(first["input_ids"]) == ran


def test_variants_listed_twice_and_an_out_file_are_one_line_errors(capsys, tmp_path):
    """QA: `--variants bf16,bf16` ran bf16 twice (the second row "2.757 x fp32", against the
    first); `--out` naming a file said "cannot create the folder: File exists"."""
    with pytest.raises(SystemExit) as stop:
        main(["bench", "--tiny", "--variants", "bf16,fp8-te-swap,bf16", "--out", str(tmp_path)])
    assert stop.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "foundry-fp8 bench: error: argument --variants: bf16 listed more than once")
    (tmp_path / "afile").write_text("")
    assert main(["bench", "--tiny", "--out", str(tmp_path / "afile")]) == 2
    assert capsys.readouterr().err == (f"foundry-fp8 bench: --out {tmp_path / 'afile'}: a file, "
                                       "not a folder (--out names the folder the results go "
                                       "to)\n")
    assert main(["bench", "--tiny", "--out", "/dev/null"]) == 2
    assert "--out /dev/null: a character device, not a folder" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    ["--tiny"],
    ["--tiny", "--variants", "bf16,fp8-te-swap", "--steps", "3", "--compile"],
    ["--variants", "fp8-te-swap-fused", "--micro-batch", "auto", "--activation-checkpointing",
     "--yamls", "my yamls"],
])
def test_the_results_record_the_command_that_runs_them_again(argv, tmp_path, monkeypatch):
    """QA: the JSON kept the options but not the command (record.py and stats_memory.py keep
    theirs), and nothing said which `--yamls` a run benched. The recorded command, read back by
    the bench's own parser, gives the same configuration."""
    import shlex

    from foundry_fp8.cli import build_parser

    monkeypatch.chdir(tmp_path)
    if "--yamls" in argv:
        (tmp_path / "my yamls").mkdir()
        for name in ("mpt-1b-bf16.yaml", "mpt-1b-fp8.yaml"):
            (tmp_path / "my yamls" / name).write_text((bench.YAMLS / name).read_text())
    config = _config(argv)
    command = bench._result(config, [], [], [])["command"]
    assert command.startswith("foundry-fp8 bench ")
    monkeypatch.chdir(tmp_path.parent)  # QA 17: a relative --yamls ran again from elsewhere
    again = bench.config_from_args(build_parser().parse_args(shlex.split(command)[1:]))
    assert again.yamls.resolve() == (tmp_path / config.yamls).resolve()
    assert dataclasses.replace(again, yamls=config.yamls) == config
    assert (f"--yamls '{tmp_path / 'my yamls'}'" in command) == ("--yamls" in argv)


@pytest.mark.parametrize(("argv", "says"), [
    (["--micro-batch", "9", "--batch", "4"],
     "--micro-batch 9 is larger than --batch 4: Composer would run each batch of 4 whole; give "
     "at most 4"),
    (["--micro-batch", "100000000000000000000"],
     "--micro-batch 100000000000000000000 is larger than --batch 4: Composer would run each "
     "batch of 4 whole; give at most 4"),
    (["--micro-batch", "auto"],
     "--micro-batch auto: Composer's auto micro-batching runs on a GPU only, and --tiny runs on "
     "CPU; give a number"),
])
def test_a_micro_batch_that_would_not_run_as_asked_is_one_line(argv, says, capsys, tmp_path,
                                                                 monkeypatch):
    """QA: `--tiny --micro-batch 9 --batch 4` ran micro-batch 4 with exit 0, and `--tiny
    --micro-batch auto` ran the whole batch while the results' setup said `auto`. Composer's
    own code is the reference: it runs a micro-batch over the batch unsplit, and refuses auto
    micro-batching on a CPU device."""
    from composer.core.data_spec import _default_split_batch
    from composer.devices import DeviceCPU
    from composer.trainer.trainer import _is_auto_microbatching

    batch = bench.synthetic_batches(1, 4, 16, 512, 17)[0]
    with pytest.warns(UserWarning):
        assert len(_default_split_batch(batch, 9)) == 1  # one micro-batch of 4, not of 9
    with pytest.warns(UserWarning), pytest.raises(ValueError, match="only use adaptive"):
        _is_auto_microbatching("auto", DeviceCPU())
    monkeypatch.setattr(bench, "run_bench", lambda config, after_each: pytest.fail("ran"))
    assert main(["bench", "--tiny", *argv, "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"foundry-fp8 bench: {says}\n"


def test_auto_micro_batching_gets_the_batch_size_composer_starts_from():
    """`--micro-batch auto` on a GPU: Composer starts from the dataloader's `batch_size`
    (trainer.py _get_initial_device_train_microbatch_size) and raised AttributeError for the
    bench's plain list of batches, so every variant would have failed."""
    from composer.trainer.trainer import _get_initial_device_train_microbatch_size

    batches = bench.synthetic_batches(3, 6, 16, 512, 17)
    assert _get_initial_device_train_microbatch_size("auto", True, batches) == 6
    assert len(batches) == 3 and len(batches[0]["input_ids"]) == 6


@pytest.mark.parametrize(("argv", "says"), [
    (["--seq-len", "7", "--micro-batch", "1"],
     "--seq-len 7: 1 x 7 = 7 tokens per micro-batch is not a multiple of 8"),
    (["--seq-len", "4", "--batch", "5", "--micro-batch", "2"],  # split 2, 2, 1: 4 tokens last
     "--seq-len 4: 1 x 4 = 4 tokens per micro-batch (the last micro-batch of each step: --batch 5 "
     "leaves 1) is not a multiple of 8"),
])
def test_fp8_tokens_per_micro_batch_that_te_refuses_are_one_line_before_the_run(
        argv, says, capsys, tmp_path, monkeypatch):
    """TE's assert_dim_for_fp8_exec: an FP8 GEMM input's leading dims (micro-batch x sequence)
    multiply to a multiple of 8. The FP8 variants would have failed after building MPT-1B;
    `--tiny`'s emulated rows ran what TE refuses. A bf16-only run has no such rule."""
    monkeypatch.setattr(bench, "run_bench", lambda config, after_each: pytest.fail("ran"))
    for tiny in (["--tiny"], []):
        assert main(["bench", *tiny, *argv, "--out", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"foundry-fp8 bench: {says}") and err.count("\n") == 1, err
    assert _config(["--tiny", "--variants", "bf16", *argv]).seq_len == int(argv[1])


def test_what_runs_other_than_asked_is_said_before_the_run(capsys, tmp_path, monkeypatch):
    """--tiny ignores --activation-checkpointing (no FSDP on CPU), and 24 tokens per micro-batch
    pass TE's forward assert but are no multiple of 16 (FP8006's warning): each one line."""
    monkeypatch.setattr(bench, "run_bench", lambda config, after_each: pytest.fail("ran"))
    with pytest.raises(pytest.fail.Exception, match="ran"):
        main(["bench", "--tiny", "--activation-checkpointing", "--seq-len", "12",
              "--micro-batch", "2", "--out", str(tmp_path)])
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == ("foundry-fp8 bench: --activation-checkpointing: not applied under "
                        "--tiny (no FSDP on CPU); the results record it off")
    assert lines[1].startswith("foundry-fp8 bench: --seq-len 12: 24 tokens per micro-batch is a "
                               "multiple of 8 but not of 16") and len(lines) == 2


def test_the_checkout_script_runs_the_cli_with_its_guarded_output(tmp_path):
    """QA: `python benchmarks/mpt_throughput.py --help >&-` exited 0 having printed nothing
    (it called `bench.run` without the CLI's `main`). Reference for a closed stdout: the
    shell's own echo, which fails on it."""
    import subprocess
    from pathlib import Path

    script = Path(bench.__file__).resolve().parents[2] / "benchmarks" / "mpt_throughput.py"
    echo = subprocess.run(["bash", "-c", 'echo hi >&-; echo "exit $?"'], capture_output=True,
                          text=True, timeout=60)
    assert echo.stdout == "exit 1\n"
    done = subprocess.run(["bash", "-c", '"$@" --help >&-; echo "exit $?"', "bash",
                           sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120)
    assert done.stdout == "exit 2\n", done
    assert done.stderr == "foundry-fp8: cannot write to stdout: Bad file descriptor\n"
    sys.path.insert(0, str(script.parent))
    try:
        import mpt_throughput
    finally:
        sys.path.remove(str(script.parent))
    from foundry_fp8.cli import build_parser

    results = script.parents[1] / "benchmarks" / "results"
    # review s16: an explicit `--out .` (the CLI's default) went to benchmarks/results
    for given, out in (([], results), (["--out", "."], Path(".")), (["--ou", "x"], Path("x"))):
        assert build_parser().parse_args(mpt_throughput.argv_for(["--tiny", *given])).out == out


@pytest.mark.parametrize(("script", "argv", "says"), [
    ("stats_overhead.py", ["--rounds", "0"], "--rounds must be at least 1, got 0"),
    ("guard_overhead.py", ["--interval", "3"], "--interval must be at least 5: three "
     "non-logging steps before each logging step and one after, got 3"),
    ("emulation_cost.py", ["--steps", "0"], "--steps must be at least 1, got 0"),
])
def test_the_cost_benchmarks_refuse_counts_before_their_runs(script, argv, says):
    """QA: `stats_overhead.py --rounds 0` built the tiny data and then raised StatisticsError
    (a median of no rounds); `guard_overhead.py --interval 3` ran a whole round before its
    ValueError; `emulation_cost.py --steps 0` timed nothing. Now argparse's one-line error,
    exit 2, before any run."""
    import subprocess
    from pathlib import Path

    path = Path(bench.__file__).resolve().parents[2] / "benchmarks" / script
    done = subprocess.run([sys.executable, str(path), *argv], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.splitlines()[-1] == f"{script}: error: {says}"
    assert "Traceback" not in done.stderr and done.stdout == ""


def test_a_log_gets_one_line_per_variant_and_phase_not_a_bar_redraw_per_step(capsys,
                                                                              monkeypatch):
    """QA 20: with stderr a CI log or a file, tqdm's bar wrote a carriage-return redraw on every
    step and a cleared bar around every line a variant printed (38 lines for a 6-step variant,
    blank 72-space ones among them). Each phase starts one line there instead, with the step
    count so far; the steps come from the bench's own step timer."""
    from types import SimpleNamespace

    def run_variant(variant, config, bar):
        label = variant.label(config.tiny)
        bar.set_postfix_str(f"{label}: building the model")
        timer = bench._Timer(config, False, bar, label)
        state = SimpleNamespace(loss=torch.tensor(1.0))
        for batch in range(config.warmup + config.steps):
            timer.on_batch_start(batch)
            print(f"{label} printed at batch {batch}")
            timer.on_batch_end(batch, state)
        raise RuntimeError("no row: this test reads only the progress lines")

    monkeypatch.setattr(bench, "run_variant", run_variant)
    config = dataclasses.replace(bench.TINY_CONFIG, variants=("bf16", "fp8-fc-te", "fp8-te-swap"),
                                 warmup=1, steps=2, profile_steps=0)
    bench.run_bench(config)
    fp8 = bench.VARIANTS["fp8-te-swap"].label(True)
    captured = capsys.readouterr()
    assert "\r" not in captured.err
    # each variant's first line in its row's words (before: `bf16` for the fp32 row, and a
    # variant not run only by its name)
    assert captured.err.splitlines() == [
        "bench [0/9] fp32", "bench [0/9] fp32: building the model",
        "bench [0/9] fp32: warm-up step 1", "bench [1/9] fp32: timed step 2",
        "bench [3/9] fp8-fc-te: not run: needs TransformerEngine layers (no CPU emulation)",
        f"bench [6/9] {fp8}", f"bench [6/9] {fp8}: building the model",
        f"bench [6/9] {fp8}: warm-up step 1", f"bench [7/9] {fp8}: timed step 2"]
    assert captured.out.splitlines() == [f"{label} printed at batch {b}"
                                         for label in ("fp32", fp8) for b in range(3)]
