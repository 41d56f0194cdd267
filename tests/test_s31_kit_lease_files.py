"""`benchmarks/gpu/lease.sh check` leaves at most 7 files in $OUT: a device call returns 8 at
most (/work/.library/device/README.md, "files back from $OUT"), and on the GPU the step's
scripts write 7 (verify.sh: environment-tests.txt, gpu-tests.log, gpu-tests.xml;
emulate_vs_te.py: emulate_vs_te.json; stats_gpu_cost.py: stats_gpu_cost_<gpu>.json and .md;
lease.sh: install-check.log). Before, lease.sh also kept verify.sh's whole output as
verify-tests.out (the environment file and the pytest log again): 8, so any one more file
would have lost one of them, the junit XML that record.py reads perhaps, and a rerun.

Stand-ins: install.sh prints a versions line; `python3` writes what each script writes on the
GPU (the junit XML where pytest is told, the two scripts' files under --out); nvidia-smi names
an H200. verify.sh and lease.sh are the real ones."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DEVICE_FILES = 8

PYTHON3 = r"""#!/bin/bash
out=
for a in "$@"; do
  case "$prev" in --out) out=$a ;; esac
  case "$a" in --junitxml=*) echo '<testsuites/>' > "${a#--junitxml=}" ;; esac
  prev=$a
done
case "$*" in
  *emulate_vs_te.py*) echo '{}' > "$out/emulate_vs_te.json" ;;
  *stats_gpu_cost.py*) echo '{}' > "$out/stats_gpu_cost_nvidia_h200.json"
                       echo '#' > "$out/stats_gpu_cost_nvidia_h200.md" ;;
esac
"""


def test_the_check_step_leaves_a_file_to_spare_of_what_a_device_call_returns(tmp_path):
    repo, stubs, out = tmp_path / "repo", tmp_path / "bin", tmp_path / "out"
    (repo / "benchmarks/gpu").mkdir(parents=True)
    for script in ("lease.sh", "verify.sh"):
        shutil.copy(REPO_ROOT / "benchmarks/gpu" / script, repo / "benchmarks/gpu" / script)
    (repo / "benchmarks/gpu/install.sh").write_text("echo torch 2.11.0 TE 2.20.2\n")
    stubs.mkdir()
    for name, body in (("python3", PYTHON3),
                       ("nvidia-smi", "#!/bin/bash\necho 'NVIDIA H200, 580.159.04, 143771 MiB, "
                                      "1980 MHz'\n")):
        (stubs / name).write_text(body)
        (stubs / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{stubs}:{os.environ['PATH']}", "OUT": str(out)}
    done = subprocess.run(["bash", str(repo / "benchmarks/gpu/lease.sh"), "check"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    files = sorted(p.name for p in out.iterdir())
    assert {"install-check.log", "environment-tests.txt", "gpu-tests.log", "gpu-tests.xml",
            "emulate_vs_te.json", "stats_gpu_cost_nvidia_h200.json"} <= set(files), files
    assert len(files) < DEVICE_FILES, files
