"""The router's retention settings: defaults from the retention terms, one read-mode word, the old one accepted."""

from __future__ import annotations

import argparse
import threading
import time

import pytest

from kvshuttle.retention.terms import DEFAULT_ROUTER_TTL_S, DEFAULT_TTL_S, ROUTER_READ_MODE
from kvshuttle.router import BackendSpec, RouterConfig, RouterConfigError
from kvshuttle.router.main import add_arguments, config_from
from router_helpers import Conversation, LoopThread, deploy, prefill_handles, wait_until

pytest_plugins = ["router_fixtures"]  # loop
P, D = [BackendSpec("http://127.0.0.1:8100")], [BackendSpec("http://127.0.0.1:8200")]


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--prefill", "http://h:1", "--decode", "http://h:2", *argv])


def test_defaults_are_the_retention_terms() -> None:
    for config in (RouterConfig(P, D).check(), config_from(_args(), environ={})):
        assert (config.ttl_s, config.decode_ttl_s, config.reads) == (DEFAULT_ROUTER_TTL_S, DEFAULT_TTL_S,
                                                                     ROUTER_READ_MODE)
    with pytest.raises(RouterConfigError, match=f"e.g. {DEFAULT_ROUTER_TTL_S:g} and {DEFAULT_TTL_S:g}"):
        RouterConfig(P, D, ttl_s=DEFAULT_TTL_S).check()


def test_reads_takes_the_retention_words() -> None:
    assert RouterConfig(P, D, reads="multi_read").check().reads == "multi_read"
    assert config_from(_args("--reads", "multi_read"), environ={}).reads == "multi_read"
    assert config_from(_args("--reads", "use_once"), environ={}).reads == "use_once"


def test_the_old_word_multi_still_works_with_a_warning() -> None:
    with pytest.warns(FutureWarning, match="'multi' is deprecated: use 'multi_read'"):
        config = RouterConfig(P, D, reads="multi").check()  # type: ignore[arg-type]  # what old code passes
    assert config.reads == "multi_read"
    with pytest.warns(FutureWarning, match="--reads 'multi'"):
        assert config_from(_args("--reads", "multi"), environ={}).reads == "multi_read"


@pytest.mark.parametrize("word", ["twice", "MULTI", "", "multi-read"])
def test_other_words_are_refused(word: str) -> None:
    with pytest.raises(RouterConfigError, match="--reads is one of"):
        RouterConfig(P, D, reads=word).check()  # type: ignore[arg-type]
    with pytest.raises(SystemExit):
        _args("--reads", word)


def _params(reads: str | None) -> dict[str, object]:
    return {"kvshuttle_handle_id": "h", **({"kvshuttle_reads": reads} if reads is not None else {})}


def test_a_handle_names_its_read_mode_and_the_setting_is_the_fallback() -> None:
    multi, once = RouterConfig(P, D, reads="multi_read").check(), RouterConfig(P, D, reads="use_once").check()
    assert multi.read_mode_of(_params("use_once")) == "use_once" and once.read_mode_of(_params("multi_read")) == \
        "multi_read"
    for config in (multi, once):  # a handle that does not say (NixlConnector, an older decode), or says nonsense
        assert config.read_mode_of(_params(None)) == config.reads == config.read_mode_of(None)
        assert config.read_mode_of(_params("twice")) == config.reads


def test_who_releases_a_handle_it_has_no_use_for() -> None:
    multi, once = RouterConfig(P, D, reads="multi_read").check(), RouterConfig(P, D, reads="use_once").check()
    # taken from the store (use_once): no other turn has it, whatever the decode's mode (unchanged behaviour)
    assert once.sole_user(_params("multi_read")) and once.sole_user(_params("use_once")) and once.sole_user(None)
    # kept in the store (multi_read): concurrent turns may read a multi-read handle, never a use-once one
    assert not multi.sole_user(_params("multi_read")) and not multi.sole_user(_params(None))
    assert multi.sole_user(_params("use_once"))


@pytest.mark.parametrize(("router", "decode", "released"), [
    ("multi_read", "use_once", True),  # the handle says use-once: no concurrent turn could read it
    ("multi_read", "multi_read", False),  # a concurrent turn may still read it from the store
    ("use_once", "multi_read", True),  # taken from the store: this turn's alone (as before handles said)
])
def test_a_handle_left_unread_is_released_as_its_read_mode_says(loop: LoopThread, router: str, decode: str,
                                                                released: bool) -> None:
    d = deploy(loop, reads=router)
    try:
        d.decodes[0].read_mode = decode  # type: ignore[assignment]
        d.prefills[0].read_tokens = 0  # its own cache held the history: turn 1's handle goes unread
        chat = Conversation(d.client(), "c", "hello")
        chat.turn(stream=False)
        chat.turn(stream=False)
        first = d.decodes[0].issued_params[0]
        assert first is not None and first["kvshuttle_reads"] == decode
        if released:
            assert wait_until(lambda: d.decodes[0].stats.released == [first["kvshuttle_handle_id"]])
        else:
            time.sleep(0.5)  # a release would be under way by now
            assert d.decodes[0].stats.released == []
    finally:
        d.close()


@pytest.mark.parametrize(("decode", "both"), [("use_once", False), ("multi_read", True)])
def test_concurrent_turns_share_a_handle_only_when_it_is_multi_read(loop: LoopThread, decode: str,
                                                                   both: bool) -> None:
    """With --reads multi_read, a use-once handle is still taken by one turn: its second reader could only fail."""
    d = deploy(loop, reads="multi_read")
    try:
        d.decodes[0].read_mode = decode  # type: ignore[assignment]
        first = Conversation(d.client(), "c", "hi")
        first.turn(stream=False)
        d.prefills[0].barrier = 2  # both second turns looked up their handle before either one's decode stores
        threads = [threading.Thread(target=Conversation(d.client(), "c", "hi", messages=list(first.messages)).turn,
                                    args=(False,)) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        offered = [bool(p.get("kvshuttle_handle_id")) for p in prefill_handles(d.prefills[0])[1:]]
        assert sorted(offered) == ([True, True] if both else [False, True])
    finally:
        d.close()
