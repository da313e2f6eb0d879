"""The retention handle and its wire format inside vLLM's ``kv_transfer_params``.

Decode issues a :class:`KVHandle` when it retains a finished request's blocks; it travels through the router
to the next turn's prefill, which parses it strictly: anything malformed is a :class:`HandleFormatError`
(the caller recomputes). vLLM's field names are used where the meaning is the same; ours carry the
``kvshuttle_`` prefix, so a vLLM peer ignores them and we ignore vLLM's extras.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..errors import KVShuttleError

WIRE_VERSION = 1
PREFIX = "kvshuttle_"


class HandleFormatError(KVShuttleError, ValueError):
    """``kv_transfer_params`` do not hold a well-formed kvshuttle handle; recompute instead of reading."""


@dataclass(frozen=True)
class KVHandle:
    """What prefill needs to claim and read a decode's retained blocks.

    ``digests[k]`` is the chained digest of block k (tokens [k*B, (k+1)*B)); ``expiry_time`` is on the
    decode's wall clock (``issued_at`` too, so a reader can estimate the clock offset).
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

    def to_kv_transfer_params(self) -> dict[str, Any]:
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
        }

    @classmethod
    def from_kv_transfer_params(cls, params: Any) -> KVHandle:
        """Parse strictly; HandleFormatError names the first problem."""
        if not isinstance(params, dict):
            raise HandleFormatError(f"kv_transfer_params must be a dict, got {type(params).__name__}")
        version = _field(params, PREFIX + "version", int)
        if version != WIRE_VERSION:
            raise HandleFormatError(f"handle wire version {version}, this kvshuttle speaks {WIRE_VERSION}")
        block_ids = _field(params, "remote_block_ids", list)
        if block_ids and (set(map(type, block_ids)) != {int} or min(block_ids) < 0):
            raise HandleFormatError("remote_block_ids must be non-negative integers")
        size = _field(params, PREFIX + "digest_size", int)
        try:
            blob = bytes.fromhex(_field(params, PREFIX + "digests", str))
        except ValueError:
            raise HandleFormatError("kvshuttle_digests must be one hex string") from None
        if size < 0 or (size == 0) != (len(blob) == 0) or (size and len(blob) % size):
            raise HandleFormatError(f"kvshuttle_digests holds {len(blob)} bytes, not a whole number of "
                                    f"{size}-byte digests")
        digests = tuple([blob[i:i + size] for i in range(0, len(blob), size)]) if size else ()
        handle = cls(
            engine_id=_field(params, "remote_engine_id", str),
            request_id=_field(params, "remote_request_id", str),
            host=_field(params, "remote_host", str),
            port=_field(params, "remote_port", int),
            block_ids=tuple(block_ids),
            num_tokens=_field(params, "remote_num_tokens", int),
            expiry_time=_number(params, "remote_blocks_expiry_time"),
            tp_size=_field(params, "tp_size", int),
            handle_id=_field(params, PREFIX + "handle_id", str),
            generation=_field(params, PREFIX + "generation", int),
            block_size=_field(params, PREFIX + "block_size", int),
            digests=digests,
            issued_at=_number(params, PREFIX + "issued_at"),
            ttl_s=_number(params, PREFIX + "ttl_s"),
        )
        handle.check()
        return handle

    def check(self) -> None:
        """Internal consistency; HandleFormatError otherwise."""
        if not self.handle_id or not self.engine_id:
            raise HandleFormatError("empty handle or engine id")
        if not 0 < self.port < 65536 or self.tp_size < 1 or self.block_size < 1 or self.generation < 0:
            raise HandleFormatError("port, tp_size, block_size or generation out of range")
        capacity = len(self.block_ids) * self.block_size
        fits = capacity - self.block_size < self.num_tokens <= capacity or self.num_tokens == 0 == capacity
        if not fits:
            raise HandleFormatError(f"{len(self.block_ids)} blocks of {self.block_size} cannot hold "
                                    f"{self.num_tokens} tokens")
        if len(self.digests) != len(self.block_ids) or len(set(map(len, self.digests))) > 1:
            raise HandleFormatError(f"{len(self.digests)} digests for {len(self.block_ids)} blocks")
        if len(set(self.block_ids)) != len(self.block_ids):
            raise HandleFormatError("remote_block_ids repeat a block")


def _field(params: dict[str, Any], name: str, kind: type) -> Any:
    if name not in params:
        raise HandleFormatError(f"kv_transfer_params lack {name!r}")
    value = params[name]
    if type(value) is not kind:  # bool is not an int here
        raise HandleFormatError(f"{name!r} must be {kind.__name__}, got {type(value).__name__}")
    return value


def _number(params: dict[str, Any], name: str) -> float:
    if name not in params:
        raise HandleFormatError(f"kv_transfer_params lack {name!r}")
    value = params[name]
    if type(value) not in (int, float) or not math.isfinite(value):
        raise HandleFormatError(f"{name!r} must be a finite number, got {value!r}")
    return float(value)
