"""kvflow proxy without vLLM: the prefill copy of a request, and a dead server's error."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvflow_vllm.apiserver import free_port
from kvflow_vllm.proxy import PREFILL_PARAMS, PdProxy, prefill_request


def test_the_prefill_copy_follows_vllms_convention() -> None:
    body = {"prompt": [1, 2], "max_tokens": 50, "stream": True, "stream_options": {}}
    pre = prefill_request(body)
    assert pre["max_tokens"] == 1 and pre["stream"] is False and "stream_options" not in pre
    assert pre["kv_transfer_params"] == PREFILL_PARAMS
    assert PREFILL_PARAMS["do_remote_decode"] is True and PREFILL_PARAMS["remote_host"] is None
    assert body["max_tokens"] == 50 and "kv_transfer_params" not in body  # untouched
    chat = prefill_request({"messages": [], "max_completion_tokens": 9})
    assert chat["max_completion_tokens"] == 1


def test_a_dead_prefill_server_is_a_clear_502_naming_it() -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    proxy = PdProxy([dead], [dead]).start()
    try:
        req = urllib.request.Request(
            proxy.url + "/v1/completions",
            json.dumps({"prompt": "hi", "max_tokens": 4}).encode(),
            {"Content-Type": "application/json"},
        )
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=30)
        assert err.value.code == 502
        assert f"prefill server {dead}" in json.loads(err.value.read())["error"]
    finally:
        proxy.close()


def test_a_burst_of_clients_is_answered_not_reset() -> None:
    """64 clients connecting at once (socketserver's backlog of 5 reset some of them)."""
    dead = f"http://127.0.0.1:{free_port()}"
    proxy = PdProxy([dead], [dead]).start()

    def ask(_: int) -> int | str:
        req = urllib.request.Request(
            proxy.url + "/v1/completions", b'{"prompt": "hi"}', {"Content-Type": "application/json"}
        )
        try:
            urllib.request.urlopen(req, timeout=60)
        except urllib.error.HTTPError as exc:
            return exc.code
        except OSError as exc:
            return type(exc).__name__
        return 200

    try:
        with ThreadPoolExecutor(64) as ex:
            answers = list(ex.map(ask, range(256)))
    finally:
        proxy.close()
    assert answers == [502] * 256, Counter(answers)


def test_a_proxy_needs_both_kinds_of_server() -> None:
    with pytest.raises(ValueError, match="at least one prefill and one decode"):
        PdProxy([], ["http://127.0.0.1:1"])
