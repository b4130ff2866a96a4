"""Faults on a real store under vLLM's OpenAI server: each ends in a recompute (policy
`recompute`) or a clear request error (policy `fail`), identical tokens otherwise, and
no leaked block (`vllm:kv_cache_usage_perc` is 0 once the server is idle).

Two servers share nothing: `recompute` keeps its store on a 1.5 MiB tmpfs (disk full,
read-only remount), `strict` on a directory. The tmpfs is mounted in a user and mount
namespace of the test's own (`unshare -rm`: no root or CAP_SYS_ADMIN needed), and the
server reaches it through the path `/proc/PID/root/...` of the process holding that
namespace; where the kernel or a sandbox refuses user namespaces (Docker's default
seccomp profile, `user.max_user_namespaces=0`, Ubuntu's AppArmor restriction for
non-root users) the store is a plain directory and the two tests that need it skip.
vLLM's own prefix cache is off, so every request asks kvflow. The P/D faults (producer
killed, consumer never comes, claims) are in test_e2e_pd.py and test_pd_lease.py;
a taken side-channel port is at the end here.
"""

from __future__ import annotations

import random
import re
import shutil
import socket
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from kvflow.keyfiles import keygen
from kvflow.keys import chunk_keys
from kvflow.observe.events import TransferFailed
from kvflow.observe.log import read_event_log
from kvflow_vllm.apiserver import ApiServer
from kvflow_vllm.engine_process import EngineFailed, Scenario, spawn_engine
from kvflow_vllm.serving import close_all

from ..support.vllm_servers import assert_same, wait_idle

pytestmark = [pytest.mark.engine, pytest.mark.slow]

_rng = random.Random(41)
PROMPTS = [[_rng.randrange(3, 1000) for _ in range(60 + 17 * i)] for i in range(12)]
BASE = [_rng.randrange(3, 1000) for _ in range(160)]  # five chunks of 32
SHARED = BASE[:128] + [_rng.randrange(3, 1000) for _ in range(64)]  # its first four, two new
PROMPTS += [BASE, SHARED]
ARGS = ("--no-enable-prefix-caching", "--max-num-seqs", "8")
TMPFS_BYTES = 3 << 19
"""1.5 MiB: a few of PROMPTS' chunks (4 KiB per token on the tiny model) fill it."""


def _config(path: Path, policy: str, events: Path) -> dict[str, Any]:
    return {
        "kv_connector": "KVFlowConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": policy,
        "kv_connector_extra_config": {
            "transport": "fs",
            "options": {"path": str(path)},
            "event_log": str(events),
        },
    }


HOLDER = """
mount -t tmpfs -o size="$2",mode=0700 tmpfs "$1" || exit 1
echo mounted
while read -r mode; do mount -o remount,bind,"$mode" "$1" && echo "$mode" || echo failed; done
"""
"""Mounts the tmpfs in its namespace (mode 0700: `fs` refuses a store others may write
to, as a tmpfs's default 1777 allows), then remounts it `ro` or `rw` as told on stdin
(a bind remount: a user namespace may not remount the superblock it mounted)."""


class SmallStore:
    """A 1.5 MiB tmpfs in a user and mount namespace held by a shell (`unshare -rm`),
    reached from outside it at `path`; `path` is a plain directory, and `why_not` says
    why, where no such namespace can be made."""

    def __init__(self, where: Path) -> None:
        where.mkdir(parents=True)
        self.path, self.why_not = where, ""
        cmd = ["unshare", "--user", "--map-root-user", "--mount", "--propagation", "private"]
        cmd += ["sh", "-c", HOLDER, "holder", str(where), str(TMPFS_BYTES)]
        try:
            self.holder: subprocess.Popen[str] | None = subprocess.Popen(
                cmd,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        except OSError as exc:
            self.holder, self.why_not = None, f"cannot run unshare: {exc}"
            return
        assert self.holder.stdout is not None
        if self.holder.stdout.readline().strip() != "mounted":
            _, err = self.holder.communicate()
            said = (err.strip().splitlines() or ["no error message"])[0]
            self.holder, self.why_not = None, f"unshare -rm, mount -t tmpfs: {said}"
            return
        self.path = Path(f"/proc/{self.holder.pid}/root") / where.relative_to(where.anchor)

    def remount(self, mode: str) -> None:
        assert self.holder is not None and self.holder.stdin and self.holder.stdout
        self.holder.stdin.write(f"{mode}\n")
        self.holder.stdin.flush()
        assert self.holder.stdout.readline().strip() == mode, f"remount {mode} failed"

    def close(self) -> None:
        """The namespace, and its tmpfs, go when the holder exits (at the end of stdin)."""
        if self.holder is not None:
            self.holder.communicate()


class Servers:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.store = SmallStore(tmp / "small")
        self.small = self.store.path
        self.dir = tmp / "dir"
        self.events = {name: tmp / f"{name}.events.jsonl" for name in ("recompute", "strict")}
        self.recompute = ApiServer(
            tmp,
            "recompute",
            _config(self.small, "recompute", self.events["recompute"]),
            *ARGS,
            cores="0",
        )
        self.strict = ApiServer(
            tmp, "strict", _config(self.dir, "fail", self.events["strict"]), *ARGS, cores="1"
        )
        self.want: list[dict[str, Any]] = []

    def close(self) -> None:
        try:
            close_all((self.recompute, self.strict))
        finally:
            self.store.close()

    def failed(self, server: ApiServer) -> list[TransferFailed]:
        """The failed KV transfers in `server`'s event log, oldest first."""
        log = self.events[server.name]
        events = read_event_log(str(log)) if log.exists() else []
        return [e for e in events if isinstance(e, TransferFailed) and e.what == "kv"]


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    s = Servers(tmp_path_factory.mktemp("faults"))
    try:
        s.recompute.wait_ready()
        s.strict.wait_ready()
        # the reference: each prompt computed alone (kvflow's store was empty)
        s.want = [s.strict.completion(p, 8) for p in PROMPTS]
        wait_idle(s.strict)
        yield s
    finally:
        s.close()


def chunks(store: Path) -> list[Path]:
    return sorted(store.rglob("*.kv"))


def _idle(server: ApiServer) -> None:
    m = wait_idle(server)
    assert m.get("vllm:num_requests_running", 0) == 0
    assert m.get("vllm:kv_cache_usage_perc") == 0, "blocks still held when idle"


def _failed(resp: dict[str, Any]) -> bool:
    """A request error: an HTTP error, or a choice that finished with `error`."""
    return "error" in resp or resp["choices"][0].get("finish_reason") == "error"


def _counter(server: ApiServer, name: str) -> float:
    return server.metrics().get(name, 0.0)


def _needs_tmpfs(servers: Servers) -> None:
    if servers.store.why_not:
        pytest.skip(
            "needs the 1.5 MiB tmpfs store, mounted in a user and mount namespace, which "
            f"this kernel or sandbox refuses ({servers.store.why_not})"
        )


def _detected(
    servers: Servers, server: ApiServer, failures: float, seen: int, victim: Path, bad: bytes
) -> None:
    """Since the event log held `seen` failures and the counter `failures`: one load
    failed, on `victim`'s checksum, named in the event log and the server's log; the bad
    file (`bad`, its bytes) was deleted (the recompute may have saved it afresh); and
    `vllm:kvflow_failures_total` counted each failed transfer."""
    new = servers.failed(server)[seen:]
    loads = [e.reason for e in new if e.direction == "load"]
    assert len(loads) == 1, f"not one failed load (a miss, not a corrupt chunk?): {loads}"
    (reason,) = loads
    assert reason.startswith("ChunkCorrupt: chunk"), reason
    named = rf"checksum mismatch in layer \d+ in {re.escape(str(victim))}; deleted it$"
    assert re.search(named, reason), reason
    assert reason in server.log_text(), "the failed load is logged"
    assert not victim.exists() or victim.read_bytes() != bad, "the bad file is still there"
    name = "vllm:kvflow_failures_total"
    m = server.metrics_once(lambda m: m.get(name, 0.0) >= failures + len(new))
    assert m.get(name, 0.0) == failures + len(new), f"{name}: not each failure counted"


def test_a_full_disk_drops_saves_never_requests(servers: Servers) -> None:
    _needs_tmpfs(servers)
    server = servers.recompute
    before = _counter(server, "vllm:kvflow_failures_total")
    logged = len(server.log_text())
    with ThreadPoolExecutor(4) as ex:  # more than the store holds
        got = list(ex.map(lambda p: server.completion(p, 8), PROMPTS))
    for i, g in enumerate(got):
        assert_same(g, servers.want[i], f"prompt {i} with the disk full")
    _idle(server)
    assert _counter(server, "vllm:kvflow_failures_total") > before, "no save failed"
    assert "No space left on device" in server.log_text()[logged:]
    assert chunks(servers.small), "the saves that fitted are kept"


def test_a_read_only_store_still_serves_its_chunks(servers: Servers) -> None:
    _needs_tmpfs(servers)
    server, store = servers.recompute, servers.small
    for p in chunks(store):
        p.unlink()
    assert_same(server.completion(PROMPTS[0], 8), servers.want[0], "saved before read-only")
    _idle(server)
    assert chunks(store), "prompt 0 was saved"
    loaded = _counter(server, 'vllm:kvflow_tokens_total{direction="load"}')
    logged, seen = len(server.log_text()), len(servers.failed(server))
    servers.store.remount("ro")
    try:
        assert_same(server.completion(PROMPTS[0], 8), servers.want[0], "a hit, read-only")
        assert_same(server.completion(PROMPTS[1], 8), servers.want[1], "a miss, read-only")
        _idle(server)
    finally:
        servers.store.remount("rw")
    assert _counter(server, 'vllm:kvflow_tokens_total{direction="load"}') > loaded
    failed = servers.failed(server)[seen:]
    assert [e.direction for e in failed if e.direction == "save"], "no save failed"
    assert not [e.reason for e in failed if e.direction == "load"], "a load failed"
    assert "Read-only file system" in server.log_text()[logged:]


def _break(store: Path, how: str) -> Path:
    """Truncate one chunk file, or flip a byte in the middle of it."""
    return _break_file(chunks(store)[0], how)


def _break_file(victim: Path, how: str) -> Path:
    if how == "truncate":
        with open(victim, "r+b") as f:
            f.truncate(victim.stat().st_size // 2)
    else:
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(bytes(data))
    return victim


@pytest.mark.parametrize(("how", "why"), [("truncate", "truncated"), ("flip", "checksum")])
def test_a_truncated_or_corrupt_chunk_is_a_request_error_once(
    servers: Servers, how: str, why: str
) -> None:
    server, store = servers.strict, servers.dir
    prompt, want = PROMPTS[2], servers.want[2]
    for p in chunks(store):  # so that only this prompt's chunks are there to break
        p.unlink()
    assert_same(server.completion(prompt, 8), want, "saved")
    _idle(server)
    logged = len(server.log_text())
    victim = _break(store, how)
    failed = server.completion(prompt, 8)  # policy fail: a clear request error
    assert _failed(failed), failed
    _idle(server)
    log = server.log_text()[logged:]  # this request's, not an earlier case's
    assert "ChunkCorrupt: chunk" in log and why in log and str(victim) in log, log[-3000:]
    assert not victim.exists(), "the bad file was deleted"
    # the next request loads what is intact, computes the rest and saves it again
    assert_same(server.completion(prompt, 8), want, "after the bad chunk")
    _idle(server)
    assert victim.exists()
    assert_same(server.completion(prompt, 8), want, "from the chunk saved afresh")
    _idle(server)


def test_under_policy_recompute_a_corrupt_chunk_is_only_a_recompute(servers: Servers) -> None:
    """The same tokens as computed alone, and the corrupt chunk detected: a checksum
    failure counted, named in the event log and deleted (kvflow did not just miss)."""
    server, store = servers.recompute, servers.small
    for p in chunks(store):
        p.unlink()
    assert_same(server.completion(PROMPTS[3], 8), servers.want[3], "saved")
    _idle(server)
    failures = _counter(server, "vllm:kvflow_failures_total")
    seen = len(servers.failed(server))
    victim = _break(store, "flip")
    bad = victim.read_bytes()
    assert_same(server.completion(PROMPTS[3], 8), servers.want[3], "recomputed")
    _idle(server)
    _detected(servers, server, failures, seen, victim, bad)


def test_a_store_deleted_mid_run_is_a_miss_and_is_made_again(servers: Servers) -> None:
    server, store = servers.strict, servers.dir
    with ThreadPoolExecutor(6) as ex:
        running = [ex.submit(server.completion, p, 8) for p in PROMPTS[4:10]]
        gone = store.rename(store.with_name("deleted"))  # while they save and load
        shutil.rmtree(gone, ignore_errors=True)  # (saves still land in the moved tree)
        got = [r.result() for r in running]
    for i, g in enumerate(got, start=4):
        assert_same(g, servers.want[i], f"prompt {i}, store deleted")  # policy fail: no error
    _idle(server)
    assert_same(server.completion(PROMPTS[10], 8), servers.want[10], "after the deletion")
    _idle(server)
    assert chunks(store), "saves made the store again"


def test_a_taken_side_channel_port_fails_at_start_naming_it(tmp_path: Path) -> None:
    """The engine stops at start naming the port. Keyed, the producer's handshake
    socket was left open by the failed bind, and the worker process never exited (nor,
    with it, vLLM's server): found by scripts/faults.py's port-taken row. (Keyless, the
    same bind fails the same way, one socket fewer; that run was dropped to keep CI
    within its time.)"""
    extra: dict[str, Any] = {"transport": "zmq", "key_file": str(keygen(tmp_path / "key"))}
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        sc = Scenario(
            batches=[], kv_role="kv_producer", extra_config={**extra, "options": {"port": port}}
        )
        with pytest.raises(EngineFailed) as failed:
            spawn_engine(tmp_path, "taken", sc, timeout=240)
    assert f"cannot bind tcp://127.0.0.1:{port}" in failed.value.log
    assert "kv_connector_extra_config['options']" in failed.value.log


def _chunk_file(store: Path, prompt: list[int], index: int) -> Path:
    (namespace,) = [d for d in store.iterdir() if d.is_dir()]
    key = chunk_keys(namespace.name, prompt, 32)[index]
    (path,) = namespace.glob(f"{key[:2]}/{key}.*.kv")
    return path


def test_nothing_computed_over_a_failed_load_is_stored(servers: Servers) -> None:
    """SHARED's first four chunks are BASE's; BASE's chunk 1 is corrupt. SHARED's load
    fails there, and the forward of that step computed SHARED's last two chunks over
    the bad blocks: those must not be stored (vLLM recomputes them), or every later
    request of SHARED would load them."""
    server, store = servers.recompute, servers.small
    base, shared, want = PROMPTS[-2], PROMPTS[-1], servers.want[-1]
    for p in chunks(store):
        p.unlink()
    assert_same(server.completion(base, 8), servers.want[-2], "BASE saved")
    _idle(server)
    failures = _counter(server, "vllm:kvflow_failures_total")
    seen = len(servers.failed(server))
    victim = _break_file(_chunk_file(store, base, 1), "flip")
    bad = victim.read_bytes()
    for attempt in range(3):  # the failed load; a recompute over a miss; all hits
        assert_same(server.completion(shared, 8), want, f"SHARED, request {attempt}")
        _idle(server)
        if attempt == 0:
            _detected(servers, server, failures, seen, victim, bad)
    loads = [e for e in servers.failed(server)[seen:] if e.direction == "load"]
    assert len(loads) == 1, "only the first request's load failed"
