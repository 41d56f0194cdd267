"""FP8126: an Accelerate config's `distributed_type` against Accelerate's own config loader,
load_config_from_file (`accelerate launch --config_file`'s first step)."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from foundry_fp8.environment import Snapshot
from foundry_fp8.lint.cli import lint_file
from foundry_fp8.lint.rules.accelerate import DISTRIBUTED_TYPES, SAGEMAKER_DISTRIBUTED_TYPES

pytest.importorskip("accelerate")

#: Accelerate's examples/config_yaml_templates/fp8.yaml, on two GPUs.
FP8 = {"compute_environment": "LOCAL_MACHINE", "mixed_precision": "fp8", "num_processes": 2,
       "fp8_config": {"backend": "TE", "amax_history_len": 1024, "fp8_format": "E4M3",
                      "interval": 1, "margin": 0,
                      "override_linear_precision": [False, False, False],
                      "use_autocast_during_eval": False}}
SAGEMAKER = {"compute_environment": "AMAZON_SAGEMAKER", "mixed_precision": "bf16",
             "ec2_instance_type": "ml.p3.2xlarge", "iam_role_name": "r", "num_machines": 1}


def test_the_members_are_the_installed_accelerates():
    from accelerate.utils import DistributedType, SageMakerDistributedType

    assert DISTRIBUTED_TYPES == tuple(e.value for e in DistributedType)
    assert SAGEMAKER_DISTRIBUTED_TYPES == tuple(e.value for e in SageMakerDistributedType)


@pytest.mark.parametrize(("base", "value", "want"), [
    *((FP8, v, None) for v in DISTRIBUTED_TYPES),
    (FP8, False, None),  # an unquoted NO: kept as is
    (FP8, "multi_gpu", "error"), (FP8, "Multi_GPU", "error"), (FP8, "no", "error"),
    (FP8, "deepspeed", "error"), (FP8, "fsdp", "error"), (FP8, "multi-gpu", "error"),
    (FP8, "MULTI_GPUS", "warning"), (FP8, "DDP", "warning"),
    (FP8, "DATA_PARALLEL", "warning"),  # SageMaker's, not ClusterConfig's
    # NO under SageMaker: process_config adds num_processes, which it lacks (FP8111's)
    *((SAGEMAKER, v, None) for v in SAGEMAKER_DISTRIBUTED_TYPES if v != "NO"),
    (SAGEMAKER, "data_parallel", "error"), (SAGEMAKER, "MULTI_GPU", "warning"),
])
def test_distributed_type_as_load_config_from_file_reads_it(tmp_path, base, value: Any, want):
    from accelerate.commands.config.config_args import load_config_from_file

    path = tmp_path / "accelerate.yaml"
    path.write_text(yaml.safe_dump({**base, "distributed_type": value}, sort_keys=False))
    try:
        load_config_from_file(str(path))
        refused = False
    except ValueError as e:
        assert "is not a valid" in str(e)
        refused = True
    entry = lint_file(path, 1, Snapshot(python="3.11"))
    assert entry["error"] is None
    found = [(f["severity"], f["key"]) for f in entry["findings"] if f["rule"] == "FP8126"]
    assert refused == (want is not None)
    assert found == ([] if want is None else [(want, "distributed_type")])


@pytest.mark.parametrize(("distributed", "written", "refused"), [
    ("NO", "'no'", False), ("NO", "null", False), ("NO", "BF16", False), ("NO", "fp16", False),
    ("NO", "no", True), ("NO", "false", True), ("NO", "true", True), ("NO", "1", True),
    ("NO", "fp9", True), ("NO", "bf-16", True),
    ("MULTI_GPU", "no", True), ("MULTI_GPU", "fp9", True),
])
def test_mixed_precision_as_accelerate_launch_reads_it(tmp_path, distributed, written, refused):
    """FP8127 against the real `accelerate launch --config_file` (on CPU; a script that only
    prints the precision the launcher exported)."""
    import subprocess
    import sys

    path = tmp_path / "accelerate.yaml"
    path.write_text(f"compute_environment: LOCAL_MACHINE\ndistributed_type: {distributed}\n"
                    f"mixed_precision: {written}\nnum_processes: 2\n")
    script = tmp_path / "show.py"
    script.write_text("import os\nprint('exported', os.environ['ACCELERATE_MIXED_PRECISION'])\n")
    run = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                          str(path), str(script)], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path)
    assert (run.returncode != 0) == refused, run.stderr[-2000:]
    if refused:
        assert "no attribute 'lower'" in run.stderr or "Unknown mixed_precision" in run.stderr
    else:
        assert "exported" in run.stdout
    entry = lint_file(path, 1, Snapshot(python="3.11"))
    assert entry["error"] is None
    found = [f["key"] for f in entry["findings"] if f["rule"] == "FP8127"]
    assert found == (["mixed_precision"] if refused else [])
