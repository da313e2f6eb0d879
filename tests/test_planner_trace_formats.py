"""Raw public traces read by the planner (planner/trace_formats.py, ``kvshuttle plan --trace-format``).

Each format's sample is written here, and what the team's converter (``shared/data/traces/tools/``) writes for the
same rows is worked out by hand beside it: the in-process conversion must plan exactly that trace.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from kvshuttle.cli import main
from kvshuttle.planner.errors import TraceError
from kvshuttle.planner.trace import Trace, parse_trace
from kvshuttle.planner.trace_formats import (
    MAX_SUBAGENT_DEPTH,
    TRACE_FORMATS,
    claude_code_trace,
    load_trace_as,
    mooncake_trace,
)


def _lines(rows: list[dict[str, Any]]) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def _expected(rows: list[dict[str, Any]]) -> Trace:
    return parse_trace(_lines(rows).splitlines(), source="expected")


# --------------------------------------------------------------------------------------------- claude-code
# block_size 4 to keep the arithmetic small: a hash id per full 4-token block
SESSION_A = {"id": "s1", "block_size": 4, "requests": [
    {"t": 0.0, "in": 10, "out": 3, "hash_ids": [1, 2]},
    {"t": 5.0, "in": 16, "out": 2, "hash_ids": [1, 2, 3, 4], "think_time": 1.5},
    {"t": 9.0, "in": 17, "out": 4, "hash_ids": [1, 2, 3, 4], "api_time": 2.0},
    {"t": 20.0, "in": 12, "out": 1, "hash_ids": [1, 9, 9]},
]}
SESSION_B = {"id": "s2", "block_size": 4, "requests": [
    {"t": 1.0, "in": 8, "out": 2, "hash_ids": [5, 6]},
    {"type": "subagent", "agent_id": "a", "t": 3.0, "requests": [
        {"t": 0.5, "in": 8, "out": 1, "hash_ids": [7, 8]},
        {"t": 2.0, "in": 12, "out": 1, "hash_ids": [7, 8, 5], "think_time": 0.25},
    ]},
    {"t": 30.0, "in": 12, "out": 2, "hash_ids": [5, 6, 1], "api_time": 4.0, "think_time": 7.0},
]}
CLAUDE_CODE_EXPECTED = [
    # s1 starts at 0 s (first file); each turn as the converter writes it:
    {"conversation": "s1", "turn": 1, "prompt_tokens": 10, "new_tokens": 10, "output_tokens": 3, "gap_s": 0.0},
    # all of the previous blocks carried, 16 >= 10 + 3: a continuation with 3 new tokens; gap = think_time
    {"conversation": "s1", "turn": 2, "prompt_tokens": 16, "new_tokens": 3, "output_tokens": 2, "gap_s": 1.5},
    # blocks carried but 17 < 16 + 2 (the answer not carried): the 4 verified blocks (16 tokens) are the history;
    # no think_time and the previous request has no api_time: gap = 9 - 5
    {"conversation": "s1", "turn": 3, "prompt_tokens": 17, "new_tokens": 1, "output_tokens": 4, "gap_s": 4.0,
     "edit_at": 16},
    # 1 common block of the previous 4: edit at 4 tokens, the rest new; gap = 20 - 9 - api_time 2
    {"conversation": "s1", "turn": 4, "prompt_tokens": 12, "new_tokens": 8, "output_tokens": 1, "gap_s": 9.0,
     "edit_at": 4},
    # s2 (second file) starts 10 s later; its subagent is its own conversation, written before s2's turns,
    # starting at s2's start + the subagent's t + its first request's t
    {"conversation": "s2/a", "turn": 1, "prompt_tokens": 8, "new_tokens": 8, "output_tokens": 1, "gap_s": 13.5},
    {"conversation": "s2/a", "turn": 2, "prompt_tokens": 12, "new_tokens": 3, "output_tokens": 1, "gap_s": 0.25},
    {"conversation": "s2", "turn": 1, "prompt_tokens": 8, "new_tokens": 8, "output_tokens": 2, "gap_s": 11.0},
    {"conversation": "s2", "turn": 2, "prompt_tokens": 12, "new_tokens": 2, "output_tokens": 2, "gap_s": 7.0},
]


def _sessions(folder: Path, *docs: Any) -> Path:
    folder.mkdir(exist_ok=True)
    for k, doc in enumerate(docs):
        (folder / f"trace_{k:04d}.json").write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return folder


def test_claude_code_sessions_convert_as_the_converter_writes_them(tmp_path: Path) -> None:
    folder = _sessions(tmp_path / "sessions", SESSION_A, SESSION_B)
    trace = claude_code_trace(folder)
    assert trace.conversations == _expected(CLAUDE_CODE_EXPECTED).conversations
    assert [c.name for c in trace.conversations] == ["s1", "s2/a", "s2"]
    # one session's file alone: it starts at 0
    alone = claude_code_trace(folder / "trace_0001.json")
    assert alone.conversations[0].turns[0].gap_s == 3.5 and alone.conversations[1].turns[0].gap_s == 1.0
    assert load_trace_as(folder, "claude-code") == trace


def test_claude_code_names_seen_twice_stay_apart(tmp_path: Path) -> None:
    one = {"id": "x", "requests": [{"in": 5, "out": 1}, {"type": "subagent", "requests": [{"in": 3, "out": 1}]},
                                   {"type": "subagent", "requests": [{"in": 4, "out": 1}]}]}
    trace = claude_code_trace(_sessions(tmp_path / "s", one, {**one, "requests": one["requests"][:1]}))
    assert [c.name for c in trace.conversations] == ["x/sa", "x/sa#2", "x", "x#2"]
    assert [c.turns[0].prompt_tokens for c in trace.conversations] == [3, 4, 5, 5]


@pytest.mark.parametrize(("doc", "where"), [
    ({"id": "s", "requests": [{"in": 5, "out": 1}, {"out": 1}]}, "field 'requests[1].in'"),
    ({"id": "s", "requests": [{"in": 0, "out": 1}]}, "field 'requests[0].in'"),
    ({"id": "s", "requests": [{"in": 5, "out": -1}]}, "field 'requests[0].out'"),
    ({"id": "s", "requests": [{"in": 5, "out": 1}, {"in": 6, "out": 1, "think_time": -2}]},
     "field 'requests[1].think_time'"),
    ({"id": "s", "requests": [{"in": 5, "out": 1, "hash_ids": [1, "x"]}]}, "field 'requests[0].hash_ids'"),
    ({"id": "s", "requests": [7]}, "field 'requests[0]'"),
    ({"id": "s", "requests": [{"type": "subagent", "requests": [{"in": 2}]}]}, "field 'requests[0].requests[0].out'"),
    ({"id": "s"}, "field 'requests'"),
    ({"id": "", "requests": []}, "field 'id'"),
    ('{"id": "s",\n "requests": [}', ":2:"),  # a JSON syntax error: the line
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
])
def test_malformed_claude_code_sessions_name_the_file_and_where(tmp_path: Path, doc: Any, where: str) -> None:
    folder = _sessions(tmp_path / "s", SESSION_A, doc)
    with pytest.raises(TraceError) as info:
        claude_code_trace(folder)
    assert str(folder / "trace_0001.json") in str(info.value) and where in str(info.value)


def test_claude_code_subagents_nest_only_so_deep(tmp_path: Path) -> None:
    inner: dict[str, Any] = {"in": 2, "out": 1}
    for _ in range(MAX_SUBAGENT_DEPTH + 1):
        inner = {"type": "subagent", "requests": [inner]}
    folder = _sessions(tmp_path / "s", {"id": "deep", "requests": [inner]})
    with pytest.raises(TraceError, match="nested deeper"):
        claude_code_trace(folder)


def test_an_empty_folder_is_named(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match=r"no \*\.json session files"):
        claude_code_trace(tmp_path)


# ------------------------------------------------------------------------------------------------ mooncake
# 512-token blocks; the file is out of time order (the converter sorts by timestamp, stably)
MOONCAKE_ROWS = [
    {"timestamp": 500, "input_length": 700, "output_length": 50, "hash_ids": [0, 9]},
    {"timestamp": 0, "input_length": 1200, "output_length": 100, "hash_ids": [0, 1, 2]},
    {"timestamp": 20000, "input_length": 1536, "output_length": 10, "hash_ids": [0, 1, 3]},
    {"timestamp": 21000, "input_length": 1100, "output_length": 20, "hash_ids": [0, 1, 4]},
    {"timestamp": 25000, "input_length": 600, "output_length": 7, "hash_ids": [0, 5]},
    {"timestamp": 30000, "input_length": 1600, "output_length": 5, "hash_ids": [0, 1, 3, 7]},
    {"timestamp": 40000, "input_length": 1590, "output_length": 5, "hash_ids": [0, 1, 3, 8]},
]
MOONCAKE_EXPECTED = [
    # in time order: request 0 (ts 0) starts m0; its full blocks [0, 1] are registered
    {"conversation": "m0", "turn": 1, "prompt_tokens": 1200, "new_tokens": 1200, "output_tokens": 100, "gap_s": 0.0},
    # ts 20000: [0, 1] is request 0's full prefix: continues m0; 1536 >= 1200 + 100: 236 new;
    # gap = 20 s - (1200 / 8000 + 100 * 0.030) = 20 - 3.15
    {"conversation": "m0", "turn": 2, "prompt_tokens": 1536, "new_tokens": 236, "output_tokens": 10, "gap_s": 16.85},
    # ts 30000: [0, 1, 3] is the ts 20000 request's (1536 tokens: 3 full blocks); 1600 >= 1546: 54 new;
    # gap = 10 - (1536 / 8000 + 10 * 0.030) = 10 - 0.492
    {"conversation": "m0", "turn": 3, "prompt_tokens": 1600, "new_tokens": 54, "output_tokens": 5, "gap_s": 9.508},
    # ts 40000: [0, 1, 3] is now the ts 30000 request's (1600 tokens: 3 full blocks, the latest); 1590 < 1605:
    # the answer was not carried, the 3 shared blocks are the history; gap = 10 - (0.2 + 0.15)
    {"conversation": "m0", "turn": 4, "prompt_tokens": 1590, "new_tokens": 54, "output_tokens": 5, "gap_s": 9.65,
     "edit_at": 1536},
    # ts 500: [0] alone is under the 2 blocks a parent needs: a new conversation, named by its index in time order
    {"conversation": "m1", "turn": 1, "prompt_tokens": 700, "new_tokens": 700, "output_tokens": 50, "gap_s": 0.5},
    # ts 21000: its parent (request 0) already has a child: a branch, a new conversation starting at 21 s
    {"conversation": "m3", "turn": 1, "prompt_tokens": 1100, "new_tokens": 1100, "output_tokens": 20, "gap_s": 21.0},
    # ts 25000: shares only block 0 (with the ts 500 request, whose 1 full block is under the 2 a parent needs)
    {"conversation": "m4", "turn": 1, "prompt_tokens": 600, "new_tokens": 600, "output_tokens": 7, "gap_s": 25.0},
]


def test_mooncake_requests_rebuild_the_converters_conversations(tmp_path: Path) -> None:
    path = tmp_path / "conversation_trace.jsonl"
    path.write_text(_lines(MOONCAKE_ROWS) + "\n")
    trace = mooncake_trace(path)
    assert trace.conversations == _expected(MOONCAKE_EXPECTED).conversations
    assert [c.name for c in trace.conversations] == ["m0", "m1", "m3", "m4"]
    # --min-turns 2 (the collection's multi-turn file): the single-turn conversations dropped
    assert mooncake_trace(path, min_turns=2).conversations == _expected(MOONCAKE_EXPECTED[:4]).conversations
    assert load_trace_as(path, "mooncake") == trace


@pytest.mark.parametrize(("line", "field"), [
    ("{not json", None),
    ("[1, 2]", None),
    ('{"timestamp": 1, "input_length": 5, "output_length": 1}', "hash_ids"),
    ('{"timestamp": 1, "input_length": 0, "output_length": 1, "hash_ids": []}', "input_length"),
    ('{"timestamp": 1, "input_length": 5, "output_length": 1.5, "hash_ids": []}', "output_length"),
    ('{"timestamp": -1, "input_length": 5, "output_length": 1, "hash_ids": []}', "timestamp"),
    ('{"input_length": 5, "output_length": 1, "hash_ids": []}', "timestamp"),
    ('{"timestamp": 1, "input_length": 5, "output_length": 1, "hash_ids": [0, -3]}', "hash_ids"),
    ('{"timestamp": 1, "input_length": 5, "output_length": 1, "hash_ids": {"a": 1}}', "hash_ids"),
    ("[" * 100_000, None),
])
def test_malformed_mooncake_rows_name_the_file_line_and_field(tmp_path: Path, line: str, field: str | None) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(_lines(MOONCAKE_ROWS[:2]) + "\n" + line + "\n")  # the bad row is on line 4
    with pytest.raises(TraceError) as info:
        mooncake_trace(path)
    assert info.value.source == str(path) and info.value.line == 4 and info.value.field == field
    assert f"{path}:4: " in str(info.value)


def test_mooncake_long_shared_prefixes_match_in_linear_time(tmp_path: Path) -> None:
    """Prefixes live in a trie: a request is matched in one pass over its hash ids, not one lookup per length
    (which takes minutes on rows this long)."""
    n = 60_000
    rows = [{"timestamp": k * 1000, "input_length": n * 512 + 100 * (k + 1), "output_length": 1,
             "hash_ids": [*range(n), 10 ** 9 + k]} for k in range(6)]
    path = tmp_path / "long.jsonl"
    path.write_text(_lines(rows))
    start = time.monotonic()
    trace = mooncake_trace(path)
    assert time.monotonic() - start < 10
    # each request's full blocks are the 60,000 shared ones: every request continues the previous one
    assert len(trace.conversations) == 1 and len(trace.conversations[0].turns) == 6


def test_an_unknown_format_is_named(tmp_path: Path) -> None:
    assert TRACE_FORMATS == ("kvshuttle", "claude-code", "mooncake")
    with pytest.raises(TraceError, match="unknown trace format 'csv'"):
        load_trace_as(tmp_path / "x", "csv")


# ------------------------------------------------------------------------------------------------------ CLI
def _plan(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    assert main(["plan", *args, "--ttl", "30,480", "--threshold", "64", "--tier", "host:1800:6.25:0.5:0.001",
                 "--json"]) == 0
    doc: dict[str, Any] = json.loads(capsys.readouterr().out)
    return doc


@pytest.mark.parametrize(("fmt", "write", "expected"), [
    ("claude-code", lambda p: _sessions(p / "sessions", SESSION_A, SESSION_B), CLAUDE_CODE_EXPECTED),
    ("mooncake", lambda p: (p / "m.jsonl").write_text(_lines(MOONCAKE_ROWS)) and p / "m.jsonl", MOONCAKE_EXPECTED),
])
def test_plan_reads_a_raw_trace_as_its_converted_file(tmp_path: Path, capsys: pytest.CaptureFixture[str], fmt: str,
                                                     write: Any, expected: list[dict[str, Any]]) -> None:
    raw = write(tmp_path)
    converted = tmp_path / "converted.jsonl"
    converted.write_text(_lines(expected))
    got = _plan(capsys, "--trace", str(raw), "--trace-format", fmt, "--write-trace", str(tmp_path / "out.jsonl"))
    want = _plan(capsys, "--trace", str(converted))
    assert got["trace"] == {**want["trace"], "source": str(raw)}
    assert got["settings"] == want["settings"] and got["baselines"] == want["baselines"]
    assert got["trace"]["turns"] == len(expected)
    # --write-trace writes the conversion in the planner's format
    assert parse_trace((tmp_path / "out.jsonl").read_text().splitlines()).conversations == \
        _expected(expected).conversations


def test_plan_trace_format_errors_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(_lines(MOONCAKE_ROWS[:1]) + '{"timestamp": 1, "input_length": 5}\n')
    assert main(["plan", "--trace", str(bad), "--trace-format", "mooncake", "--no-progress"]) == 2
    assert f"{bad}:2: field 'output_length'" in capsys.readouterr().err
    assert main(["plan", "--trace-format", "mooncake", "--no-progress"]) == 2
    assert "give --trace" in capsys.readouterr().err
    # the default format is the planner's own: a raw Mooncake row is not a planner turn
    assert main(["plan", "--trace", str(bad), "--no-progress"]) == 2
    assert f"{bad}:1: field 'hash_ids': unknown field" in capsys.readouterr().err
