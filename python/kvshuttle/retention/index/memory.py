"""The in-process content index: one host's decodes and prefills sharing a :class:`MemoryTable`.

Bounded three ways, each evicting the least recently used retention (published or found): in total
(``max_entries``), per scope (``max_per_scope``: one tenant's churn evicts its own retentions first) and per
publisher (``max_per_publisher``: a flooding decode evicts its own). A retention's digest keys go with it
unless they already name another retention. Thread-safe (one lock: every operation is a few dict steps).
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ...errors import shown
from ...policy.digests import PromptDigests
from ...trust import DeploymentSecret
from .scheme import (
    DEFAULT_STRIDE,
    MAX_RECORD_BYTES,
    IndexArgumentError,
    Match,
    Names,
    Pointer,
    check_publication,
    check_stride,
    encode_record,
    keeps,
    lookup_positions,
    positions,
    prompt_chain,
    retention_fields,
)


@dataclass
class _Record:
    scope: str
    params: dict[str, Any]  # a copy: a caller's later edits never reach a reader
    expiry_ms: int
    publisher: str
    incarnation: str
    keys: list[str] = field(default_factory=list)


def _copied(params: Mapping[str, Any]) -> dict[str, Any]:
    """Params a reader may edit without reaching the table (their values are scalars and lists of scalars)."""
    return {k: list(v) if isinstance(v, list) else v for k, v in params.items()}


def _bound(name: str, value: int) -> int:
    if type(value) is not int or value < 1:
        raise IndexArgumentError(f"{name} must be a positive int, got {shown(value)}")
    return value


class MemoryTable:
    """The shared state of in-process content indexes (one per host process)."""

    def __init__(self, max_entries: int = 100_000, max_per_scope: int = 10_000, max_per_publisher: int = 50_000,
                 max_record_bytes: int = MAX_RECORD_BYTES) -> None:
        self.max_entries = _bound("max_entries", max_entries)
        self.max_per_scope = _bound("max_per_scope", max_per_scope)
        self.max_per_publisher = _bound("max_per_publisher", max_per_publisher)
        self.max_record_bytes = _bound("max_record_bytes", max_record_bytes)
        self.lock = threading.Lock()
        self.pointers: dict[str, Pointer] = {}
        self.records: OrderedDict[str, _Record] = OrderedDict()  # least recently used first
        self.scopes: dict[str, OrderedDict[str, None]] = {}
        self.publishers: dict[str, OrderedDict[str, None]] = {}
        self.incarnations: dict[str, str] = {}
        self.counts = {"published": 0, "withdrawn": 0, "evicted": 0, "refused": 0, "lookups": 0, "hits": 0,
                       "stale_skipped": 0}

    def drop(self, record_id: str) -> bool:
        """Remove a record and the digest keys that still name it (under the lock)."""
        rec = self.records.pop(record_id, None)
        if rec is None:
            return False
        for key in rec.keys:
            pointer = self.pointers.get(key)
            if pointer is not None and pointer.record == record_id:
                del self.pointers[key]
        for group, name in ((self.scopes, rec.scope), (self.publishers, rec.publisher)):
            members = group.get(name)
            if members is not None:
                members.pop(record_id, None)
                if not members:
                    del group[name]
        return True

    def touch(self, record_id: str) -> None:
        rec = self.records[record_id]
        self.records.move_to_end(record_id)
        self.scopes[rec.scope].move_to_end(record_id)
        self.publishers[rec.publisher].move_to_end(record_id)

    def trim(self, scope: str, publisher: str) -> None:
        """Enforce the bounds after one insertion: the scope's and the publisher's own first, then in total."""
        for members, cap in ((self.scopes.get(scope), self.max_per_scope),
                             (self.publishers.get(publisher), self.max_per_publisher)):
            while members is not None and len(members) > cap:
                self.drop(next(iter(members)))
                self.counts["evicted"] += 1
        while len(self.records) > self.max_entries:
            self.drop(next(iter(self.records)))
            self.counts["evicted"] += 1

    def live(self, pointer: Pointer, now_ms: int) -> bool:
        return (pointer.expiry_ms > now_ms and pointer.record in self.records
                and self.incarnations.get(pointer.publisher) == pointer.incarnation)


class MemoryContentIndex:
    """A :class:`~kvshuttle.retention.index.ContentIndex` over a :class:`MemoryTable` (a new one by default).

    ``publisher``: this decode's address (empty for a reader); ``clock``: wall-clock seconds (expiries are on it).
    """

    def __init__(self, secret: DeploymentSecret, publisher: str = "", *, table: MemoryTable | None = None,
                 stride: int = DEFAULT_STRIDE, max_tries: int = 4, clock: Callable[[], float] = time.time) -> None:
        if not isinstance(publisher, str):
            raise IndexArgumentError(f"publisher must be a string (the decode's address), got {shown(publisher)}")
        self.names = Names(secret)
        self.table = table if table is not None else MemoryTable()
        self.stride = check_stride(stride)
        self.max_tries = _bound("max_tries", max_tries)
        self._clock = clock
        self._publisher = self.names.publisher_id(publisher) if publisher else ""
        self._incarnation = ""

    def start(self) -> None:
        if not self._publisher:
            raise IndexArgumentError("a reader (no publisher address) has no incarnation to start")
        table = self.table
        with table.lock:
            self._incarnation = secrets.token_hex(8)
            table.incarnations[self._publisher] = self._incarnation
            for record_id in list(table.publishers.get(self._publisher, ())):  # the dead incarnation's retentions
                table.drop(record_id)

    def publish(self, scope: str, digests: Sequence[bytes], params: Mapping[str, Any], expiry_wall_s: float) -> bool:
        handle_id, mode = retention_fields(params)
        check_publication(digests, expiry_wall_s)
        if not self._incarnation:
            raise IndexArgumentError("publish before start(): a publisher needs a current incarnation")
        table, names = self.table, self.names
        size = len(encode_record(names.scope_tag(scope), self._publisher, self._incarnation, expiry_wall_s, params))
        keys = names.digest_keys(scope, digests, positions(len(digests), self.stride))
        now = self._clock()
        record_id = names.record_id(handle_id)
        pointer = Pointer(self._publisher, self._incarnation, record_id, int(expiry_wall_s * 1000), mode)
        with table.lock:
            if (size > table.max_record_bytes or expiry_wall_s <= now or not keys
                    or table.incarnations.get(self._publisher) != self._incarnation):
                table.counts["refused"] += 1
                return False
            table.drop(record_id)
            table.records[record_id] = _Record(scope, _copied(params), pointer.expiry_ms, self._publisher,
                                               self._incarnation, keys)
            table.scopes.setdefault(scope, OrderedDict())[record_id] = None
            table.publishers.setdefault(self._publisher, OrderedDict())[record_id] = None
            now_ms = int(now * 1000)
            for key in keys:
                existing = table.pointers.get(key)
                if existing is None or not table.live(existing, now_ms) or not keeps(existing, pointer):
                    table.pointers[key] = pointer
            table.counts["published"] += 1
            table.trim(scope, self._publisher)
            return record_id in table.records

    def withdraw(self, handle_id: str) -> bool:
        if not isinstance(handle_id, str):
            raise IndexArgumentError(f"handle_id must be a string, got {shown(handle_id)}")
        table = self.table
        with table.lock:
            dropped = table.drop(self.names.record_id(handle_id))
            table.counts["withdrawn"] += dropped
            return dropped

    def lookup(self, scope: str, prompt: Sequence[bytes] | PromptDigests) -> Match | None:
        chain = prompt_chain(prompt)
        at = lookup_positions(len(chain), self.stride)
        keys = self.names.digest_keys(scope, chain, at)
        table, now = self.table, self._clock()
        now_ms, tries = int(now * 1000), self.max_tries
        with table.lock:
            table.counts["lookups"] += 1
            for position, key in zip(at, keys, strict=True):
                pointer = table.pointers.get(key)
                if pointer is None:
                    continue
                if table.incarnations.get(pointer.publisher) != pointer.incarnation:
                    table.counts["stale_skipped"] += 1
                    continue
                rec = table.records.get(pointer.record)
                if rec is not None and rec.scope == scope and now_ms < rec.expiry_ms:
                    table.touch(pointer.record)  # found: least recently used no more
                    table.counts["hits"] += 1
                    return Match(_copied(rec.params), position + 1, str(rec.params["kvshuttle_handle_id"]))
                tries -= 1
                if tries <= 0:
                    break
        return None

    def stats(self) -> dict[str, int]:
        table = self.table
        with table.lock:
            return {**table.counts, "records": len(table.records), "digest_keys": len(table.pointers)}

    def close(self) -> None:
        """Nothing to release (the table lives as long as its holders)."""
