"""`kvflow doctor` on a redis store (`RedisTransport.doctor`): a real server reachable, a
closed port, credentials it refuses, a server that does not evict, and the command as a
user runs it, with redis as the store and as a tier below `fs`. The URL's password is
never shown."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import servers

from kvflow_redis import RedisOptions, RedisTransport

SECRET = "hunter2-not-shown"


class Found:
    """What a check said (`kvflow doctor` hands a check its own collector)."""

    def __init__(self) -> None:
        self.items: list[tuple[str, str, str, str]] = []

    def ok(self, check: str, found: str) -> None:
        self.items.append(("ok", check, found, ""))

    def warn(self, check: str, found: str, fix: str) -> None:
        self.items.append(("warn", check, found, fix))

    def fail(self, check: str, found: str, fix: str) -> None:
        self.items.append(("FAIL", check, found, fix))


def doctor(**options: Any) -> tuple[str, str, str]:
    """(status, found, fix) of the one finding of `RedisTransport.doctor`."""
    found = Found()
    RedisTransport.doctor(RedisOptions(**options), found)
    assert len(found.items) == 1, found.items
    status, check, text, fix = found.items[0]
    assert check == "redis" and SECRET not in text + fix
    return status, text, fix


def closed_url() -> str:
    return f"redis://kvflow:{SECRET}@127.0.0.1:{servers.free_port()}/0"


def test_a_reachable_server_answers(redis_url: str) -> None:
    status, text, _ = doctor(url=redis_url)
    assert status == "ok" and "answers PING" in text, text


def test_a_closed_port_fails_without_showing_the_password() -> None:
    status, text, fix = doctor(url=closed_url(), timeout_s=2.0)
    assert status == "FAIL" and "Connection refused" in text
    assert "kvflow:***@127.0.0.1" in text and "['url']" in fix


def test_a_password_the_server_refuses_fails(redis_url: str) -> None:
    url = redis_url.replace("redis://", f"redis://kvflow:{SECRET}@")
    status, text, _ = doctor(url=url)  # the test server has no such user
    assert status == "FAIL" and "***" in text, text


def test_a_password_env_that_is_not_set_fails(redis_url: str) -> None:
    status, text, fix = doctor(url=redis_url, password_env="KVFLOW_DOCTOR_NO_SUCH_VAR")
    assert status == "FAIL" and "KVFLOW_DOCTOR_NO_SUCH_VAR" in text + fix


def test_a_bad_url_fails_without_showing_the_password() -> None:
    status, text, _ = doctor(url=f"redis://kvflow:{SECRET}@127.0.0.1:6379/notadb")
    assert status == "FAIL" and "database 'notadb' is not a number" in text


def test_some_nodes_down_is_a_warning(redis_url: str) -> None:
    live = redis_url.split("://")[1].split("/")[0]
    url = f"redis://{live},127.0.0.1:{servers.free_port()}"
    status, text, fix = doctor(url=url, mode="cluster", timeout_s=2.0)
    assert status == "warn" and "1 of 2 answered" in text and "nodes" in fix, text


def test_a_tls_server_answers_with_its_ca_and_fails_without(redis_tls: tuple[str, Path]) -> None:
    url, ca = redis_tls
    status, text, _ = doctor(url=url, tls_ca_file=str(ca))
    assert status == "ok" and "answers PING" in text, text
    status, text, _ = doctor(url=url)  # the system's CAs do not sign the test server's
    assert status == "FAIL" and "CERTIFICATE_VERIFY_FAILED" in text, text


@pytest.fixture(scope="module")
def noeviction(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A server that refuses writes once full instead of evicting."""
    if servers.binary() is None:
        pytest.skip("redis-server is not installed (Debian: apt-get install -y redis-server)")
    work = tmp_path_factory.mktemp("noeviction")
    s = servers.server(work, "noeviction", "--maxmemory-policy", "noeviction").start()
    try:
        servers.wait_for("redis-server", lambda: servers.answers(s.port), [s])
        yield f"redis://127.0.0.1:{s.port}/0"
    finally:
        s.kill()


def test_a_server_that_does_not_evict_warns(noeviction: str) -> None:
    status, text, fix = doctor(url=noeviction)
    assert status == "warn" and "noeviction" in text and "allkeys-lru" in fix


def kvflow_doctor(config: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """`kvflow doctor --json CONFIG` as a user runs it."""
    script = Path(sys.executable).parent / "kvflow"
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "kvflow.cli.main"]
    out = subprocess.run(
        [*cmd, "doctor", "--json", json.dumps(config)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert SECRET not in out.stdout + out.stderr
    found = json.loads(out.stdout)
    return out.returncode, {f["check"]: f for f in found["findings"]}


def test_the_command_checks_redis_as_the_store_and_as_a_tier(
    redis_url: str, tmp_path: Path
) -> None:
    rc, found = kvflow_doctor({"transport": "redis", "options": {"url": redis_url}})
    assert found["redis"]["status"] == "ok" and found["config"]["status"] == "ok"
    store = {"transport": "fs", "options": {"path": str(tmp_path), "max_gb": 0.001}}
    tier = {"transport": "redis", "options": {"url": closed_url(), "timeout_s": 2.0}}
    rc, found = kvflow_doctor({**store, "tiers": [tier]})
    assert rc == 1 and found["redis"]["status"] == "FAIL", found
    assert found["fs path"]["status"] == "ok"
