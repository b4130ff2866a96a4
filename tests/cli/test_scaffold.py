"""`kvflow new-transport`, end to end: scaffold a package, see its conformance run fail
until the methods are filled in, fill them in, pass the suite, install it, and find it
through the entry point."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvflow.cli.scaffold import scaffold

# What an author writes into the three methods: a directory store (one file per chunk,
# written to a temp name and renamed, so a chunk is never visible half-written).
FILLED = {
    "lookup": """\
        for i, key in enumerate(keys):
            if not all(self._file(key, s).exists() for s in self.context.shards):
                return i
        return len(keys)""",
    "save": """\
        spans: list[list[list[memoryview]]] = [[] for _ in job.keys]  # chunk, layer
        for i in range(job.num_layers):
            for c, s in enumerate(await job.layer(i)):
                spans[c].append(s)
        for c, key in enumerate(job.keys):
            data = [self.header(key, job.token_counts[c], spans[c])]
            data += [b"".join(s) for s in spans[c]]
            path = self._file(key, self.context.shard)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.{id(job)}.tmp")  # one per concurrent save
            await trio.to_thread.run_sync(tmp.write_bytes, msgspec.msgpack.encode(data))
            tmp.replace(path)""",
    "load": """\
        found, failures = [], []
        for c, key in enumerate(job.keys):
            path = self._file(key, self.context.shard)
            if not path.exists():
                failures.append(ChunkFailure(c, ChunkMissing, "not stored"))
                break
            raw = await trio.to_thread.run_sync(path.read_bytes)  # blocking I/O off the loop
            data = msgspec.msgpack.decode(raw, type=list[bytes])
            header = self.check(c, key, job.token_counts[c], data[0])
            if isinstance(header, ChunkFailure):
                failures.append(header)
                break
            found.append((header, data[1:]))
        for i in range(job.num_layers):
            for c, spans in enumerate(job.spans(i)[: len(found)]):
                header, layers = found[c]
                off = 0
                for span in spans:
                    span[:] = layers[i][off : off + len(span)]
                    off += len(span)
                if layer_hash(spans) != header.layer_hash[i]:
                    failures.append(ChunkFailure(c, ChunkCorrupt, f"layer {i} corrupt"))
            job.layer_loaded(i)
            await trio.lowlevel.checkpoint()  # cancellable between layers
        if (failure := first_failure(failures)) is not None:
            raise failure.error(job.keys[failure.chunk])""",
}
HELPER = """
    def _file(self, key: ChunkKey, shard: str) -> Path:
        return Path(self.options.path) / self.context.namespace / shard / key
"""


def _run(*args: str, cwd: Path | None = None, path: str = "") -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=path) if path else None
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def _pytest(root: Path) -> subprocess.CompletedProcess[str]:
    return _run(
        sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "tests",
        cwd=root, path=str(root),
    )  # fmt: skip


def test_scaffold_fails_until_filled_in_then_passes_and_installs(tmp_path: Path) -> None:
    made = _run(sys.executable, "-m", "kvflow.cli.main", "new-transport", "memdir",
                "--dir", str(tmp_path))  # fmt: skip
    assert made.returncode == 0, made.stderr
    root = tmp_path / "kvflow-memdir"
    source = root / "kvflow_memdir" / "_transport.py"
    assert str(source) in made.stdout

    empty = _pytest(root)
    assert empty.returncode != 0
    assert "MemdirTransport.lookup: fill in" in empty.stdout, empty.stdout[-2000:]

    code = source.read_text()
    for method, body in FILLED.items():
        code = code.replace(
            f'        raise NotImplementedError("MemdirTransport.{method}: fill in")', body
        )
    imports = "from pathlib import Path\n\nimport msgspec\nimport trio\n"
    code = code.replace("import msgspec\n", imports) + HELPER
    source.write_text(code)
    filled = _pytest(root)
    assert filled.returncode == 0, filled.stdout[-3000:]
    assert " passed" in filled.stdout and "failed" not in filled.stdout

    site = tmp_path / "site"
    installed = _run(sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                     "--no-build-isolation", "--target", str(site), str(root))  # fmt: skip
    assert installed.returncode == 0, installed.stderr
    listed = _run(sys.executable, "-m", "kvflow.cli.main", "transports", path=str(site))
    assert "memdir" in listed.stdout and "kvflow_memdir:MemdirTransport" in listed.stdout


@pytest.mark.parametrize("bad", ["S3", "1store", "with-dash", "class"])
def test_bad_names_are_refused_with_the_rule(tmp_path: Path, bad: str) -> None:
    with pytest.raises(ValueError, match="lowercase letters, digits and underscores"):
        scaffold(bad, tmp_path)
