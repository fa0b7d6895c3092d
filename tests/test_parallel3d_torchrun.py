"""train_3d under torchrun (env:// rendezvous), 4 CPU ranks, loopback only: the loss of a
2·2·1 layout equals single-process training's."""
import os
import shutil
import subprocess
import sys

import pytest

from helpers.labs.parallel3d import reference_3d

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")


@pytest.mark.skipif(shutil.which("bash") is None, reason="the wrapper script is bash")
def test_a_4_rank_layout_under_torchrun_has_the_single_process_loss(tmp_path):
    env = dict(os.environ, TORCHRUN=TORCHRUN, OMP_NUM_THREADS="1")
    done = subprocess.run(  # --log-dir: torchrun's own folder would stay under /tmp
        [os.path.join(ROOT, "scripts", "torchrun_local.sh"), f"--log-dir={tmp_path}",
         "--nproc-per-node=4",
         "-m", "helpers.run", "train3d", "--data", "2", "--tensor", "2", "--pipeline", "1",
         "--micro-batches", "1"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert "train_3d d=2 t=2 p=1 m=1 on 4 ranks (gloo):" in lines, done.stdout
    loss = float(next(line for line in lines if line.startswith("  step 0: loss ")).split()[-1])
    assert loss == pytest.approx(reference_3d().loss, rel=1e-5)


def test_train3d_refuses_a_bad_layout_before_starting(monkeypatch):
    # In this process (no second torch import): the check raises before any rendezvous.
    from helpers.launch import torchrun
    monkeypatch.setattr(torchrun, "init_from_env", _never_started)
    with pytest.raises(ValueError, match="heads must be a multiple of 3"):
        torchrun.main(["train3d", "--tensor", "3"])


def _never_started():
    raise AssertionError("a bad layout must be refused before the process group starts")
