"""Workload traces: conversations of turns, read from JSON lines or generated (seeded).

One JSON object per line, one line per turn, a conversation's turns in order (blank lines and lines starting
with ``#`` are skipped)::

    {"conversation": "a", "prompt_tokens": 2150, "new_tokens": 2150, "output_tokens": 300, "gap_s": 0}
    {"conversation": "a", "prompt_tokens": 2600, "new_tokens": 150, "output_tokens": 300, "gap_s": 4.2}
    {"conversation": "a", "prompt_tokens": 2900, "new_tokens": 150, "output_tokens": 80, "gap_s": 95, "edit_at": 1200}

* ``prompt_tokens``: the whole prompt of the turn (history + new); ``new_tokens``: the tokens appended after the
  history (the user message, the tool result); the history is ``prompt_tokens - new_tokens`` tokens.
* ``output_tokens``: the answer decode generates.
* ``gap_s``: seconds from the end of the previous turn's answer to this turn's request (a tool call: seconds; a
  person: minutes). On a conversation's first turn: its start time from the beginning of the trace.
* ``edit_at`` (optional): the first history position that differs from the previous turn's prompt + answer (an
  edited or re-rendered history, stripped reasoning). Without it the history is taken as an exact continuation
  of the previous turn's prompt + answer, as far as it reaches.
* ``turn`` (optional): 1, 2, ... in order; checked when given.

Every problem is a :class:`~.errors.TraceError` naming the line and the field.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from .errors import TraceError

_KNOWN = {"conversation", "turn", "prompt_tokens", "new_tokens", "output_tokens", "gap_s", "edit_at"}


@dataclass(frozen=True)
class TurnSpec:
    """One turn of a conversation (token counts and the pause before it)."""

    prompt_tokens: int
    new_tokens: int
    output_tokens: int
    gap_s: float
    edit_at: int | None = None

    @property
    def history_tokens(self) -> int:
        return self.prompt_tokens - self.new_tokens


@dataclass(frozen=True)
class Conversation:
    name: str
    turns: tuple[TurnSpec, ...]


@dataclass(frozen=True)
class Trace:
    conversations: tuple[Conversation, ...]
    source: str = "<trace>"

    @property
    def num_turns(self) -> int:
        return sum(len(c.turns) for c in self.conversations)

    def summary(self) -> dict[str, Any]:
        turns = [t for c in self.conversations for t in c.turns]
        later = [t for c in self.conversations for t in c.turns[1:]]
        gaps = np.array([t.gap_s for t in later]) if later else np.zeros(0)
        prompts = np.array([t.prompt_tokens for t in turns]) if turns else np.zeros(0)
        return {
            "source": self.source, "conversations": len(self.conversations), "turns": len(turns),
            "prompt_tokens_mean": round(float(prompts.mean()), 1) if turns else 0.0,
            "prompt_tokens_max": int(prompts.max()) if turns else 0,
            "gap_s_p50": round(float(np.median(gaps)), 2) if later else None,
            "gap_s_max": round(float(gaps.max()), 2) if later else None,
            "edited_turns": sum(t.edit_at is not None for t in later),
        }


# ------------------------------------------------------------------------------------------------ parsing
def _int_field(obj: Mapping[str, Any], name: str, line: int | None, source: str, low: int, default: int | None = None
               ) -> int:
    if name not in obj:
        if default is not None:
            return default
        raise TraceError("missing", line=line, field=name, source=source)
    value = obj[name]
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise TraceError(f"must be an integer >= {low}, got {value!r}", line=line, field=name, source=source)
    return int(value)


def parse_turn(obj: Any, *, line: int | None, source: str = "<trace>") -> tuple[str, int | None, TurnSpec]:
    """One line's ``(conversation, turn or None, TurnSpec)``; TraceError names the line and the field."""
    if not isinstance(obj, Mapping):
        raise TraceError(f"a turn is a JSON object, got {type(obj).__name__}", line=line, source=source)
    unknown = sorted(set(obj) - _KNOWN)
    if unknown:
        raise TraceError(f"unknown field (known: {', '.join(sorted(_KNOWN))})", line=line, field=unknown[0],
                         source=source)
    conv = obj.get("conversation")
    if isinstance(conv, bool) or not isinstance(conv, (str, int)) or conv == "":
        raise TraceError(f"must be a non-empty string or an integer, got {conv!r}", line=line,
                         field="conversation", source=source)
    turn = _int_field(obj, "turn", line, source, 1) if "turn" in obj else None
    prompt = _int_field(obj, "prompt_tokens", line, source, 1)
    new = _int_field(obj, "new_tokens", line, source, 0, default=prompt)
    if new > prompt:
        raise TraceError(f"{new} new tokens in a prompt of {prompt}", line=line, field="new_tokens", source=source)
    output = _int_field(obj, "output_tokens", line, source, 0)
    gap = obj.get("gap_s", 0.0)
    if isinstance(gap, bool) or not isinstance(gap, (int, float)) or not math.isfinite(gap) or gap < 0:
        raise TraceError(f"must be a finite number of seconds >= 0, got {gap!r}", line=line, field="gap_s",
                         source=source)
    edit = obj.get("edit_at")
    if edit is not None:
        edit = _int_field(obj, "edit_at", line, source, 0)
        if edit > prompt - new:
            raise TraceError(f"edit at {edit} is past the history ({prompt - new} tokens)", line=line,
                             field="edit_at", source=source)
    return str(conv), turn, TurnSpec(prompt, new, output, float(gap), edit)


def parse_trace(lines: Iterable[str], source: str = "<trace>") -> Trace:
    """A trace from JSON lines (see the module docstring)."""
    order: list[str] = []
    turns: dict[str, list[TurnSpec]] = {}
    for number, raw in enumerate(lines, start=1):
        text = raw.strip()
        if not text or text.startswith("#"):
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise TraceError(f"not valid JSON: {exc.msg} (column {exc.colno})", line=number, source=source) from None
        name, turn, spec = parse_turn(obj, line=number, source=source)
        if name not in turns:
            order.append(name)
            turns[name] = []
        expected = len(turns[name]) + 1
        if turn is not None and turn != expected:
            raise TraceError(f"conversation {name!r} expects turn {expected} here, got {turn}", line=number,
                             field="turn", source=source)
        turns[name].append(spec)
    if not order:
        raise TraceError("no turns in the trace", source=source)
    return Trace(tuple(Conversation(n, tuple(turns[n])) for n in order), source)


def load_trace(path: str | Path) -> Trace:
    p = Path(path)
    try:
        text = p.read_text("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(f"cannot read the trace: {exc}", source=str(p)) from None
    return parse_trace(text.splitlines(), source=str(p))


def example_trace_path() -> Path:
    """The bundled example agent trace (package data)."""
    return Path(str(resources.files("kvshuttle.planner").joinpath("data", "agent_trace.jsonl")))


def write_trace(trace: Trace) -> str:
    """The trace as JSON lines (what :func:`parse_trace` reads)."""
    out = []
    for conv in trace.conversations:
        for k, t in enumerate(conv.turns, start=1):
            obj: dict[str, Any] = {"conversation": conv.name, "turn": k, "prompt_tokens": t.prompt_tokens,
                                   "new_tokens": t.new_tokens, "output_tokens": t.output_tokens,
                                   "gap_s": t.gap_s}
            if t.edit_at is not None:
                obj["edit_at"] = t.edit_at
            out.append(json.dumps(obj))
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------------- synthetic
@dataclass(frozen=True)
class SyntheticSpec:
    """A synthetic agent workload. Gaps: a tool call (lognormal, median ``tool_gap_s``) with probability
    ``1 - human_fraction``, else a person's pause (exponential, mean ``human_gap_s``). Conversations start as a
    Poisson process over ``start_window_s``. ``edit_fraction`` of later turns edit their history at a uniform
    position; ``fresh_fraction`` of conversations reuse nothing (every turn a new context)."""

    conversations: int = 20
    turns_min: int = 4
    turns_max: int = 12
    first_tokens: int = 4000
    new_tokens: int = 600
    output_tokens: int = 250
    tool_gap_s: float = 3.0
    human_gap_s: float = 120.0
    human_fraction: float = 0.25
    edit_fraction: float = 0.0
    fresh_fraction: float = 0.0
    start_window_s: float = 600.0
    seed: int = 0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise TraceError(f"must be a finite number >= 0, got {value!r}", field=f.name, source="--synthetic")
        if self.turns_min < 1 or self.turns_max < self.turns_min or self.conversations < 1 or self.first_tokens < 1:
            raise TraceError("need conversations >= 1, first_tokens >= 1, 1 <= turns_min <= turns_max",
                             source="--synthetic")
        for name in ("human_fraction", "edit_fraction", "fresh_fraction"):
            if getattr(self, name) > 1:
                raise TraceError("must be a fraction in [0, 1]", field=name, source="--synthetic")

    @classmethod
    def parse(cls, text: str) -> SyntheticSpec:
        """``key=value,key=value`` (the fields of this class); empty: the defaults."""
        types = {f.name: f.type for f in fields(cls)}
        values: dict[str, Any] = {}
        for item in filter(None, (s.strip() for s in text.split(","))):
            key, sep, raw = item.partition("=")
            key = key.strip().replace("-", "_")
            if not sep or key not in types:
                raise TraceError(f"{item!r} is not key=value with a key in {', '.join(types)}", source="--synthetic")
            try:
                values[key] = int(raw) if types[key] in ("int", int) else float(raw)
            except ValueError:
                raise TraceError(f"not a number: {raw!r}", field=key, source="--synthetic") from None
        return cls(**values)


def synthetic_trace(spec: SyntheticSpec) -> Trace:
    """A seeded synthetic trace (the same spec gives the same trace)."""
    rng = np.random.default_rng(spec.seed)
    starts = np.sort(rng.uniform(0.0, spec.start_window_s, spec.conversations))
    convs = []
    for c in range(spec.conversations):
        fresh = bool(rng.random() < spec.fresh_fraction)
        n_turns = int(rng.integers(spec.turns_min, spec.turns_max + 1))
        turns: list[TurnSpec] = []
        prev_seq = 0
        for k in range(n_turns):
            output = max(1, int(rng.poisson(spec.output_tokens))) if spec.output_tokens else 0
            if k == 0:
                prompt = max(1, int(rng.poisson(spec.first_tokens)))
                turns.append(TurnSpec(prompt, prompt, output, float(starts[c])))
            else:
                new = max(1, int(rng.poisson(spec.new_tokens))) if spec.new_tokens else 0
                gap = (float(rng.exponential(spec.human_gap_s)) if rng.random() < spec.human_fraction
                       else float(rng.lognormal(math.log(max(spec.tool_gap_s, 1e-3)), 0.6)))
                if fresh:
                    prompt = max(1, int(rng.poisson(spec.first_tokens)))
                    turns.append(TurnSpec(prompt, prompt, output, gap))
                else:
                    edit = int(rng.integers(0, prev_seq)) if prev_seq and rng.random() < spec.edit_fraction else None
                    turns.append(TurnSpec(prev_seq + new, new, output, gap, edit))
            prev_seq = turns[-1].prompt_tokens + output
        convs.append(Conversation(f"c{c}", tuple(turns)))
    return Trace(tuple(convs), f"synthetic(seed={spec.seed})")


def uniform_trace(*, conversations: int, turns: int, first_tokens: int, new_tokens: int, output_tokens: int,
                  gap_s: float = 0.0, edit_at: int | None = None, fresh: bool = False, name: str = "uniform",
                  start_spacing_s: float = 0.0) -> Trace:
    """Identical conversations (the published benchmark's and the end-to-end bench's shape). ``edit_at`` edits
    turn 2's history there; ``fresh``: every turn a new context of ``first_tokens`` (nothing reusable)."""
    convs = []
    for c in range(conversations):
        specs: list[TurnSpec] = []
        prev_seq = 0
        for k in range(turns):
            if k == 0 or fresh:
                spec = TurnSpec(first_tokens, first_tokens, output_tokens, c * start_spacing_s if k == 0 else gap_s)
            else:
                spec = TurnSpec(prev_seq + new_tokens, new_tokens, output_tokens, gap_s,
                                edit_at if k == 1 else None)
            specs.append(spec)
            prev_seq = spec.prompt_tokens + output_tokens
        convs.append(Conversation(f"{name}{c}", tuple(specs)))
    return Trace(tuple(convs), name)
