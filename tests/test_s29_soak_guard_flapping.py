"""fp8_guard over a long run whose layer keeps falling back and coming back (`repromote_after`).
Its checkpoint entry and memory are meant to stay bounded: a layer's last KEPT_DECISIONS pairs
whole, older ones counted in one summary. But every fold also retired the keys of the records
and the summary it dropped, logged or not, so that no later record reuses one; only a layer's
first pairs and its summaries at 1, 2, 4, ... pairs are ever logged, and the rest no logger
holds. The retired keys grew by three a pair (about 150 bytes in the checkpoint's JSON each
pair: 548 keys after 50 pairs of 4 layers, 4748 after 400, 56 kB to 266 kB of checkpoint), so
a layer flipping every 6 logging steps at interval 10 added some 250 kB per 100k batches. Now
only logged keys are retired: their number grows with the log of the pairs, and every key
logged keeps its value, also across a `fit(reset_time=True)`."""

from __future__ import annotations

import json
from typing import Any

from foundry_fp8.guard import GuardConfig, GuardCore
from tests.test_guard import REPROMOTION_FLOPS, _table

CONFIG = GuardConfig(consecutive=2, repromote_after=3, max_fallback_share=0.5)


def _flap(core: GuardCore, cycles: int, logged: dict[str, Any]) -> None:
    """`a` bad 2 logging steps of every 5 (back in FP8 after 3 healthy ones), from step 0;
    every record logged is noted in `logged`, which must never see a key change value."""
    for step in range(5 * cycles):
        table = _table({"a"} if step % 5 < 2 else set(), ("a", "b"))
        core.decide(step, core.candidates(step, table), table)
        core.repromote(step, core.ready(step, table), table)
        for key, value in core.records().items():
            assert logged.setdefault(key, value) == value, key


def _checkpoint(core: GuardCore) -> str:
    return json.dumps(core.state_dict())


def test_a_layer_flapping_all_run_keeps_a_checkpoint_that_grows_with_the_log_of_its_pairs():
    sizes = []
    for cycles in (32, 64, 128):
        core = GuardCore(CONFIG, REPROMOTION_FLOPS)
        _flap(core, cycles, {})
        assert core.summaries["a"].pairs == cycles - 1 - 4 + 1  # the last is whole, 4 kept
        sizes.append((len(json.loads(_checkpoint(core))["retired"]), len(_checkpoint(core))))
    # one more summary key logged (and retired) per doubling: was 3 keys a pair
    (r32, b32), (r64, b64), (r128, b128) = sizes
    assert r64 - r32 == 1 and r128 - r64 == 1, sizes
    assert b128 - b32 < 200, sizes


def test_the_keys_logged_over_two_fits_keep_their_values_and_a_resume_gives_the_same():
    """The second fit restarts its steps (`reset_time`): its records and summaries meet step
    numbers of the first fit's, logged and unlogged. No logged key changes value, and a core
    resumed from a checkpoint mid-fit logs what the uninterrupted one logs."""
    logged: dict[str, Any] = {}
    straight = GuardCore(CONFIG, REPROMOTION_FLOPS)
    _flap(straight, 24, logged)
    saved = _checkpoint(straight)
    _flap(straight, 24, logged)
    resumed = GuardCore(CONFIG, REPROMOTION_FLOPS)
    resumed.load_state_dict(json.loads(saved))
    again: dict[str, Any] = {key: logged[key] for key in resumed.records()}
    _flap(resumed, 24, again)
    assert again.items() <= logged.items()
    assert resumed.records() == straight.records()
    assert _checkpoint(resumed) == _checkpoint(straight)
    # the run's first pairs whole (the second fit's are past them) and the summaries at powers
    # of 2 pairs
    assert sum(k.startswith("fp8/guard/fallback/a") for k in logged) == 4
    assert sum(k.startswith("fp8/guard/summary/a") for k in logged) == 6  # 1, 2, ..., 32
