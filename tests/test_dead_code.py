"""No dead code (issue 15): `vulture` over the package and its scripts and benchmarks (the
tests do not count as users: code only a test calls is dead too), with a short allow-list of
names something outside Python's view calls. Skipped where vulture is not installed (it is in
the `test` extra)."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

#: (file, name) -> who uses it.
ALLOWED = {
    # called by frameworks, not by our code
    ("foundry_fp8/__init__.py", "__getattr__"): "Python: lazy public names (PEP 562)",
    ("foundry_fp8/composer/lint.py", "FP8Lint"): "setup.cfg entry point fp8_lint",
    ("foundry_fp8/composer/te_swap.py", "_precision_config"): "Composer's State reads it",
    ("foundry_fp8/te/debug.py", "log_scalar"): "nvdlfw-inspect's logger interface",
    ("foundry_fp8/tools/tiny_data.py", "pre_tokenizer"): "tokenizers reads it",
    ("foundry_fp8/tools/tiny_data.py", "decoder"): "tokenizers reads it",
    ("foundry_fp8/tools/tiny_data.py", "description"): "argparse",
    ("foundry_fp8/tools/tiny_data.py", "formatter_class"): "argparse",
    ("foundry_fp8/fault.py", "fp8_guard"): "a train config llmfoundry reads",
    ("foundry_fp8/fault.py", "inject_outlier"): "a train config llmfoundry reads",
    ("foundry_fp8/fault.py", "save_interval"): "a train config llmfoundry reads",
    # public API for users' own training loops (README)
    ("foundry_fp8/numerics.py", "tensor_stats"): "public API (foundry_fp8.tensor_stats)",
    ("foundry_fp8/numerics.py", "quantize_dequantize"): "public API (foundry_fp8.quantize_dequantize)",
    ("foundry_fp8/plain_state.py", "fp8_state_dict"): "public API (foundry_fp8.fp8_state_dict)",
    ("foundry_fp8/plain_state.py", "load_fp8_state_dict"):
        "public API (foundry_fp8.load_fp8_state_dict)",
}


def _composer_events() -> set[str]:
    """Composer calls a Callback's (and LoggerDestination's) method named after each Event."""
    from composer.core import Event

    return {event.value for event in Event} | {"run_event"}


def _unused() -> dict[tuple[str, str], str]:
    vulture = pytest.importorskip("vulture")
    events = _composer_events()
    scan = vulture.Vulture(ignore_decorators=["@rule"])  # lint rules register where defined
    scan.scavenge([str(REPO / p) for p in ("foundry_fp8", "scripts", "benchmarks")])
    return {(str(Path(item.filename).resolve().relative_to(REPO)), item.name):
            f"{item.filename}:{item.first_lineno}: unused {item.typ} {item.name!r}"
            for item in scan.get_unused_code(min_confidence=60)
            if not (item.typ == "method" and item.name in events)}


def test_no_dead_code():
    dead = {k: v for k, v in _unused().items() if k not in ALLOWED}
    assert not dead, "dead code (remove it, or allow-list what calls it):\n" + "\n".join(
        sorted(dead.values()))


def test_the_allow_list_holds_only_what_vulture_reports():
    stale = sorted(set(ALLOWED) - set(_unused()))
    assert not stale, f"no longer reported, remove from ALLOWED: {stale}"
