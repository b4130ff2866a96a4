"""kvflow's public API is pinned: what `kvflow` exports, that every module says what it
exports, and that transport authors (the scaffold's code, the redis example) import
public names only."""

from __future__ import annotations

import importlib
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import pytest

import kvflow
from kvflow._moved import MOVED
from kvflow.cli import scaffold

ROOT = Path(__file__).resolve().parents[2]

PUBLIC = [  # a change here is a change of kvflow's API: say so in the changelog
    "BadFrame",
    "BadHeader",
    "Capabilities",
    "ChunkCorrupt",
    "ChunkFailure",
    "ChunkHeader",
    "ChunkKey",
    "ChunkMissing",
    "ConfigError",
    "KVFlowConfig",
    "KVLayout",
    "LayerGeometry",
    "LayoutError",
    "LoadJob",
    "NoOptions",
    "Offer",
    "PeerContext",
    "PeerOptions",
    "PeerRead",
    "PeerSource",
    "PeerTransport",
    "Renewed",
    "SaveJob",
    "TransferStuck",
    "Transport",
    "TransportContext",
    "TransportError",
    "first_failure",
    "layer_hash",
    "one_error",
    "stacked",
    "with_host_tier",
]


def test_kvflow_exports_the_pinned_api() -> None:
    assert sorted(kvflow.__all__) == PUBLIC


PD_HELPERS = ["HeldOffers", "NotHeld", "Renew", "answer_renew", "renew_at", "select_blocks"]


@pytest.mark.parametrize("name", PD_HELPERS)
def test_the_pd_helpers_kvflow_exported_until_0_4_still_import_and_warn(name: str) -> None:
    """Moved to `kvflow.pd` (issue 47): the old name is the same object, for one version."""
    import kvflow.pd

    assert name in kvflow.pd.__all__ and name not in kvflow.__all__
    with pytest.warns(DeprecationWarning, match=rf"kvflow.{name} moved to kvflow.pd.{name}"):
        old = getattr(kvflow, name)
    assert old is getattr(kvflow.pd, name)


@pytest.mark.parametrize("old", sorted(MOVED))
def test_a_moved_module_imports_by_its_old_name_as_itself_with_a_warning(old: str) -> None:
    code = (
        "import importlib, sys, warnings\n"
        "warnings.simplefilter('error')\n"
        f"try:\n    importlib.import_module({old!r})\n"
        "except DeprecationWarning as w:\n    print(w)\n"
        "warnings.simplefilter('ignore')\n"
        f"print(importlib.import_module({old!r}) is importlib.import_module({MOVED[old]!r}))\n"
        f"print(importlib.import_module({MOVED[old]!r}).__spec__.name)\n"
        "import kvflow\n"
        f"print(eval({old!r}) is sys.modules[{MOVED[old]!r}])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.splitlines() == [
        f"{old} moved to {MOVED[old]}; the old name goes in kvflow 0.5",
        "True",
        MOVED[old],  # its own spec, not the alias's
        "True",  # `kvflow.layout` as an attribute too
    ], out.stderr


RENAMED = {  # a name 0.4 moved between modules or renamed -> where it is now
    "kvflow.transport:PeerRead": "kvflow.pd.context:PeerRead",
    "kvflow.geometry.cells:token_major": "kvflow.geometry.cells:is_token_major",
    "kvflow.engine.staging:token_major": "kvflow.geometry.views:to_token_major",
    "kvflow.config:channel_of": "kvflow.pd.security:channel_of",
    **{f"kvflow.pd.security:{n}": f"kvflow.keyfiles:{n}" for n in ("keygen", "runtime_dir")},
    **{f"kvflow.pd.security:{n}": f"kvflow.keyfiles:{n}" for n in ("KEY_ENV", "HOST_KEY")},
    "kvflow.pd.security:RUNTIME_ENV": "kvflow.keyfiles:RUNTIME_ENV",
}


@pytest.mark.parametrize("old", sorted(RENAMED))
def test_a_moved_or_renamed_name_answers_by_its_old_name_with_a_warning(old: str) -> None:
    (module, name), (where, new) = old.split(":"), RENAMED[old].split(":")
    with pytest.warns(DeprecationWarning, match=rf"{module}.{name} is {where}.{new} now"):
        got = getattr(importlib.import_module(module), name)
    assert got is getattr(importlib.import_module(where), new)
    for name in PUBLIC:
        assert getattr(kvflow, name) is not None, name


def _modules() -> list[str]:
    names = []
    for package in ("kvflow", "kvflow_vllm", "kvflow_fs", "kvflow_zmq", "kvflow_nixl"):
        mod = importlib.import_module(package)
        names.append(package)
        names += [m.name for m in pkgutil.walk_packages(mod.__path__, f"{package}.")]
    return [n for n in names if not n.rsplit(".", 1)[-1].startswith("_") and ".cli" not in n]


@pytest.mark.parametrize("name", _modules())
def test_every_module_says_what_it_exports(name: str) -> None:
    if name.startswith("kvflow_nixl"):
        pytest.importorskip("nixl_cu12", reason="NIXL is an optional extra: kvflow[nixl]")
    mod = importlib.import_module(name)
    exported = getattr(mod, "__all__", None)
    assert exported is not None, f"{name} has no __all__"
    assert [n for n in exported if not hasattr(mod, n)] == [], f"{name}.__all__ names a ghost"


_IMPORT = re.compile(r"^\s*from ([\w.]+) import", re.M)


@pytest.mark.parametrize(
    "source",
    [
        *sorted((ROOT / "plugins" / "kvflow_redis" / "kvflow_redis").glob("*.py")),
        *sorted((ROOT / "plugins" / "kvflow_redis" / "tests").glob("*.py")),
        "scaffold",
    ],
    ids=str,
)
def test_transport_authors_import_public_names_only(source: Path | str) -> None:
    text = scaffold.TRANSPORT + scaffold.TEST if source == "scaffold" else Path(source).read_text()
    used = {m for m in _IMPORT.findall(text) if m.split(".")[0] == "kvflow"}
    # the event log (`event_log`, `kvflow inspect`) and hidden states are user-facing too
    public = {
        "kvflow",
        "kvflow.testing",
        "kvflow.observe.events",
        "kvflow.observe.log",
        "kvflow.hidden_states",
    }
    assert used <= public, f"{source} imports {sorted(used)}"
