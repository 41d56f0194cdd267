"""fp8_stats' `te_debug` on a model built before fp8_stats (a Composer script's order): TE turns
its debug API on only when a TE module is built while a session exists (`TEDebugState.initialize`
in `TransformerEngineBaseModule.__init__`, pytorch/module/base.py:922-923 in 2.20.2), and its
forwards compute statistics only while `TEDebugState.debug_enabled` is true (`is_debug_iter`,
base.py:1979-1985). Here on the real nvdlfw-inspect with the stand-in TE (whose TEDebugState,
like TE's, nothing but a module's construction sets); on TE itself in tests/test_te_debug_gpu.py.
"""

from __future__ import annotations

import sys

from foundry_fp8.te.debug import TEDebugSession
from tests.test_a24_te_debug_lifetime import CONFIG, te_features  # noqa: F401 (fixture)


def test_a_model_built_before_the_session_gets_tes_statistics(te_features, tmp_path):  # noqa: F811
    te = sys.modules["transformer_engine.pytorch"]
    state = sys.modules["transformer_engine.debug.pytorch.debug_state"].TEDebugState
    layer = te.Linear(16, 16, device="cpu")  # built before fp8_stats: TE's flag stays None
    session = TEDebugSession(CONFIG, tmp_path / "te", lambda name, value, step: None)
    session.start()
    session.name_layers([("blocks.0.fc", layer), ("norm", te.LayerNorm(16, device="cpu"))])
    assert layer.name == "blocks.0.fc"
    assert state.debug_enabled is True  # was None: every forward skipped TE's statistics
    session.pause()
    assert state.debug_enabled is False
    session.name_layers([("blocks.0.fc", layer)])  # paused (an evaluation): left paused
    assert state.debug_enabled is False
    session.close()
    state.debug_enabled = None
    session.name_layers([("blocks.0.fc", layer)])  # a closed session turns nothing on
    assert state.debug_enabled is None


class _TEDebugState:
    """TE's flag and its `initialize` (debug/pytorch/debug_state.py:23-39 in 2.20.2), which a TE
    module calls when built while the flag is not true (pytorch/module/base.py:922-923)."""

    debug_enabled: bool | None = None

    @classmethod
    def initialize(cls) -> None:
        if "nvdlfw_inspect" in sys.modules:
            import nvdlfw_inspect.api as debug_api

            if cls.debug_enabled is False and debug_api.DEBUG_MANAGER is not None:
                raise RuntimeError("[nv_dlfw_inspect] nv_dlfw_inspect module should be "
                                   "initialized before initialization of the first TE module")
            cls.debug_enabled = debug_api.DEBUG_MANAGER is not None


def _build_te_module(state: type[_TEDebugState]) -> None:
    if not state.debug_enabled:  # TransformerEngineBaseModule.__init__
        state.initialize()


def test_te_modules_built_without_a_session_do_not_make_te_refuse_the_next(
        te_features, tmp_path, monkeypatch):  # noqa: F811
    """nvdlfw-inspect imported (a test module, an earlier run) and TE modules built without a
    session leave TE's flag False; TE then refused the first module built in the next
    fp8_stats' session. On the GPU: the whole `tests/` collected (test_a24's import), the GPU
    tests before test_te_debug_gpu.py built te.Linear, and its first test would fail so (the
    next ones start after that test's `TEDebugState._reset()`)."""
    module = sys.modules["transformer_engine.debug.pytorch.debug_state"]
    monkeypatch.setattr(module, "TEDebugState", _TEDebugState)
    monkeypatch.setattr(_TEDebugState, "debug_enabled", None)
    _build_te_module(_TEDebugState)  # no session yet
    assert _TEDebugState.debug_enabled is False
    session = TEDebugSession(CONFIG, tmp_path / "te", lambda name, value, step: None)
    session.start()
    try:
        _build_te_module(_TEDebugState)  # the run's model
        assert _TEDebugState.debug_enabled is True
    finally:
        session.close()
