"""`kvflow.observe.timeline`: joining a P/D request's events across its two instances by
the offer, and the spread of each gap. (Real servers' timelines: tests/serving/test_serve_pd.py.)"""

from __future__ import annotations

import msgspec

from kvflow.observe.events import (
    ClaimSeen,
    Event,
    FirstToken,
    LoadStarted,
    OfferStreamed,
    Origin,
    RequestArrived,
    RequestFinished,
    RequestScheduled,
    TransferDone,
)
from kvflow.observe.timeline import spread, timelines

P = Origin("prefill", "scheduler")
PW = Origin("prefill", "worker")
D = Origin("decode", "scheduler")
DW = Origin("decode", "worker")


def _request(n: int, t0: float, pull_s: float) -> list[Event]:
    """A P/D request `n` whose pull takes `pull_s`: the producer's events under its own
    request id, the consumer's under another, tied by the offer."""
    offer, prod, cons = f"offer{n}", f"p{n}", f"d{n}"
    done = t0 + 0.02 + pull_s
    moved = {"chunks": 3, "nbytes": 1, "elapsed_s": pull_s}
    return [
        RequestFinished(req=prod, lent=True, blocks=3, offer=offer, ts=t0, origin=P),
        RequestArrived(req=cons, tokens=90, offer=offer, ts=t0 + 0.010, origin=D),
        ClaimSeen(req=prod, ts=t0 + 0.012, origin=PW),
        LoadStarted(
            req=cons, chunks=3, tokens=90, nbytes=1, transport="zmq", ts=t0 + 0.02, origin=DW
        ),
        TransferDone(req=cons, direction="load", ts=done, origin=DW, **moved),
        TransferDone(req=prod, direction="send", ts=done + 0.001, origin=PW, **moved),
        RequestScheduled(req=cons, step=7, ts=done + 0.03, origin=D),
        FirstToken(req=cons, step=7, ts=done + 0.05, origin=D),
    ]


def test_a_request_is_joined_across_its_instances_by_its_offer() -> None:
    stray = RequestArrived(req="local", tokens=5, ts=0.5, origin=D)  # no offer: not P/D
    other = RequestFinished(req="p9", lent=True, offer="nobody-pulled", ts=0.6, origin=P)
    events = [stray, other, *_request(1, 1.0, 0.004), *_request(2, 2.0, 0.1)]
    lines = timelines(reversed(events))  # in any order
    assert [(t.req, t.producer_req) for t in lines] == [("d1", "p1"), ("d2", "p2")]
    first = lines[0]
    assert [m.stage for m in first.marks] == [
        "offered",
        "arrived",
        "claim seen",
        "pull started",
        "pull done",
        "pull served",
        "scheduled",
        "first token",
    ]
    gaps = first.gaps()
    assert round(gaps["pull"], 6) == 0.004
    assert round(gaps["offer to arrival"], 6) == 0.010
    assert round(gaps["first step"], 6) == 0.020
    assert "claim" not in gaps  # no `claim answered` mark: the span is not made up


def test_the_spread_of_each_gap_over_requests() -> None:
    events = [e for n in range(10) for e in _request(n, float(n), 0.001 * (n + 1))]
    by_name = {s.name: s for s in spread(timelines(events))}
    pull = by_name["pull"]
    assert pull.n == 10
    assert round(pull.max, 6) == 0.010
    assert 0.005 <= pull.p50 <= 0.006
    assert "claim" not in by_name


def test_a_streamed_offer_is_offered_as_scheduled_and_its_prefills_end_is_a_mark() -> None:
    """Streamed (`kvflow proxy --stream`): the offer is made as the prefill is scheduled
    (`OfferStreamed`), the consumer arrives meanwhile, and the producer's finish is
    "prefill done": the pull's part past it is what streaming did not hide."""
    events = _request(1, 1.0, 0.004)
    finished = events[0]
    assert isinstance(finished, RequestFinished)
    streamed = OfferStreamed(req="p1", offer="offer1", step=3, blocks=3, ts=0.99, origin=P)
    finished = msgspec.structs.replace(finished, ts=1.022)  # mid-pull: before its end
    (line,) = timelines([streamed, finished, *events[1:]])
    stages = [m.stage for m in line.marks]
    assert stages[:2] == ["offered", "arrived"] and "prefill done" in stages
    assert line.marks[0].ts == 0.99
    assert round(line.gaps()["pull past prefill"], 6) == 0.002
