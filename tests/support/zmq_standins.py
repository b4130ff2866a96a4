"""Stand-ins for a GPU on `zmq`'s CUDA IPC path, for the tests on hosts without one."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from typing import ClassVar

import pytest
import torch

from kvflow.geometry import kernels
from kvflow.geometry.layout import KVLayout
from kvflow_zmq import ZmqTransport
from kvflow_zmq._ipc import Device, IpcHandle


class InProcessDevice(Device):
    """Stands in for CUDA IPC where there is no GPU: a "handle" names a tensor of this
    process. Everything else on the IPC path (the control frames, the lease, the
    per-peer cache, the block copies) runs as it does on a GPU."""

    exported: ClassVar[dict[bytes, torch.Tensor]] = {}
    opened = 0

    def export(self, layer: torch.Tensor) -> IpcHandle:
        handle = uuid.uuid4().bytes
        self.exported[handle] = layer
        return IpcHandle(0, handle, layer.numel(), 0, b"", 0, b"", False, 0, layer.numel())

    def open(self, handle: IpcHandle) -> torch.Tensor:
        InProcessDevice.opened += 1
        return self.exported[handle.handle]


class StandInIpcZmq(ZmqTransport):
    device_type = InProcessDevice


def as_device(layout: KVLayout) -> KVLayout:
    """`layout` labelled `cuda`, its tensors host tensors over its buffers."""
    layout.memory = "cuda"
    layout.tensors = [torch.frombuffer(b, dtype=torch.uint8) for b in layout.buffers]
    return layout


@contextlib.contextmanager
def interpreted_kernels() -> Iterator[list[int]]:
    """CUDA IPC's device kernels (`kvflow.geometry.kernels`) run in Triton's interpreter on
    host tensors in place of torch's indexing; yields a list counting the copies they
    were asked for (so a test knows they ran)."""
    pytest.importorskip("triton", reason="the device kernels are Triton's (every GPU vLLM has it)")
    calls: list[int] = []
    k = kernels.build(interpret=True)

    def device_kernels(src: torch.Tensor, dst: torch.Tensor) -> kernels.Kernels:
        calls.append(1)
        return k

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernels, "device_kernels", device_kernels)
        yield calls
