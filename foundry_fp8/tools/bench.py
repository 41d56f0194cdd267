"""`foundry-fp8 bench`: MPT-1B training throughput, FP8 variants against BF16, in one process.

Every variant is built from our `tools/yamls/mpt-1b-*.yaml` (package data) through LLM-Foundry's model builder and
trained by Composer's Trainer on synthetic batches with learnable structure (random n-grams
repeated through each sequence), so the loss after the timed steps can be compared across
variants. Timing: warm-up steps, then timed steps between CUDA events (perf_counter on CPU),
then a few profiled steps that give attention's share of op time. `--tiny` runs the same path
on CPU with a tiny MPT in fp32, te_swap on its `emulate` backend, and its rows say so. Results
go to the current directory unless `--out` says otherwise.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import gc
import io
import json
import logging
import math
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from foundry_fp8.cli import OutputError, interrupted_by
from foundry_fp8.environment import hides_every_gpu, memory_limit, nvte_not_integer
from foundry_fp8.jsonl import check_output, file_kind, write_output
from foundry_fp8.lint.known import (
    AUTO_MICROBATCH_CHECKED_FROM,
    AUTO_MICROBATCH_SOURCE,
    UNSHARD_TORCH_RANGE,
    auto_microbatch_fsdp_fails,
)
from foundry_fp8.packages import DISTRIBUTION
from foundry_fp8.shapes import FP8_DIM_MULTIPLE, FP8_TOKEN_MULTIPLE, dim_fits_fp8, tokens_fit_fp8
from foundry_fp8.te.facts import dotted

#: The MPT-1B YAMLs, shipped inside the package so an installed bench needs no checkout.
YAMLS = Path(__file__).resolve().parent / "yamls"


# H100 SXM dense peaks, the numbers Composer's speed_monitor uses (1.979e15 / 2, 3.958e15 / 2).
PEAK_FLOPS = {"bf16": 989e12, "fp8": 1979e12}

# Tiny CPU model: small enough for CI, TE-shaped (multiples of 16).
TINY_MODEL = {"d_model": 64, "n_heads": 4, "n_layers": 2, "vocab_size": 512,
              "init_device": "cpu"}
ATTENTION_OPS = re.compile(r"scaled_dot_product|ScaledDotProduct|flash_attention|"
                           r"efficient_attention|cudnn_attention")


@dataclass(frozen=True)
class Variant:
    """One way a user could train MPT-1B; `yaml` picks mpt-1b-{yaml}.yaml."""

    name: str
    yaml: str
    what: str
    model: dict[str, Any] = field(default_factory=dict)
    te_swap: bool = False
    swap: dict[str, Any] = field(default_factory=dict)  # te_swap options over the YAML's
    stats_interval: int | None = None

    @property
    def needs_te(self) -> bool:
        """Builds TE modules that have no emulation: LLM-Foundry's own TE layers, or te_swap's
        fused LayerNormMLP."""
        return "fc_type" in self.model or bool(self.swap.get("fuse_ln_mlp"))

    def label(self, tiny: bool) -> str:
        """The row's name: under --tiny the baseline trains in fp32, not bf16, and te_swap
        emulates FP8, so the rows say what ran."""
        if not tiny:
            return self.name
        return "fp32" if self.yaml == "bf16" else f"{self.name} (emulated)"


VARIANTS = {v.name: v for v in (
    Variant("bf16", "bf16", "amp_bf16, torch layers"),
    Variant("fp8-fc-te", "fp8", "amp_fp8, LLM-Foundry fc_type: te", model={"fc_type": "te"}),
    Variant("fp8-te-ln-mlp", "fp8", "amp_fp8, fc_type: te + ffn_type: te_ln_mlp",
            model={"fc_type": "te", "ffn_config": {"ffn_type": "te_ln_mlp"}}),
    Variant("fp8-te-swap", "fp8", "amp_fp8 via our te_swap", te_swap=True),
    # init_device cpu: under meta init LLM-Foundry's own init of te.LayerNormMLP runs, which
    # raises NameError in 0.22.0 (param_init_fns.py te_layernorm_mlp_init, div_is_residual)
    Variant("fp8-te-swap-fused", "fp8", "te_swap with fuse_ln_mlp (te.LayerNormMLP: norm_2 + "
            "MLP in one TE module, tanh GELU), init_device cpu",
            model={"init_device": "cpu"}, te_swap=True, swap={"fuse_ln_mlp": True}),
    Variant("fp8-te-swap-stats100", "fp8", "te_swap + fp8_stats every 100 batches",
            te_swap=True, stats_interval=100),
    Variant("fp8-te-swap-stats1", "fp8", "te_swap + fp8_stats every batch",
            te_swap=True, stats_interval=1),
)}


@dataclass(frozen=True)
class BenchConfig:
    variants: tuple[str, ...] = tuple(VARIANTS)
    tiny: bool = False
    seq_len: int = 2048
    batch: int = 32  # sequences per optimizer step
    # Sequences per forward. Not "auto": Composer's auto microbatching with FSDP raises
    # NameError outside UNSHARD_TORCH_RANGE (FP8031; seen on the H200 run, torch 2.11). 8 fits
    # MPT-1B at seq 2048 with room
    # on an 80 GB H100 (peak 53 GB bf16, 58 GB fp8 on the H200).
    micro_batch: int | str = 8
    warmup: int = 10
    steps: int = 30
    profile_steps: int = 2
    activation_checkpointing: bool = False
    compile: bool = False
    seed: int = 17
    yamls: Path = YAMLS  # holds mpt-1b-{bf16,fp8}.yaml


#: --tiny's defaults where they differ from the GPU run's.
TINY_CONFIG = BenchConfig(tiny=True, seq_len=64, batch=4, warmup=2, steps=6)


class _Batches(list):
    """The bench's train dataloader: a list of batches with the `batch_size` that Composer's
    auto micro-batching starts from (trainer.py, _get_initial_device_train_microbatch_size,
    raises AttributeError for a dataloader without one)."""

    def __init__(self, batches: list[dict[str, Any]], batch_size: int):
        super().__init__(batches)
        self.batch_size = batch_size


def synthetic_batches(n_batches: int, batch: int, seq_len: int, vocab: int, seed: int,
                      ngram: int = 8, bank: int = 256) -> _Batches:
    """Sequences of n-grams drawn from a fixed random bank: after an n-gram's first token the
    rest is predictable, so a model that learns drives the loss well below log(vocab)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    grams = torch.randint(0, vocab, (bank, ngram), generator=g)
    per_seq = math.ceil(seq_len / ngram)
    out = []
    for _ in range(n_batches):
        ids = grams[torch.randint(0, bank, (batch, per_seq), generator=g)].view(batch, -1)
        ids = ids[:, :seq_len].contiguous()
        out.append({"input_ids": ids, "labels": ids.clone()})
    return _Batches(out, batch)


def yaml_path(variant: Variant, config: BenchConfig) -> Path:
    return config.yamls / f"mpt-1b-{variant.yaml}.yaml"


def load_config(variant: Variant, config: BenchConfig) -> dict[str, Any]:
    """The variant's train config from our YAML, resolved, with the bench's overrides."""
    from omegaconf import OmegaConf as om

    cfg = om.to_container(om.load(yaml_path(variant, config)), resolve=True)
    model = cfg["model"]
    _override_model(model, variant, config)
    algorithms = cfg.setdefault("algorithms", {}) or {}
    if not variant.te_swap:
        algorithms.pop("te_swap", None)
    else:
        algorithms["te_swap"] = {**algorithms["te_swap"], **variant.swap}
    fsdp = cfg.get("fsdp_config") or {}
    if config.activation_checkpointing:
        fsdp.update(activation_checkpointing=True, activation_checkpointing_reentrant=False)
        if variant.yaml == "fp8":  # recompute inside TE's FP8 context (lint rule FP8002)
            fsdp["te_checkpoint_wrapper"] = True
    if config.tiny:
        cfg["precision"] = "fp32"  # Composer runs amp_fp8 only on CUDA with TE
        cfg["optimizer"]["lr"] = 3e-3
        fsdp = None  # single CPU process; FSDP is a GPU setup
        if "te_swap" in algorithms:
            algorithms["te_swap"]["backend"] = "emulate"
    cfg["fsdp_config"] = fsdp
    cfg["algorithms"] = algorithms
    return cfg


def _override_model(model: dict[str, Any], variant: Variant, config: BenchConfig) -> None:
    """The bench's changes to a YAML's model section: the variant's keys, the sequence
    length, and under --tiny the tiny MPT's shape."""
    model.update(variant.model, max_seq_len=config.seq_len)
    if config.tiny:
        model.update(TINY_MODEL)


def model_config(variant: Variant, config: BenchConfig) -> dict[str, Any]:
    """The model section `load_config` gives, resolved alone: the rest of the YAML is left to
    the run (a key there that does not resolve fails its variant, as it did). An interpolation
    in it that does not resolve (an unset `${oc.env:...}`, which the linter's loader leaves to
    the run) is a ValueError naming file, line and key: every variant would fail on it."""
    from omegaconf import OmegaConf as om
    from omegaconf.errors import OmegaConfBaseException

    from foundry_fp8.lint.load import load_config as load_yaml
    from foundry_fp8.lint.load import position_of

    path = yaml_path(variant, config)
    try:
        model = om.to_container(om.load(path).model, resolve=True)
    except OmegaConfBaseException as err:
        key = err.full_key or "model"
        line = (position_of(key, load_yaml(path).positions) or (1,))[0]
        raise ValueError(f"{path}:{line}: {key}: {str(err.msg).splitlines()[0]}") from None
    _override_model(model, variant, config)
    return model


class _Timer:
    """Composer callback: times steps [warmup, warmup+steps), keeps their losses, then profiles
    the following `profile_steps` steps for attention's share."""

    def __init__(self, config: BenchConfig, cuda: bool, bar, label: str):
        from composer.core import Callback

        self.config, self.cuda, self.bar, self.label = config, cuda, bar, label
        self.start = self.end = None
        self.losses: list = []
        self.profiler = None
        self.attention_share: float | None = None
        # memory still allocated when this variant's fit starts: the peak below is reset to
        # it, so what an earlier variant in this process left behind counts in this one's peak
        self.start_bytes: int | None = None
        timer = self

        class Hook(Callback):
            def fit_start(self, state, logger):
                if timer.cuda:
                    import torch

                    torch.cuda.reset_peak_memory_stats()
                    timer.start_bytes = torch.cuda.memory_allocated()

            def batch_start(self, state, logger):
                timer.on_batch_start(int(state.timestamp.batch))

            def batch_end(self, state, logger):
                timer.on_batch_end(int(state.timestamp.batch) - 1, state)

        self.callback = Hook()

    def _stamp(self):
        if self.cuda:
            import torch

            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self) -> float:
        if self.cuda:
            import torch

            torch.cuda.synchronize()
            return self.start.elapsed_time(self.end) / 1000
        return self.end - self.start

    def on_batch_start(self, batch: int) -> None:
        c = self.config
        phase = "warm-up" if batch < c.warmup else "timed" if batch < c.warmup + c.steps \
            else "profiled"
        self.bar.set_postfix_str(f"{self.label}: {phase} step {batch + 1}")
        if batch == c.warmup:
            self.start = self._stamp()
        elif batch == c.warmup + c.steps and c.profile_steps:
            import torch.profiler as tp

            activities = [tp.ProfilerActivity.CPU] + ([tp.ProfilerActivity.CUDA] if self.cuda else [])
            self.profiler = tp.profile(activities=activities)
            self.profiler.__enter__()

    def on_batch_end(self, batch: int, state) -> None:
        c = self.config
        if c.warmup <= batch < c.warmup + c.steps:
            self.losses.append(state.loss.detach())  # no sync inside the timed window
        if batch == c.warmup + c.steps - 1:
            self.end = self._stamp()
        if batch == c.warmup + c.steps + c.profile_steps - 1 and self.profiler is not None:
            self.profiler.__exit__(None, None, None)
            self.attention_share = attention_share(self.profiler.events(), self.cuda)
        self.bar.update(1)


def attention_share(events, cuda: bool) -> float | None:
    """Attention's share of op time (device time on CUDA, CPU time otherwise): inclusive time of
    the outermost attention ops over that of all top-level ops."""
    def total(e) -> float:
        return e.device_time_total if cuda else e.cpu_time_total

    def inside_attention(e) -> bool:
        parent = e.cpu_parent
        while parent is not None:
            if ATTENTION_OPS.search(parent.name):
                return True
            parent = parent.cpu_parent
        return False

    ops = [e for e in events if e.device_type.name == "CPU"]
    everything = sum(total(e) for e in ops if e.cpu_parent is None)
    attention = sum(total(e) for e in ops
                    if ATTENTION_OPS.search(e.name) and not inside_attention(e))
    return attention / everything if everything else None


def flops_per_token(model, seq_len: int) -> float:
    """LLM-Foundry's model flops per token, fwd+bwd (ComposerMPTCausalLM.flops_per_batch:
    3 x (2 x params + attention term) per token)."""
    import torch

    batch = {"input_ids": torch.zeros(1, seq_len, dtype=torch.long)}
    return model.flops_per_batch(batch) / seq_len


def _release_memory(tiny: bool) -> None:
    """Free the last variant's model and optimizer (also after it raised: its frames are gone
    once the exception is handled) before the next one measures its peak memory."""
    gc.collect()
    if not tiny:
        import torch

        torch.cuda.empty_cache()


def run_variant(variant: Variant, config: BenchConfig, bar,
                extra_callbacks: Sequence[Any] = ()) -> dict[str, Any]:
    """Train one variant; return its measured row (without ratio_to_bf16). `extra_callbacks`:
    Composer callbacks added to the run (benchmarks/gpu/stats_memory.py's probes)."""
    import torch
    from composer import Trainer
    from composer.algorithms import GradientClipping
    from composer.core.engine import Engine
    from composer.utils import reproducibility
    from llmfoundry.utils.builders import build_composer_model, build_optimizer
    from llmfoundry.utils.config_utils import process_init_device

    import foundry_fp8.attention  # noqa: F401  (registers attn_impl sdpa before MPT is built)

    cfg = load_config(variant, config)
    cuda = not config.tiny
    bar.set_postfix_str(f"{variant.label(config.tiny)}: building the model")
    model_cfg = dict(cfg["model"])
    name = model_cfg.pop("name")
    fsdp = cfg["fsdp_config"]
    reproducibility.seed_all(config.seed)  # same initial weights in every variant
    model = build_composer_model(name, model_cfg, tokenizer=None,
                                 init_context=process_init_device(model_cfg, fsdp))
    fpt = flops_per_token(model, config.seq_len)  # counts parameters: before FSDP shards them
    optimizer_cfg = dict(cfg["optimizer"])
    optimizer = build_optimizer(model, optimizer_cfg.pop("name"), optimizer_cfg)
    algorithms = [GradientClipping(**cfg["algorithms"]["gradient_clipping"])]
    if "te_swap" in cfg["algorithms"]:
        from foundry_fp8.composer.te_swap import TESwap

        algorithms.append(TESwap(**cfg["algorithms"]["te_swap"]))
    timer = _Timer(config, cuda, bar, variant.label(config.tiny))
    callbacks = [timer.callback, *extra_callbacks]
    if variant.stats_interval is not None:
        from foundry_fp8.composer.stats import FP8Stats

        callbacks.append(FP8Stats(interval=variant.stats_interval))
    n_batches = config.warmup + config.steps + config.profile_steps
    batches = synthetic_batches(n_batches, config.batch, config.seq_len,
                                model_cfg["vocab_size"], config.seed)
    trainer = None
    try:
        trainer = Trainer(
            model=model, train_dataloader=batches, max_duration=f"{n_batches}ba",
            optimizers=optimizer, algorithms=algorithms, callbacks=callbacks, loggers=[],
            precision=cfg["precision"], device="gpu" if cuda else "cpu",
            device_train_microbatch_size=config.micro_batch,
            parallelism_config={"fsdp": fsdp} if fsdp else None,
            compile_config={} if config.compile else None,
            progress_bar=False, log_to_console=False, seed=config.seed)
        trainer.fit()
        seconds = timer.seconds()
        micro_used = trainer.state.device_train_microbatch_size
        peak_gb = (torch.cuda.max_memory_allocated() if cuda else _peak_rss()) / 2**30
    finally:
        if trainer is not None:
            trainer.close()
        # Composer registers every Engine's close with atexit, holding its State (model and
        # optimizer) until the process exits: with six 1B variants that would fill the GPU.
        # All trainers this bench made are closed by now, so their exit hooks have nothing to do.
        atexit.unregister(Engine._close)
    tokens_per_s = config.steps * config.batch * config.seq_len / seconds
    precision = "fp8" if variant.yaml == "fp8" else "bf16"
    mfu = fpt * tokens_per_s / PEAK_FLOPS[precision]
    losses = [float(x) for x in timer.losses]
    ran = cfg["precision"] + (" + emulated FP8" if config.tiny and variant.te_swap else "")
    return {
        "name": variant.name, "label": variant.label(config.tiny), "precision": ran,
        "tokens_per_s": tokens_per_s,
        "mfu": mfu,
        # LLM-Foundry's collect_results.py: recompute adds a forward, 4 passes instead of 3
        "hfu": mfu * 4 / 3 if config.activation_checkpointing and not config.tiny else mfu,
        "mfu_peak_tflops": PEAK_FLOPS[precision] / 1e12, "peak_mem_gb": peak_gb,
        "start_mem_gb": None if timer.start_bytes is None else timer.start_bytes / 2**30,
        "loss": losses[-1], "loss_first_timed_step": losses[0],
        "attention_share": timer.attention_share, "micro_batch": micro_used,
        "what": variant.what,
    }


def _peak_rss() -> int:
    """Process peak RSS in bytes (CPU runs have no per-variant allocator peak)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def skip_reason(variant: Variant, config: BenchConfig) -> str | None:
    """Why a variant cannot run here, or None."""
    if config.tiny:
        return "needs TransformerEngine layers (no CPU emulation)" if variant.needs_te else None
    from foundry_fp8.te.probe import te_available

    if variant.yaml == "fp8" and not te_available():
        return "TransformerEngine is not installed"
    return None


def gpu_name(tiny: bool) -> str:
    """The device the variants run on, as the results and their file name say it."""
    import torch

    if torch.cuda.is_available() and not tiny:
        return torch.cuda.get_device_name()
    return f"cpu ({platform.processor() or platform.machine()})"


def environment(tiny: bool) -> dict[str, Any]:
    from importlib.metadata import PackageNotFoundError, version

    import torch

    def dist(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    driver = None
    if torch.cuda.is_available() and not tiny:
        try:
            lines = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, errors="replace", check=True).stdout.split()
            driver = lines[0] if lines else None
        except (OSError, subprocess.CalledProcessError):
            driver = None
    gpu = gpu_name(tiny)
    versions = {"torch": torch.__version__, "cuda": torch.version.cuda, "driver": driver,
                "transformer_engine": dist("transformer_engine") or dist("transformer-engine"),
                "composer": dist("mosaicml"), "llmfoundry": dist("llm-foundry"),
                "foundry_fp8": dist(DISTRIBUTION), "python": platform.python_version()}
    return {"gpu": gpu, "versions": versions}


def run_bench(config: BenchConfig,
              after_each: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """All chosen variants, in order, in this process. Variants that cannot run here are listed
    under `skipped` with the reason, variants that raised under `failed` with the error (and its
    traceback); no number is ever filled in for either. `after_each` gets the result so far after
    every variant, so a run cut off by a time limit keeps the variants it finished."""
    from tqdm import tqdm

    outer = sys.exc_info()[1]  # a caller's, when run_bench is called inside its own `except`
    per_variant = config.warmup + config.steps + config.profile_steps
    rows, skipped, failed = [], [], []
    total = per_variant * len(config.variants)
    bar = (tqdm(total=total, unit="step", desc="bench") if sys.stderr.isatty()
           else _PhaseLines(total))
    with bar, _above_the_bar():
        for i, name in enumerate(config.variants):
            variant = VARIANTS[name]
            reason = skip_reason(variant, config)
            # the row's own words: its label (`fp32` for --tiny's bf16), or the table's `not run`
            bar.set_postfix_str(variant.label(config.tiny) if reason is None
                                else f"{name}: not run: {reason}")
            if reason is not None:
                skipped.append({"name": name, "reason": reason})
            else:
                try:
                    rows.append(run_variant(variant, config, bar))
                except OutputError:  # the terminal or pipe is gone, not the variant
                    raise
                except Exception as err:  # a broken variant must not lose the others' numbers
                    if interrupted_by(err, outer):  # Ctrl-C during an import: stop, as anywhere else
                        raise
                    failed.append({"name": name, "reason": failure_reason(err),
                                   "traceback": traceback.format_exc()})
                finally:
                    _release_memory(config.tiny)
            bar.update((i + 1) * per_variant - bar.n)
            if after_each is not None and i + 1 < len(config.variants):
                after_each(_result(config, rows, skipped, failed, config.variants[i + 1:]))
    return _result(config, rows, skipped, failed)


#: The most characters of a failed variant's error in its row and its stderr line (the JSON
#: keeps the whole traceback).
REASON_CHARS = 600


def failure_reason(err: BaseException) -> str:
    """A failed variant's error in one line: its first line, and where longer than
    REASON_CHARS its start and its end, which holds the fix our own errors close with (cut at
    300 characters, TE's NVTE_BACKWARD_OVERRIDE refusal lost its `(fix: ...)`)."""
    from foundry_fp8.health.table import elide

    first = f"{type(err).__name__}: {err}".splitlines()[0]
    return elide(first, REASON_CHARS) + nvte_not_integer(first)


def command_of(config: BenchConfig) -> str:
    """The `foundry-fp8 bench` command that runs `config` again, from any folder (every option
    spelled out, so a later change of a default does not change what it runs)."""
    argv = ["foundry-fp8", "bench", *(["--tiny"] if config.tiny else []),
            "--variants", ",".join(config.variants), "--seq-len", str(config.seq_len),
            "--batch", str(config.batch), "--micro-batch", str(config.micro_batch),
            "--warmup", str(config.warmup), "--steps", str(config.steps),
            *(["--activation-checkpointing"] if config.activation_checkpointing else []),
            *(["--compile"] if config.compile else []),
            # absolute: the results (and their command) are read from anywhere, `--out` elsewhere
            *(["--yamls", str(config.yamls.resolve())] if config.yamls != YAMLS else [])]
    return shlex.join(argv)


def _result(config: BenchConfig, rows: list[dict[str, Any]], skipped: list[dict[str, Any]],
            failed: list[dict[str, Any]], pending: Sequence[str] = ()) -> dict[str, Any]:
    """The bench's result from the variants run so far, ratios to the bf16 row among them.
    `pending`: the variants not reached yet, so a file left by a bench cut off (Ctrl-C, a time
    limit) says it is partial instead of passing for a run of fewer variants."""
    base = next((r["tokens_per_s"] for r in rows if r["name"] == "bf16"), None)
    for row in rows:
        row["ratio_to_bf16"] = row["tokens_per_s"] / base if base else None
    env = environment(config.tiny)
    return {"gpu": env["gpu"], "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "versions": env["versions"], "variants": rows, "skipped": skipped,
            "failed": failed, "pending": list(pending),
            "setup": {"model": "tiny MPT (CPU, fp32)" if config.tiny else "MPT-1B",
                      "seq_len": config.seq_len, "batch": config.batch,
                      "micro_batch": config.micro_batch, "warmup": config.warmup,
                      "steps": config.steps,
                      "activation_checkpointing": config.activation_checkpointing,
                      "compile": config.compile,
                      "attention": "sdpa", "tiny": config.tiny},
            "command": command_of(config)}


#: The step number the bar's text ends with (`fp32: timed step 4`), which a log leaves out.
_STEP_NUMBER = re.compile(r" step \d+$")


class _PhaseLines:
    """The progress bar where stderr is no terminal (a CI log, a file): one line per variant and
    phase, as `bench [2/24] fp32: timed step 3`, where tqdm's redraw on every step would be a
    line of its own in the log, and a cleared bar around every line the variants print."""

    def __init__(self, total: int):
        self.n, self.total, self._shown = 0, total, ""

    def __enter__(self) -> _PhaseLines:
        return self

    def __exit__(self, *exc_info: object) -> None:
        return None

    def update(self, n: int = 1) -> None:
        self.n += n

    def set_postfix_str(self, text: str) -> None:
        phase = _STEP_NUMBER.sub("", text)
        if phase != self._shown:
            self._shown = phase
            print(f"bench [{self.n}/{self.total}] {text}", file=sys.stderr, flush=True)


class _Lines(io.TextIOBase):
    """A text stream that hands whole lines to `tqdm.write`, which prints them above the bar."""

    def __init__(self, stream: Any):
        super().__init__()
        self.stream, self.pending = stream, ""

    def write(self, text: str) -> int:
        from tqdm import tqdm

        *lines, self.pending = (self.pending + text).split("\n")
        for line in lines:
            tqdm.write(line, file=self.stream)
        return len(text)

    def flush(self) -> None:
        if self.pending:
            self.write("\n")


@contextlib.contextmanager
def _above_the_bar():
    """What the variants print, log or warn (our coverage tables, LLM-Foundry's and
    Transformers' warnings) goes above the progress bar, not into its line."""
    import sys

    streams = {id(sys.stdout): _Lines(sys.stdout), id(sys.stderr): _Lines(sys.stderr)}
    # Handlers made before now hold the real streams (Transformers' does): point them here too.
    loggers = [logging.root, *(logger for logger in logging.Logger.manager.loggerDict.values()
                               if isinstance(logger, logging.Logger))]
    moved = [(h, h.stream) for logger in loggers for h in logger.handlers
             if type(h) is logging.StreamHandler and id(h.stream) in streams]
    for handler, stream in moved:
        handler.setStream(streams[id(stream)])
    out, err = streams[id(sys.stdout)], streams[id(sys.stderr)]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            yield
    finally:
        out.flush()
        err.flush()
        for handler, stream in moved:
            handler.setStream(stream)


def versions_line(result: dict[str, Any]) -> str:
    """What ran, atop the markdown: a package that is absent says so (`TE not installed`, not
    `TE None`); the driver only for a GPU run, the one that asks nvidia-smi for it."""
    v = result["versions"]

    def shown(name: str, absent: str = "not installed") -> str:
        return absent if v.get(name) is None else str(v[name])

    driver = [] if result["setup"]["tiny"] else [f"driver {shown('driver', 'unknown')}"]
    parts = [result["gpu"], *driver, f"CUDA {shown('cuda', 'none (CPU build of torch)')}",
             f"torch {v['torch']}", f"TE {shown('transformer_engine')}",
             f"Composer {shown('composer')}", f"LLM-Foundry {shown('llmfoundry')}",
             f"foundry-fp8 {shown('foundry_fp8')}"]
    return f"{', '.join(parts)}; {result['date']}."


def markdown(result: dict[str, Any]) -> str:
    s = result["setup"]
    base = "fp32" if s["tiny"] else "bf16"  # what the baseline row ran
    lines = [f"# {s['model']} training throughput", "",
             versions_line(result), "",
             f"seq {s['seq_len']}, {s['batch']} sequences/step, micro-batch {s['micro_batch']}, "
             f"{s['warmup']} warm-up + {s['steps']} timed steps, attention `{s['attention']}`, "
             f"activation checkpointing {s['activation_checkpointing']}, "
             f"torch.compile {s['compile']}.", "",
             f"Command: `{result['command']}`", "",
             "MFU = LLM-Foundry's flops per token (3 x (2 x params + attention term)) x tokens/s "
             f"over the H100 SXM dense peak: {PEAK_FLOPS['bf16'] / 1e12:g} TFLOP/s for bf16, "
             f"{PEAK_FLOPS['fp8'] / 1e12:g} TFLOP/s for fp8 variants. HFU adds the recomputed "
             "forward when activation checkpointing is on.", "",
             "Memory: the peak of each variant's fit, and what was still allocated when it "
             "started (on a GPU: what earlier variants in this process left, counted in the "
             "peak too).", "",
             f"| variant | precision | tokens/s | x {base} | MFU | HFU | peak mem GB | at start GB "
             "| loss (first timed -> last) | attention share | micro-batch |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
    def fmt(value: float | None, spec: str) -> str:
        return "n/a" if value is None else format(value, spec)

    for r in result["variants"]:
        lines.append(
            f"| {r['label']} | {r['precision']} | {r['tokens_per_s']:,.0f} | "
            f"{fmt(r['ratio_to_bf16'], '.3f')} | {100 * r['mfu']:.1f}% | {100 * r['hfu']:.1f}% | "
            f"{r['peak_mem_gb']:.2f} | {fmt(r.get('start_mem_gb'), '.2f')} | "
            f"{r['loss_first_timed_step']:.3f} -> {r['loss']:.3f} | "
            f"{fmt(r['attention_share'], '.1%')} | {r['micro_batch']} |")
    for r in result["skipped"]:
        lines.append(f"| {r['name']} | not run: {r['reason']} | | | | | | | | | |")
    for r in result["failed"]:
        lines.append(f"| {r['name']} | FAILED: {r['reason']} | | | | | | | | | |")
    for name in result.get("pending", ()):
        lines.append(f"| {name} | not reached: the bench stopped (or was still running) before "
                     "this variant; these results are partial | | | | | | | | | |")
    lines += stats_cost_lines(result)
    if s["tiny"]:
        lines += ["", "Tiny CPU run: exercises the code path only, in fp32 with te_swap's "
                  "emulated FP8 (the GPU variants' bf16 and amp_fp8 need CUDA). Speeds, MFU "
                  "(against H100 peaks) and memory (process peak RSS) say nothing about H100 "
                  "performance."]
    return "\n".join(lines) + "\n"


def stats_cost_lines(result: dict[str, Any]) -> list[str]:
    """fp8_stats' cost per logging step, from the every-batch row against plain te_swap (the
    timed window is too short for interval 100 to log in it), amortized over its default
    interval."""
    from foundry_fp8.options import Schedule

    interval = Schedule().interval
    rows = {r["name"]: r for r in result["variants"]}
    base, every = rows.get("fp8-te-swap"), rows.get("fp8-te-swap-stats1")
    if base is None or every is None:
        return []
    tokens = result["setup"]["batch"] * result["setup"]["seq_len"]
    step, logging = tokens / base["tokens_per_s"], tokens / every["tokens_per_s"]
    extra = logging - step
    return ["", f"fp8_stats: a logging step takes {logging:.3f} s against {step:.3f} s without "
            f"it ({extra:+.3f} s, {every['label']} vs {base['label']}); amortized over "
            f"{interval} batches (its default interval) that is "
            f"{100 * extra / (interval * step):.2f} % of training time."]


def result_paths(out: Path, tiny: bool, gpu: str) -> tuple[Path, Path]:
    """`mpt-tiny-cpu.{json,md}` for --tiny, `mpt-1b-<gpu>.*` otherwise: a CI run never
    overwrites published GPU results."""
    stem = "mpt-tiny-cpu" if tiny else "mpt-1b-" + re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-")
    return out / f"{stem}.json", out / f"{stem}.md"


def write_results(result: dict[str, Any], out: Path) -> tuple[Path, Path]:
    """The results as JSON and markdown in `out` (`result_paths`), each file replaced whole."""
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = result_paths(out, result["setup"]["tiny"], result["gpu"])
    write_output(json_path, json.dumps(result, indent=2) + "\n")
    write_output(md_path, markdown(result))
    return json_path, md_path


def _micro_batch(value: str) -> int | str:
    if value == "auto":
        return value
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise argparse.ArgumentTypeError(f"a positive integer or 'auto', got {value!r}")
    return number


def _variants(value: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in value.split(",") if n.strip())
    unknown = [n for n in names if n not in VARIANTS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown {', '.join(unknown) or '(none given)'}; choose from "
            + ", ".join(VARIANTS))
    twice = [n for n in dict.fromkeys(names) if names.count(n) > 1]
    if twice:  # two rows of one name: the ratio column would take the first as baseline
        raise argparse.ArgumentTypeError(f"{', '.join(twice)} listed more than once")
    return names


def _default(name: str) -> str:
    """An option's defaults as its help says them: `default 2048 (tiny: 64)`."""
    return f"default {getattr(BenchConfig, name)} (tiny: {getattr(TINY_CONFIG, name)})"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tiny", action="store_true",
                        help="a tiny MPT on CPU in fp32, te_swap on its emulated backend (the CI "
                        "path; the TE-native variants are listed as not run); default off: "
                        "MPT-1B on a CUDA GPU")
    parser.add_argument("--variants", type=_variants, default=BenchConfig.variants,
                        help="comma-separated, from: " + ", ".join(VARIANTS) + "; default all")
    parser.add_argument("--seq-len", type=int, default=None,
                        help=f"tokens per sequence; {_default('seq_len')}")
    parser.add_argument("--batch", type=int, default=None,
                        help=f"sequences per optimizer step; {_default('batch')}")
    parser.add_argument("--micro-batch", type=_micro_batch, default=None,
                        help="sequences per forward, or 'auto' to let Composer fill the GPU "
                        f"(Composer >= {dotted(AUTO_MICROBATCH_CHECKED_FROM)} with FSDP needs "
                        f"torch{UNSHARD_TORCH_RANGE} for it; GPU only); at most --batch; "
                        f"default {BenchConfig.micro_batch}, or --batch where that is smaller")
    parser.add_argument("--warmup", type=int, default=None,
                        help=f"untimed steps first; {_default('warmup')}")
    parser.add_argument("--steps", type=int, default=None,
                        help=f"timed steps; {_default('steps')}")
    parser.add_argument("--activation-checkpointing", action="store_true",
                        help="GPU runs: recompute activations in backward (FSDP activation "
                        "checkpointing, non-reentrant; fp8 variants with te_checkpoint_wrapper) "
                        "and report HFU with the recomputed forward; --tiny has no FSDP and "
                        "ignores it; default off")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile the model (Composer's compile_config); default off")
    parser.add_argument("--yamls", type=Path, default=BenchConfig.yamls, metavar="DIR",
                        help="folder holding mpt-1b-bf16.yaml and mpt-1b-fp8.yaml, to bench your "
                        "own edits of them; default the copies shipped in the package")
    parser.add_argument("--out", type=Path, default=Path("."), metavar="DIR",
                        help="folder for the results (mpt-tiny-cpu.{json,md} with --tiny, else "
                        "mpt-1b-<gpu>.{json,md}); default the current directory")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    tiny = args.tiny
    positive = {"--seq-len": args.seq_len, "--batch": args.batch, "--steps": args.steps}
    for key, value in positive.items():
        if value is not None and value < 1:
            raise ValueError(f"{key} must be >= 1, got {value}")
    if args.warmup is not None and args.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {args.warmup}")

    def pick(value, name):
        return value if value is not None else getattr(TINY_CONFIG if tiny else BenchConfig, name)

    batch = pick(args.batch, "batch")
    micro = _micro_batch_for(args.micro_batch, batch, tiny)
    config = BenchConfig(variants=args.variants, tiny=tiny, seq_len=pick(args.seq_len, "seq_len"),
                         batch=batch, micro_batch=micro,
                         warmup=pick(args.warmup, "warmup"), steps=pick(args.steps, "steps"),
                         # --tiny has no FSDP to checkpoint with: recorded as what ran
                         activation_checkpointing=args.activation_checkpointing and not tiny,
                         compile=args.compile, yamls=args.yamls)
    if config.yamls.exists() and not config.yamls.is_dir():
        raise ValueError(f"--yamls {config.yamls}: {file_kind(config.yamls.stat().st_mode)}, "
                         "not a folder (--yamls names the folder holding mpt-1b-bf16.yaml and "
                         "mpt-1b-fp8.yaml)")
    for path in dict.fromkeys(yaml_path(VARIANTS[name], config) for name in config.variants):
        if not path.is_file():
            raise ValueError(f"--yamls {config.yamls}: no {path.name} there (the bench reads "
                             "mpt-1b-bf16.yaml and mpt-1b-fp8.yaml; the package ships both)")
        check_yaml(path, [VARIANTS[n] for n in config.variants
                          if yaml_path(VARIANTS[n], config) == path], tiny)
    _check_fp8_tokens(config)
    _check_memory(config, memory_limit(), "host memory")
    return config


def _micro_batch_for(asked: int | str | None, batch: int, tiny: bool) -> int | str:
    """The micro-batch to run. Composer runs one larger than the batch as the whole batch
    (data_spec.py _split_tensor: "no splitting will be done"), so an explicit one is refused
    rather than recorded as a size that did not run; the default is cut to the batch (bench.md
    says so, and the results record the size that ran)."""
    if asked is None:
        return min(BenchConfig.micro_batch, batch)
    if asked == "auto":
        if tiny:  # composer/trainer/trainer.py _is_auto_microbatching: GPU only
            raise ValueError("--micro-batch auto: Composer's auto micro-batching runs on a GPU "
                             "only, and --tiny runs on CPU; give a number")
        return asked
    if asked > batch:
        raise ValueError(f"--micro-batch {asked} is larger than --batch {batch}: Composer would "
                         f"run each batch of {batch} whole; give at most {batch}")
    return asked


def _micro_batch_sizes(config: BenchConfig) -> list[int]:
    """The sizes Composer splits each batch into: the micro-batch, and the rest when it does
    not divide the batch (torch.split, data_spec.py _split_tensor)."""
    if not isinstance(config.micro_batch, int):
        return []
    rest = config.batch % config.micro_batch
    return [config.micro_batch] + ([rest] if rest else [])


def _check_fp8_tokens(config: BenchConfig) -> None:
    """TE asserts that an FP8 GEMM's tokens (micro-batch x sequence length) are a multiple of
    FP8_TOKEN_MULTIPLE (lint rule FP8006): an FP8 variant would fail only after building its
    model, so the options are refused first. The emulated backend follows TE's rule too."""
    if not any(VARIANTS[n].yaml == "fp8" for n in config.variants):
        return
    for size in _micro_batch_sizes(config):
        tokens = size * config.seq_len
        if not tokens_fit_fp8(tokens):
            part = "" if size == config.micro_batch else \
                f" (the last micro-batch of each step: --batch {config.batch} leaves {size})"
            raise ValueError(f"--seq-len {config.seq_len}: {size} x {config.seq_len} = {tokens} "
                             f"tokens per micro-batch{part} is not a multiple of "
                             f"{FP8_TOKEN_MULTIPLE}, as TE's FP8 GEMMs require (FP8006); pick "
                             f"--seq-len and --micro-batch whose product is a multiple of "
                             f"{FP8_DIM_MULTIPLE}")


def _positive_int(model: dict[str, Any], key: str) -> int:
    """`model[key]` where it is a positive integer, else 0: a key the YAML leaves to
    LLM-Foundry's default adds nothing to the lower bound."""
    value = model.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def least_memory(config: BenchConfig) -> dict[str, list[tuple[str, int]]]:
    """What the run certainly allocates at once, as (what, bytes) parts by where it lives:
    "host memory" (the synthetic batches, all made before training; under --tiny also the
    activations) and "GPU memory" (one micro-batch's activations). A lower bound: it counts the
    logits (and the log-softmax torch's cross entropy keeps for backward), and each block's MLP
    up-projection output its GELU keeps (not with activation checkpointing), at 4 bytes an
    element in --tiny's fp32 and 2 (bfloat16) on a GPU. A typo (`--seq-len 2048000`) is then
    refused before anything is allocated, not met by the kernel's OOM killer or a CUDA
    out-of-memory error in every variant in turn."""
    steps = config.warmup + config.steps + config.profile_steps
    sequences = config.micro_batch if isinstance(config.micro_batch, int) else 1  # auto: >= 1
    tokens = sequences * config.seq_len
    size = 4 if config.tiny else 2
    per_token = 0
    for name in config.variants:
        model = model_config(VARIANTS[name], config)
        mlp = 0 if config.activation_checkpointing else (
            _positive_int(model, "n_layers") * _positive_int(model, "expansion_ratio")
            * _positive_int(model, "d_model"))
        # torch's cross entropy keeps the log-softmax, a second copy of the logits; flash-attn's
        # (LLM-Foundry's default loss_fn, fused_crossentropy) does not
        copies = 2 if model.get("loss_fn") == "torch_crossentropy" else 1
        per_token = max(per_token, (copies * _positive_int(model, "vocab_size") + mlp) * size)
    batches = (f"the synthetic batches ({steps} steps with warm-up and profiling, x "
               f"{config.batch} sequences of {config.seq_len} tokens, ids and labels, all made "
               "before training)",
               steps * config.batch * config.seq_len * 2 * 8)
    activations = (f"one micro-batch's activations ({sequences} x {config.seq_len} tokens: the "
                   "logits, and each MLP's up-projection)",
                   tokens * per_token)
    if config.tiny:
        return {"host memory": [activations, batches]}
    return {"host memory": [batches], "GPU memory": [activations]}


def _gb(n: int) -> str:
    return f"{n / 2**30:,.1f} GB"


def _check_memory(config: BenchConfig, available: int | None, where: str) -> None:
    """ValueError naming the options when `least_memory`'s parts for `where` exceed
    `available` bytes (None: unknown, nothing refused)."""
    parts = least_memory(config)[where]
    needed = sum(n for _, n in parts)
    if available is None or needed <= available:
        return
    large = [part for part in sorted(parts, key=lambda p: -p[1]) if part[1] >= 2**30 / 20]
    micro = f" --micro-batch {config.micro_batch}" if isinstance(config.micro_batch, int) else ""
    raise ValueError(
        f"--seq-len {config.seq_len} --batch {config.batch}{micro} --steps {config.steps}: the "
        f"run needs at least {_gb(needed)} of {where}, more than the {_gb(available)} here: "
        + "; ".join(f"{_gb(n)} for {what}" for what, n in large or parts)  # not 0.0 GB ones
        + "; lower --seq-len, --batch, --micro-batch or --steps")


def notes(config: BenchConfig, args: argparse.Namespace) -> list[str]:
    """What runs other than the options say, in one line each (printed before the run)."""
    said = []
    if args.activation_checkpointing and config.tiny:
        said.append("--activation-checkpointing: not applied under --tiny (no FSDP on CPU); "
                    "the results record it off")
    fp8 = [n for n in config.variants if VARIANTS[n].yaml == "fp8"]
    odd = [size * config.seq_len for size in _micro_batch_sizes(config)
           if not dim_fits_fp8(size * config.seq_len)]
    if fp8 and odd:
        said.append(f"--seq-len {config.seq_len}: {odd[0]} tokens per micro-batch is a multiple "
                    f"of {FP8_TOKEN_MULTIPLE} but not of {FP8_DIM_MULTIPLE}: TE's own tests run "
                    f"FP8 only on multiples of {FP8_DIM_MULTIPLE}, and its weight-gradient GEMM may refuse it "
                    "(FP8006, a warning: not run on a GPU)")
    return said


#: How a message names the type a key needs.
_A = {dict: "a mapping", str: "a string", int: "an integer"}


def _needed(variants: Sequence[Variant], tiny: bool) -> dict[str, tuple[type, str]]:
    """The keys `load_config` and `run_variant` read from a variant's YAML: key -> (type, why)."""
    needed = {"model": (dict, "the bench builds the model from it"),
              "model.name": (str, "LLM-Foundry's model registry name"),
              "optimizer": (dict, "the bench builds the optimizer from it"),
              "optimizer.name": (str, "LLM-Foundry's optimizer registry name"),
              "algorithms.gradient_clipping": (dict, "every variant clips gradients with it")}
    if not tiny:  # --tiny sets these itself
        needed.update({"model.vocab_size": (int, "the synthetic batches' token range"),
                       "precision": (str, "the variant's Composer precision")})
    swapping = [v.name for v in variants if v.te_swap]
    if swapping:
        needed["algorithms.te_swap"] = (dict, f"the {swapping[0]} variant reads it")
    return needed


def check_yaml(path: Path, variants: Sequence[Variant], tiny: bool) -> None:
    """Load a bench YAML as `load_config` will and check the keys the bench reads, before any
    heavy import: ValueError, one line naming file and line (the linter's loader gives them),
    rather than a parser error or a bare KeyError from inside the first variant."""
    from foundry_fp8.lint.config import get
    from foundry_fp8.lint.load import LintInputError, load_config, position_of

    try:
        loaded = load_config(path)
    except LintInputError as err:
        raise ValueError(str(err)) from None
    for key, (kind, why) in _needed(variants, tiny).items():
        line = (position_of(key, loaded.positions) or (1,))[0]
        value = get(loaded.config, key)
        if value is None:
            raise ValueError(f"{path}:{line}: {key}: "
                             f"{'null' if key in loaded.positions else 'missing'} ({why})")
        if not isinstance(value, kind) or isinstance(value, bool):
            raise ValueError(f"{path}:{line}: {key}: expected {_A[kind]}, got {value!r:.40}")



def _auto_microbatch_refusal(config: BenchConfig) -> str | None:
    """Why `--micro-batch auto` cannot run here: the YAMLs shard with FSDP, and this Composer's
    auto micro-batching under FSDP raises NameError with this torch (lint rule FP8031)."""
    from importlib.metadata import version

    import torch

    if config.micro_batch != "auto" or not auto_microbatch_fsdp_fails(version("mosaicml"),
                                                                     torch.__version__):
        return None
    return (f"--micro-batch auto: Composer {version('mosaicml')}'s auto micro-batching under "
            f"FSDP raises NameError with torch {torch.__version__} ({AUTO_MICROBATCH_SOURCE}); "
            "give a number, e.g. --micro-batch 8")


def gpu_memory() -> int | None:
    """The first CUDA GPU's memory in bytes; None where torch cannot read it (nothing is then
    refused up front: a variant's own CUDA error says what is wrong)."""
    import torch

    try:
        return torch.cuda.get_device_properties(0).total_memory
    except RuntimeError:  # "Found no NVIDIA driver", a GPU lost since is_available()
        return None


def no_gpu_reason(torch_version: str, torch_cuda: str | None) -> str:
    """Why torch sees no CUDA GPU, as far as this process can tell: "no CUDA GPU" alone sends a
    user on a GPU machine to --tiny, where the cause is torch's CPU build or a
    CUDA_VISIBLE_DEVICES that hides every GPU (nvidia-smi ignores it; CUDA does not)."""
    if torch_cuda is None:
        return (f"no CUDA GPU for torch {torch_version}, its CPU build (torch.version.cuda is "
                "None), which uses none even where there is one: on a GPU machine install a "
                "CUDA build of torch (`foundry-fp8 doctor` says which CUDA the driver takes)")
    hiding = os.environ.get("CUDA_VISIBLE_DEVICES")
    if hiding is not None and hides_every_gpu(hiding):
        return (f"no CUDA GPU: CUDA_VISIBLE_DEVICES={hiding!r} hides every GPU "
                "from CUDA; unset it, or list the GPUs to run on (CUDA_VISIBLE_DEVICES=0)")
    return "no CUDA GPU (torch.cuda.is_available() is False; `foundry-fp8 doctor` says why)"


def _error(message: str) -> None:
    """One line on stderr, as every subcommand's errors: paths and reasons escaped onto it."""
    import sys

    from foundry_fp8.health.table import one_line

    print(f"foundry-fp8 bench: {one_line(message)}", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except ValueError as err:
        _error(str(err))
        return 2
    for note in notes(config, args):
        _error(note)
    if not config.tiny:
        import torch

        if not torch.cuda.is_available():
            _error(f"{no_gpu_reason(torch.__version__, torch.version.cuda)}; use --tiny for "
                   "the CPU path")
            return 2
        try:  # the activations of one micro-batch must fit on the GPU
            _check_memory(config, gpu_memory(), "GPU memory")
        except ValueError as err:
            _error(str(err))
            return 2
        refusal = _auto_microbatch_refusal(config)
        if refusal is not None:
            _error(refusal)
            return 2
    out = args.out
    if out.exists() and not out.is_dir():
        _error(f"--out {out}: {file_kind(out.stat().st_mode)}, not a folder (--out names the "
               "folder the results go to)")
        return 2
    try:  # a folder that cannot be written fails now, not after the benchmark has run
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        _error(f"--out {out}: cannot create the folder: {err.strerror or err}")
        return 2
    try:  # an existing one too: mkdir(exist_ok=True) asks nothing of a read-only folder
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as err:
        _error(f"--out {out}: cannot write in the folder: {err.strerror or err}")
        return 2
    try:  # and so does a FIFO or folder where a result goes
        for path in result_paths(out, config.tiny, gpu_name(config.tiny)):
            check_output(path)
    except OSError as err:
        _error(f"--out {out}: {err.filename}: {err.strerror}")
        return 2
    def keep(partial: dict[str, Any]) -> None:
        with contextlib.suppress(OSError):  # the final write says why, in one line
            write_results(partial, out)

    result = run_bench(config, after_each=keep)
    try:
        json_path, md_path = write_results(result, out)
    except OSError as err:
        print(markdown(result))
        _error(f"--out {out}: results not written: {err}")
        return 2
    print(markdown(result))
    print(f"wrote {json_path} and {md_path}")
    for r in result["failed"]:
        _error(f"{r['name']} failed: {r['reason']}")
    if not result["variants"] and not result["failed"]:
        _error("no variant ran (see 'not run' above)")
    return 1 if result["failed"] or not result["variants"] else 0
