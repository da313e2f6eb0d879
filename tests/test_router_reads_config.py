"""The router's retention settings: defaults from the retention terms, one read-mode word, the old one accepted."""

from __future__ import annotations

import argparse

import pytest

from kvshuttle.retention.terms import DEFAULT_ROUTER_TTL_S, DEFAULT_TTL_S, ROUTER_READ_MODE
from kvshuttle.router import BackendSpec, RouterConfig, RouterConfigError
from kvshuttle.router.main import add_arguments, config_from

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
