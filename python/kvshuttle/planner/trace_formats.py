"""Raw public traces read straight into the planner (``kvshuttle plan --trace-format``), converted in-process.

Three formats, named as the folders of the team's trace collection (``shared/data/traces``):

* ``kvshuttle``: the planner's own JSON lines (:mod:`.trace`).
* ``claude-code``: kv-cache-tester's Claude Code sessions, one JSON document per session (a file, or a folder of
  ``*.json`` files taken in name order). Per request: ``t`` (s from the session's start), ``in``, ``out``,
  ``hash_ids`` (one per full ``block_size``-token block, 64 by default), ``api_time``, ``think_time``; a
  ``type: "subagent"`` entry nests its own ``requests``.
* ``mooncake``: Mooncake's FAST'25 traces, one request per line: ``timestamp`` (ms), ``input_length``,
  ``output_length``, ``hash_ids`` (one per 512-token block, the last one partial when the input is not a multiple
  of 512); no conversation id.

How each field maps (the same as the collection's ``tools/`` converters, so a converted file and an in-process
conversion plan the same):

Claude Code. A session is a conversation named by its ``id`` (a subagent is its own conversation
``<id>/<agent_id>``; a name seen before gets ``#2``, ``#3``, ...). ``prompt_tokens = in``, ``output_tokens = out``.
A request whose hash_ids start with all of the previous request's is a continuation: ``new_tokens = in - (previous
in + out)``, or, when that is negative (thinking stripped, the answer not carried verbatim), the previous request's
blocks are the history and ``edit_at`` marks their end. A shorter common prefix (compaction, a changed system
prompt) sets ``edit_at`` there and counts the rest as new. ``gap_s`` is ``think_time`` when recorded, else ``t``
minus the previous ``t`` and ``api_time`` (at least 0). Sessions start ``start_interval_s`` apart in file order (the
traces have no absolute start); a subagent starts at its parent's start + its ``t``.

Mooncake. A request's parent is the latest earlier request whose full blocks (all its hash_ids, less a partial last
one) are the longest prefix of this request's hash_ids, of at least ``min_blocks`` blocks (block 0 is a system
prompt every request shares). A parent's first child continues its conversation (``new_tokens = input - (parent
input + output)``, or, when the answer was not carried, ``edit_at`` at the shared blocks); a later child starts a new
conversation (a branch). ``gap_s`` is estimated: arrival gap minus the parent's service time (``input /
prefill_tok_s + output * tpot_ms / 1000``), at least 0. ``min_turns`` drops shorter conversations.

Every problem is a :class:`~.errors.TraceError` naming the file and the line (a Claude Code session is one JSON
document: its problems name the request's path, e.g. ``requests[4].in``). Memory stays linear in the input: a
session is read one file at a time; Mooncake's prefixes are kept once, as a trie, and matched in one pass per
request.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import TraceError
from .trace import Conversation, Trace, TurnSpec, load_trace, parse_turn

TRACE_FORMATS = ("kvshuttle", "claude-code", "mooncake")

CLAUDE_CODE_BLOCK = 64  # kv-cache-tester's default block_size
CLAUDE_CODE_START_INTERVAL_S = 10.0
MAX_SUBAGENT_DEPTH = 16
MOONCAKE_BLOCK = 512
MOONCAKE_MIN_BLOCKS = 2
MOONCAKE_PREFILL_TOK_S = 8000.0
MOONCAKE_TPOT_MS = 30.0
_HASH_LIMIT = 1 << 63  # hash ids are packed with a trie node id into one dict key


@dataclass(frozen=True)
class RawTurn:
    """One converted turn: the planner's JSON object and where it came from (a file and its line, for errors)."""

    obj: dict[str, Any]
    source: str
    line: int | None = None


def load_trace_as(path: str | Path, trace_format: str = "kvshuttle") -> Trace:
    """The trace at ``path`` read as ``trace_format`` (one of :data:`TRACE_FORMATS`)."""
    if trace_format == "kvshuttle":
        return load_trace(path)
    if trace_format == "claude-code":
        return claude_code_trace(path)
    if trace_format == "mooncake":
        return mooncake_trace(path)
    raise TraceError(f"unknown trace format {trace_format!r} (known: {', '.join(TRACE_FORMATS)})", source=str(path))


# ------------------------------------------------------------------------------------------------- shared
def _assemble(turns: Iterable[RawTurn], source: str) -> Trace:
    """Turn objects (a conversation's turns in order) into a Trace, each checked by :func:`.trace.parse_turn`."""
    order: list[str] = []
    specs: dict[str, list[TurnSpec]] = {}
    for turn in turns:
        name, _, spec = parse_turn(turn.obj, line=turn.line, source=turn.source)
        if name not in specs:
            order.append(name)
            specs[name] = []
        specs[name].append(spec)
    if not order:
        raise TraceError("no turns in the trace", source=source)
    return Trace(tuple(Conversation(n, tuple(specs[n])) for n in order), source)


def _int(obj: Mapping[str, Any], key: str, low: int, *, source: str, line: int | None = None, where: str = "",
         default: int | None = None) -> int:
    value = obj.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise TraceError(f"must be an integer >= {low}, got {value!r}", line=line, field=where + key, source=source)
    return value


def _number(obj: Mapping[str, Any], key: str, *, source: str, line: int | None = None, where: str = "",
            default: float | None = None) -> float | None:
    value = obj.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise TraceError(f"must be a finite number >= 0, got {value!r}", line=line, field=where + key, source=source)
    return float(value)


def _hash_ids(obj: Mapping[str, Any], *, source: str, line: int | None = None, where: str = "",
              required: bool = False) -> list[int]:
    if "hash_ids" not in obj and required:
        raise TraceError("missing", line=line, field=where + "hash_ids", source=source)
    value = obj.get("hash_ids", [])
    if not isinstance(value, list) or not all(
            not isinstance(h, bool) and isinstance(h, int) and 0 <= h < _HASH_LIMIT for h in value):
        raise TraceError("must be a list of integers in [0, 2**63)", line=line, field=where + "hash_ids",
                         source=source)
    return value


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


# -------------------------------------------------------------------------------------------- claude-code
def claude_code_trace(path: str | Path, *, start_interval_s: float = CLAUDE_CODE_START_INTERVAL_S) -> Trace:
    """Claude Code sessions (kv-cache-tester): one session file, or a folder of ``*.json`` session files."""
    p = Path(path)
    files = sorted(p.glob("*.json")) if p.is_dir() else [p]
    if not files:
        raise TraceError("no *.json session files in the folder", source=str(p))
    seen: dict[str, int] = {}

    def turns() -> Iterator[RawTurn]:
        for k, file in enumerate(files):
            yield from claude_code_session(_read_json(file), source=str(file), default_id=file.name,
                                           start_s=k * start_interval_s, seen=seen)

    return _assemble(turns(), str(p))


def _read_json(path: Path) -> Any:
    try:
        text = path.read_text("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(f"cannot read the trace: {exc}", source=str(path)) from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceError(f"not valid JSON: {exc.msg} (column {exc.colno})", line=exc.lineno,
                         source=str(path)) from None
    except RecursionError:
        raise TraceError("nested too deeply", source=str(path)) from None


def claude_code_session(doc: Any, *, source: str = "<trace>", default_id: str = "session", start_s: float = 0.0,
                        seen: dict[str, int] | None = None) -> list[RawTurn]:
    """One session document's turns: its subagents' conversations first (each in full), then its own."""
    if not isinstance(doc, Mapping) or not isinstance(doc.get("requests"), list):
        raise TraceError("a session is a JSON object with a 'requests' list", field="requests", source=source)
    name = doc.get("id", default_id)
    if isinstance(name, bool) or not isinstance(name, (str, int)) or name == "":
        raise TraceError(f"must be a non-empty string or an integer, got {name!r}", field="id", source=source)
    block = _int(doc, "block_size", 1, source=source, default=CLAUDE_CODE_BLOCK)
    out: list[RawTurn] = []
    _claude_code_requests(str(name), doc["requests"], start_s, block, out, source=source, where="requests",
                          depth=0, seen={} if seen is None else seen)
    return out


def _unique(name: str, seen: dict[str, int]) -> str:
    count = seen.get(name, 0) + 1
    seen[name] = count
    return name if count == 1 else f"{name}#{count}"


def _claude_code_requests(name: str, requests: list[Any], start_s: float, block: int, out: list[RawTurn], *,
                          source: str, where: str, depth: int, seen: dict[str, int]) -> None:
    if depth > MAX_SUBAGENT_DEPTH:
        raise TraceError(f"subagents nested deeper than {MAX_SUBAGENT_DEPTH}", field=where, source=source)
    name = _unique(name, seen)
    turns: list[RawTurn] = []
    prev_hashes: list[int] | None = None
    prev_in = prev_out = 0
    prev_t = 0.0
    prev_api: float | None = None
    for i, r in enumerate(requests):
        at = f"{where}[{i}]."
        if not isinstance(r, Mapping):
            raise TraceError(f"a request is a JSON object, got {type(r).__name__}", field=at[:-1], source=source)
        if r.get("type") == "subagent":
            sub = r.get("requests") or []
            if not isinstance(sub, list):
                raise TraceError("must be a list of requests", field=at + "requests", source=source)
            if sub:
                agent = r.get("agent_id", "sa")
                t0 = _number(r, "t", source=source, where=at, default=0.0) or 0.0
                _claude_code_requests(f"{name}/{agent}", sub, start_s + t0, block, out, source=source,
                                      where=at + "requests", depth=depth + 1, seen=seen)
            continue
        n_in = _int(r, "in", 1, source=source, where=at)
        n_out = _int(r, "out", 0, source=source, where=at)
        t = _number(r, "t", source=source, where=at, default=0.0) or 0.0
        hashes = _hash_ids(r, source=source, where=at)
        think = _number(r, "think_time", source=source, where=at)
        obj: dict[str, Any] = {"conversation": name, "prompt_tokens": n_in}
        if prev_hashes is None:
            obj["new_tokens"] = n_in
            gap = start_s + t
        else:
            common = _common_prefix(hashes, prev_hashes)
            history = prev_in + prev_out
            if common >= len(prev_hashes) and n_in >= history:
                obj["new_tokens"] = n_in - history
            else:  # the answer not carried verbatim, or a shorter common prefix: the verified blocks are history
                kept = min(n_in, common * block)
                obj["new_tokens"] = n_in - kept
                obj["edit_at"] = kept
            if think is not None:
                gap = think
            elif prev_api is not None:
                gap = max(0.0, t - prev_t - prev_api)
            else:
                gap = max(0.0, t - prev_t)
        obj["output_tokens"] = n_out
        obj["gap_s"] = round(gap, 3)
        turns.append(RawTurn(obj, source))
        prev_hashes, prev_in, prev_out, prev_t = hashes, n_in, n_out, t
        prev_api = _number(r, "api_time", source=source, where=at)
    out.extend(turns)


# ----------------------------------------------------------------------------------------------- mooncake
@dataclass(frozen=True)
class _Request:
    line: int
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: list[int]


def _mooncake_rows(lines: Iterable[str], source: str) -> list[_Request]:
    rows: list[_Request] = []
    for number, raw in enumerate(lines, start=1):
        text = raw.strip()
        if not text:
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise TraceError(f"not valid JSON: {exc.msg} (column {exc.colno})", line=number, source=source) from None
        except RecursionError:
            raise TraceError("nested too deeply", line=number, source=source) from None
        if not isinstance(obj, Mapping):
            raise TraceError(f"a request is a JSON object, got {type(obj).__name__}", line=number, source=source)
        ts = _number(obj, "timestamp", source=source, line=number)
        if ts is None:
            raise TraceError("missing", line=number, field="timestamp", source=source)
        rows.append(_Request(number, ts, _int(obj, "input_length", 1, source=source, line=number),
                             _int(obj, "output_length", 0, source=source, line=number),
                             _hash_ids(obj, source=source, line=number, required=True)))
    return rows


class _PrefixTrie:
    """Block-hash prefixes -> the latest request whose full blocks are exactly that prefix (one node per block)."""

    def __init__(self) -> None:
        self._child: dict[int, int] = {}  # (node << 63 | hash id) -> child node; node 0 is the root
        self._latest: dict[int, int] = {}  # node -> request index
        self._nodes = 1

    def longest(self, hashes: Sequence[int]) -> tuple[int, int] | None:
        """``(request, blocks)`` of the longest registered prefix of ``hashes`` (only prefixes of at least
        ``min_blocks`` blocks are registered)."""
        node, best = 0, None
        for depth, h in enumerate(hashes, start=1):
            nxt = self._child.get(node << 63 | h)
            if nxt is None:
                break
            node = nxt
            if node in self._latest:
                best = (self._latest[node], depth)
        return best

    def register(self, hashes: Sequence[int], request: int) -> None:
        node = 0
        for h in hashes:
            key = node << 63 | h
            nxt = self._child.get(key)
            if nxt is None:
                nxt = self._child[key] = self._nodes
                self._nodes += 1
            node = nxt
        self._latest[node] = request


def mooncake_turns(lines: Iterable[str], *, source: str = "<trace>", min_blocks: int = MOONCAKE_MIN_BLOCKS,
                   prefill_tok_s: float = MOONCAKE_PREFILL_TOK_S, tpot_ms: float = MOONCAKE_TPOT_MS,
                   min_turns: int = 1) -> list[RawTurn]:
    """A Mooncake trace's requests rebuilt into conversations (see the module docstring), conversation by
    conversation in order of their first request."""
    if min_blocks < 1 or min_turns < 1 or not prefill_tok_s > 0 or not tpot_ms >= 0:
        raise TraceError("need min_blocks >= 1, min_turns >= 1, prefill_tok_s > 0, tpot_ms >= 0", source=source)
    rows = _mooncake_rows(lines, source)
    rows.sort(key=lambda r: r.timestamp_ms)  # stable: the file's order on equal timestamps
    trie = _PrefixTrie()
    convs: dict[str, list[RawTurn]] = {}
    conv_of: list[str] = []
    has_child: set[int] = set()
    for i, r in enumerate(rows):
        found = trie.longest(r.hash_ids)
        obj: dict[str, Any] = {"prompt_tokens": r.input_length}
        if found is not None and found[0] not in has_child:
            parent, shared = rows[found[0]], found[1]
            has_child.add(found[0])
            name = conv_of[found[0]]
            history = parent.input_length + parent.output_length
            service_s = parent.input_length / prefill_tok_s + parent.output_length * tpot_ms / 1000.0
            gap = max(0.0, (r.timestamp_ms - parent.timestamp_ms) / 1000.0 - service_s)
            if r.input_length >= history:
                obj["new_tokens"] = r.input_length - history
            else:  # the answer not carried verbatim (stripped reasoning, truncation)
                kept = min(r.input_length, shared * MOONCAKE_BLOCK)
                obj["new_tokens"] = r.input_length - kept
                obj["edit_at"] = kept
        else:  # a new conversation (or a branch of one that already continued)
            name = f"m{i}"
            gap = r.timestamp_ms / 1000.0
            obj["new_tokens"] = r.input_length
        obj["conversation"] = name
        obj["output_tokens"] = r.output_length
        obj["gap_s"] = round(gap, 3)
        conv_of.append(name)
        convs.setdefault(name, []).append(RawTurn(obj, source, r.line))
        full = len(r.hash_ids) if r.input_length % MOONCAKE_BLOCK == 0 else len(r.hash_ids) - 1
        if full >= min_blocks:
            trie.register(r.hash_ids[:full], i)
    return [t for turns in convs.values() if len(turns) >= min_turns for t in turns]


def mooncake_trace(path: str | Path, *, min_turns: int = 1, min_blocks: int = MOONCAKE_MIN_BLOCKS,
                   prefill_tok_s: float = MOONCAKE_PREFILL_TOK_S, tpot_ms: float = MOONCAKE_TPOT_MS) -> Trace:
    """A Mooncake FAST'25 trace file (``conversation_trace.jsonl``, ``synthetic_trace.jsonl``) as a Trace."""
    p = Path(path)
    try:
        with p.open(encoding="utf-8") as f:
            turns = mooncake_turns(f, source=str(p), min_blocks=min_blocks, prefill_tok_s=prefill_tok_s,
                                   tpot_ms=tpot_ms, min_turns=min_turns)
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(f"cannot read the trace: {exc}", source=str(p)) from None
    return _assemble(turns, str(p))
