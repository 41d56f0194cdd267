"""The doctor's GPU row under CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER, with a fake nvidia-smi
on PATH (this machine has no GPU). nvidia-smi numbers GPUs in PCI bus order and ignores
CUDA_VISIBLE_DEVICES; CUDA counts the variable's ordinals in CUDA_DEVICE_ORDER's order (its
default FASTEST_FIRST, not PCI_BUS_ID) and matches `GPU-` entries by UUID prefix. QA: with
CUDA_VISIBLE_DEVICES=1 on a machine whose first GPU is an A100 and second an H100 the row named
the A100 and warned FP8202, though torch trains on the H100."""

from __future__ import annotations

import sys

import pytest
import torch.cuda as torch_cuda

from foundry_fp8.environment import gather_snapshot
from foundry_fp8.lint.rules.environment import environment_findings

A100 = ("NVIDIA A100-SXM4-80GB", (8, 0))
H100 = ("NVIDIA H100 80GB HBM3", (9, 0))
UUIDS = ["GPU-aaaa1111-0000", "GPU-bbbb2222-0000", "GPU-bbbc3333-0000", "GPU-dddd4444-0000"]


def _snapshot(tmp_path, monkeypatch, gpus, visible, order=None):
    """The snapshot with nvidia-smi listing `gpus` (and UUIDS for `--query-gpu=uuid`)."""
    listing = "".join(f"{name}, {cap[0]}.{cap[1]}\\n" for name, cap in gpus)
    uuids = "".join(f"{uuid}\\n" for uuid in UUIDS[:len(gpus)])
    fake = tmp_path / "nvidia-smi"
    fake.write_text('#!/bin/sh\ncase "$1" in\n'
                    f"  --query-gpu=uuid) printf '{uuids}';;\n"
                    f"  --query-gpu=name,compute_cap) printf '{listing}';;\n"
                    "  *) exit 2;;\nesac\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    if order is None:
        monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    else:
        monkeypatch.setenv("CUDA_DEVICE_ORDER", order)
    monkeypatch.delitem(sys.modules, "torch", raising=False)  # else the GPU comes from torch
    return gather_snapshot(probe_te_import=False)


def _torch_indices(visible: str, count: int, monkeypatch) -> list[int]:
    """torch 2.7's own reading: `_parse_visible_devices`, UUIDs mapped by
    `_transform_uuid_to_ordinals`, ordinals trimmed at the last GPU as `_device_count_nvml`."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    parsed = torch_cuda._parse_visible_devices()
    if parsed and isinstance(parsed[0], str):
        return torch_cuda._transform_uuid_to_ordinals(parsed, UUIDS[:count])
    return parsed[:next((n for n, i in enumerate(parsed) if i >= count), len(parsed))]


@pytest.mark.parametrize(("visible", "order", "name", "capability", "row"), [
    ("1", "PCI_BUS_ID", *H100, "NVIDIA H100 80GB HBM3 (compute capability 9.0): nvidia-smi's "
     "GPU 1 of 3, by CUDA_VISIBLE_DEVICES='1'"),
    # cuda:0 is nvidia-smi's 2; the A100 (1) is used too, so FP8 is judged on it
    ("2,0", "PCI_BUS_ID", *A100, "NVIDIA H100 80GB HBM3 (compute capability 9.0), NVIDIA "
     "A100-SXM4-80GB (compute capability 8.0): nvidia-smi's GPUs 2, 0 of 3, by "
     "CUDA_VISIBLE_DEVICES='2,0'"),
    # a UUID names one GPU in any order; a unique prefix is enough
    ("GPU-bbbb", None, *H100, "NVIDIA H100 80GB HBM3 (compute capability 9.0): nvidia-smi's GPU "
     "1 of 3, by CUDA_VISIBLE_DEVICES='GPU-bbbb'"),
    ("GPU-bbbc3333-0000,GPU-aaaa", None, *A100, "NVIDIA H100 80GB HBM3 (compute capability 9.0), "
     "NVIDIA A100-SXM4-80GB (compute capability 8.0): nvidia-smi's GPUs 2, 0 of 3, by "
     "CUDA_VISIBLE_DEVICES='GPU-bbbc3333-0000,GPU-aaaa'"),
    # FASTEST_FIRST (CUDA's default) on mixed GPUs: ordinal 1 is not nvidia-smi's 1
    ("1", None, *A100, "one of NVIDIA A100-SXM4-80GB (compute capability 8.0), NVIDIA H100 80GB "
     "HBM3 (compute capability 9.0), unknown which: CUDA_VISIBLE_DEVICES='1' counts in CUDA's "
     "default FASTEST_FIRST order, not nvidia-smi's (set CUDA_DEVICE_ORDER=PCI_BUS_ID to count as "
     "nvidia-smi does)"),
    ("0,1,2", None, *A100, "NVIDIA A100-SXM4-80GB (compute capability 8.0), 2 x NVIDIA H100 80GB "
     "HBM3 (compute capability 9.0): every GPU, by CUDA_VISIBLE_DEVICES='0,1,2'"),
])
def test_the_gpu_row_names_the_gpus_cuda_sees(tmp_path, monkeypatch, capsys, visible, order,
                                              name, capability, row):
    gpus = [A100, H100, H100]
    snapshot = _snapshot(tmp_path, monkeypatch, gpus, visible, order)
    assert (snapshot.gpu_name, snapshot.capability, snapshot.gpu_seen) == (name, capability, row)
    fp8202 = [f for f in environment_findings(snapshot) if f.rule == "FP8202"]
    assert bool(fp8202) is (capability < (8, 9))
    if order == "PCI_BUS_ID" or visible.startswith("GPU-"):  # torch agrees on which GPUs
        seen = [gpus[i] for i in _torch_indices(visible, len(gpus), monkeypatch)]
        assert row.startswith(", ".join(f"{n} (compute capability {c[0]}.{c[1]})"
                                        for n, c in seen))
    from foundry_fp8 import doctor
    monkeypatch.setattr(doctor, "gather_snapshot", lambda **_: snapshot)
    from foundry_fp8.cli import main
    main(["doctor"])
    assert f"GPU                  {row}\n" in capsys.readouterr().out


@pytest.mark.parametrize("visible", ["2,0", "1", "3,1,0", "GPU-dddd,GPU-bbbb2"])
@pytest.mark.parametrize("order", [None, "PCI_BUS_ID"])
def test_alike_gpus_are_named_in_either_order(tmp_path, monkeypatch, visible, order):
    """All GPUs alike: FASTEST_FIRST and PCI order see the same models, so the row is exact;
    the indices are torch's own."""
    snapshot = _snapshot(tmp_path, monkeypatch, [H100] * 4, visible, order)
    indices = _torch_indices(visible, 4, monkeypatch)
    count = f"{len(indices)} x " if len(indices) > 1 else ""
    assert snapshot.gpu_seen == (
        f"{count}NVIDIA H100 80GB HBM3 (compute capability 9.0): nvidia-smi's "
        f"GPU{'s' * (len(indices) > 1)} {', '.join(map(str, indices))} of 4, by "
        f"CUDA_VISIBLE_DEVICES={visible!r}")
    assert snapshot.capability == (9, 0)


@pytest.mark.parametrize("visible", ["GPU-", "GPU-bbbb2222-0000,GPU-bbbb", "GPU-zzzz", "1,1"])
def test_uuids_that_name_no_gpu_or_one_twice_hide_them_all(tmp_path, monkeypatch, visible):
    """'GPU-' is a prefix of every UUID (ambiguous), 'GPU-zzzz' of none, a GPU named twice
    hides every one: torch's reading, whose count is 0 for each."""
    gpus = [A100, H100, H100]
    assert _torch_indices(visible, len(gpus), monkeypatch) == []
    snapshot = _snapshot(tmp_path, monkeypatch, gpus, visible, "PCI_BUS_ID")
    assert snapshot.gpu_hidden and snapshot.capability is None
    fp8201, = (f for f in environment_findings(snapshot) if f.rule == "FP8201")
    assert "hides every one from CUDA" in fp8201.message


def test_a_mig_instance_names_its_gpu_model(tmp_path, monkeypatch):
    snapshot = _snapshot(tmp_path, monkeypatch, [H100, H100], "MIG-1234abcd")
    assert snapshot.gpu_seen == ("a MIG instance (CUDA_VISIBLE_DEVICES='MIG-1234abcd') of "
                                 "NVIDIA H100 80GB HBM3 (compute capability 9.0)")
    assert snapshot.capability == (9, 0)


def test_one_gpu_and_no_variable_keeps_the_plain_row(tmp_path, monkeypatch):
    snapshot = _snapshot(tmp_path, monkeypatch, [H100], "0")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    plain = gather_snapshot(probe_te_import=False)
    assert (plain.gpu_name, plain.capability, plain.gpu_seen) == (*H100, None)
    assert snapshot.gpu_seen.endswith("nvidia-smi's GPU 0 of 1, by CUDA_VISIBLE_DEVICES='0'")


@pytest.mark.parametrize("where", ["before", "after"])
def test_nvidia_smi_s_own_warning_lines_are_not_gpus(tmp_path, monkeypatch, where):
    """nvidia-smi can print a line of its own beside the CSV rows ("WARNING: infoROM is
    corrupted at gpu 0000:01:00.0"): the GPU rows are still read (before: a warning first made
    the GPU unknown)."""
    warning = "WARNING: infoROM is corrupted at gpu 0000:01:00.0"
    rows = ["NVIDIA H100 80GB HBM3, 9.0", "NVIDIA H100 80GB HBM3, 9.0"]
    lines = [warning, *rows] if where == "before" else [*rows, warning]
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\n" + "".join(f"echo '{line}'\n" for line in lines))
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    snapshot = gather_snapshot(probe_te_import=False)
    assert (snapshot.gpu_name, snapshot.capability, snapshot.gpu_error) == (*H100, None)
    assert snapshot.gpu_seen.endswith("nvidia-smi's GPU 1 of 2, by CUDA_VISIBLE_DEVICES='1'")


def test_uuids_nvidia_smi_cannot_give_leave_the_gpu_unknown_among_the_listed(tmp_path,
                                                                             monkeypatch):
    """The UUID query shares nvidia-smi's time limit; one that fails names the listed models."""
    from foundry_fp8 import environment

    fake = tmp_path / "nvidia-smi"
    fake.write_text('#!/bin/sh\ncase "$1" in --query-gpu=uuid) sleep 30;; '
                    '*) echo "NVIDIA H100 80GB HBM3, 9.0"; echo "NVIDIA A100-SXM4-80GB, 8.0";; '
                    "esac\n")
    fake.chmod(0o755)
    monkeypatch.setattr(environment, "NVIDIA_SMI_TIMEOUT_S", 1)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-abc")
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    snapshot = gather_snapshot(probe_te_import=False)
    assert snapshot.gpu_seen == (
        "NVIDIA A100-SXM4-80GB (compute capability 8.0), NVIDIA H100 80GB HBM3 (compute "
        "capability 9.0), unknown which: CUDA_VISIBLE_DEVICES='GPU-abc' not matched (nvidia-smi "
        "--query-gpu=uuid printed no UUID per GPU)")
    assert snapshot.capability == (8, 0)


def test_a_long_cuda_visible_devices_keeps_the_gpu_row_one_short_line(tmp_path, monkeypatch,
                                                                      capsys):
    """QA: CUDA_VISIBLE_DEVICES='0,0,...' (6,000 characters, a repeated ordinal: every GPU
    hidden) was printed whole in the GPU row."""
    value = ",".join(["0"] * 3000)
    snapshot = _snapshot(tmp_path, monkeypatch, [H100], value)
    assert snapshot.gpu_hidden
    from foundry_fp8 import doctor
    from foundry_fp8.cli import main

    monkeypatch.setattr(doctor, "gather_snapshot", lambda **_: snapshot)
    main(["doctor"])
    row, = (line for line in capsys.readouterr().out.splitlines() if line.startswith("GPU "))
    assert row == ("GPU                  NVIDIA H100 80GB HBM3, hidden from CUDA by "
                   "CUDA_VISIBLE_DEVICES=" + repr(value)[:77] + "...")
