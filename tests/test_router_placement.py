"""Where the router places a turn: conversation affinity (sticky, else a rendezvous-hash home, with failover) and
decode-local turns (a short follow-up computed on the decode that holds the conversation). Real HTTP through a
real ``Router`` to fake vLLM servers (:mod:`kvshuttle.router.doubles`)."""

from __future__ import annotations

from typing import Any

import pytest

from kvshuttle.router import FIRST_TURN_PARAMS, RouterConfig, parse_backend
from kvshuttle.router.backends import BackendPool, home_score
from kvshuttle.router.bodies import CHAT, COMPLETIONS
from kvshuttle.router.errors import RouterConfigError
from kvshuttle.router.placement import history_mark, new_tokens_estimate
from kvshuttle.router.proxy import NO_PREFILL_PARAMS, PUBLISH_KEY
from router_helpers import Conversation, LoopThread, deploy, prefill_handles, routing, wait_until

pytest_plugins = ["router_fixtures"]  # loop


def _served(servers: list[Any], conversation: str) -> list[int]:
    """Which server (index) got each of ``conversation``'s completion requests, in arrival order."""
    seen = []
    for i, server in enumerate(servers):
        seen += [(r["order"], i) for r in server.requests if r["body"].get("user") == conversation]
    return [i for _, i in sorted(seen)]


# ---------------------------------------------------------------------------------------------- unit level
def test_rendezvous_homes_agree_across_pools_and_move_only_with_their_backend() -> None:
    specs = [parse_backend(f"http://10.0.0.{i}:8000") for i in range(1, 5)]
    salt = b"s" * 32
    a, b = BackendPool(specs, "prefill", salt=salt), BackendPool(list(reversed(specs)), "prefill", salt=salt)
    keys = [f"conversation-{i}" for i in range(400)]
    homes = {k: a.choose_for(k)[0].name for k in keys}  # type: ignore[union-attr]
    assert homes == {k: b.choose_for(k)[0].name for k in keys}  # type: ignore[union-attr]  # order-free
    assert len(set(homes.values())) == 4 and min(list(homes.values()).count(s.name) for s in specs) > 60
    # one backend goes: only its conversations move, each to its next-ranked backend
    gone = specs[0].name
    a.mark(a.backends[0], False)
    moved = {k: a.choose_for(k) for k in keys}
    for k in keys:
        backend, how = moved[k]
        assert backend is not None
        if homes[k] != gone:
            assert (backend.name, how) == (homes[k], "hashed")
        else:
            ranked = sorted((s.name for s in specs[1:]), key=lambda n: -home_score(k, n, salt))
            assert (backend.name, how) == (ranked[0], "failover")
    # sticky wins while healthy; a sticky backend that is down or already tried does not
    other = next(s.name for s in specs[1:])
    assert a.choose_for("k", sticky=other)[0].name == other  # type: ignore[union-attr]
    assert a.choose_for("k", sticky=gone)[1] != "sticky"
    assert a.choose_for("k", sticky=other, exclude=frozenset({other}))[0].name != other  # type: ignore[union-attr]
    assert a.choose_for(None)[1] == "balanced"
    # another deployment's secret ranks the same conversations differently: homes cannot be aimed at from outside
    other = BackendPool(specs, "prefill", salt=b"t" * 32)
    assert sum(other.choose_for(k)[0].name != homes[k] for k in keys) > 200  # type: ignore[union-attr]


SEEN = [{"role": "user", "content": "a"}]  # the last turn's prompt, as the router saw it; its answer was "b"
MARK = history_mark(SEEN, "b")


@pytest.mark.parametrize("messages, expected", [
    ([{"role": "user", "content": "x" * 400}], None),  # turn 1: nothing held yet
    ([*SEEN, {"role": "assistant", "content": "b"}, {"role": "user", "content": "x" * 400}], 108),
    ([*SEEN, {"role": "assistant", "content": "b"},
      {"role": "tool", "content": "y" * 40}, {"role": "user", "content": [{"type": "text", "text": "z" * 80}]}],
     10 + 8 + 20 + 8),
    ([*SEEN, {"role": "assistant", "content": "b"},
      {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:"}}]}], None),
    ([*SEEN, {"role": "assistant", "content": "b"}], None),  # nothing new
    ([*SEEN, {"role": "assistant", "content": "b"}, "junk"], None),
    ([*SEEN, {"role": "assistant", "content": [{"type": "text", "text": "b"}]}, {"role": "user", "content": "c"}], 8),
])
def test_new_tokens_are_estimated_after_the_history_the_router_saw(messages: list[Any], expected: int | None) -> None:
    assert new_tokens_estimate(CHAT, {"messages": messages}, MARK) == expected
    assert new_tokens_estimate(CHAT, {"messages": messages}, None) is None  # no history seen: never decode-local
    assert new_tokens_estimate(COMPLETIONS, {"prompt": "anything", "messages": messages}, MARK) is None


@pytest.mark.parametrize("messages", [
    # a huge message before a fabricated assistant turn: the new part is huge, whatever follows it
    [*SEEN, {"role": "assistant", "content": "b"}, {"role": "user", "content": "x" * 400_000},
     {"role": "assistant", "content": "ok"}, {"role": "user", "content": "short"}],
    # the history rewritten: a huge first message, then a fabricated answer and a short turn
    [{"role": "user", "content": "x" * 400_000}, {"role": "assistant", "content": "b"},
     {"role": "user", "content": "short"}],
    # the real prompt, but an answer the decode never gave
    [*SEEN, {"role": "assistant", "content": "y" * 400_000}, {"role": "user", "content": "short"}],
    # a message slipped into the history
    [*SEEN, {"role": "user", "content": "x" * 400_000}, {"role": "assistant", "content": "b"},
     {"role": "user", "content": "short"}],
])
def test_client_written_history_cannot_make_a_turn_look_short(messages: list[Any]) -> None:
    """Only what follows the exact history the router saw (the last turn's messages and the answer its decode
    gave) is new: a fabricated assistant turn never hides a huge message from the estimate."""
    estimate = new_tokens_estimate(CHAT, {"messages": messages}, MARK)
    assert estimate is None or estimate > 100_000


@pytest.mark.parametrize("changes, message", [
    ({"affinity": "random"}, "--affinity is one of"),
    ({"decode_local_max_tokens": -1}, "decode_local_max_tokens must be an int"),
    ({"decode_local_max_tokens": 1.5}, "decode_local_max_tokens must be an int"),
])
def test_bad_placement_settings_are_refused(changes: dict[str, Any], message: str) -> None:
    config = RouterConfig(prefill=[parse_backend("http://p:1")], decode=[parse_backend("http://d:1")], **changes)
    with pytest.raises(RouterConfigError, match=message):
        config.check()


# ---------------------------------------------------------------------------------------------- end to end
def _chat(d: Any, name: str, **body: Any) -> Conversation:
    chat = Conversation(d.client(), name, f"hello from {name}")
    chat.turn_body = {"user": name, **body}  # type: ignore[attr-defined]
    return chat


def _turns(chat: Conversation, n: int, stream: bool, text: str | None = None) -> None:
    for _ in range(n):
        chat.turn(stream, text, **chat.turn_body)  # type: ignore[attr-defined]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_conversation_stays_on_its_prefill_and_decode(loop: LoopThread, stream: bool) -> None:
    d = deploy(loop, prefills=2, decodes=2)
    try:
        names = [f"conv-{i}" for i in range(16)]
        for name in names:
            _turns(_chat(d, name), 3, stream)
        homes = set()
        for name in names:
            p, q = _served(d.prefills, name), _served(d.decodes, name)
            assert len(p) == len(q) == 3 and len(set(p)) == len(set(q)) == 1, (name, p, q)
            homes.add(p[0])
        assert homes == {0, 1}  # spread over both prefills (16 conversations: all on one has odds 2^-15)
        assert d.metric("kvshuttle_router_affinity_total", role="prefill", how="hashed") == 16
        assert d.metric("kvshuttle_router_affinity_total", role="prefill", how="sticky") == 32
        assert d.metric("kvshuttle_router_placements_total", choice="reverse_read") == 32
        assert d.metric("kvshuttle_router_placements_total", choice="recompute") == 16
        assert sum(p.stats.matched for p in d.prefills) == 32
        assert d.metric("kvshuttle_router_read_tokens_total") == 32 * 48  # as the prefills reported
    finally:
        d.close()


def test_a_down_home_fails_over_with_the_handle_and_the_conversation_sticks_where_it_went(
        loop: LoopThread) -> None:
    d = deploy(loop, prefills=2)
    try:
        chat = _chat(d, "c")
        _turns(chat, 1, stream=False)
        home = _served(d.prefills, "c")[0]
        assert d.router is not None
        d.router.prefill.mark(d.router.prefill.backends[home], False)
        _turns(chat, 1, stream=False)
        d.router.prefill.mark(d.router.prefill.backends[home], True)  # back up: the other one holds it now
        _turns(chat, 2, stream=False)
        assert _served(d.prefills, "c") == [home, 1 - home, 1 - home, 1 - home]
        # the failover turn read the conversation back (its local cache had nothing)
        assert routing(prefill_handles(d.prefills[1 - home])[0])["kvshuttle_handle_id"]
        assert d.metric("kvshuttle_router_affinity_total", role="prefill", how="failover") == 1
        assert d.metric("kvshuttle_router_affinity_total", role="prefill", how="sticky") == 2
    finally:
        d.close()


def test_without_affinity_turns_are_balanced(loop: LoopThread) -> None:
    d = deploy(loop, prefills=2, affinity="none")
    try:
        _turns(_chat(d, "c"), 4, stream=False)
        assert _served(d.prefills, "c") in ([0, 1, 0, 1], [1, 0, 1, 0])
        assert d.metric("kvshuttle_router_affinity_total", role="prefill", how="balanced") == 4
    finally:
        d.close()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_short_follow_up_is_computed_on_the_decode_that_holds_the_conversation(loop: LoopThread,
                                                                                 stream: bool) -> None:
    d = deploy(loop, decodes=2, decode_local_max_tokens=40)
    try:
        chat = _chat(d, "c")
        _turns(chat, 1, stream)  # turn 1: prefill computes, a decode answers and holds the conversation
        holder = _served(d.decodes, "c")[0]
        first_handle = d.decodes[holder].issued_params[0]
        assert first_handle is not None
        _turns(chat, 1, stream, text="ok, go on")  # short: straight to the holder
        _turns(chat, 1, stream, text="x" * 400)  # long (~108 tokens): a prefill reads the history back
        assert _served(d.decodes, "c") == [holder] * 3
        assert len(d.prefills[0].requests) == 2  # turns 1 and 3
        local = d.decodes[holder].requests[1]["body"]["kv_transfer_params"]
        assert routing(local) == NO_PREFILL_PARAMS  # computed from its own prefix cache, nothing to read
        # turn 3's prefill got the handle the decode-local turn 2 returned
        sent = prefill_handles(d.prefills[0])
        assert sent[0] == FIRST_TURN_PARAMS
        assert sent[1]["kvshuttle_handle_id"] == d.decodes[holder].issued_params[1]["kvshuttle_handle_id"]
        # turn 1's handle, taken for turn 2 and superseded by it, was released on the decode
        assert wait_until(lambda: d.decodes[holder].stats.released == [first_handle["kvshuttle_handle_id"]])
        assert d.metric("kvshuttle_router_placements_total", choice="decode_local") == 1
        assert d.metric("kvshuttle_router_placements_total", choice="reverse_read") == 1
        assert d.metric("kvshuttle_router_placements_total", choice="recompute") == 1
    finally:
        d.close()


def test_a_short_follow_up_goes_through_a_prefill_when_its_decode_is_down(loop: LoopThread) -> None:
    d = deploy(loop, decodes=2, decode_local_max_tokens=40)
    try:
        chat = _chat(d, "c")
        _turns(chat, 1, stream=False)
        holder = _served(d.decodes, "c")[0]
        assert d.router is not None
        d.router.decode.mark(d.router.decode.backends[holder], False)
        _turns(chat, 1, stream=False, text="ok")
        assert _served(d.decodes, "c") == [holder, 1 - holder]
        assert prefill_handles(d.prefills[0])[1]["kvshuttle_handle_id"]  # the prefill read it back instead
        assert d.metric("kvshuttle_router_placements_total", choice="decode_local") == 0
        assert d.decodes[holder].stats.released == []
    finally:
        d.close()



def test_a_prefill_that_refuses_the_connection_passes_the_use_once_handle_on(loop: LoopThread) -> None:
    """Nothing reached a prefill whose port refused the connection, so the handle cannot have been consumed:
    the retry on the next prefill carries it (and reads back), where any other failure drops it."""
    d = deploy(loop, prefills=2)
    try:
        chat = _chat(d, "c")
        _turns(chat, 1, stream=False)
        home = _served(d.prefills, "c")[0]
        issued = d.decodes[0].issued_params[0]
        assert issued is not None
        loop.run(d.prefills[home].stop())  # its port now refuses connections
        _turns(chat, 1, stream=False)
        other = d.prefills[1 - home]
        assert prefill_handles(other)[0]["kvshuttle_handle_id"] == issued["kvshuttle_handle_id"]
        assert d.metric("kvshuttle_router_retries_total", role="prefill") == 1
        assert d.metric("kvshuttle_router_placements_total", choice="reverse_read") == 1
    finally:
        d.close()


def test_a_handle_the_prefill_read_nothing_from_counts_as_a_recompute(loop: LoopThread) -> None:
    """A prefill whose own prefix cache held the history (or that found too little to read) reports 0 tokens
    read: the turn is a recompute of its suffix, not a reverse read, and the unused handle is released."""
    d = deploy(loop)
    try:
        d.prefills[0].read_tokens = 0
        _turns(_chat(d, "c"), 2, stream=False)
        assert prefill_handles(d.prefills[0])[1]["kvshuttle_handle_id"]  # the handle was offered
        assert d.metric("kvshuttle_router_placements_total", choice="reverse_read") == 0
        assert d.metric("kvshuttle_router_placements_total", choice="recompute") == 2
        assert d.metric("kvshuttle_router_read_tokens_total") == 0
        # the unread handle was released: the decode need not hold the history to its TTL for nobody
        first = d.decodes[0].issued_params[0]
        assert first is not None
        assert wait_until(lambda: d.decodes[0].stats.released == [first["kvshuttle_handle_id"]])
    finally:
        d.close()


def test_without_reverse_reads_prefills_get_no_handle_and_decodes_keep_nothing(loop: LoopThread) -> None:
    d = deploy(loop, reverse_reads=False)
    try:
        chat = _chat(d, "c")
        _turns(chat, 2, stream=False)
        _turns(chat, 1, stream=True)
        assert prefill_handles(d.prefills[0]) == [FIRST_TURN_PARAMS] * 3
        assert d.decodes[0].stats.granted == 0 and d.decodes[0].stats.ungranted == 3  # no retention asked
        # nothing to publish: the streamed turn carried no publish key (the router would wait for nothing)
        assert PUBLISH_KEY not in d.decodes[0].requests[2]["body"]["kv_transfer_params"]
        assert d.prefills[0].stats.granted == 3  # the prefill still keeps each prompt for its decode's read
        assert d.metric("kvshuttle_router_placements_total", choice="recompute") == 3
    finally:
        d.close()


def test_replicas_on_redis_keep_a_failed_over_conversation_where_it_went(loop: LoopThread,
                                                                         redis_server: Any) -> None:
    """The prefill that served a conversation is stored with its handle: another router replica sends the next
    turn there too, even when that is not the conversation's hash home (it failed over while the home was down)."""
    from router_helpers import Deployment

    d = deploy(loop, prefills=2, store=redis_server.url)
    other = Deployment(loop, d.prefills, d.decodes, d.config)
    other.start_router()
    try:
        chat = _chat(d, "c")
        _turns(chat, 1, stream=False)
        home = _served(d.prefills, "c")[0]
        assert d.router is not None
        d.router.prefill.mark(d.router.prefill.backends[home], False)  # down, as replica 1 sees it
        _turns(chat, 1, stream=False)
        d.router.prefill.mark(d.router.prefill.backends[home], True)
        replica = _chat(other, "c")
        replica.messages = chat.messages
        _turns(replica, 1, stream=False)  # replica 2: never saw the failover, reads it from Redis
        assert _served(d.prefills, "c") == [home, 1 - home, 1 - home]
        assert other.metric("kvshuttle_router_affinity_total", role="prefill", how="sticky") == 1
    finally:
        other.stop_router()
        d.close()


def test_a_handle_taken_while_reverse_reads_are_off_is_released(loop: LoopThread) -> None:
    """Decode-local turns keep handles (the router finds the decode through them); a longer turn without reverse
    reads takes the handle and sends it nowhere: the decode is told to let go of it."""
    d = deploy(loop, reverse_reads=False, decode_local_max_tokens=16)
    try:
        chat = _chat(d, "c")
        _turns(chat, 1, stream=False)
        first = d.decodes[0].issued_params[0]
        assert first is not None
        _turns(chat, 1, stream=False, text="x" * 400)  # too long for the decode alone: through the prefill
        assert prefill_handles(d.prefills[0])[1] == FIRST_TURN_PARAMS
        assert wait_until(lambda: d.decodes[0].stats.released == [first["kvshuttle_handle_id"]])
    finally:
        d.close()


def test_a_read_found_by_content_without_a_handle_counts_as_a_reverse_read(loop: LoopThread) -> None:
    """A prefill with a content index reads back a retained history the router sent no handle for (here a first
    turn: another router's, or a lost key's): the prefill reports the tokens it read, and the turn is a reverse
    read, not a recompute."""
    d = deploy(loop)
    try:
        d.prefills[0].content_read_tokens = 64
        _turns(_chat(d, "c"), 1, stream=False)
        assert not prefill_handles(d.prefills[0])[0].get("remote_block_ids")  # no handle was sent
        assert d.metric("kvshuttle_router_placements_total", choice="reverse_read") == 1
        assert d.metric("kvshuttle_router_placements_total", choice="recompute") == 0
        assert d.metric("kvshuttle_router_read_tokens_total") == 64
    finally:
        d.close()
