"""Real Redis deployments for the tests: a standalone server, a 3-master/3-replica Redis
Cluster, a primary/replica pair watched by three Sentinels, and a TLS server, each from
Debian's `redis-server` on free loopback ports, without persistence, killed at the end."""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import socket
import ssl
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

START_TIMEOUT_S = 30.0
CACHE = ["--save", "", "--appendonly", "no", "--maxmemory", "1gb"]
CACHE += ["--maxmemory-policy", "allkeys-lru"]


def binary() -> str | None:
    return shutil.which("redis-server") or shutil.which("valkey-server")


def free_port(bus: bool = False) -> int:
    """A free loopback port; with `bus`, one whose cluster bus port (+10000) is free too."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if not bus:
            return port
        if port <= 55535:
            with socket.socket() as s, contextlib.suppress(OSError):
                s.bind(("127.0.0.1", port + 10000))
                return port


def command(port: int, *args: str, tls: Path | None = None) -> bytes:
    """One command over a plain (or, with `tls`'s CA, a TLS) socket: its raw reply."""
    body = b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a.encode()) for a in args)
    with socket.create_connection(("127.0.0.1", port), timeout=2) as raw:
        sock: socket.socket = raw
        if tls is not None:
            ctx = ssl.create_default_context(cafile=str(tls / "ca.crt"))
            sock = ctx.wrap_socket(raw, server_hostname="localhost")
        sock.sendall(body)
        return sock.recv(1 << 16)


def answers(port: int, tls: Path | None = None) -> bool:
    try:
        return command(port, "PING", tls=tls).startswith(b"+PONG")
    except OSError:
        return False


def wait_for(what: str, ready: Callable[[], bool], procs: list[Server]) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not ready():
        for p in procs:
            p.check()
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not ready within {START_TIMEOUT_S} s")
        time.sleep(0.05)


@dataclasses.dataclass
class Server:
    """One redis-server (or sentinel) process."""

    port: int
    args: list[str]
    log: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Server:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(self.args, stdout=out, stderr=subprocess.STDOUT)
        return self

    def check(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            tail = self.log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {tail}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


@dataclasses.dataclass
class Deployment:
    servers: list[Server]
    url: str

    def close(self) -> None:
        for s in self.servers:
            s.kill()


def server(work: Path, name: str, *extra: str) -> Server:
    exe = binary()
    assert exe is not None
    port = free_port(bus="--cluster-enabled" in extra)
    home = work / name
    home.mkdir(parents=True, exist_ok=True)
    args = [exe, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(home), *CACHE, *extra]
    return Server(port, args, home / "redis.log")


@contextlib.contextmanager
def standalone(work: Path, maxmemory: str = "1gb") -> Iterator[Deployment]:
    s = server(work, "standalone", "--maxmemory", maxmemory).start()
    d = Deployment([s], f"redis://127.0.0.1:{s.port}/0")
    try:
        wait_for("redis-server", lambda: answers(s.port), d.servers)
        yield d
    finally:
        d.close()


@contextlib.contextmanager
def cluster(work: Path, masters: int = 3) -> Iterator[Deployment]:
    """`masters` masters with one replica each, formed by `redis-cli --cluster create`."""
    options = ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
    options += ["--cluster-node-timeout", "1000"]
    options += ["--cluster-replica-validity-factor", "0"]  # a replica always takes over
    nodes = [server(work, f"node{i}", *options) for i in range(2 * masters)]
    d = Deployment([n.start() for n in nodes], "")
    try:
        for n in nodes:
            wait_for(f"cluster node :{n.port}", lambda n=n: answers(n.port), d.servers)
        cli = shutil.which("redis-cli") or shutil.which("valkey-cli") or "redis-cli"
        addresses = [f"127.0.0.1:{n.port}" for n in nodes]
        subprocess.run(
            [cli, "--cluster", "create", *addresses, "--cluster-replicas", "1", "--cluster-yes"],
            check=True,
            capture_output=True,
            timeout=60,
        )
        for n in nodes:  # every node agrees: slots covered, each master has its replica
            wait_for("the cluster", lambda n=n: cluster_ok(n.port, masters), d.servers)
        d.url = "redis://" + ",".join(addresses[:2])  # the client discovers the rest
        yield d
    finally:
        d.close()


def cluster_ok(port: int, replicas: int = 0) -> bool:
    """The node at `port` sees every slot served, and at least `replicas` replicas."""
    try:
        if b"cluster_state:ok" not in command(port, "CLUSTER", "INFO"):
            return False
        lines = command(port, "CLUSTER", "NODES").split(b"\n")[1:]
        flags = [line.split()[2] for line in lines if len(line.split()) > 2]
        return sum(b"slave" in f.split(b",") for f in flags) >= replicas
    except OSError:
        return False


def role(port: int) -> bytes:
    """`master` or `slave`, from ROLE's first element."""
    reply = command(port, "ROLE")
    return reply.split(b"\r\n")[2]


@contextlib.contextmanager
def sentinel(work: Path, master_name: str = "kvflow") -> Iterator[Deployment]:
    """A primary, its replica, and three sentinels (quorum 2) that fail it over within
    about a second."""
    primary = server(work, "primary").start()
    replica = server(work, "replica", "--replicaof", "127.0.0.1", str(primary.port)).start()
    sentinels: list[Server] = []
    for i in range(3):
        s = server(work, f"sentinel{i}")
        conf = Path(s.log.parent / "sentinel.conf")
        conf.write_text(
            f"port {s.port}\nbind 127.0.0.1\ndir {s.log.parent}\n"
            f"sentinel monitor {master_name} 127.0.0.1 {primary.port} 2\n"
            f"sentinel down-after-milliseconds {master_name} 1000\n"
            f"sentinel failover-timeout {master_name} 5000\n"
        )
        s.args = [s.args[0], str(conf), "--sentinel"]
        sentinels.append(s.start())
    d = Deployment([primary, replica, *sentinels], "")
    try:
        for s in d.servers:
            wait_for(f"redis :{s.port}", lambda s=s: answers(s.port), d.servers)
        wait_for("replication", lambda: b"master_link_status:up" in info(replica.port), d.servers)
        d.url = "redis://" + ",".join(f"127.0.0.1:{s.port}" for s in sentinels) + "/0"
        yield d
    finally:
        d.close()


def info(port: int) -> bytes:
    try:
        return command(port, "INFO", "replication")
    except OSError:
        return b""


def make_certs(work: Path) -> Path:
    """A CA and a server certificate for `localhost`/127.0.0.1 (openssl), in `work`."""
    work.mkdir(parents=True, exist_ok=True)

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=work, check=True, capture_output=True, timeout=60)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt",
        "-days", "2", "-subj", "/CN=kvflow-test-ca")  # fmt: skip
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr",
        "-subj", "/CN=localhost")  # fmt: skip
    (work / "san.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
        "-CAcreateserial", "-out", "server.crt", "-days", "2", "-extfile", "san.ext")  # fmt: skip
    return work


@contextlib.contextmanager
def tls(work: Path) -> Iterator[Deployment]:
    """A server that speaks only TLS, with a certificate for 127.0.0.1 signed by the CA in
    `<work>/certs/ca.crt`."""
    certs = make_certs(work / "certs")
    s = server(work, "tls")
    s.args[s.args.index("--port") + 1] = "0"
    s.args += ["--tls-port", str(s.port), "--tls-cert-file", str(certs / "server.crt")]
    s.args += ["--tls-key-file", str(certs / "server.key"), "--tls-ca-cert-file"]
    s.args += [str(certs / "ca.crt"), "--tls-auth-clients", "no"]
    d = Deployment([s.start()], f"rediss://127.0.0.1:{s.port}/0")
    try:
        wait_for("the TLS server", lambda: answers(s.port, tls=certs), d.servers)
        yield d
    finally:
        d.close()
