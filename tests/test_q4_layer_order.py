"""The model's layer order for the report from any sink (QA Q4, s22): fp8_stats records it as
hyperparameters (`health.keys.LAYER_ORDER`), in parts each within MLflow's param limit; a run
without the record is ordered by name where its sink kept no order (W&B, MLflow), said once.
The three sinks of one real run: tests/test_report_mlflow.py."""

from __future__ import annotations

import ast
import json

from foundry_fp8.composer.destinations import HPARAM_MAX_CHARS
from foundry_fp8.health import RunMetrics
from foundry_fp8.health.keys import LAYER_ORDER, by_name, layer_order, layer_order_params
from foundry_fp8.report.read import in_model_order

#: MPT's linear layers in forward order, 100 blocks: 400 names, 10,160 characters as a list
FORWARD = [f"blocks.{b}.{layer}" for b in range(100)
           for layer in ("attn.Wqkv", "attn.out_proj", "ffn.up_proj", "ffn.down_proj")]


def test_a_long_layer_list_is_logged_in_parts_each_within_mlflows_limit_and_read_back():
    assert len(str(FORWARD)) == 10_160 > HPARAM_MAX_CHARS
    params = layer_order_params(FORWARD, HPARAM_MAX_CHARS)
    assert sorted(params) == [LAYER_ORDER, f"{LAYER_ORDER}.2"]
    # MLflow keeps str(value) (composer's MLFlowLogger: mlflow.log_params), cut at its limit
    assert all(len(str(value)) <= HPARAM_MAX_CHARS for value in params.values())
    assert layer_order({k: ast.literal_eval(str(v)) for k, v in params.items()}) == FORWARD
    assert layer_order(json.loads(json.dumps(params))) == FORWARD  # hparams.json, W&B's config
    # a part lost (a logger that failed, a cut value) is no order, not a wrong one
    assert layer_order({k: v for k, v in params.items() if not k.endswith(".2")}) is None
    assert layer_order({**params, f"{LAYER_ORDER}.2": str(params[f"{LAYER_ORDER}.2"])[:100]}) \
        is None
    assert layer_order_params(["x" * HPARAM_MAX_CHARS], HPARAM_MAX_CHARS) == {}


def _run(layers: list[str]) -> RunMetrics:
    run = RunMetrics()
    for layer in layers:
        for tensor in ("activation", "gradient"):
            run.add(0, layer, tensor, "underflow_pct", 0.0)
    run.tidy()
    return run


def test_the_record_orders_the_layers_and_their_values_whatever_order_the_sink_gave():
    scrambled = FORWARD[::-7] + [name for name in FORWARD if name not in FORWARD[::-7]]
    run, said = _run(scrambled), []
    in_model_order(run, layer_order_params(FORWARD, HPARAM_MAX_CHARS), "w", "W&B's history",
                   said.append)
    assert run.layers == FORWARD and not said
    assert list(dict.fromkeys(layer for layer, _, _ in run.values)) == FORWARD


def test_without_a_record_an_unordered_sink_goes_by_name_and_says_so_a_jsonl_keeps_its_order():
    logged = ["blocks.10.ffn.up_proj", "blocks.2.ffn.up_proj", "blocks.2.attn.Wqkv"]
    run, said = _run(logged), []
    in_model_order(run, {}, "run.wandb", "W&B's history", said.append)
    assert run.layers == ["blocks.2.attn.Wqkv", "blocks.2.ffn.up_proj", "blocks.10.ffn.up_proj"]
    assert len(said) == 1 and said[0].startswith("run.wandb: no record of the model's layer order")
    run, said = _run(logged), []
    in_model_order(run, {"seed": 1}, "metrics.jsonl", None, said.append)  # the order logged
    assert run.layers == logged and not said
    assert sorted(["a.²", "a.10", "a.9", "a"], key=by_name) == ["a", "a.9", "a.10", "a.²"]


def test_a_corrupt_part_count_is_no_order_and_looks_up_no_more_keys_than_there_are():
    """QA F2 s22: `parts: 10**9` made `layer_order` look up 10**9 keys (the report hung)."""

    class Counted(dict):
        lookups = 0

        def get(self, key, default=None):
            Counted.lookups += 1
            if Counted.lookups > 10:
                raise AssertionError(f"looked up {key!r}: more keys than the hyperparameters hold")
            return super().get(key, default)

    params = layer_order_params(FORWARD, HPARAM_MAX_CHARS)
    for parts in (10**9, 3, 0, -1):
        Counted.lookups = 0
        bad = Counted({**params, LAYER_ORDER: {**params[LAYER_ORDER], "parts": parts}})
        assert layer_order(bad) is None, parts
    assert layer_order(Counted(params)) == FORWARD
