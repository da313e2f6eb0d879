"""The retention handle and its wire format inside vLLM's ``kv_transfer_params``.

Decode issues a :class:`KVHandle` when it retains a finished request's blocks; it travels through the router
to the next turn's prefill, which parses it strictly: anything malformed is a :class:`HandleFormatError`
(the caller recomputes). vLLM's field names are used where the meaning is the same; ours carry the
``kvshuttle_`` prefix, so a vLLM peer ignores them and we ignore vLLM's extras.
"""

from __future__ import annotations

import array
from dataclasses import dataclass
from typing import Any, Literal

from .._values import is_finite
from ..core.blocks import blocks_hold_tokens
from ..errors import KVShuttleError, shown
from ..trust import DeploymentSecret

# 2: every field covered by kvshuttle_mac; 3: length-prefixed (injective) MAC input; 4: cache dtype and read mode
WIRE_VERSION = 4
PREFIX = "kvshuttle_"
MAC_FIELD = PREFIX + "mac"
_MAC_PURPOSE = "kv-handle"
# How a retention may be read: again and again until it ends (a retried turn reads again), or by one reader. The
# decode decides; the handle says which, so a router follows the decode instead of being configured to match it.
ReadMode = Literal["multi_read", "use_once"]
READ_MODES: tuple[ReadMode, ...] = ("multi_read", "use_once")
MAX_DTYPE_CHARS = 32


class HandleFormatError(KVShuttleError, ValueError):
    """``kv_transfer_params`` do not hold a well-formed kvshuttle handle; recompute instead of reading."""


class HandleAuthError(HandleFormatError):
    """A well-formed handle that no member of this deployment issued as it stands (no MAC, a wrong MAC: forged
    or edited), or that names an owner this process may not trust; recompute without connecting anywhere."""


@dataclass(frozen=True)
class KVHandle:
    """What prefill needs to claim and read a decode's retained blocks.

    ``digests[k]`` is the chained digest of block k (tokens [k*B, (k+1)*B)); ``expiry_time`` is on the
    decode's wall clock (``issued_at`` too, so a reader can estimate the clock offset).

    ``ranks``: the side channels (``host:port``) of owner ranks 0..tp_size-1 when the owner runs tensor
    parallel, each rank its own peer holding its head shard and its own retention of the same handle (same
    id, generation, block ids and digests). Empty: the single owner at ``host:port``. When listed there are
    exactly ``tp_size`` of them, distinct, and rank 0 is ``host:port``. A handle at ``tp_size > 1`` without
    ranks is well formed (what kvshuttle issued before ranks existed) but names no rank to read a head
    shard from: :class:`~kvshuttle.reuse.ReuseReader` recomputes it (``rank_mapping``).
    """

    engine_id: str  # remote_engine_id
    request_id: str  # remote_request_id
    host: str  # remote_host: the decode's side channel
    port: int  # remote_port
    block_ids: tuple[int, ...]  # remote_block_ids, in token order
    num_tokens: int  # remote_num_tokens: tokens whose KV the blocks hold
    expiry_time: float  # remote_blocks_expiry_time (decode wall clock, seconds since the epoch)
    tp_size: int
    handle_id: str  # unguessable; names the retention on decode
    generation: int  # decode's generation of these blocks; a reused block has a newer one
    block_size: int
    digests: tuple[bytes, ...]  # one per block (full blocks; a partial last block has one too)
    issued_at: float  # decode wall clock when issued
    ttl_s: float  # seconds of retention left when issued
    ranks: tuple[str, ...] = ()  # kvshuttle_ranks: owner ranks' side channels "host:port" (empty: TP=1, host:port)
    # kvshuttle_cache_dtype: what the blocks' bytes mean ("bfloat16", "fp8_e4m3", ...; "" unknown). Bytes move as
    # they are, so a reader whose cache holds another dtype recomputes (cache_dtype_mismatch), never reads.
    cache_dtype: str = ""
    read_mode: ReadMode = "multi_read"  # kvshuttle_reads

    def signing_bytes(self) -> bytes:
        """Every field in one canonical encoding (typed, so a JSON or msgpack round trip cannot change it) that is
        injective: each field is length-prefixed, so no byte can move from one field to the next and leave the
        MAC input unchanged (a separator byte could: strings and digests may hold it)."""
        parts = [self.engine_id, self.request_id, self.host, str(self.port), str(self.num_tokens),
                 float(self.expiry_time).hex(), str(self.tp_size), self.handle_id, str(self.generation),
                 str(self.block_size), float(self.issued_at).hex(), float(self.ttl_s).hex(), str(len(self.block_ids)),
                 str(len(self.digests[0]) if self.digests else 0), self.cache_dtype, self.read_mode,
                 str(len(self.ranks)), *self.ranks]
        # With the count and size of the digests (one size: check()), their concatenation splits one way only.
        # Ids as fixed-width integers and digests as bytes: C speed at thousands of blocks (checked in range).
        fields = [f"v{WIRE_VERSION}".encode(), *(p.encode("utf-8", "surrogatepass") for p in parts),
                  array.array("q", self.block_ids).tobytes(), b"".join(self.digests)]
        return b"".join(len(f).to_bytes(8, "big") + f for f in fields)

    def mac(self, secret: DeploymentSecret) -> str:
        return secret.mac(_MAC_PURPOSE, self.signing_bytes()).hex()

    def to_kv_transfer_params(self, secret: DeploymentSecret | None = None) -> dict[str, Any]:
        """The wire form; signed with ``secret`` (a handle without a MAC is refused by every verifying reader)."""
        params = self._wire_fields()
        if secret is not None:
            params[MAC_FIELD] = self.mac(secret)
        return params

    def _wire_fields(self) -> dict[str, Any]:
        return {
            "remote_engine_id": self.engine_id,
            "remote_request_id": self.request_id,
            "remote_host": self.host,
            "remote_port": self.port,
            "remote_block_ids": list(self.block_ids),
            "remote_num_tokens": self.num_tokens,
            "remote_blocks_expiry_time": self.expiry_time,
            "tp_size": self.tp_size,
            PREFIX + "version": WIRE_VERSION,
            PREFIX + "handle_id": self.handle_id,
            PREFIX + "generation": self.generation,
            PREFIX + "block_size": self.block_size,
            # One hex string, digests back to back: half the JSON size of a list of 1,536 quoted strings.
            PREFIX + "digest_size": len(self.digests[0]) if self.digests else 0,
            PREFIX + "digests": b"".join(self.digests).hex(),
            PREFIX + "issued_at": self.issued_at,
            PREFIX + "ttl_s": self.ttl_s,
            PREFIX + "cache_dtype": self.cache_dtype,
            PREFIX + "reads": self.read_mode,
            **({PREFIX + "ranks": list(self.ranks)} if self.ranks else {}),
        }

    @classmethod
    def from_kv_transfer_params(cls, params: Any, secret: DeploymentSecret | None) -> KVHandle:
        """Parse strictly and, with ``secret``, authenticate: HandleFormatError (HandleAuthError for a missing or
        wrong MAC, or an owner ``secret`` may not trust) names the first problem; no other exception comes out.
        ``secret=None`` skips authentication: only for params that never crossed a trust boundary."""
        handle = cls._parse(params)
        if secret is not None:
            handle.authenticate(params.get(MAC_FIELD), secret)
        return handle

    def authenticate(self, mac: Any, secret: DeploymentSecret) -> None:
        """HandleAuthError unless ``mac`` is this handle's MAC under ``secret`` and its owner may be trusted."""
        if not isinstance(mac, str) or len(mac) != 32:
            raise HandleAuthError(f"the handle carries no valid {MAC_FIELD}: not issued by a member of this "
                                  f"deployment (secret {secret.fingerprint}), or issued by an older kvshuttle")
        try:
            tag = bytes.fromhex(mac)
        except ValueError:
            tag = b""
        if not secret.verify(_MAC_PURPOSE, self.signing_bytes(), tag):
            raise HandleAuthError(f"the handle's {MAC_FIELD} does not match its fields: forged or edited, or issued "
                                  f"under another deployment secret than this one ({secret.fingerprint})")
        for host in (self.host, *(rank_host(rank) for rank in self.ranks)):
            if not secret.allows_host(host):
                raise HandleAuthError(f"the handle names owner {host}, but only a local (loopback) secret is "
                                      "configured here; set KVSHUTTLE_SECRET on every engine to trust remote owners")

    @classmethod
    def _parse(cls, params: Any) -> KVHandle:
        if not isinstance(params, dict):
            raise HandleFormatError(f"kv_transfer_params must be a dict, got {type(params).__name__}")
        version = _int(params, PREFIX + "version", 0, INT64_MAX)
        if version != WIRE_VERSION:
            raise HandleFormatError(f"handle wire version {version}, this kvshuttle speaks {WIRE_VERSION}; "
                                    "upgrade the older side")
        block_ids = _field(params, "remote_block_ids", list)  # its elements: check() below
        size = _int(params, PREFIX + "digest_size", 0, MAX_DIGEST_SIZE)
        hex_digests = _field(params, PREFIX + "digests", str)
        try:
            blob = bytes.fromhex(hex_digests)
        except ValueError:
            blob = b""
        if len(hex_digests) != 2 * len(blob):  # bytes.fromhex skips whitespace: "00 11" is not our encoding
            raise HandleFormatError("kvshuttle_digests must be one string of hex digits")
        if len(blob) != size * len(block_ids) or (size == 0) != (len(block_ids) == 0):
            raise HandleFormatError(f"kvshuttle_digests holds {len(blob)} bytes, not one {size}-byte digest for "
                                    f"each of {len(block_ids)} blocks")
        digests = tuple([blob[i:i + size] for i in range(0, len(blob), size)]) if size else ()
        ranks: list[Any] = _field(params, PREFIX + "ranks", list) if PREFIX + "ranks" in params else []
        if PREFIX + "ranks" in params and not ranks:
            raise HandleFormatError("'kvshuttle_ranks' is empty: omit it for a single owner")
        handle = cls(
            engine_id=_text(params, "remote_engine_id"),
            request_id=_text(params, "remote_request_id"),
            host=_text(params, "remote_host"),
            port=_int(params, "remote_port", 1, 65535),
            block_ids=tuple(block_ids),
            num_tokens=_int(params, "remote_num_tokens", 0, INT64_MAX),
            expiry_time=_number(params, "remote_blocks_expiry_time"),
            tp_size=_int(params, "tp_size", 1, INT64_MAX),
            handle_id=_text(params, PREFIX + "handle_id"),
            generation=_int(params, PREFIX + "generation", 0, INT64_MAX),
            block_size=_int(params, PREFIX + "block_size", 1, INT64_MAX),
            digests=digests,
            issued_at=_number(params, PREFIX + "issued_at"),
            ttl_s=_number(params, PREFIX + "ttl_s"),
            ranks=tuple(ranks),
            cache_dtype=_field(params, PREFIX + "cache_dtype", str),
            read_mode=_read_mode(params),
        )
        handle.check()
        return handle

    def structure_problem(self) -> str | None:
        """What makes this handle unusable, found in O(1) (types, ranges, the token rule), or None.

        For handles built by hand; a parsed handle passed these and :meth:`check`'s O(n) checks already.
        """
        ids, digests, bs, tokens = self.block_ids, self.digests, self.block_size, self.num_tokens
        if not isinstance(ids, tuple) or not isinstance(digests, tuple):
            return "block_ids and digests must be tuples"
        for name in ("engine_id", "request_id", "host", "handle_id"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                return f"{name} must be a non-empty string, got {shown(value)}"
        for name, low, high in _INT_FIELDS:
            value = getattr(self, name)
            if type(value) is not int or not low <= value <= high:
                return f"{name} must be an int in [{low}, {_bound(high)}], got {shown(value)}"
        for name in ("expiry_time", "issued_at", "ttl_s"):
            value = getattr(self, name)
            if not is_finite(value):
                return f"{name} must be a finite number, got {shown(value)}"
        if not self.ttl_s >= 0:
            return f"ttl_s must be >= 0, got {self.ttl_s}"
        if not (isinstance(self.cache_dtype, str) and len(self.cache_dtype) <= MAX_DTYPE_CHARS
                and all(c.isascii() and (c.isalnum() or c == "_") for c in self.cache_dtype)):
            return f"cache_dtype must be a dtype name of at most {MAX_DTYPE_CHARS} [A-Za-z0-9_] characters, got " \
                   f"{shown(self.cache_dtype)}"
        if self.read_mode not in READ_MODES:
            return f"read_mode must be one of {READ_MODES}, got {shown(self.read_mode)}"
        if not blocks_hold_tokens(len(ids), bs, tokens):
            return f"{len(ids)} blocks of {bs} tokens cannot hold exactly {tokens} tokens"
        if len(digests) != len(ids):
            return f"{len(digests)} digests for {len(ids)} blocks"
        if ids and not (isinstance(digests[0], bytes) and 1 <= len(digests[0]) <= MAX_DIGEST_SIZE):
            return f"digests must be 1..{MAX_DIGEST_SIZE}-byte strings"
        return self._ranks_problem()

    def _ranks_problem(self) -> str | None:
        """What is wrong with ``ranks`` (O(tp_size): it holds that many addresses), or None."""
        ranks = self.ranks
        if not isinstance(ranks, tuple):
            return "ranks must be a tuple of host:port strings"
        if not ranks:
            return None
        if len(ranks) != self.tp_size:
            return f"kvshuttle_ranks lists {len(ranks)} owner ranks for tp_size={self.tp_size}"
        for k, rank in enumerate(ranks):
            problem = rank_address_problem(rank)
            if problem is not None:
                return f"owner rank {k}: {problem}"
        if len(set(ranks)) != len(ranks):
            return "kvshuttle_ranks names one side channel twice (every rank is its own peer)"
        if ranks[0] != f"{self.host}:{self.port}":
            return f"owner rank 0 is {shown(ranks[0])}, not the handle's owner {self.host}:{self.port}"
        return None

    def check(self) -> None:
        """Internal consistency; HandleFormatError otherwise. O(n) at C speed (no per-block Python loop)."""
        problem = self.structure_problem()
        if problem is not None:
            raise HandleFormatError(problem)
        ids, digests = self.block_ids, self.digests
        # The type test first: min/max of mixed types would raise TypeError.
        if ids and (set(map(type, ids)) != {int} or min(ids) < 0 or max(ids) > INT64_MAX):
            raise HandleFormatError("remote_block_ids must be integers in [0, 2**63)")
        if len(set(ids)) != len(ids):
            raise HandleFormatError("remote_block_ids repeat a block")
        if digests and (set(map(type, digests)) != {bytes} or len(set(map(len, digests))) != 1):
            raise HandleFormatError("digests must all be bytes of one length")


# Integer fields and their ranges. Every integer on the wire fits a signed 64-bit int: what msgpack, numpy and the
# native code carry, so a handle never turns into an OverflowError further down.
INT64_MAX = 2**63 - 1
MAX_DIGEST_SIZE = 64  # blake2b's largest digest
_INT_FIELDS = (("port", 1, 65535), ("num_tokens", 0, INT64_MAX), ("tp_size", 1, INT64_MAX),
               ("generation", 0, INT64_MAX), ("block_size", 1, INT64_MAX))


MAX_ADDRESS_CHARS = 255


def rank_address_problem(address: Any) -> str | None:
    """Why ``address`` is not an owner rank's side channel ``host:port`` (canonical port: 1..65535, no sign or
    leading zero; a host without whitespace, commas or NUL: an IPv6 literal goes in brackets), or None."""
    if type(address) is not str or not 0 < len(address) <= MAX_ADDRESS_CHARS:
        return f"a rank address must be a 'host:port' string of at most {MAX_ADDRESS_CHARS} characters, got " \
               f"{shown(address)}"
    host, sep, port = address.rpartition(":")
    if not sep or not host or any(c.isspace() or c in ",\0/" for c in host):
        return f"{shown(address)} is not 'host:port'"
    if host.count(":") and not (host.startswith("[") and host.endswith("]")):
        return f"{shown(address)}: an IPv6 host goes in brackets, '[::1]:port'"
    if not (port.isascii() and port.isdigit() and port[0] != "0" and int(port) <= 65535):
        return f"{shown(address)}: the port must be 1..65535"
    return None


def rank_host(address: str) -> str:
    """The host of a rank address ``host:port`` (brackets of an IPv6 literal kept, as ``is_loopback`` takes it)."""
    return address.rpartition(":")[0]


def _bound(value: int) -> str:
    return "2**63 - 1" if value == INT64_MAX else str(value)


def _field(params: dict[str, Any], name: str, kind: type) -> Any:
    if name not in params:
        raise HandleFormatError(f"kv_transfer_params lack {name!r}")
    value = params[name]
    if type(value) is not kind:  # bool is not an int here, a str subclass not a str
        raise HandleFormatError(f"{name!r} must be {kind.__name__}, got {type(value).__name__}")
    return value


def _read_mode(params: dict[str, Any]) -> ReadMode:
    value = _field(params, PREFIX + "reads", str)
    for mode in READ_MODES:
        if value == mode:
            return mode
    raise HandleFormatError(f"'kvshuttle_reads' must be one of {READ_MODES}, got {shown(value)}")


def _int(params: dict[str, Any], name: str, low: int, high: int) -> int:
    value: int = _field(params, name, int)
    if not low <= value <= high:
        raise HandleFormatError(f"{name!r} must be in [{low}, {_bound(high)}], got {shown(value)}")
    return value


def _text(params: dict[str, Any], name: str) -> str:
    value: str = _field(params, name, str)
    if not value:
        raise HandleFormatError(f"{name!r} is empty")
    return value


def _number(params: dict[str, Any], name: str) -> float:
    if name not in params:
        raise HandleFormatError(f"kv_transfer_params lack {name!r}")
    value = params[name]
    if type(value) not in (int, float) or not is_finite(value):  # exact types: what JSON and msgpack decode to
        raise HandleFormatError(f"{name!r} must be a finite number, got {shown(value)}")
    return float(value)
