"""`make run`'s fp8_guard step shows the fault run's guard lines, not LLM-Foundry's config dump."""
from pathlib import Path

from omegaconf import OmegaConf as om

from foundry_fp8.fault import guard_lines

YAML = Path(__file__).parent.parent / "yamls" / "mpt-tiny-cpu.yaml"

# Two lines of a real fault run's log (`make run`, 2026-11-29): the guard's warning and the
# header of its table.
WARNING = ("2026-11-29 17:50:13,544: rank0[16279][MainThread]: WARNING: "
           "foundry_fp8.composer.guard: fp8_guard: layer 'blocks.1.attn.out_proj' runs in high "
           "precision from step 16 on (3.1 % of the linear FLOPs)")
TABLE = "| layer | from step | until | FLOPs share | flagged for |"
# fp8_guard's own failure lines (composer/guard.py's log.error format strings, as logged)
FAILED = ("2026-11-29 17:50:13,544: rank0[16279][MainThread]: ERROR: foundry_fp8.composer.guard: "
          "fp8_guard failed on this rank (its error above); it is off from now on, on every rank "
          "(layers already in fallback stay in high precision)")
FAILED_STRICT = ("2026-11-29 17:50:13,544: rank0[16279][MainThread]: ERROR: "
                 "foundry_fp8.composer.guard: fp8_guard failed: RuntimeError('x')")


def test_the_config_dump_is_left_out_and_the_guard_lines_kept() -> None:
    cfg = om.load(YAML)
    cfg.callbacks.fp8_guard = {"consecutive": 3}
    # LLM-Foundry's `log_config` prints `om.to_yaml(cfg)` (llmfoundry/utils/config_utils.py:634)
    dump = om.to_yaml(cfg)
    assert any(line.strip() == "fp8_guard:" for line in dump.splitlines())
    kept = [WARNING, FAILED, FAILED_STRICT,
            "foundry_fp8 fp8_guard: layers moved to high precision", TABLE]
    assert guard_lines("\n".join([dump, *kept])) == kept
