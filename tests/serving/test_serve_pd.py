"""Prefill/decode through vLLM's OpenAI server, as a user runs it.

Two `python -m vllm.entrypoints.openai.api_server` processes on this host, each in
its own session (as a supervisor or two terminals start them) and, on vLLM's CPU
build, on its own core; kvflow's proxy between them follows vLLM's convention. zmq
runs with the *same* `--kv-transfer-config` (`kv_both`) on both servers, nixl with
`kv_producer` / `kv_consumer`; both with `kv_load_failure_policy: fail`, so a pull
that fails is a request error here, never a silent recompute. zmq runs as the README
sets it up (no key: the servers sign with this user's host key), nixl with a deployment
key (`kvflow keygen`): both ways a user runs P/D. A second process, and an API client,
attack each pair (docs/security.md).
"""

from __future__ import annotations

import random
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import zmq

from kvflow.keyfiles import keygen
from kvflow.observe.events import TransferFailed
from kvflow.observe.log import read_event_log
from kvflow.observe.timeline import Timeline, timelines
from kvflow.pd.proxy import PREFILL_PARAMS, PdProxy
from kvflow_vllm.apiserver import ApiServer, post
from kvflow_vllm.serving import close_all

from ..support.compat import PLAIN_ROW
from ..support.vllm_servers import assert_same

pytestmark = pytest.mark.engine

_rng = random.Random(23)


def _prompt(n: int) -> list[int]:
    return [_rng.randrange(3, 1000) for _ in range(n)]


HOLD_S = 15.0
"""The prefill server's hold_timeout_s: how long a prefill waits for a decode server's
claim (sent as the request reaches the decode server's queue). Short, so a test can
queue a request past it; not so short that a loaded 2-core host misses it: with both
cores also busy elsewhere, 16 concurrent requests reached the decode server 6.1 s
after their prefill ended."""


def _config(transport: str, role: str, key_file: str = "", events: str = "") -> dict[str, Any]:
    extra: dict[str, Any] = {"transport": transport, "hold_timeout_s": HOLD_S}
    if key_file:
        extra["key_file"] = key_file
    if events:
        extra["event_log"] = events
    return {
        "kv_connector": "KVFlowConnector",
        "kv_role": role,
        "kv_load_failure_policy": "fail",
        "kv_connector_extra_config": extra,
    }


class PD:
    def __init__(
        self, prefill: ApiServer, decode: ApiServer, proxy: PdProxy, keyed: bool, events: Path
    ) -> None:
        self.prefill, self.decode, self.proxy = prefill, decode, proxy
        self.keyed = keyed
        """The pair shares a deployment key (`kvflow keygen`), else this host's key."""
        self.events = events
        """Both servers' kvflow event log (one file: any runtime may append to it)."""

    def reference(self, prompt: list[int], max_tokens: int = 8) -> dict[str, Any]:
        """One server doing everything (the prefill server, asked plainly)."""
        return self.prefill.completion(prompt, max_tokens)

    def ask(self, prompt: list[int], max_tokens: int = 8) -> dict[str, Any]:
        return self.decode.completion(prompt, max_tokens, url=self.proxy.url)


@pytest.fixture(
    scope="module",
    params=[
        ("zmq", "kv_both", "kv_both", False),
        pytest.param(("nixl", "kv_producer", "kv_consumer", True), marks=pytest.mark.slow),
    ],
    ids=["zmq-kv_both-default", "nixl-producer-consumer-keyed"],
)
def pd(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PD]:
    transport, p_role, d_role, keyed = request.param
    if transport == "nixl":
        pytest.importorskip("nixl_cu12", reason="NIXL is an optional extra: kvflow[nixl]")
    tmp = tmp_path_factory.mktemp(f"serve-pd-{transport}")
    key = str(keygen(tmp / "key")) if keyed else ""
    events = tmp / "events.jsonl"
    prefill = ApiServer(tmp, "prefill", _config(transport, p_role, key, str(events)), cores="0")
    # dev mode: vLLM's /pause and /resume, to hold a request in the decode server's queue
    dev = {"VLLM_SERVER_DEV_MODE": "1"}
    decode = ApiServer(
        tmp, "decode", _config(transport, d_role, key, str(events)), cores="1", env=dev
    )
    proxy = None
    try:
        prefill.wait_ready()
        decode.wait_ready()
        proxy = PdProxy([prefill.url], [decode.url]).start()
        yield PD(prefill, decode, proxy, keyed, events)
    finally:
        if proxy is not None:
            proxy.close()
        close_all((prefill, decode))


def _loaded(m: dict[str, float]) -> tuple[float, float, float]:
    """(kvflow's loaded tokens, vLLM's external-transfer tokens, vLLM's local cache hits)."""
    return (
        m.get('vllm:kvflow_tokens_total{direction="load"}', 0.0),
        m.get('vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}', 0.0),
        m.get('vllm:prompt_tokens_by_source_total{source="local_cache_hit"}', 0.0),
    )


def _loaded_since(server: ApiServer, before: tuple[float, ...]) -> tuple[float, ...]:
    """What `_loaded` grew by, once kvflow's stats (reported a step after the load) agree
    with vLLM's count of external tokens, or after 30 s with whatever they say then."""

    def delta(m: dict[str, float]) -> tuple[float, ...]:
        return tuple(a - b for a, b in zip(_loaded(m), before, strict=True))

    return delta(server.metrics_once(lambda m: delta(m)[0] == delta(m)[1]))


def _transport(item: pytest.Item) -> str:
    """The transport of the pair a test of this module ran on (its `cell` column)."""
    return str(item.callspec.params["pd"][0])  # type: ignore[attr-defined]


@pytest.mark.cell(PLAIN_ROW, _transport)
def test_one_request_at_a_time_with_the_prefill_server_idle_between(pd: PD) -> None:
    # shorter than a block (32), a few blocks, a partial last block
    for n in (10, 150, 301):
        prompt = _prompt(n)
        want = pd.reference(prompt)
        before = _loaded(pd.decode.metrics())
        got = pd.ask(prompt)
        assert_same(got, want, f"a {n}-token prompt through P/D")
        pulled, external, _ = _loaded_since(pd.decode, before)
        assert pulled == external == n, f"{n} prompt tokens: pulled {pulled}, vLLM {external}"


CHAIN = (
    "offered",
    "arrived",
    "claim sent",
    "claim answered",
    "blocks allocated",
    "pull started",
    "pull done",
    "load reported",
    "scheduled",
    "first token",
)
"""A P/D request's stages in the order they must happen (issue 49)."""


def _timeline(pd: PD, req: str, stages: tuple[str, ...] = ("first token",)) -> Timeline:
    """The timeline of the decode server's request `req` (an id prefix) once `stages`
    (its first token) are in the event log, or as it is after 30 s."""
    deadline = time.monotonic() + 30
    while True:
        found = [t for t in timelines(read_event_log(str(pd.events))) if req in t.req]
        seen = found and all(found[0].first(stage) for stage in stages)
        if seen or time.monotonic() > deadline:
            assert found, f"no P/D timeline of {req}"
            return found[0]
        time.sleep(0.2)  # polls the servers' event log


def test_each_pd_request_has_a_timeline_across_both_servers(pd: PD) -> None:
    """Issue 49, 1: from both servers' events, one request's way: offer made, arrival,
    claim sent, seen and answered, blocks, pull, every layer landed, vLLM told, the
    request scheduled, its first token; in that order, on the host's one clock.
    `kvflow inspect --timeline` shows it, and the spread of each gap over the log."""
    prompt = _prompt(150)
    got = pd.ask(prompt)
    assert_same(got, pd.reference(prompt), "the request")
    t = _timeline(pd, got["id"].removeprefix("cmpl-"))
    at = {m.stage: m.ts for m in reversed(t.marks)}  # each stage's first mark
    missing = {*CHAIN, "claim seen", "layer landed", "pull served"} - at.keys()
    assert not missing, f"stages missing: {missing}: {[m.stage for m in t.marks]}"
    times = [at[stage] for stage in CHAIN]
    assert times == sorted(times), [m.stage for m in t.marks]
    assert at["claim sent"] <= at["claim seen"] <= at["pull done"]
    layers = [m for m in t.marks if m.stage == "layer landed"]
    assert len({m.detail for m in layers}) == 4, "every layer of the model landed"  # 4 layers
    assert all(at["pull started"] <= m.ts <= at["load reported"] for m in layers)
    show = [sys.executable, "-m", "kvflow.cli.main", "inspect", "--log", str(pd.events)]
    one = subprocess.run([*show, "--timeline", t.req], capture_output=True, text=True)
    assert one.returncode == 0, one.stderr
    for stage in (*CHAIN, "claim seen", "layer landed", "pull served"):
        assert stage in one.stdout, f"{stage!r} not in:\n{one.stdout}"
    every = subprocess.run([*show, "--timeline"], capture_output=True, text=True)
    assert every.returncode == 0, every.stderr
    rows = {cells[1] for ln in every.stdout.splitlines() if len(cells := _cells(ln)) > 2}
    for span in ("claim", "pull", "first step", "offer to first token"):
        assert span in rows, every.stdout


@pytest.mark.cell(PLAIN_ROW, _transport)
def test_streamed_requests_are_pulled_as_their_prefill_computes_them(pd: PD) -> None:
    """Issue 49, 3: `kvflow proxy --stream` sends each request to both servers at once;
    the prefill server offers its blocks as it schedules the prompt (`OfferStreamed`),
    before its request finishes, and the decode server pulls them under the proxy's id:
    the same tokens as one server, every prompt token pulled."""
    proxy = PdProxy([pd.prefill.url], [pd.decode.url], stream=True).start()
    try:
        first = _prompt(40)  # goes the convention's way: the proxy learns the workers
        assert_same(pd.decode.completion(first, 8, url=proxy.url), pd.reference(first), "first")
        assert proxy.producer(pd.prefill.url), "the prefill's answer named its workers"
        for n in (10, 301):
            prompt = _prompt(n)
            want = pd.reference(prompt)
            before = _loaded(pd.decode.metrics())
            got = pd.decode.completion(prompt, 8, url=proxy.url)
            assert_same(got, want, f"a streamed {n}-token prompt")
            pulled, external, _ = _loaded_since(pd.decode, before)
            assert pulled == external == n, f"{n} prompt tokens: pulled {pulled}, vLLM {external}"
            t = _timeline(pd, got["id"].removeprefix("cmpl-"), ("first token", "prefill done"))
            marks = {m.stage: m for m in t.marks}
            assert marks["offered"].detail.startswith("streamed"), t.marks
            assert marks["offered"].ts < marks["prefill done"].ts, "offered as scheduled"
            assert t.first("pull done") is not None and t.first("first token") is not None
        prompts = [_prompt(60 + 37 * i) for i in range(4)]
        want = [pd.reference(p) for p in prompts]
        with ThreadPoolExecutor(4) as ex:
            got = list(ex.map(lambda p: pd.decode.completion(p, 8, url=proxy.url), prompts))
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"streamed concurrent request {i}")
    finally:
        proxy.close()


def _cells(line: str) -> list[str]:
    """A line of a table `kvflow inspect` drew: its cells, stripped."""
    return [c.strip() for c in re.split("[│┃]", line)]


def test_a_prefix_already_in_the_decode_servers_cache_is_not_pulled_again(pd: PD) -> None:
    first = _prompt(128)  # four whole blocks
    assert_same(pd.ask(first), pd.reference(first), "the first prompt")
    longer = first + _prompt(90)
    want = pd.reference(longer)
    before = _loaded(pd.decode.metrics())
    assert_same(pd.ask(longer), want, "a prompt whose first blocks the decode server holds")
    pulled, external, local = _loaded_since(pd.decode, before)
    assert local == 128, "the decode server's own prefix cache supplied the first blocks"
    assert pulled == external == len(longer) - 128, (pulled, external, local)


def test_sixteen_concurrent_requests(pd: PD) -> None:
    prompts = [_prompt(40 + 23 * i) for i in range(16)]
    want = [pd.reference(p) for p in prompts]
    with ThreadPoolExecutor(16) as ex:
        got = list(ex.map(pd.ask, prompts))
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_same(g, w, f"concurrent request {i}")


def test_a_request_queued_past_the_prefill_servers_hold_timeout_is_still_pulled(pd: PD) -> None:
    """A loaded decode server may start a request long after its prefill: here vLLM's
    /pause?mode=keep (as for a weight update) holds it in the queue past the prefill
    server's hold_timeout_s. The decode server claimed the blocks as the request
    arrived and renews the claim (every lease_s / 3), so they are still there."""
    prompt = _prompt(100)
    want = pd.reference(prompt)
    prefill = pd.prefill.completion(prompt, 1, dict(PREFILL_PARAMS))  # the proxy's first leg
    params = prefill["kv_transfer_params"]
    post(pd.decode.url + "/pause?mode=keep", {})
    try:
        with ThreadPoolExecutor(1) as ex:
            queued = ex.submit(pd.decode.completion, prompt, 8, params)
            time.sleep(HOLD_S + 5)  # the scenario itself: the request waits in the queue
            assert not queued.done(), "the decode server ran it while paused"
            post(pd.decode.url + "/resume", {})
            got = queued.result()
    finally:
        post(pd.decode.url + "/resume", {})
    assert_same(got, want, "a request that queued past the hold timeout")  # policy fail


def _rejected(m: dict[str, float], reason: str) -> float:
    return m.get(f'vllm:kvflow_rejected_total{{reason="{reason}"}}', 0.0)


def test_a_stranger_on_the_side_channel_cannot_stop_pd(pd: PD) -> None:
    """Issue 27: one multi-frame message to the prefill server's side channel (its
    address is in any prefill answer's kv_transfer_params) ended the producer's serving
    task, and every later P/D request failed. Now each bad message is refused and
    counted (keyed: the stranger's connection fails its handshake first), P/D goes on,
    and the offer whose params the stranger read is still pulled by its request."""
    prompt = _prompt(40)
    params = pd.prefill.completion(prompt, 1, dict(PREFILL_PARAMS))["kv_transfer_params"]
    (address,) = params["kvflow"]["addresses"]
    before = pd.prefill.metrics()
    ctx = zmq.Context()
    try:
        attacker = ctx.socket(zmq.DEALER)
        attacker.connect(address)
        attacker.send_multipart([b"one", b"two", b"three"])  # the frame that killed serve
        attacker.send(b"\x81\xa4type\xa4Pull")  # msgpack of the wrong shape
        attacker.send_multipart([b""])
        attacker.close(linger=2000)
    finally:
        ctx.term()
    want = pd.reference(prompt)
    assert_same(pd.decode.completion(prompt, 8, params), want, "the request the stranger saw")
    for n in (40, 150):  # P/D still works
        other = _prompt(n)
        assert_same(pd.ask(other), pd.reference(other), f"P/D after the attack ({n} tokens)")
    reason = "unauthenticated"  # a host key authenticates the channel as a deployment's does
    m = pd.prefill.metrics_once(lambda m: _rejected(m, reason) > _rejected(before, reason))
    assert _rejected(m, reason) > _rejected(before, reason), "the stranger was not counted"
    assert "Traceback" not in pd.prefill.log_text()


def test_params_of_another_prompt_are_computed_here_never_loaded(pd: PD) -> None:
    """Issue 27, finding 4: a client (or a buggy proxy) sends one prompt with another
    prompt's kv_transfer_params. The decode server computes the prompt itself: the
    tokens are one server's, nothing is pulled, the refusal is counted."""
    theirs, mine = _prompt(120), _prompt(120)
    params = pd.prefill.completion(theirs, 1, dict(PREFILL_PARAMS))["kv_transfer_params"]
    want = pd.reference(mine)
    before = pd.decode.metrics()
    got = pd.decode.completion(mine, 8, params)
    assert_same(got, want, "a prompt sent with another prompt's params")
    m = pd.decode.metrics_once(lambda m: _rejected(m, "prompt") > _rejected(before, "prompt"))
    assert _rejected(m, "prompt") == _rejected(before, "prompt") + 1
    assert _loaded(m)[0] == _loaded(before)[0], "the decode server loaded something"
    # the params still serve the prompt they were made for (and its offer is pulled)
    assert_same(pd.decode.completion(theirs, 8, params), pd.reference(theirs), "their prompt")


def test_an_api_client_cannot_forge_params_that_put_one_prompts_kv_under_anothers(
    pd: PD,
) -> None:
    """Issue 46, H1: an API client prefills prompts A and B (same token count) with
    `do_remote_decode`, then sends the decode server B with A's offer, blocks and
    addresses and B's prompt digest, signed with nothing or with B's MAC. Keyless, the
    decode server pulled A's KV into B's blocks and its prefix cache kept them under B's
    hashes. Now the params are signed (the README's keyless setup too, with the host
    key): the decode server computes B itself, loads nothing, counts `signature`, and B's
    later users get B's KV."""
    a, b = _prompt(200), _prompt(200)
    ka, kb = (
        pd.prefill.completion(p, 1, dict(PREFILL_PARAMS))["kv_transfer_params"] for p in (a, b)
    )
    assert ka["kvflow"]["mac"] and kb["kvflow"]["mac"], "the default setup signs its params"
    want = pd.reference(b)
    for mac in ("", kb["kvflow"]["mac"]):
        forged = dict(ka, kvflow=dict(ka["kvflow"], prompt=kb["kvflow"]["prompt"], mac=mac))
        before = pd.decode.metrics()
        got = pd.decode.completion(b, 8, forged)
        assert_same(got, want, f"prompt B with A's offer (mac {mac[:8]!r})")
        m = pd.decode.metrics_once(
            lambda m, n=before: _rejected(m, "signature") > _rejected(n, "signature")
        )
        assert _rejected(m, "signature") == _rejected(before, "signature") + 1
        assert _loaded(m)[0] == _loaded(before)[0], "the decode server loaded A's KV"
    # B's later users: from the decode server's prefix cache, and through P/D
    assert_same(pd.decode.completion(b, 8), want, "B again, from the decode server's cache")
    longer = b + _prompt(40)
    assert_same(pd.ask(longer), pd.reference(longer), "B and more, through P/D")
    # A's params, as they came, still serve A: its offer was never touched
    assert_same(pd.decode.completion(a, 8, ka), pd.reference(a), "A with its own params")


def test_no_pull_failed_or_timed_out(pd: PD) -> None:
    m = pd.decode.metrics()
    assert m.get('vllm:kvflow_tokens_total{direction="load"}', 0) > 0
    assert m.get("vllm:kvflow_failures_total", 0) == 0, m
    assert m.get("vllm:kvflow_timeouts_total", 0) == 0, m
    log = pd.decode.log_text()
    assert "kvflow load of" not in log, "a load failed: " + log[-3000:]
    assert "pinned to CPU cores" not in log  # each server on its own core: no clash reported
    assert pd.prefill.metrics().get("vllm:kvflow_failures_total", 0) == 0


def test_a_request_the_decode_server_refuses_hands_its_offer_back_at_once(pd: PD) -> None:
    """vLLM's serving layer answers a request it refuses before the engine (here: more
    tokens than the model's length) with an error, and tells the connector with a
    stand-in request of one token and the request's params, aborted at once
    (`notify_kv_transfer_request_rejected`). kvflow took that for params made for
    another prompt: it logged and counted a refusal (`prompt`) and left the prefill
    server holding the offer until its hold timeout. Now the producer is told to let
    the offer go, and nothing is counted as refused. (Last in the module: the released
    offer counts as the prefill server's one failed transfer.)"""
    prompt = _prompt(70)
    params = pd.prefill.completion(prompt, 1, dict(PREFILL_PARAMS))["kv_transfer_params"]
    before = pd.decode.metrics()
    refused = pd.decode.completion(prompt, 4096, params)  # past max_model_len
    assert refused.get("error") == 400, refused

    def ended() -> list[TransferFailed]:
        events = read_event_log(str(pd.events))
        return [e for e in events if isinstance(e, TransferFailed) and e.direction == "send"]

    deadline = time.monotonic() + HOLD_S + 30  # it ends either way: now, or at HOLD_S
    while not ended() and time.monotonic() < deadline:
        time.sleep(0.2)  # polls another process's event log
    outcomes = [e.reason for e in ended()]
    assert outcomes == ["released unpulled by its consumer"], outcomes
    m = pd.decode.metrics()
    assert _rejected(m, "prompt") == _rejected(before, "prompt"), "vLLM's notice was refused"
