"""The `zmq` transport's CUDA IPC path on a real GPU: a producer process exports its
caches, this process pulls blocks device to device and checks every byte.

Runs `bench/bench_cuda_ipc.py --quick`; skipped where there is no CUDA device (the
IPC path's logic also runs on CPU with a stand-in for the handles, in
tests/transports/test_conformance_zmq.py).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="CUDA IPC needs an NVIDIA GPU; torch.cuda.is_available() is False here",
)

BENCH = Path(__file__).parents[2] / "bench" / "bench_cuda_ipc.py"


def test_blocks_move_device_to_device_with_every_byte_equal() -> None:
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--quick"], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "bytes equal: yes" in proc.stdout, proc.stdout
