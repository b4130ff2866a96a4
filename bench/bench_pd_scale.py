"""P/D bookkeeping against the offers a producer holds (issue 50, item 5).

    python bench/bench_pd_scale.py            # 10^2, 10^3 and 10^4 offers (~1 min)
    python bench/bench_pd_scale.py --quick    # 10^2 and 10^3

A producer worker (`zmq`, keyed: the deployment's channel) holds N offers, and a
consumer that claimed them all renews them, as `kvflow.pd.claims` does every
`lease_s / 3` (10 s by default): one `Transport.renew` carrying every claim, in
messages of at most `MAX_RENEW_REQS`. Over real sockets, in one process:

- `offer`: the producer taking one more offer (per offer, N started together);
- `renew all`: one renewal of all N claims (its wall time, and its bytes on the wire:
  what each round costs, every `lease_s / 3`);
- `renew one`: one renewal of a single claim among N held (the time to find one offer,
  and the claim's first answer on a request's path);
- kvflow's bytes per held offer (`tracemalloc`, kvflow's files only).

Every sample is kept; `python bench/run.py --render` renders them into
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

import msgspec
import record  # bench/record.py
import trio
import trio.testing

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from kvflow.pd.offers import MAX_RENEW_REQS, Renew, new_nonce  # noqa: E402
from kvflow.pd.security import Channel  # noqa: E402
from kvflow.transport import Offer  # noqa: E402
from tests.support.side_channel_attacks import (  # noqa: E402
    COUNTS,
    LAYERS,
    OFFERED,
    Peers,
    peers,
    spans,
)

OUT = ROOT / "bench" / "results" / "pd-scale.json"
LEASE_S = 30.0
ONE = 200


def _ids(n: int) -> list[str]:
    return [os.urandom(16).hex() for _ in range(n)]


async def _hold(p: Peers, nursery: trio.Nursery, ids: list[str]) -> float:
    """The producer holds an offer under each id; seconds per offer."""
    t0 = time.perf_counter()
    for offer_id in ids:
        offer = Offer(offer_id, OFFERED, COUNTS, LAYERS, spans(p.prod, OFFERED), lambda s: None)
        nursery.start_soon(p.producer.offer, offer)
    await trio.testing.wait_all_tasks_blocked()
    return (time.perf_counter() - t0) / len(ids)


def _wire_bytes(ids: list[str], channel: Channel) -> int:
    """The sealed `Renew` messages of one round renewing `ids`."""
    total = 0
    for i in range(0, len(ids), MAX_RENEW_REQS):
        msg = Renew(ids[i : i + MAX_RENEW_REQS], int(LEASE_S * 1000), [], new_nonce(), "c" * 32)
        total += len(channel.seal(msgspec.msgpack.encode(msg), "producer"))
    return total


async def measure(n: int) -> dict[str, Any]:
    channel = Channel(os.urandom(32), "kv-in-clear")
    async with peers("zmq", channel) as p, trio.open_nursery() as nursery:
        nursery.start_soon(p.producer.serve)
        ids = _ids(n)
        per_offer = await _hold(p, nursery, ids)
        address = p.producer.address
        answer = await p.consumer.renew(address, ids, LEASE_S)  # claims them all
        assert not answer.refused and not answer.pending, answer
        rounds = []
        for _ in range(5):
            t0 = time.perf_counter()
            await p.consumer.renew(address, ids, LEASE_S)
            rounds.append(time.perf_counter() - t0)
        ones = []
        for i in range(ONE):
            t0 = time.perf_counter()
            await p.consumer.renew(address, [ids[(i * 7919) % n]], LEASE_S)
            ones.append(time.perf_counter() - t0)
        nursery.cancel_scope.cancel()
    return {
        "offers": n,
        "offer_us": 1e6 * per_offer,
        "renew_all_ms": 1e3 * statistics.median(rounds),
        "renew_all_bytes": _wire_bytes(ids, channel),
        "renew_one_ms": {
            "p50": 1e3 * statistics.median(ones),
            "p99": 1e3 * sorted(ones)[int(0.99 * len(ones))],
        },
        "samples_ms": {
            "renew_all": [round(1e3 * x, 3) for x in rounds],
            "renew_one": [round(1e3 * x, 3) for x in ones],
        },
    }


async def bytes_per_offer(n: int) -> float:
    """kvflow's allocations per offer a producer holds (`tracemalloc`, kvflow's files)."""
    kvflow = [tracemalloc.Filter(True, str(ROOT / "kvflow") + "/*")]
    channel = Channel(os.urandom(32), "kv-in-clear")
    async with peers("zmq", channel) as p, trio.open_nursery() as nursery:
        tracemalloc.start()
        before = tracemalloc.take_snapshot().filter_traces(kvflow)
        await _hold(p, nursery, _ids(n))
        after = tracemalloc.take_snapshot().filter_traces(kvflow)
        tracemalloc.stop()
        nursery.cancel_scope.cancel()
    return sum(s.size_diff for s in after.compare_to(before, "filename")) / n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="10^2 and 10^3 offers")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()
    sizes = [100, 1000] + ([] if args.quick else [10_000])
    meta = record.start()
    rows = []
    for n in sizes:
        row = trio.run(measure, n)
        row["bytes_per_offer"] = trio.run(bytes_per_offer, n)
        rows.append(row)
        print(
            f"{n:6d} offers: offer {row['offer_us']:.0f} us; renew all "
            f"{row['renew_all_ms']:.1f} ms, {row['renew_all_bytes']} bytes; renew one "
            f"{row['renew_one_ms']['p50']:.2f} / {row['renew_one_ms']['p99']:.2f} ms; "
            f"{row['bytes_per_offer']:.0f} B an offer",
            flush=True,
        )
    data = {"lease_s": LEASE_S, "renew_one_samples": ONE, "rows": rows}
    record.save(args.out, data, meta, extra=["tests/support/side_channel_attacks.py"])
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
