"""What every content-index backend shares: the sparse positions, the keyed names, the records and the match.

**Positions.** A block digest names its whole prefix (the chain), so a retention of full blocks ``0..m`` makes
every prefix ``0..k`` findable through digest ``k``. Publishing all of them would cost one key per block (4,375
for a 70k-token conversation); :func:`positions` keeps the blocks ``2**j - 1`` below the stride (1, 2, 4, ...
blocks: short shared preambles are found to within half their length), every ``stride``-th block after that,
and the last one. A lookup asks the same positions of the prompt's chain (and the prompt's last block) in one
round trip and takes the deepest one present. That finds a *candidate*, never the exact match: the handle
carries every digest, and the policy's block-by-block verification finds how far it really matches the prompt.
What the stride costs is only the choice among candidates that agree up to the same position.

**Names.** Every key is a keyed hash (blake2b keyed with the deployment secret's ``content-index`` key):
a digest's key is ``H(scope key, digest)`` where the scope key is ``H(index key, scope)``, so two scopes
(tenants, or cache salts) never share a key, a tenant cannot probe another's entries (it cannot compute
their keys), and someone reading Redis without the secret cannot test a guessed prompt against the keys.
Records are named by a keyed hash of the handle id, publishers by one of their address. The records hold the
handle's signed ``kv_transfer_params`` as the router's handle store already does: a reader of Redis sees those
params (the router's per-tenant ``cache_salt``, a keyed hash, is what keeps their digests unguessable).

**Incarnations.** A publisher (one decode) draws a random incarnation when it starts and makes it current;
every entry names its incarnation and a lookup skips entries of an incarnation that is no longer current, so
a decode restarted under the same address is never found through its dead predecessor's entries. The worst
any stale entry can do is name a retention that no longer exists: its handle is signed, the decode's ledger
refuses a claim on a handle id it does not hold (or whose blocks moved on: the generation), and the reader
verifies digests block by block before it reads, so the cost is a refused claim and a recompute, never wrong
bytes.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from ...errors import shown
from ...policy.digests import PromptDigests
from ...trust import DeploymentSecret
from ..errors import RetentionError

PURPOSE = "content-index"  # the deployment secret's key for this index: independent of every other MAC's
# Every 64th block (1,024 tokens): a 70k-token conversation publishes 75 keys and a lookup asks as many; 32 and 16
# cost a lookup about 2x and 4x the keys for nothing a reader needs (verification finds the exact match), see
# benchmarks/results/vm5_index_strides.json.
DEFAULT_STRIDE = 64
MAX_POSITIONS = 512  # digests asked per lookup or published per retention (a 1M-token prompt at stride 64: 983)
MAX_RECORD_BYTES = 1 << 20  # one handle's record (msgpack); a 70k-token handle's is about 60 KB
MAX_RECORD_IDS = 1 << 18  # block ids one record may list (a 4M-token prompt of 16-token blocks)
MAX_RECORD_CONTAINERS = 64  # lists and maps in one record (a handle has a handful)
RECORD_VERSION = 2  # 2: msgpack with raw digests (1: JSON)
Mode = Literal["m", "u"]  # multi-read, use-once (pointer encoding)


class IndexArgumentError(RetentionError, ValueError):
    """A content index got an argument it cannot use (a caller bug): the message names it."""


@dataclass(frozen=True)
class Match:
    """The retention that holds the longest indexed prefix of a prompt.

    ``params``: its signed ``kv_transfer_params`` (verify them as any handle: they are a candidate, not a
    promise); ``blocks``: how many of the prompt's blocks are known to match (the deepest position found; the
    handle may cover more, which verification finds).
    """

    params: dict[str, Any]
    blocks: int
    handle_id: str


class ContentIndex(Protocol):
    """Where decodes publish retentions by content and prefills find the longest retained prefix."""

    def start(self) -> None:
        """Make this publisher's new incarnation current (its earlier incarnation's entries stop being found)."""

    def publish(self, scope: str, digests: Sequence[bytes], params: Mapping[str, Any], expiry_wall_s: float) -> bool:
        """Index a retention (its full blocks' digests); False when it was not indexed (too large, not current)."""

    def withdraw(self, handle_id: str) -> bool:
        """Forget a retention that ended; True if it was indexed."""

    def lookup(self, scope: str, prompt: Sequence[bytes] | PromptDigests) -> Match | None:
        """The retention holding the longest indexed prefix of ``prompt`` in ``scope``; None: recompute."""

    def stats(self) -> dict[str, int]: ...

    def close(self) -> None: ...


def positions(num_blocks: int, stride: int) -> list[int]:
    """The block indices published for (or asked of) a chain of ``num_blocks`` full blocks, shallowest first."""
    out: list[int] = []
    j = 1
    while j < stride and j <= num_blocks:
        out.append(j - 1)
        j *= 2
    out.extend(range(stride - 1, num_blocks, stride))
    if num_blocks and (not out or out[-1] != num_blocks - 1):
        out.append(num_blocks - 1)
    if len(out) > MAX_POSITIONS:  # a flood bound: the deepest positions are the valuable ones
        out = out[-MAX_POSITIONS:]
    return out


def check_stride(stride: int) -> int:
    if type(stride) is not int or not 1 <= stride <= 1 << 16:
        raise IndexArgumentError(f"stride must be an int in 1..65536 blocks, got {shown(stride)}")
    return stride


def prompt_chain(prompt: Sequence[bytes] | PromptDigests) -> Sequence[bytes]:
    """A prompt's full-block digests, as a sequence (a :class:`PromptDigests` without copying them all)."""
    if isinstance(prompt, PromptDigests):
        return _BufferChain(prompt)
    if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence):
        raise IndexArgumentError(f"a prompt is a sequence of block digests or PromptDigests, got {shown(prompt)}")
    return prompt


class _BufferChain(Sequence[bytes]):
    def __init__(self, prompt: PromptDigests) -> None:
        self._buf, self._size, self._n = prompt.buffer, prompt.digest_size, prompt.num_full_blocks

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, k: Any) -> Any:
        if not isinstance(k, int):
            raise IndexArgumentError("a prompt chain is indexed by int")
        return self._buf[k * self._size:(k + 1) * self._size]


class Names:
    """The keyed names of one deployment's index under one key prefix."""

    def __init__(self, secret: DeploymentSecret, prefix: str = "kvshuttle:ci:") -> None:
        if not isinstance(secret, DeploymentSecret):
            raise IndexArgumentError(f"secret must be a DeploymentSecret, got {type(secret).__name__}")
        if not isinstance(prefix, str):
            raise IndexArgumentError(f"prefix must be a string, got {shown(prefix)}")
        self._key = secret.key(PURPOSE)
        self.prefix = prefix
        self._scopes: dict[str, Any] = {}  # scope -> keyed blake2b state (a copy per digest is the cheap part)

    def _scope_state(self, scope: str) -> Any:
        state = self._scopes.get(scope)
        if state is None:
            if not isinstance(scope, str):
                raise IndexArgumentError(f"scope must be a string (a tenant or its cache_salt), got {shown(scope)}")
            raw = scope.encode("utf-8", "surrogatepass")
            # Length-prefixed so no two scopes hash the same input; the scope key itself is never stored.
            scope_key = hashlib.blake2b(len(raw).to_bytes(8, "big") + raw, key=self._key, digest_size=32,
                                        person=b"kvs.ci.scope").digest()
            state = hashlib.blake2b(key=scope_key, digest_size=16, person=b"kvs.ci.digest")
            if len(self._scopes) >= 4096:  # bounded: a flood of scopes costs recomputing a state, not memory
                self._scopes.clear()
            self._scopes[scope] = state
        return state

    def digest_keys(self, scope: str, chain: Sequence[bytes], at: Sequence[int]) -> list[str]:
        """The keys of ``chain[k]`` for k in ``at``, in scope."""
        base, prefix = self._scope_state(scope), self.prefix + "p:"
        out: list[str] = []
        for k in at:
            digest = chain[k]
            if not isinstance(digest, bytes) or not 1 <= len(digest) <= 64:
                raise IndexArgumentError(f"block digest {k} must be 1..64 bytes, got {shown(digest)}")
            h = base.copy()
            h.update(digest)
            out.append(prefix + h.hexdigest())
        return out

    def _tag(self, what: bytes, text: str) -> str:
        raw = text.encode("utf-8", "surrogatepass")
        return hashlib.blake2b(raw, key=self._key, digest_size=16, person=b"kvs.ci." + what).hexdigest()

    def scope_tag(self, scope: str) -> str:
        """Names a scope inside records (a keyed hash: the scope itself is never stored)."""
        return self._tag(b"scope", scope)

    def record_id(self, handle_id: str) -> str:
        return self._tag(b"record", handle_id)

    def record_key(self, record_id: str) -> str:
        return self.prefix + "r:" + record_id

    def publisher_id(self, publisher: str) -> str:
        return self._tag(b"publisher", publisher)[:16]

    def incarnation_key(self, publisher_id: str) -> str:
        return self.prefix + "i:" + publisher_id

    def live_key(self, publisher_id: str) -> str:
        return self.prefix + "l:" + publisher_id


@dataclass(frozen=True)
class Pointer:
    """What a digest key holds: which retention, of which incarnation, until when, read how."""

    publisher: str
    incarnation: str
    record: str
    expiry_ms: int
    mode: Mode

    def encode(self) -> str:
        return f"{self.publisher}|{self.incarnation}|{self.record}|{self.expiry_ms}|{self.mode}"


def retention_fields(params: Mapping[str, Any]) -> tuple[str, Mode]:
    """The handle id and read mode of signed params (IndexArgumentError if they carry none)."""
    if not isinstance(params, Mapping):
        raise IndexArgumentError(f"params must be a handle's kv_transfer_params dict, got {shown(params)}")
    handle_id, reads = params.get("kvshuttle_handle_id"), params.get("kvshuttle_reads")
    if not isinstance(handle_id, str) or not handle_id:
        raise IndexArgumentError("params carry no kvshuttle_handle_id: publish a kvshuttle handle's params")
    if reads not in ("multi_read", "use_once"):
        raise IndexArgumentError(f"params carry no read mode (kvshuttle_reads), got {shown(reads)}")
    return handle_id, "u" if reads == "use_once" else "m"


def check_publication(digests: Sequence[bytes], expiry_wall_s: float) -> None:
    if isinstance(digests, (str, bytes)) or not isinstance(digests, Sequence):
        raise IndexArgumentError(f"digests must be a sequence of block digests, got {shown(digests)}")
    if type(expiry_wall_s) not in (int, float) or not math.isfinite(expiry_wall_s):
        raise IndexArgumentError(f"expiry_wall_s must be a finite wall-clock time, got {shown(expiry_wall_s)}")


_DIGESTS = "kvshuttle_digests"  # the handle's one hex string of block digests: stored as raw bytes (half the size)


def encode_record(scope_tag: str, publisher: str, incarnation: str, expiry_wall_s: float,
                  params: Mapping[str, Any]) -> bytes:
    """One retention's record: msgpack, the digests as raw bytes. A hit reads and parses it on the admission path,
    so it is kept small and cheap: a 70k-token handle's JSON was 161 KB and most of a lookup's time."""
    import msgpack  # type: ignore[import-untyped]  # (the transfer extra, which the index's users install)

    stored = dict(params)
    digests = stored.get(_DIGESTS)
    if isinstance(digests, str):
        try:
            raw = bytes.fromhex(digests)
        except ValueError:
            raw = None
        if raw is not None and raw.hex() == digests:  # only where it comes back exactly (the handle is signed)
            stored[_DIGESTS] = raw
    data: bytes = msgpack.packb({"v": RECORD_VERSION, "scope": scope_tag, "pub": publisher, "inc": incarnation,
                                 "exp": float(expiry_wall_s), "params": stored}, use_bin_type=True)
    return data


def decode_record(raw: Any, scope_tag: str, now: float,
                  max_bytes: int = MAX_RECORD_BYTES) -> tuple[dict[str, Any], str, str] | None:
    """A record's (params, publisher, incarnation) if it is well formed, of ``scope_tag``'s scope and not expired;
    None otherwise (a malformed, oversized, foreign or expired value is never served)."""
    import msgpack

    if not isinstance(raw, bytes) or len(raw) > max_bytes:
        return None
    containers = [MAX_RECORD_CONTAINERS]

    def counted(value: Any) -> Any:  # msgpack expands a 1-byte empty list into a 56-byte one: count them
        containers[0] -= 1
        if containers[0] < 0:
            raise ValueError("too many lists and maps")
        return value

    try:  # bounded: a record is a few maps, one list of block ids and one digest string
        data = msgpack.unpackb(raw, raw=False, strict_map_key=True, max_bin_len=max_bytes, max_str_len=max_bytes,
                               max_array_len=MAX_RECORD_IDS, max_map_len=64, max_ext_len=0, list_hook=counted,
                               object_hook=counted)
    except Exception:
        return None
    if not isinstance(data, dict) or data.get("v") != RECORD_VERSION or data.get("scope") != scope_tag:
        return None
    params, pub, inc, exp = data.get("params"), data.get("pub"), data.get("inc"), data.get("exp")
    if not (isinstance(params, dict) and isinstance(pub, str) and isinstance(inc, str)
            and isinstance(exp, (int, float)) and not isinstance(exp, bool) and exp > now
            and isinstance(params.get("kvshuttle_handle_id"), str)):
        return None
    if isinstance(params.get(_DIGESTS), bytes):
        params[_DIGESTS] = params[_DIGESTS].hex()
    return params, pub, inc


def keeps(existing: Pointer, new: Pointer) -> bool:
    """Whether a digest key keeps naming a *live* retention rather than a newly published one holding the same
    prefix: a multi-read one over a use-once one (which its one reader ends), else the one that lives longer."""
    if existing.mode != new.mode:
        return existing.mode == "m"
    return existing.expiry_ms > new.expiry_ms


def parse_pointer(raw: Any) -> Pointer | None:
    if isinstance(raw, bytes):
        raw = raw.decode("ascii", "replace")
    if not isinstance(raw, str):
        return None
    parts = raw.split("|")
    if len(parts) != 5 or parts[4] not in ("m", "u") or not parts[3].isdigit():
        return None
    mode: Mode = "m" if parts[4] == "m" else "u"
    return Pointer(parts[0], parts[1], parts[2], int(parts[3]), mode)


def lookup_positions(num_blocks: int, stride: int) -> list[int]:
    """The positions a lookup asks, deepest first (the prompt's own last block included by :func:`positions`)."""
    return positions(num_blocks, stride)[::-1]
