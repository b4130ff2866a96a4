"""`kvflow new-transport NAME`: a package skeleton for a third-party transport.

The package it writes is complete except for the transport's storage calls:
a `pyproject.toml` that registers the transport under the `kvflow.transports`
entry point, the transport class with each method's contract in its
docstring (bodies raise `NotImplementedError` naming what to fill in), an
options Struct, and a test module that runs kvflow's conformance suite. Fill
the methods in until `pytest` passes, `pip install -e .`, and
`"transport": NAME` works in vLLM.
"""

from __future__ import annotations

import argparse
import keyword
import re
import sys
from pathlib import Path

__all__ = ["add_parser", "scaffold"]

PYPROJECT = """\
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "kvflow-{dash}"
version = "0.1.0"
description = "A kvflow transport: {name}"
requires-python = ">=3.11"
dependencies = ["kvflow"]

[project.optional-dependencies]
test = ["kvflow[testing]"]  # kvflow.testing: the conformance suite

[project.entry-points."kvflow.transports"]
{name} = "{package}:{cls}"

[tool.setuptools.packages.find]
include = ["{package}", "{package}.*"]  # found, not listed: a subpackage cannot be left out

[tool.pytest.ini_options]
trio_mode = true
"""

INIT = '''\
"""kvflow transport `{name}`."""

from ._transport import {cls}, {cls_options}

__all__ = ["{cls}", "{cls_options}"]
'''

TRANSPORT = '''\
"""The `{name}` transport: TODO say what it stores KV in, and why one would use it."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from kvflow import (
    BadHeader,
    Capabilities,
    ChunkCorrupt,
    ChunkFailure,
    ChunkHeader,
    ChunkKey,
    ChunkMissing,
    LoadJob,
    SaveJob,
    Transport,
    TransportContext,
    TransportError,
    first_failure,
    layer_hash,
)

__all__ = [
    "{cls}",
    "{cls_options}",
    "ChunkCorrupt",
    "ChunkFailure",
    "ChunkMissing",
    "TransportError",
    "first_failure",
    "layer_hash",
]


class {cls_options}(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Options of `{name}` (`kv_connector_extra_config["options"]`); unknown keys and
    wrong types are rejected at engine start with the key named."""

    path: str = ""
    """TODO: replace with what your store needs (a URL, a bucket, credentials...)."""


class {cls}(Transport):
    name = "{name}"
    Options = {cls_options}
    capabilities = Capabilities(store=True, peer=False, memory=frozenset({{"cpu"}}))

    def __init__(self, options: {cls_options}, context: TransportContext) -> None:
        super().__init__(options, context)
        self.options: {cls_options} = options

    async def open(self) -> None:
        """Connect. Raise `TransportError("...")` naming the option on bad options.
        `self.context` holds the namespace (never serve another one's chunks), this
        worker's `shard` and every `shards` (a lookup hit needs all of them)."""

    async def aclose(self) -> None:
        """Release what `open` acquired; called once, also after cancelled transfers."""

    async def lookup(self, keys: Sequence[ChunkKey]) -> int:
        """How many *leading* keys are stored for every shard in `self.context.shards`."""
        raise NotImplementedError("{cls}.lookup: fill in")

    async def save(self, job: SaveJob) -> None:
        """Store every chunk of `job` under (namespace, shard, key), or raise.

        `await job.layer(i)` returns, once vLLM computed layer i, each chunk's spans
        (memoryviews of vLLM's blocks: copy them, vLLM reuses the blocks). A chunk must
        never be visible half-written, and a cancelled save must leave nothing."""
        raise NotImplementedError("{cls}.save: fill in")

    async def load(self, job: LoadJob) -> None:
        """Fill `job.spans(i)` of every chunk, calling `job.layer_loaded(i)` in layer order
        once layer i landed (never touch layer i again afterwards). If chunk k is missing or
        corrupt, raise `ChunkMissing` / `ChunkCorrupt` with `chunk=k` (chunks before k
        complete in every layer). Check each stored chunk with `check` before using
        it, and layer i's bytes (`header.layer_intact(i, spans, self.context.store_key)`:
        under a store key, always) before `job.layer_loaded(i)`; raise
        `first_failure(failures).error(key)`."""
        raise NotImplementedError("{cls}.load: fill in")

    # -- what a store keeps next to each chunk, and checks before using it --------------
    def header(self, key: ChunkKey, num_tokens: int, layers: list[list[memoryview]]) -> bytes:
        """Bytes to store with a chunk whose layer i is `layers[i]`: its key, namespace,
        shard, token count, each layer's size and hash (keyed under a store key), this
        worker's KV layout (`kvflow.ChunkHeader`)."""
        return ChunkHeader.of(self.context, key, num_tokens, layers).encode()

    def check(
        self, chunk: int, key: ChunkKey, num_tokens: int, raw: bytes
    ) -> ChunkHeader | ChunkFailure:
        """A stored chunk's header, or why it is not the chunk this load asked for."""
        try:
            h = ChunkHeader.decode(raw)
        except BadHeader as exc:
            return ChunkFailure(chunk, ChunkCorrupt, str(exc))
        problem = h.problem(self.context, key, num_tokens)
        return ChunkFailure(chunk, ChunkCorrupt, problem) if problem else h
'''

TEST = '''\
"""kvflow's transport conformance suite against `{name}`."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from kvflow import TransportContext
from kvflow.testing import TransportConformance
from {package} import {cls}, {cls_options}


class Test{cls}Conformance(TransportConformance):
    @pytest.fixture
    def make_transport(self, tmp_path: Path) -> Callable[[TransportContext], {cls}]:
        # every instance of one test must reach the same store
        return lambda context: {cls}({cls_options}(path=str(tmp_path)), context)
'''

README = """\
# kvflow-{dash}

A [kvflow](https://github.com/) transport: `{name}`.

    pip install -e '.[test]'
    pytest                      # kvflow's conformance suite
    kvflow transports           # lists `{name}` once installed

In vLLM: `--kv-transfer-config '{{"kv_connector":"KVFlowConnector",
"kv_connector_extra_config":{{"transport":"{name}","options":{{...}}}}}}'`.
"""


def _names(name: str) -> dict[str, str]:
    if not re.fullmatch(r"[a-z][a-z0-9_]*", name) or keyword.iskeyword(name):
        raise ValueError(
            f"transport name {name!r}: use lowercase letters, digits and underscores, "
            "starting with a letter (it becomes a Python package name)"
        )
    cls = "".join(part.capitalize() for part in name.split("_")) + "Transport"
    return {
        "name": name,
        "dash": name.replace("_", "-"),
        "package": f"kvflow_{name}",
        "cls": cls,
        "cls_options": cls.removesuffix("Transport") + "Options",
    }


def scaffold(name: str, parent: Path) -> Path:
    """Write the package `kvflow-NAME` under `parent`; returns its directory."""
    n = _names(name)
    root = parent / f"kvflow-{n['dash']}"
    if root.exists():
        raise FileExistsError(f"{root} already exists")
    files = {
        root / "pyproject.toml": PYPROJECT,
        root / "README.md": README,
        root / n["package"] / "__init__.py": INIT,
        root / n["package"] / "_transport.py": TRANSPORT,
        root / "tests" / "test_conformance.py": TEST,
    }
    for path, template in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(template.format(**n))
    return root


def _cmd(args: argparse.Namespace) -> int:
    try:
        root = scaffold(args.name, Path(args.dir))
    except (ValueError, FileExistsError) as exc:
        print(f"kvflow new-transport: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {root}\n")
    print(f"next: fill in lookup/save/load in {root}/{_names(args.name)['package']}/_transport.py")
    print(f"      cd {root} && pip install -e '.[test]' && pytest")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "new-transport", help="write a package skeleton for a new transport (with its tests)"
    )
    p.add_argument("name", help="transport name, e.g. s3 (package kvflow_s3)")
    p.add_argument("--dir", default=".", help="where to create kvflow-NAME (default: .)")
    p.set_defaults(fn=_cmd)
