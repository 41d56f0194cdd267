"""TE 2.20.2 facts the GPU tests rely on, pinned on the CPU with the real TE where it imports
(TE builds no module without CUDA, module/base.py:895-896, but its recipes, autocast keys and
debug features are plain Python); skipped without it. Read against the 2.20.2 wheel."""

from __future__ import annotations

import inspect

import pytest

from foundry_fp8.te.debug import (
    CURRENT_STATS,
    DELAYED_STATS,
    TEDebugSession,
    log_fp8_tensor_stats_config,
)


@pytest.fixture(scope="module")
def te():
    """transformer_engine.pytorch, or a skip: a TE without its torch extension raises
    FileNotFoundError (an OSError) at import, not ImportError."""
    try:
        import transformer_engine.pytorch as te
    except (ImportError, OSError) as error:
        pytest.skip(f"TransformerEngine does not import here: {error}")
    return te


def test_the_runs_delayed_recipe_and_tes_default_share_one_autocast_key(te):
    """Why te_high_precision hands its region the run's recipe (test_te_gpu's
    test_a_fallback_region_keeps_the_runs_amax_compute_algo): TE 2.20.2 keys each autocast's
    recipe by its repr (quantization.py:715-727), which leaves out amax_compute_algo
    (common/recipe/__init__.py:272-282), and a region given no recipe stores TE's default
    DelayedScaling() under that key (quantization.py:740-745), the one the outermost exit then
    updates with (quantization.py:675)."""
    from transformer_engine.common.recipe import DelayedScaling, Format
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    run = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=1024,
                         amax_compute_algo="most_recent")
    key = FP8GlobalStateManager.get_unique_autocast_key
    assert key(run) == key(DelayedScaling())
    assert DelayedScaling().amax_compute_algo == "max"
    assert key(DelayedScaling(amax_history_len=16)) != key(DelayedScaling())


def test_the_entry_points_the_gpu_tests_call_take_their_keywords(te):
    """test_te_gpu patches `reduce_and_update_fp8_tensors` with a `(cls, forward=True)`
    classmethod and enters `te.autocast(enabled=, recipe=)`; `te.distributed.checkpoint` and
    `te.checkpoint` are one function (pytorch/__init__.py:66)."""
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    update = inspect.signature(FP8GlobalStateManager.reduce_and_update_fp8_tensors)
    assert list(update.parameters) == ["forward"]
    assert update.parameters["forward"].default is True
    assert {"enabled", "recipe"} <= set(inspect.signature(te.autocast).parameters)
    assert te.distributed.checkpoint is te.checkpoint


def test_tes_log_fp8_tensor_stats_takes_every_statistic_we_ask_for(te, tmp_path):
    """The stats fp8_stats' te_debug asks for pass LogFp8TensorStats' own check
    (debug/features/log_fp8_tensor_stats.py:165-224), under each recipe it asks them for; an
    unsupported one would fail the first logged forward on the GPU. `overflows%` only under
    delayed scaling (:208-209), which is why CURRENT_STATS leaves it out."""
    pytest.importorskip("nvdlfw_inspect")
    config = log_fp8_tensor_stats_config(r"^lin$", ["activation", "weight", "gradient"], freq=1)
    session = TEDebugSession(config, tmp_path, lambda name, value, step: None)
    session.start()  # nvdlfw-inspect registers TE's features only in a session
    try:
        from transformer_engine.debug.features.log_fp8_tensor_stats import LogFp8TensorStats

        feature = LogFp8TensorStats()
        for stats, recipe in ((DELAYED_STATS, "fp8_delayed_scaling"),
                              (CURRENT_STATS, "fp8_current_scaling")):
            for stat in stats:
                assert feature.check_if_stat_is_supported(stat, recipe, True), (stat, recipe)
        with pytest.raises(ValueError, match="unsupported stat name"):
            feature.check_if_stat_is_supported("overflows%", "fp8_current_scaling", True)
    finally:
        session.close()



def test_on_the_kits_torch_te_linear_has_no_compiled_op(te):
    """Why test_te220_compile_gpu expects te.Linear refused under fullgraph on the kit (torch
    2.11.0): TE 2.20.2 registers its quantizers as opaque types with
    `torch._library.opaque_object.is_opaque_constant_type`
    (dynamo/custom_op.py:296-306, quantizer_opaque.py:117-137),
    which torch 2.11.0 lacks, so it records compile support off and `_linear_op` stays None
    (dynamo/custom_op.py:1233-1249); te.Linear's forward then calls `_linear_eager`, which is
    `@no_torch_dynamo()` (module/linear.py:1894), a graph break fullgraph refuses. With the op
    (a newer torch), current scaling's quantizer would be value-opaque
    (tensor/float8_tensor.py:437) and te.Linear could compile: FP8050 would then be wrong."""
    import torch
    from transformer_engine.pytorch.dynamo.quantizer_opaque import _VALUE_OPAQUE_QUALNAMES
    from transformer_engine.pytorch.module import linear

    if not torch.__version__.startswith("2.11."):
        pytest.skip(f"pins TE 2.20.2 on the kit's torch 2.11, not {torch.__version__}")
    assert linear._linear_op is None
    assert _VALUE_OPAQUE_QUALNAMES == set()
