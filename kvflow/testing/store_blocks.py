"""The store conformance suite's promise about block sizes (`kvflow.shapes.reblock`): a device
cache's chunks are stored token-major, so what an engine of blocks of 16 saved, one of
blocks of 32 finds under its keys and loads token for token, and back. The caches are
host tensors labelled `cuda` (`device_layout("cpu")`), staged as a GPU's are
(`kvflow.engine.staging.HostStage`)."""

from __future__ import annotations

import pytest
import torch

from ..engine.staging import HostStage
from ..keys import chunk_keys, chunk_token_counts
from ..shapes.reblock import load_reblocked, load_window, lookup_blocks
from ..transport import LoadJob, SaveJob, Transport, TransportError
from .contract import Promise, violated
from .harness import Harness
from .layouts import device_layout

__all__ = ["BlockSizeConformance"]

PROMPT = list(range(1000, 1083))  # 83 tokens: 5 blocks of 16 and 3; 2 of 32 and 19


class BlockSizeConformance:
    """Mixed into `TransportConformance`."""

    async def test_device_caches_of_another_block_size_load_each_others_chunks(
        self, kv: Harness
    ) -> None:
        """A device cache of blocks of 16 loads what one of 32 saved, and back, every token
        equal, from its second block on (vLLM's prefix cache held the first), nothing
        past the last chunk's tokens written."""
        sched = await kv.scheduler()
        if not type(sched).capabilities.reshape:
            pytest.skip("capabilities.reshape is not set")
        for saver, reader in ((16, 32), (32, 16)):
            await self._reblock(kv, sched, saver, reader)

    async def _reblock(self, kv: Harness, sched: Transport, saver: int, reader: int) -> None:
        ns = f"{kv.namespace}-{saver}-{reader}"
        caches = [
            device_layout(
                "cpu", num_layers=2, num_blocks=8, block_size=bs, heads=2, head_dim=8, seed=bs
            )
            for bs in (saver, reader)
        ]
        (theirs, their_views), (ours, views) = caches
        writer = await kv.worker(layout=theirs, namespace=ns)
        loader = await kv.worker(layout=ours, namespace=ns)
        counts = chunk_token_counts(len(PROMPT), saver)
        src = list(range(1, 1 + len(counts)))
        stage = HostStage(theirs, src, counts)

        async def gathered(layer: int) -> list[list[memoryview]]:
            await stage.gather(layer)
            return stage.spans(layer)

        keys = chunk_keys(ns, PROMPT, saver, store_key=writer.context.store_key)  # as it looks
        await writer.save(SaveJob("reblock-save", keys, counts, 2, gathered))
        mine = chunk_token_counts(len(PROMPT), reader)
        looked = await kv.scheduler(namespace=ns)
        hits, run = await lookup_blocks(looked, ns, PROMPT, "", True, mine, [saver])
        if hits != len(mine) or run is None or run.keys != keys:
            violated(Promise.REBLOCK, f"lookup of blocks of {saver} found {hits}", keys=keys)
        assert run is not None
        chunks = list(range(1, len(mine)))
        window, _ = load_window(run, mine, chunks)
        assert window is not None
        dst, n = [7 - i for i in range(len(chunks))], [mine[i] for i in chunks]
        before = [v.clone() for v in views]
        into = HostStage(ours, dst, n)
        signalled: list[int] = []
        job = LoadJob("reblock-load", [""] * len(dst), n, 2, into.spans, signalled.append,
                      None, dst)  # fmt: skip
        try:
            await load_reblocked(loader, job, window)
        except TransportError as exc:
            violated(Promise.REBLOCK, f"load raised {exc}", chunks=[exc.chunk], keys=keys)
        for layer in range(2):
            into.scatter(layer)
        if signalled != [0, 1]:
            violated(Promise.REBLOCK, f"layers signalled {signalled}", keys=keys)
        for v, w, b in zip(views, their_views, before, strict=True):
            got = torch.cat([v[d, :, :k] for d, k in zip(dst, n, strict=True)], dim=1)
            want = torch.cat([w[s, :, :k] for s, k in zip(src, counts, strict=True)], dim=1)
            if not torch.equal(got, want[:, reader:]):
                violated(Promise.REBLOCK, f"tokens differ from what blocks of {saver} saved")
            if not torch.equal(v[dst[-1], :, n[-1] :], b[dst[-1], :, n[-1] :]):
                violated(Promise.REBLOCK, "a load wrote past its last chunk's tokens")
