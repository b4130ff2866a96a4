"""kvflow.keys: deterministic, namespaced content keys for token chunks."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import msgspec
import pytest

from kvflow.keys import Fingerprint, chunk_keys, chunk_token_counts, is_chunk_key, is_plain_name

FP = Fingerprint(
    model="tiny-llama@main",
    dtype="float32/auto/",
    block_size=4,
    num_layers=2,
    layout="default",
    bytes_per_token=128,
)
NS = FP.namespace()
TOKENS = list(range(1000, 1023))  # 23 tokens: 5 full chunks of 4 and a tail of 3


def test_keys_are_stable_across_processes() -> None:
    here = chunk_keys(NS, TOKENS, 4)
    script = (
        "import json, sys\n"
        "from kvflow.keys import Fingerprint, chunk_keys\n"
        "fp = Fingerprint(**json.loads(sys.argv[1]))\n"
        "keys = chunk_keys(fp.namespace(), json.loads(sys.argv[2]), 4)\n"
        "print(json.dumps([hash('kvflow'), fp.namespace(), keys]))"
    )
    str_hashes = set()
    for seed in ("1", "12345"):
        out = subprocess.run(
            [sys.executable, "-c", script, msgspec.json.encode(FP).decode(), json.dumps(TOKENS)],
            env=dict(os.environ, PYTHONHASHSEED=seed),
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        str_hash, ns, keys = json.loads(out.stdout)
        str_hashes.add(str_hash)
        assert ns == NS
        assert keys == here
    assert len(str_hashes) == 2, "the seeds did not change Python's hash(); the test proves nothing"


def test_keys_have_the_documented_shape() -> None:
    keys = chunk_keys(NS, TOKENS, 4)
    assert len(keys) == 6
    assert all(len(k) == 32 and int(k, 16) >= 0 for k in keys)
    assert len(set(keys)) == 6
    assert chunk_token_counts(len(TOKENS), 4) == [4, 4, 4, 4, 4, 3]
    assert chunk_token_counts(8, 4) == [4, 4]
    assert chunk_token_counts(0, 4) == []


@pytest.mark.parametrize(
    "change",
    [
        {"model": "other-model@main"},
        {"dtype": "bfloat16/auto/"},
        {"block_size": 8},
        {"layout": "HND"},
        {"num_layers": 3},
        {"bytes_per_token": 256},
        {"tp_rank": 1},
        {"tp_size": 2},
        {"pp_rank": 1},
        {"extra": "lora=a"},
    ],
    ids=lambda c: next(iter(c)),
)
def test_every_fingerprint_field_changes_the_namespace(change: dict[str, object]) -> None:
    other = msgspec.structs.replace(FP, **change)
    assert other.namespace() != NS
    assert chunk_keys(other.namespace(), TOKENS, 4)[0] != chunk_keys(NS, TOKENS, 4)[0]


def test_namespace_is_a_pure_function_of_the_fields() -> None:
    same = Fingerprint(**msgspec.structs.asdict(FP))
    assert same is not FP and same.namespace() == NS


def test_partial_tail_key_differs_from_every_full_chunk_key() -> None:
    full = chunk_keys(NS, TOKENS[:20], 4)  # exactly 5 full chunks
    with_tail = chunk_keys(NS, TOKENS, 4)
    assert with_tail[:5] == full
    assert with_tail[5] not in full
    # a 3-token tail and the first 3 tokens of a full chunk at the same position differ
    longer = chunk_keys(NS, [*TOKENS, 7], 4)  # position 5 is now a full chunk
    assert longer[5] != with_tail[5]
    # same tokens but different count in a chunk never collide: tail [a, b, c] vs [a, b, c, 0]
    assert chunk_keys(NS, [1, 2, 3], 4) != chunk_keys(NS, [1, 2, 3, 0], 4)


def test_include_partial_false_drops_only_the_tail() -> None:
    assert chunk_keys(NS, TOKENS, 4, include_partial=False) == chunk_keys(NS, TOKENS[:20], 4)
    assert chunk_keys(NS, TOKENS[:3], 4, include_partial=False) == []


def test_salt_changes_every_key() -> None:
    plain = chunk_keys(NS, TOKENS, 4)
    salted = chunk_keys(NS, TOKENS, 4, salt="lora=adapter-a")
    other = chunk_keys(NS, TOKENS, 4, salt="lora=adapter-b")
    assert not set(plain) & set(salted)
    assert not set(salted) & set(other)
    assert chunk_keys(NS, TOKENS, 4, salt="lora=adapter-a") == salted


def test_keys_of_a_prefix_are_a_prefix_of_the_keys() -> None:
    keys = chunk_keys(NS, TOKENS, 4)
    for n in range(0, len(TOKENS) + 1, 4):
        assert chunk_keys(NS, TOKENS[:n], 4) == keys[: n // 4]


def test_a_changed_token_changes_that_chunk_and_every_later_one() -> None:
    keys = chunk_keys(NS, TOKENS, 4)
    edited = list(TOKENS)
    edited[9] += 1  # inside chunk 2
    changed = chunk_keys(NS, edited, 4)
    assert changed[:2] == keys[:2]
    assert all(a != b for a, b in zip(changed[2:], keys[2:], strict=True))


def test_large_token_ids_are_keyed_without_truncation() -> None:
    a = chunk_keys(NS, [1 << 40, 2, 3, 4], 4)
    b = chunk_keys(NS, [(1 << 40) + 1, 2, 3, 4], 4)
    assert a != b


def test_non_positive_block_size_is_rejected() -> None:
    with pytest.raises(ValueError, match="block_size"):
        chunk_keys(NS, TOKENS, 0)


def test_only_the_form_chunk_keys_give_is_a_chunk_key() -> None:
    assert all(is_chunk_key(k) for k in chunk_keys("ns", list(range(100)), 16))
    for bad in ["../x", "A" * 32, "a" * 31, "a" * 33, "a" * 32 + "\n", "", None, 7]:
        assert not is_chunk_key(bad), bad
    assert is_plain_name("conformance-ns-a") and is_plain_name("0" * 32)
    for bad in ["", ".", "..", ".x", "a/b", "a\0", "a" * 129, None]:
        assert not is_plain_name(bad), bad
