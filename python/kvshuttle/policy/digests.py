"""Block digest chains: what decode publishes with a handle and what prefill checks the new prompt against.

Block ``k`` covers tokens ``[k*B, (k+1)*B)``. Its digest is ``blake2b(parent || tokens)``, where ``parent`` is
block ``k-1``'s digest (the all-zero digest for block 0) and ``tokens`` are the block's token ids as little-endian
uint32. The extra key (model or adapter id, cache salt) goes into blake2b's *salt* parameter through a 16-byte
digest of it, so it costs nothing per block and still changes every digest. A trailing partial block gets a
digest over the tokens it holds, so decode can publish one digest per block it retains.

Why this shape:

* The chain makes digest ``k`` cover the whole prefix ``[0, (k+1)*B)``: KV at block k depends on every earlier
  token through attention, so a block is reusable only if its whole history matches.
* blake2b is in hashlib (no dependency), is a cryptographic hash, and its ``person``/``salt`` parameters give
  domain separation and the extra key for free. One 16-token block (16 + 64 bytes) is one compression.
* 16-byte digests (128 bits): accidental collisions need ~2**64 blocks; a second preimage against another
  conversation's chain needs ~2**128 work. The digests travel hex-encoded in ``kv_transfer_params`` (1,536
  blocks: 48 KiB of hex at 16 bytes, 96 KiB at 32), so half the size matters more than the extra margin of
  32 bytes, which is available (``digest_size=32``) for deployments that want it.
* uint32 tokens: every vocabulary fits; the encoding is injective (fixed width, and the fixed-width parent
  first), so different token sequences never hash the same message.

Also: :func:`from_vllm_block_hashes` reuses vLLM's own block hashes (``request.block_hashes``, chained the same
way) where they exist, and :class:`PromptDigests` holds a prompt's digests precomputed for :mod:`kvshuttle.policy`.
"""

from __future__ import annotations

import array
import functools
import hashlib
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from .._values import is_int
from ..errors import KVShuttleError, shown

PERSON = b"kvshuttle.dg.v1"  # blake2b personalisation: our digests never equal another protocol's
DEFAULT_DIGEST_SIZE = 16
TOKEN_BYTES = 4  # uint32 little-endian
_MAX_TOKEN = 2**32 - 1
_ARRAY_U32 = sys.byteorder == "little" and array.array("I").itemsize == TOKEN_BYTES  # array("I") is our encoding

TokenIds = Sequence[int] | npt.NDArray[np.integer[Any]]


class DigestError(KVShuttleError, ValueError):
    """Token ids, a block size, a parent digest or block hashes that cannot be digested; fix the input."""


@functools.lru_cache(maxsize=64)
def _base(extra_key: bytes, digest_size: int) -> Any:
    """A fresh blake2b state for (extra key, size); each block starts from a ``copy()`` (cheaper than a new one)."""
    salt = hashlib.blake2b(extra_key, digest_size=16, person=b"kvshuttle.key.v1").digest()
    return hashlib.blake2b(digest_size=digest_size, person=PERSON, salt=salt)


def _check_size(digest_size: int) -> None:
    if not (is_int(digest_size) and 1 <= digest_size <= 64):
        raise DigestError(f"digest_size must be an int in 1..64 (blake2b), got {shown(digest_size)}")


def _check_block_size(block_size: int) -> None:
    if not (is_int(block_size) and block_size >= 1):
        raise DigestError(f"block_size must be a positive integer, got {shown(block_size)}")


def _key(extra_key: bytes) -> bytes:
    # bytes(5) would be five zero bytes: an int (or anything else) is a caller bug, never a key
    if not isinstance(extra_key, (bytes, bytearray, memoryview)):
        raise DigestError(f"extra_key must be bytes, got {type(extra_key).__name__}")
    return bytes(extra_key)


def salted_key(extra_key: bytes, cache_salt: object) -> bytes:
    """The extra key of a request that carries vLLM's ``cache_salt`` (a tenant's or a conversation's prefix-cache
    isolation): the salt changes every digest of the chain, so a handle issued for one salt never verifies a
    prompt with another, or with none. Without a salt the key is unchanged. Injective: a salted key starts with
    ``salted`` and a NUL byte, which no model or adapter name (the unsalted keys) contains, then the key's length."""
    key = _key(extra_key)
    if cache_salt is None or cache_salt == "":
        return key
    if not isinstance(cache_salt, str):
        raise DigestError(f"cache_salt must be a string, got {type(cache_salt).__name__}")
    return b"salted\0" + len(key).to_bytes(4, "little") + key + cache_salt.encode("utf-8", "surrogatepass")


def encode_tokens(token_ids: TokenIds) -> bytes:
    """Token ids as contiguous little-endian uint32 bytes (the digest's encoding); DigestError if out of range."""
    if _ARRAY_U32 and isinstance(token_ids, (list, tuple)):
        # A Python list through array('I') is much faster than through numpy (which first infers a dtype);
        # array checks the range itself (OverflowError) and rejects non-integers (TypeError).
        try:
            return array.array("I", token_ids).tobytes()
        except (OverflowError, TypeError) as exc:
            raise DigestError(f"token ids must be integers in [0, 2**32): {exc}") from None
    arr = np.asarray(token_ids)
    if arr.size == 0:
        return b""
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise DigestError(f"token ids must be a 1-D sequence of integers, got {arr.dtype} with shape {arr.shape}")
    if int(arr.min()) < 0 or int(arr.max()) > _MAX_TOKEN:
        raise DigestError("token ids must be in [0, 2**32); a negative or huge id is not a token")
    return arr.astype("<u4", copy=False).tobytes()


def _chain(encoded: bytes, start: int, stop: int, step: int, parent: bytes, base: Any) -> list[bytes]:
    """Digests of the byte chunks ``encoded[o:o+step]`` for o in range(start, stop, step), chained from ``parent``.

    The one per-block Python loop: a state copy, one update, one digest (benchmarks/results/vm2_policy.json).
    """
    out: list[bytes] = []
    append, copy, digest = out.append, base.copy, parent
    for offset in range(start, stop, step):
        h = copy()
        h.update(digest + encoded[offset:offset + step])
        digest = h.digest()
        append(digest)
    return out


def _root(parent: bytes | None, digest_size: int) -> bytes:
    if parent is None:
        return bytes(digest_size)
    if not isinstance(parent, (bytes, bytearray, memoryview)) or len(parent) != digest_size:
        raise DigestError(f"parent must be a {digest_size}-byte digest, got {shown(parent, 40)}")
    return bytes(parent)


def chain_encoded(encoded: bytes, block_size: int, *, extra_key: bytes = b"", parent: bytes | None = None,
                  include_partial: bool = True, digest_size: int = DEFAULT_DIGEST_SIZE) -> list[bytes]:
    """:func:`block_digests` over tokens already encoded with :func:`encode_tokens`."""
    _check_block_size(block_size)
    _check_size(digest_size)
    if not isinstance(include_partial, (bool, np.bool_)):
        raise DigestError(f"include_partial must be a bool, got {type(include_partial).__name__}")
    if len(encoded) % TOKEN_BYTES:
        raise DigestError("encoded tokens must be a whole number of uint32 values")
    step = int(block_size) * TOKEN_BYTES
    full_end = len(encoded) - len(encoded) % step
    base = _base(_key(extra_key), int(digest_size))
    out = _chain(encoded, 0, full_end, step, _root(parent, digest_size), base)
    if include_partial and full_end < len(encoded):
        last = out[-1] if out else _root(parent, digest_size)
        out.extend(_chain(encoded, full_end, len(encoded), step, last, base))
    return out


def block_digests(token_ids: TokenIds, block_size: int, *, extra_key: bytes = b"", parent: bytes | None = None,
                  include_partial: bool = True, digest_size: int = DEFAULT_DIGEST_SIZE) -> list[bytes]:
    """The digest chain of ``token_ids``: one digest per block of ``block_size`` tokens.

    ``parent`` continues a chain (the digest of the block before ``token_ids[0]``; None starts one). A trailing
    partial block gets a digest over its tokens when ``include_partial`` (decode publishes one per block it
    holds); it differs from the digest the same block has once full.
    """
    return chain_encoded(encode_tokens(token_ids), block_size, extra_key=extra_key, parent=parent,
                         include_partial=include_partial, digest_size=digest_size)


def from_vllm_block_hashes(hashes: Iterable[Any]) -> list[bytes]:
    """vLLM's own block hashes (``request.block_hashes``: ``BlockHash`` values, which are bytes) as digests.

    vLLM chains them the same way (parent hash, block tokens, extra keys: LoRA, multimodal, cache salt), so
    they can stand in for :func:`block_digests` when both sides use them. They exist for full blocks only, and
    they match across processes only when P and D run the same hash algorithm with the same ``PYTHONHASHSEED``
    (vLLM's chain root is random otherwise): a mismatch is safe, nothing verifies and prefill recomputes.
    """
    if not isinstance(hashes, Iterable):
        raise DigestError(f"vLLM block hashes must be an iterable of bytes, got {type(hashes).__name__}")
    out: list[bytes] = []
    for h in hashes:
        if not isinstance(h, (bytes, bytearray, memoryview)):
            raise DigestError(f"vLLM block hashes are bytes (vLLM >= 0.10 BlockHash); got {type(h).__name__}")
        out.append(bytes(h))
    if len({len(h) for h in out}) > 1:
        raise DigestError("vLLM block hashes of different lengths: mixed hash algorithms?")
    if out and not out[0]:
        raise DigestError("empty vLLM block hash")
    return out


@dataclass(frozen=True)
class PromptDigests:
    """One prompt's full-block digests, precomputed once per request and compared with a handle's by policy.

    ``buffer`` holds the digests of the prompt's full blocks back to back (``digest_size`` bytes each), so the
    comparison against a handle is one ``memcmp``. ``encoded`` (the prompt's uint32 token bytes) lets policy
    verify a remote partial last block; it is None for vLLM block hashes (no partial digests: never verified).
    """

    block_size: int
    num_tokens: int
    digest_size: int
    buffer: bytes
    encoded: bytes | None = None
    extra_key: bytes = b""

    def __post_init__(self) -> None:
        _check_block_size(self.block_size)
        _check_size(self.digest_size)
        if not is_int(self.num_tokens):
            raise DigestError(f"num_tokens must be an integer, got {shown(self.num_tokens)}")
        full = self.num_tokens // self.block_size
        if self.num_tokens < 0 or len(self.buffer) != full * self.digest_size:
            raise DigestError(f"{len(self.buffer)} digest bytes for {full} full blocks of {self.digest_size}")
        if self.encoded is not None and len(self.encoded) != self.num_tokens * TOKEN_BYTES:
            raise DigestError("encoded tokens do not match num_tokens")

    @classmethod
    def from_tokens(cls, token_ids: TokenIds, block_size: int, *, extra_key: bytes = b"",
                    digest_size: int = DEFAULT_DIGEST_SIZE) -> PromptDigests:
        encoded = encode_tokens(token_ids)
        digests = chain_encoded(encoded, block_size, extra_key=extra_key, include_partial=False,
                                digest_size=digest_size)
        return cls(int(block_size), len(encoded) // TOKEN_BYTES, int(digest_size), b"".join(digests), encoded,
                   _key(extra_key))

    @classmethod
    def from_vllm_block_hashes(cls, hashes: Iterable[Any], block_size: int, num_tokens: int) -> PromptDigests:
        """The prompt's vLLM ``request.block_hashes`` (full blocks of ``block_size`` tokens)."""
        _check_block_size(block_size)
        if not (is_int(num_tokens) and num_tokens >= 0):
            raise DigestError(f"num_tokens must be a non-negative integer, got {shown(num_tokens)}")
        digests = from_vllm_block_hashes(hashes)
        full = num_tokens // block_size
        if len(digests) < full:
            raise DigestError(f"{len(digests)} vLLM block hashes for {shown(full)} full blocks")
        size = len(digests[0]) if digests else DEFAULT_DIGEST_SIZE
        return cls(int(block_size), int(num_tokens), size, b"".join(digests[:full]))

    @property
    def num_full_blocks(self) -> int:
        return self.num_tokens // self.block_size

    def digest(self, index: int) -> bytes:
        """Full block ``index``'s digest."""
        if not 0 <= index < self.num_full_blocks:
            raise IndexError(f"block {index} of {self.num_full_blocks} full blocks")
        return self.buffer[index * self.digest_size:(index + 1) * self.digest_size]

    def partial_digest(self, index: int, end_token: int) -> bytes | None:
        """The digest of block ``index`` cut at ``end_token`` (a remote partial block), or None if unknowable.

        Chained on full block ``index - 1``; needs the token ids (None for vLLM block hashes).
        """
        start = index * self.block_size
        if self.encoded is None or not start < end_token <= min(start + self.block_size, self.num_tokens):
            return None
        parent = self.digest(index - 1) if index else bytes(self.digest_size)
        chunk = self.encoded[start * TOKEN_BYTES:end_token * TOKEN_BYTES]
        return _chain(chunk, 0, len(chunk), len(chunk), parent, _base(self.extra_key, self.digest_size))[0]

    def with_block_size(self, block_size: int) -> PromptDigests | None:
        """The same prompt digested in another block size (None without token ids)."""
        if block_size == self.block_size:
            return self
        if self.encoded is None:
            return None
        digests = chain_encoded(self.encoded, block_size, extra_key=self.extra_key, include_partial=False,
                                digest_size=self.digest_size)
        return PromptDigests(int(block_size), self.num_tokens, self.digest_size, b"".join(digests), self.encoded,
                             self.extra_key)

    def with_digest_size(self, digest_size: int) -> PromptDigests | None:
        """The same prompt with another digest size (None without token ids)."""
        if digest_size == self.digest_size:
            return self
        if self.encoded is None:
            return None
        digests = chain_encoded(self.encoded, self.block_size, extra_key=self.extra_key, include_partial=False,
                                digest_size=digest_size)
        return PromptDigests(self.block_size, self.num_tokens, digest_size, b"".join(digests), self.encoded,
                             self.extra_key)
