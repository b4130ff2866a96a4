"""kvflow.geometry.kernels: the device kernels' token maps and bounds, checked on the host
before any launch (a launch indexes with them; on a GPU an index out of range is a fault
that takes the whole CUDA context down). The kernels' bytes are checked through the
transports that use them (tests/transports/test_peer_layouts.py,
tests/pd/test_peer_tensor_parallel.py, tests/transports/test_staging.py)."""

from __future__ import annotations

import pytest
import torch

from kvflow.geometry import kernels
from kvflow.geometry.layout import LayoutError
from kvflow.testing.layouts import make_layout


def test_a_chunk_token_map_names_each_token_of_each_chunk() -> None:
    got = kernels.chunk_tokens([5, 9], [1, 2], [3, 2], 4, "cpu")
    assert got.tolist() == [[5, 5, 5, 9, 9], [0, 1, 2, 0, 1], [1, 1, 1, 2, 2], [0, 1, 2, 0, 1]]


def test_a_stream_token_map_carries_tokens_across_blocks_of_other_sizes() -> None:
    """Source blocks of 4 tokens from token 2 on, into destination blocks of 3."""
    got = kernels.stream_tokens([7, 8], 4, 2, [0, 1], [3, 2], 3, "cpu")
    assert got.tolist() == [[7, 7, 8, 8, 8], [2, 3, 0, 1, 2], [0, 0, 0, 1, 1], [0, 1, 2, 0, 1]]


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda: kernels.chunk_tokens([1], [2], [5], 4, "cpu"),
            r"token counts \[5\] outside 0\.\.4",
        ),
        (
            lambda: kernels.stream_tokens([1], 4, 2, [0], [3], 3, "cpu"),
            r"3 tokens from token 2 of 1 blocks of 4",
        ),
        (lambda: kernels.stream_tokens([1], 4, -1, [0], [1], 3, "cpu"), r"from token -1"),
    ],
)
def test_token_maps_past_a_block_or_a_stream_are_refused(call: object, message: str) -> None:
    with pytest.raises(LayoutError, match=message):
        call()  # type: ignore[operator]


def test_heads_outside_either_side_are_refused_before_a_launch() -> None:
    kv = make_layout(num_layers=1, num_blocks=4, block_size=4, heads=2)
    layer = torch.frombuffer(kv.buffers[0], dtype=torch.uint8)
    g = kv.geometries[0]
    pytest.importorskip("triton", reason="the device kernels are Triton's (every GPU vLLM has it)")
    tokens = kernels.chunk_tokens([0], [1], [4], 4, "cpu")
    k = kernels.build(interpret=True)
    with pytest.raises(LayoutError, match=r"destination .*: no cells of heads 1\.\.\+2"):
        k.copy_cells([layer], g, [layer], g, tokens, (0, 1, 2))
    with pytest.raises(LayoutError, match=r"source .*: no cells of heads 2\.\.\+1"):
        k.copy_cells([layer], g, [layer], g, tokens, (2, 0, 1))


def test_no_device_kernels_off_a_gpu() -> None:
    t = torch.zeros(8, dtype=torch.uint8)
    assert kernels.device_kernels(t, t) is None
