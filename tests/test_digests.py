"""The block digest chain: what changes a digest, what does not, partial blocks, encodings, vLLM hashes."""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvshuttle.policy.digests import (
    DEFAULT_DIGEST_SIZE,
    PERSON,
    DigestError,
    PromptDigests,
    block_digests,
    chain_encoded,
    encode_tokens,
    from_vllm_block_hashes,
)

B = 16


def tokens(n: int, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 200_000, size=n)]


def oracle_digest(parent: bytes, block: list[int], extra_key: bytes = b"", size: int = 16) -> bytes:
    """The construction written out independently: blake2b(parent || uint32le tokens), person and salt set."""
    salt = hashlib.blake2b(extra_key, digest_size=16, person=b"kvshuttle.key.v1").digest()
    message = parent + struct.pack(f"<{len(block)}I", *block)
    return hashlib.blake2b(message, digest_size=size, person=PERSON, salt=salt).digest()


# ------------------------------------------------------------------------------------------ construction
def test_known_answer_matches_the_written_construction() -> None:
    toks = tokens(2 * B + 5)
    d0 = oracle_digest(bytes(16), toks[:B])
    d1 = oracle_digest(d0, toks[B:2 * B])
    d2 = oracle_digest(d1, toks[2 * B:])
    assert block_digests(toks, B) == [d0, d1, d2]
    assert block_digests(toks, B, extra_key=b"m") == [
        oracle_digest(bytes(16), toks[:B], b"m"),
        oracle_digest(oracle_digest(bytes(16), toks[:B], b"m"), toks[B:2 * B], b"m"),
        oracle_digest(oracle_digest(oracle_digest(bytes(16), toks[:B], b"m"), toks[B:2 * B], b"m"),
                      toks[2 * B:], b"m"),
    ]


def test_pinned_bytes_do_not_drift() -> None:
    """A wire-format regression pin: decode and prefill of different versions must agree."""
    assert block_digests(list(range(16)), 16)[0].hex() == "8db7eab35ba9e71b18d306d246a2b992"
    assert block_digests(list(range(20)), 16, extra_key=b"qwen3-32b")[1].hex() == "97d4a8bb9527a6c71d151bf157c0fd51"
    assert DEFAULT_DIGEST_SIZE == 16


@pytest.mark.parametrize("n", [0, 1, B - 1, B, B + 1, 5 * B, 5 * B + 3])
def test_one_digest_per_block_partial_included(n: int) -> None:
    toks = tokens(n)
    assert len(block_digests(toks, B)) == -(-n // B)
    assert len(block_digests(toks, B, include_partial=False)) == n // B
    assert block_digests(toks, B)[: n // B] == block_digests(toks, B, include_partial=False)


def test_equal_prefixes_give_equal_digests() -> None:
    base = tokens(4 * B + 7)
    a = block_digests(base + tokens(20, seed=1), B)
    b = block_digests(base + tokens(20, seed=2), B)
    assert a[:4] == b[:4]  # the four full blocks of the shared prefix
    assert a[4] != b[4]  # block 4 holds 7 shared tokens and then differs


@pytest.mark.parametrize("position", [0, 1, B - 1, B, 3 * B + 5, 5 * B - 1, 5 * B + 2])
def test_changing_any_token_changes_its_block_and_all_later(position: int) -> None:
    toks = tokens(5 * B + 3)
    edited = list(toks)
    edited[position] += 1
    before, after = block_digests(toks, B), block_digests(edited, B)
    k = position // B
    assert before[:k] == after[:k]
    assert all(x != y for x, y in zip(before[k:], after[k:], strict=True))


def test_extra_key_changes_every_digest() -> None:
    toks = tokens(3 * B + 1)
    plain, model_a, model_b = (block_digests(toks, B, extra_key=k) for k in (b"", b"model-a", b"model-b"))
    assert all(len({x, y, z}) == 3 for x, y, z in zip(plain, model_a, model_b, strict=True))
    assert block_digests(toks, B, extra_key=b"model-a") == model_a  # deterministic


def test_parent_changes_every_digest_and_continues_a_chain() -> None:
    toks = tokens(4 * B + 3)
    whole = block_digests(toks, B)
    first = block_digests(toks[:2 * B], B)
    assert block_digests(toks[2 * B:], B, parent=first[-1]) == whole[2:]  # decode can extend incrementally
    other = block_digests(toks[2 * B:], B, parent=b"\x01" * 16)
    assert all(x != y for x, y in zip(other, whole[2:], strict=True))


def test_partial_block_digest_covers_only_its_tokens() -> None:
    toks = tokens(3 * B)
    partial = block_digests(toks[: 2 * B + 5], B)
    full = block_digests(toks, B)
    assert partial[:2] == full[:2]
    assert partial[2] != full[2]  # 5 tokens vs 16: a different message
    assert partial[2] == oracle_digest(full[1], toks[2 * B: 2 * B + 5])
    assert block_digests(toks[: 2 * B + 6], B)[2] != partial[2]


def test_digest_size_32() -> None:
    toks = tokens(2 * B)
    long = block_digests(toks, B, digest_size=32)
    assert [len(d) for d in long] == [32, 32]
    assert long[0] == oracle_digest(bytes(32), toks[:B], size=32)
    assert long[0][:16] != block_digests(toks, B)[0]  # the size is a blake2b parameter, not a truncation


@pytest.mark.parametrize("block_size", [1, 3, 16, 64])
def test_block_boundaries(block_size: int) -> None:
    toks = tokens(100)
    digests = block_digests(toks, block_size)
    parent = bytes(16)
    for k, d in enumerate(digests):
        assert d == oracle_digest(parent, toks[k * block_size:(k + 1) * block_size])
        parent = d


# ------------------------------------------------------------------------------------------------ inputs
@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint32, np.uint64, np.uint16])
def test_numpy_dtypes_and_lists_agree(dtype: type) -> None:
    toks = tokens(2 * B + 3)
    if dtype is np.uint16:
        toks = [t % 65536 for t in toks]
    assert block_digests(np.array(toks, dtype=dtype), B) == block_digests(toks, B)
    assert block_digests(tuple(toks), B) == block_digests(toks, B)
    assert block_digests([dtype(t) for t in toks], B) == block_digests(toks, B)  # numpy scalars in a list


@pytest.mark.parametrize("bad", [[-1], [2**32], [2**70], [1.5], [[1, 2]], ["a"], np.array([-1]), np.array([1.5]),
                                 np.array([[1, 2]]), np.array([2**32])])
def test_bad_tokens_raise(bad: list[object]) -> None:
    with pytest.raises(DigestError):
        block_digests(bad, B)  # type: ignore[arg-type]


def test_largest_token_is_fine() -> None:
    assert encode_tokens([2**32 - 1]) == b"\xff\xff\xff\xff"


@pytest.mark.parametrize("kwargs", [{"block_size": 0}, {"block_size": -4}, {"digest_size": 0}, {"digest_size": 65},
                                    {"parent": b"short"}, {"block_size": True}])
def test_bad_arguments_raise(kwargs: dict[str, object]) -> None:
    args: dict[str, object] = {"block_size": B}
    args.update(kwargs)
    with pytest.raises(DigestError):
        block_digests(tokens(20), **args)  # type: ignore[arg-type]


def test_chain_encoded_rejects_ragged_bytes() -> None:
    with pytest.raises(DigestError):
        chain_encoded(b"\x00" * 5, B)


# ------------------------------------------------------------------------------------------------- vLLM
def test_vllm_block_hashes_pass_through() -> None:
    hashes = [hashlib.sha256(bytes([i])).digest() for i in range(3)]
    assert from_vllm_block_hashes(hashes) == hashes
    assert from_vllm_block_hashes([bytearray(h) for h in hashes]) == hashes
    assert from_vllm_block_hashes(memoryview(h) for h in hashes) == hashes
    assert from_vllm_block_hashes([]) == []


@pytest.mark.parametrize("bad", [[123], ["ab"], [b"a" * 32, b"b" * 16], [b""]])
def test_vllm_block_hashes_reject(bad: list[object]) -> None:
    with pytest.raises(DigestError):
        from_vllm_block_hashes(bad)


# --------------------------------------------------------------------------------------- PromptDigests
def test_prompt_digests_from_tokens() -> None:
    toks = tokens(4 * B + 9)
    p = PromptDigests.from_tokens(toks, B, extra_key=b"x")
    full = block_digests(toks, B, extra_key=b"x", include_partial=False)
    assert p.num_tokens == len(toks) and p.num_full_blocks == 4
    assert p.buffer == b"".join(full)
    assert [p.digest(k) for k in range(4)] == full
    with pytest.raises(IndexError):
        p.digest(4)


def test_prompt_partial_digest_matches_the_publishers() -> None:
    toks = tokens(4 * B + 9)
    p = PromptDigests.from_tokens(toks, B)
    for end in (B + 1, 2 * B + 7, 4 * B + 9):
        assert p.partial_digest(end // B, end) == block_digests(toks[:end], B)[-1]
    assert p.partial_digest(0, 5) == block_digests(toks[:5], B)[0]
    assert p.partial_digest(4, 4 * B + 10) is None  # past the prompt's end
    assert p.partial_digest(2, 2 * B) is None  # empty


def test_prompt_digests_resize() -> None:
    toks = tokens(70)
    p = PromptDigests.from_tokens(toks, B)
    assert p.with_block_size(B) is p
    p8 = p.with_block_size(8)
    assert p8 is not None and p8.buffer == b"".join(block_digests(toks, 8, include_partial=False))
    p32 = p.with_digest_size(32)
    assert p32 is not None and p32.buffer == b"".join(block_digests(toks, B, include_partial=False, digest_size=32))


def test_prompt_digests_from_vllm_hashes_have_no_partial() -> None:
    hashes = [hashlib.sha256(bytes([i])).digest() for i in range(3)]
    p = PromptDigests.from_vllm_block_hashes(hashes, B, 3 * B + 4)
    assert p.digest_size == 32 and p.num_full_blocks == 3 and p.digest(2) == hashes[2]
    assert p.partial_digest(3, 3 * B + 4) is None
    assert p.with_block_size(8) is None and p.with_digest_size(16) is None
    with pytest.raises(DigestError):
        PromptDigests.from_vllm_block_hashes(hashes, B, 5 * B)  # too few hashes


def test_prompt_digests_validate() -> None:
    with pytest.raises(DigestError):
        PromptDigests(B, 2 * B, 16, b"\x00" * 16)  # one digest for two blocks
    with pytest.raises(DigestError):
        PromptDigests(B, B, 16, b"\x00" * 16, encoded=b"\x00" * 8)


# ------------------------------------------------------------------------------------------- properties
@settings(max_examples=150, deadline=None, database=None)
@given(st.lists(st.integers(0, 3), max_size=60), st.lists(st.integers(0, 3), max_size=60),
       st.sampled_from([1, 2, 3, 8]))
def test_digest_k_equal_iff_prefix_through_block_k_equal(a: list[int], b: list[int], block_size: int) -> None:
    da, db = block_digests(a, block_size), block_digests(b, block_size)
    for k in range(min(len(da), len(db))):
        end_a, end_b = min((k + 1) * block_size, len(a)), min((k + 1) * block_size, len(b))
        assert (da[k] == db[k]) == (a[:end_a] == b[:end_b])


def test_a_cache_salt_changes_every_digest_and_keys_stay_apart() -> None:
    from kvshuttle.policy import salted_key

    tokens = list(range(64))
    plain = block_digests(tokens, 16, extra_key=b"m")
    assert salted_key(b"m", None) == salted_key(b"m", "") == b"m"
    a = block_digests(tokens, 16, extra_key=salted_key(b"m", "a"))
    b = block_digests(tokens, 16, extra_key=salted_key(b"m", "b"))
    assert all(x != y for x, y in zip(plain, a, strict=True)) and all(x != y for x, y in zip(a, b, strict=True))
    # injective: moving bytes between the model key and the salt never gives the same key
    assert salted_key(b"ab", "c") != salted_key(b"a", "bc") and salted_key(b"m", "a") != b"m" + b"a"
    with pytest.raises(DigestError):
        salted_key(b"m", 5)
