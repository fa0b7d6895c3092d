"""The same rank functions under torchrun (env:// rendezvous), 2 CPU ranks, loopback only."""
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")


@pytest.mark.skipif(shutil.which("bash") is None, reason="the wrapper script is bash")
def test_allreduce_demo_under_torchrun(tmp_path):
    env = dict(os.environ, TORCHRUN=TORCHRUN)
    done = subprocess.run(  # --log-dir: torchrun's own folder would stay under /tmp
        [os.path.join(ROOT, "scripts", "torchrun_local.sh"), f"--log-dir={tmp_path}",
         "--nproc-per-node=2",
         "-m", "helpers.run", "allreduce"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert "allreduce on 2 ranks (gloo):" in lines
    # rank r holds [0,1,2,3] + r: the sum over 2 ranks is [1, 3, 5, 7]; rank 1 keeps [5, 7]
    assert any(line.startswith("  rank 1: ") and "'reduce_scatter': [5.0, 7.0]" in line
               and "'all_reduce': [1.0, 3.0, 5.0, 7.0]" in line for line in lines), done.stdout
    # one machine: both ranks in one network namespace (the wrapper's private one), their
    # transports pinned to loopback
    network = next(line for line in lines if line.startswith("  network: "))
    assert re.fullmatch(r"  network: ranks 0 1 in namespace \d+ at 127\.0\.0\.1", network), network


def test_helpers_run_refuses_to_start_outside_torchrun():
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    done = subprocess.run([sys.executable, "-m", "helpers.run", "allreduce"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "start this module with torchrun" in done.stderr
