"""The multi-node path: DDP and FSDP scripts launched by torchrun (gloo, 2 processes), exactly as a user
would, train like one process on the same global batch."""

import json
import os
import subprocess
import sys

import pytest
import torch

from lab.parallel.launcher import free_port
from lab.paths import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "examples"))
import train_parallel  # noqa: E402


def _single_process(steps: int, batch: int) -> dict:
    torch.manual_seed(0)
    model = train_parallel.TransformerLM(train_parallel.CONFIG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data, losses = train_parallel.global_batch(steps, batch), []
    for s in range(steps):
        loss = model(data[s, :, :-1], data[s, :, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return dict(losses=losses, checksum=float(sum(p.detach().double().abs().sum() for p in model.parameters())))


@pytest.mark.slow
@pytest.mark.parametrize("wrapper", train_parallel.WRAPPERS)
def test_script_under_torchrun_matches_one_process(wrapper):
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           str(REPO_ROOT / "examples" / "train_parallel.py"), "--wrapper", wrapper, "--steps", "3", "--batch", "4"]
    out = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads([ln for ln in out.stdout.splitlines() if ln.startswith("{")][-1])
    assert got["world_size"] == 2
    ref = _single_process(3, 4)
    assert got["losses"] == pytest.approx(ref["losses"], rel=1e-5)
    assert got["checksum"] == pytest.approx(ref["checksum"], rel=1e-5)
