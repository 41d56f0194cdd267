"""TE's FP8 GEMM leading-dim check (from TE 2.9, "Leading dimension requirement on A for FP8
GEMM. Caller must pad.", common/gemm/cublaslt_gemm.cu:146-148 at v2.9, :160-162 at v2.18, absent
at v2.8) has one home, `te.facts`: the lint rules that cite it (FP8005, FP8006) quote it from
there instead of each writing the version and the message."""

from __future__ import annotations

import inspect

from foundry_fp8.lint.rules import LintContext, lint_config
from foundry_fp8.lint.rules import model as model_rules
from foundry_fp8.lint.rules import train as train_rules
from foundry_fp8.te.facts import TE_GEMM_LEADING_DIM_ERROR, TE_GEMM_LEADING_DIM_FROM, dotted

CONFIG = {"precision": "amp_fp8", "max_seq_len": 1000, "device_train_microbatch_size": 1,
          "model": {"name": "mpt_causal_lm", "fc_type": "te", "d_model": 2048, "n_heads": 16,
                    "n_layers": 2, "expansion_ratio": 4, "max_seq_len": 1000},
          "train_loader": {"name": "text", "dataset": {"local": "./c4", "split": "train",
                                                       "max_seq_len": 1000}}}


def test_fp8006_quotes_te_s_message_and_version_from_facts() -> None:
    [hit] = [f for f in lint_config(CONFIG, LintContext()) if f.rule == "FP8006"]
    assert hit.severity == "warning"  # 1000 tokens: by 8, not by 16
    assert f"TE >= {dotted(TE_GEMM_LEADING_DIM_FROM)} checks" in hit.message
    assert TE_GEMM_LEADING_DIM_ERROR in hit.message


def test_the_rules_do_not_write_the_fact_themselves() -> None:
    for module in (model_rules, train_rules):
        source = inspect.getsource(module)
        assert "Caller must pad" not in source and "2.9 " not in source \
            and "v2.9" not in source, module.__name__
