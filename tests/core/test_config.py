"""kvflow.config: kv_connector_extra_config -> KVFlowConfig, errors that name the key."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Literal

import msgspec
import pytest

from kvflow.config import (
    ConfigError,
    KVFlowConfig,
    default_cache_dir,
    parse_config,
    parse_options,
)
from kvflow.keyfiles import HOST_KEY, KEY_ENV, RUNTIME_ENV, keygen
from kvflow.pd.security import Channel, channel_of
from kvflow.transport import TransportNotFound, available_transports, load_transport
from kvflow_fs import FsOptions, FsTransport

INSTALLED = ["fs", "zmq"]
KNOWN_KEYS = sorted(f.name for f in msgspec.structs.fields(KVFlowConfig))


def test_defaults() -> None:
    cfg = parse_config(None, transports=INSTALLED)
    assert cfg == parse_config({}, transports=INSTALLED) == KVFlowConfig()
    assert cfg.transport == "fs"
    assert cfg.load_mode == "layer"
    assert cfg.load_timeout_s == 30.0
    assert cfg.save_timeout_s == 120.0
    assert cfg.lookup_timeout_s == 5.0
    assert cfg.shutdown_drain_s == 10.0
    assert cfg.max_concurrent_transfers == 16
    assert cfg.save_partial_blocks is True
    assert cfg.event_log == ""
    assert cfg.options == {}


def test_values_are_taken_and_ints_accepted_for_seconds() -> None:
    cfg = parse_config(
        {"load_mode": "async", "load_timeout_s": 2, "options": {"path": "/x"}},
        transports=INSTALLED,
    )
    assert cfg.load_mode == "async"
    assert cfg.load_timeout_s == 2.0 and isinstance(cfg.load_timeout_s, float)
    assert cfg.options == {"path": "/x"}


def test_parse_config_does_not_mutate_its_input() -> None:
    raw: dict[str, Any] = {"transport": "fs", "options": {}}
    parse_config(raw, transports=INSTALLED)
    assert raw == {"transport": "fs", "options": {}}


def test_unknown_key_is_named_with_the_valid_keys() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"load_timout_s": 3}, transports=INSTALLED)
    msg = str(info.value)
    assert "'load_timout_s'" in msg
    for key in KNOWN_KEYS:
        assert key in msg


def test_bad_load_mode_names_the_valid_choices() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"load_mode": "eager"}, transports=INSTALLED)
    msg = str(info.value)
    assert "['load_mode']" in msg
    assert "'eager'" in msg
    assert "layer" in msg and "async" in msg


def test_bad_transport_lists_installed_transports() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"transport": "nfs"}, transports=["fs", "zmq", "nixl"])
    msg = str(info.value)
    assert "['transport']" in msg and "'nfs'" in msg
    assert "fs, nixl, zmq" in msg


def test_real_registry_knows_fs_and_names_it_on_a_miss() -> None:
    installed = list(available_transports())
    assert "fs" in installed
    assert parse_config({}, transports=installed).transport == "fs"
    assert load_transport("fs") is FsTransport
    with pytest.raises(TransportNotFound, match=r"installed: .*fs"):
        load_transport("no-such-transport")
    with pytest.raises(ConfigError, match=r"valid choices: .*fs"):
        parse_config({"transport": "no-such-transport"}, transports=installed)


@pytest.mark.parametrize(
    "key", ["load_timeout_s", "save_timeout_s", "lookup_timeout_s", "shutdown_drain_s"]
)
@pytest.mark.parametrize("value", [0, -1.5])
def test_non_positive_timeouts_are_rejected_by_name(key: str, value: float) -> None:
    with pytest.raises(ConfigError, match=rf"\['{key}'\].*> 0"):
        parse_config({key: value}, transports=INSTALLED)


def test_nan_timeout_is_rejected_by_name() -> None:
    with pytest.raises(ConfigError, match=r"\['save_timeout_s'\]"):
        parse_config({"save_timeout_s": math.nan}, transports=INSTALLED)


@pytest.mark.parametrize(
    ("text", "cores"), [("", set()), ("1", {1}), ("0-1", {0, 1}), ("0, 1", {0, 1})]
)
def test_worker_cpus_lists_cores(text: str, cores: set[int]) -> None:
    assert parse_config({"worker_cpus": text}, transports=["fs"]).cpus() == cores


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("x", "is not a core list like '1' or '2-3,6'"),
        ("3-1", "is not a core list"),
        ("1-", "is not a core list"),
        ("99999", "names cores this host lacks"),
    ],
)
def test_bad_worker_cpus_name_the_key(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=r"\['worker_cpus'\]") as caught:
        parse_config({"worker_cpus": text}, transports=["fs"])
    assert message in str(caught.value)


def test_max_concurrent_transfers_must_be_positive() -> None:
    with pytest.raises(ConfigError, match=r"\['max_concurrent_transfers'\]"):
        parse_config({"max_concurrent_transfers": 0}, transports=INSTALLED)


@pytest.mark.parametrize(
    ("raw", "key", "expected"),
    [
        ({"load_timeout_s": "fast"}, "load_timeout_s", "float"),
        ({"lookup_timeout_s": True}, "lookup_timeout_s", "float"),
        ({"save_partial_blocks": "yes"}, "save_partial_blocks", "bool"),
        ({"options": 3}, "options", "object"),
        ({"transport": 1}, "transport", "str"),
    ],
)
def test_wrong_types_name_the_key(raw: dict[str, Any], key: str, expected: str) -> None:
    with pytest.raises(ConfigError, match=rf"\['{key}'\].*{expected}"):
        parse_config(raw, transports=INSTALLED)


def test_a_config_that_is_not_an_object_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="JSON object"):
        parse_options([], FsOptions, "fs")  # type: ignore[arg-type]


@pytest.mark.parametrize("raw", ["fs", [("transport", "fs")]])
def test_parse_config_rejects_non_objects(raw: Any) -> None:
    with pytest.raises(ConfigError, match="JSON object"):
        parse_config(raw, transports=INSTALLED)


# -- transport options -----------------------------------------------------


def test_fs_options_defaults_and_values() -> None:
    assert parse_options({}, FsOptions, "fs") == FsOptions()
    opts = parse_options({"path": "/tmp/kv", "max_gb": 1, "verify": False}, FsOptions, "fs")
    assert (opts.path, opts.max_gb, opts.verify, opts.fsync) == ("/tmp/kv", 1.0, False, False)


def test_unknown_option_is_named_with_the_transport_and_valid_keys() -> None:
    with pytest.raises(ConfigError) as info:
        parse_options({"pathh": "/x"}, FsOptions, "fs")
    msg = str(info.value)
    assert "'pathh'" in msg and "transport 'fs'" in msg and "['options']" in msg
    for key in ("fsync", "max_gb", "path", "verify"):
        assert key in msg


@pytest.mark.parametrize(
    ("raw", "key"),
    [({"max_gb": "big"}, "max_gb"), ({"verify": 1}, "verify"), ({"path": 3}, "path")],
)
def test_bad_option_value_names_the_key(raw: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError, match=rf"transport 'fs'\)\['{key}'\]"):
        parse_options(raw, FsOptions, "fs")


class DemoOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A third-party transport's options with a closed set of values."""

    mode: Literal["push", "pull"] = "pull"
    port: int = 0


def test_a_transport_options_struct_with_literals_lists_choices() -> None:
    assert parse_options({"mode": "push"}, DemoOptions, "demo").mode == "push"
    with pytest.raises(ConfigError, match=r"\['mode'\].*valid choices: push, pull"):
        parse_options({"mode": "both"}, DemoOptions, "demo")


# -- cache dir -------------------------------------------------------------


def test_default_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path / "kv"))
    assert default_cache_dir() == tmp_path / "kv"
    monkeypatch.delenv("KVFLOW_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "kvflow"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "kvflow"


def test_a_key_that_cannot_be_read_is_an_error_naming_key_file_and_keygen(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(KEY_ENV, raising=False)
    monkeypatch.setenv(RUNTIME_ENV, str(tmp_path / "runtime"))
    bad = tmp_path / "bad"
    bad.write_text("not hex\n")
    bad.chmod(0o600)
    shared = keygen(tmp_path / "shared")
    shared.chmod(0o640)
    for path, why in (
        (tmp_path / "missing", "cannot read"),
        (bad, "kvflow keygen PATH"),
        (shared, r"may be read or written by others \(mode 640\): `chmod 600` it"),
    ):
        cfg = parse_config({"key_file": str(path)}, transports=["fs"])
        with pytest.raises(ConfigError, match=rf"\['key_file'\]: .*{why}"):
            channel_of(cfg)
    good = keygen(tmp_path / "key")
    channel = channel_of(parse_config({"key_file": str(good)}, transports=["fs"]))
    assert channel.keyed and channel.mode == "encrypted" and not channel.host
    monkeypatch.setenv(KEY_ENV, good.read_text())
    assert channel_of(parse_config({"channel": "kv-in-clear"}, transports=["fs"])) == (
        Channel(channel.key, "kv-in-clear")
    )
    with pytest.raises(ConfigError, match="valid choices: encrypted, kv-in-clear"):
        parse_config({"channel": "authenticated"}, transports=["fs"])
    with pytest.raises(ConfigError, match="max_hold_s"):
        parse_config({"max_hold_s": 10.0}, transports=["fs"])
    for bad_fraction in (0.0, 1.5, math.nan):
        with pytest.raises(ConfigError, match="max_offer_fraction"):
            parse_config({"max_offer_fraction": bad_fraction}, transports=["fs"])


def test_without_a_key_pd_signs_with_a_host_key_and_only_insecure_is_keyless(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No key_file, no $KVFLOW_KEY: a P/D engine's channel holds this user's host key,
    made on first use in a private runtime directory and the same for every instance
    (loopback only); a store transport's holds none; `insecure` is keyless, and then a
    `channel` is a contradiction named at start."""
    monkeypatch.delenv(KEY_ENV, raising=False)
    runtime = tmp_path / "runtime"
    monkeypatch.setenv(RUNTIME_ENV, str(runtime))
    cfg = parse_config({}, transports=["fs"])
    first, second = channel_of(cfg), channel_of(cfg)
    assert first == second and first.keyed and first.host and first.mode == "kv-in-clear"
    assert (runtime / HOST_KEY).stat().st_mode & 0o777 == 0o600
    assert runtime.stat().st_mode & 0o777 == 0o700
    assert first.bind_problem("10.1.2.3") and not first.bind_problem("127.0.0.1")
    assert "host's" in first.address_problem("tcp://10.1.2.3:5555")
    assert channel_of(cfg, peer=False) == Channel()
    insecure = parse_config({"insecure": True}, transports=["fs"])
    assert channel_of(insecure) == Channel(None, insecure=True)
    with pytest.raises(ConfigError, match="'insecure' leaves the side channel keyless"):
        channel_of(parse_config({"insecure": True, "channel": "encrypted"}, transports=["fs"]))


@pytest.mark.parametrize("problem", ["others", "owner", "symlink"])
def test_a_host_key_directory_others_could_plant_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, problem: str
) -> None:
    """A runtime directory made first by someone else (a shared /tmp), open to others, or
    a symlink is refused at start, naming it and what to do, never used."""
    monkeypatch.delenv(KEY_ENV, raising=False)
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    if problem == "others":
        runtime.chmod(0o777)
        why = r"may be read or written by others \(mode 777\)"
    elif problem == "owner":
        if os.getuid() != 0:
            pytest.skip("giving a directory to another user needs root")
        os.chown(runtime, 4242, 4242)
        why = "is owned by uid 4242, not this user"
    else:
        real, runtime = runtime, tmp_path / "link"
        runtime.symlink_to(real)
        why = "is not a directory"
    monkeypatch.setenv(RUNTIME_ENV, str(runtime))
    with pytest.raises(ConfigError, match=rf"host key's directory .*{why}.*{RUNTIME_ENV}"):
        channel_of(parse_config({}, transports=["fs"]))
    assert not (runtime / HOST_KEY).exists() or problem == "symlink"


def test_tiers_below_the_store_are_checked_at_start_naming_the_key() -> None:
    """`tiers` (kvflow.tiers.stacked): each names an installed store transport and its
    options; anything else fails at start naming `['tiers'][i]` and the valid choices."""
    from kvflow_vllm.connector.context import lower_tiers

    installed = list(available_transports())
    with pytest.raises(ConfigError, match=r"\['tiers'\]\[0\]\['transport'\]: 'ftp'.*fs"):
        parse_config({"tiers": [{"transport": "ftp"}]}, transports=installed)
    with pytest.raises(ConfigError, match=r"\['tiers'\].*unknown field `nope`.*tiers\[0\]"):
        parse_config({"tiers": [{"transport": "fs", "nope": 1}]}, transports=installed)
    peer = parse_config({"tiers": [{"transport": "zmq"}]}, transports=installed)
    with pytest.raises(ConfigError, match=r"\['tiers'\]\[0\]\['transport'\]: 'zmq' is not a store"):
        lower_tiers(peer, FsTransport)
    bad = parse_config(
        {"tiers": [{"transport": "fs", "options": {"path": 3}}]}, transports=installed
    )
    with pytest.raises(
        ConfigError, match=r"\['tiers'\]\[0\]\['options'\] \(transport 'fs'\).*path"
    ):
        lower_tiers(bad, FsTransport)
    ok = parse_config(
        {"tiers": [{"transport": "fs", "options": {"path": "/tmp/x"}}]}, transports=installed
    )
    ((cls, options),) = lower_tiers(ok, FsTransport)
    assert cls is FsTransport and options.path == "/tmp/x"
