"""Retention terms (one value with every retention default and decision) and the replaceable eviction order."""

from __future__ import annotations

import functools
import math
from dataclasses import fields
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvshuttle.retention import (
    DEFAULT_BUDGET_FRACTION,
    DEFAULT_MAX_TTL_S,
    DEFAULT_READ_MODE,
    DEFAULT_TTL_S,
    EVICTION_POLICIES,
    HandleEvictedError,
    HandleExpiredError,
    LeastRecentlyUsed,
    RetentionArgumentError,
    RetentionLedger,
    RetentionTerms,
)
from kvshuttle.retention.eviction import EvictionEmptyError
from kvshuttle.retention.terms import (
    DEFAULT_PREFILL_TTL_S,
    DEFAULT_RETAIN,
    DEFAULT_ROUTER_TTL_S,
    ROUTER_READ_MODE,
    as_read_mode,
)
from test_error_contract import FUZZ, named_or_ok, wrong
from test_retention import BS, advance, make, retain


# ------------------------------------------------------------------------------------------- defaults
def test_defaults_are_the_documented_ones() -> None:
    terms = RetentionTerms()
    assert (terms.ttl_s, terms.max_ttl_s, terms.read_mode) == (DEFAULT_TTL_S, DEFAULT_MAX_TTL_S, DEFAULT_READ_MODE)
    assert (DEFAULT_TTL_S, DEFAULT_MAX_TTL_S, DEFAULT_READ_MODE) == (480.0, 3600.0, "multi_read")
    assert (terms.budget_blocks, terms.budget_fraction) == (None, DEFAULT_BUDGET_FRACTION) == (None, 0.25)
    assert (terms.eviction, terms.retain, DEFAULT_RETAIN) == ("lru", "granted", "granted")
    assert DEFAULT_PREFILL_TTL_S == 30.0 and ROUTER_READ_MODE == "use_once"
    assert 0 < DEFAULT_ROUTER_TTL_S < DEFAULT_TTL_S  # a handle the router holds is still retained on the decode


def test_a_ledger_without_terms_has_the_defaults() -> None:
    assert make().ledger.terms == RetentionTerms()


# ----------------------------------------------------------------------------------------- validation
@pytest.mark.parametrize(("field", "value"), [
    ("ttl_s", 0.0), ("ttl_s", -1.0), ("ttl_s", math.inf), ("ttl_s", math.nan), ("ttl_s", "480"), ("ttl_s", True),
    ("max_ttl_s", 0), ("read_mode", "multi"), ("read_mode", "twice"), ("read_mode", None),
    ("budget_blocks", -1), ("budget_blocks", 1.5), ("budget_blocks", True),
    ("budget_fraction", 0.0), ("budget_fraction", 1.5), ("budget_fraction", math.nan), ("budget_fraction", "0.5"),
    ("budget_fraction", False), ("eviction", "fifo"), ("eviction", None), ("retain", "never"), ("retain", 1),
])
def test_a_bad_term_is_a_named_error(field: str, value: Any) -> None:
    with pytest.raises(RetentionArgumentError, match=field):
        RetentionTerms(**{field: value})


@FUZZ
@given(field=st.sampled_from([f.name for f in fields(RetentionTerms)]), value=wrong())
def test_any_wrong_term_is_refused_by_name_or_works(field: str, value: Any) -> None:
    """Wrong types and out-of-range values: a RetentionArgumentError naming the field, or terms a ledger runs on."""
    try:
        terms = RetentionTerms(**{field: value})
    except RetentionArgumentError as exc:
        assert field in str(exc)
        return
    ledger = RetentionLedger("e", "h", 1, terms=terms)
    issued: list[Any] = []
    named_or_ok(lambda: issued.append(ledger.retain("r", [0], [b"d"], 1, 16)))  # a budget of 0 blocks refuses
    for handle in issued:
        named_or_ok(functools.partial(ledger.renew, handle.handle_id))  # a TTL of 1e-300 s has ended already
    # a TTL of 1e-205 s may have ended a handle before release_all: none is left either way
    assert named_or_ok(lambda: ledger.sweep()) and ledger.release_all() <= len(issued) and len(ledger) == 0


def test_a_budget_of_no_blocks_refuses_every_retention() -> None:
    from kvshuttle.retention import BudgetExceededError

    env = make(terms=RetentionTerms(budget_blocks=0))
    with pytest.raises(BudgetExceededError) as info:
        retain(env, [1, 2])
    assert info.value.caller_frees == (1, 2) and len(env.ledger) == 0


def test_overridden_replaces_only_given_values_and_checks_them() -> None:
    terms = RetentionTerms(ttl_s=10.0, budget_blocks=8)
    assert terms.overridden(ttl_s=None, budget_blocks=None) is terms
    assert terms.overridden(ttl_s=20.0) == RetentionTerms(ttl_s=20.0, budget_blocks=8)
    with pytest.raises(RetentionArgumentError, match="ttl_s"):
        terms.overridden(ttl_s=-1.0)
    with pytest.raises(RetentionArgumentError, match="no retention term"):
        terms.overridden(ttl=20.0)


def test_read_mode_words_and_the_deprecated_alias() -> None:
    assert as_read_mode("use_once") == "use_once" and as_read_mode("multi_read") == "multi_read"
    with pytest.warns(FutureWarning, match="'multi' is deprecated: use 'multi_read'"):
        assert as_read_mode("multi", "--reads", aliases=True) == "multi_read"
    with pytest.raises(RetentionArgumentError, match="--reads"):
        as_read_mode("multi", "--reads")  # accepted only where old input must keep working
    with pytest.raises(RetentionArgumentError):
        as_read_mode(["use_once"], aliases=True)


# --------------------------------------------------------------------------- decisions: when it ends
def test_when_a_retention_ends() -> None:
    terms = RetentionTerms(ttl_s=100.0, max_ttl_s=600.0)
    assert terms.lifetime() == 100.0 and terms.lifetime(5000.0) == 5000.0  # an issuer's own TTL is its call
    assert terms.renewal() == 100.0 and terms.renewal(1e9) == 600.0 and terms.renewal(50.0) == 50.0
    assert RetentionTerms(ttl_s=900.0, max_ttl_s=600.0).longest == 900.0  # never below the TTL itself
    assert terms.renewed(expiry=200.0, now=150.0, ttl=10.0) == 200.0  # never shortened
    assert terms.renewed(expiry=200.0, now=150.0, ttl=100.0) == 250.0
    assert terms.expired(200.0, 200.0) and not terms.expired(200.0, 199.999)  # the end is exclusive
    with pytest.raises(RetentionArgumentError, match="ttl_s"):
        terms.renewal(-5.0)


def test_read_mode_decides_use_once() -> None:
    assert not RetentionTerms().use_once() and RetentionTerms(read_mode="use_once").use_once()
    assert RetentionTerms().use_once("use_once") and not RetentionTerms(read_mode="use_once").use_once("multi_read")
    with pytest.raises(RetentionArgumentError, match="mode"):
        RetentionTerms().use_once("twice")  # type: ignore[arg-type]
    assert RetentionTerms.consumed(2, 2) and not RetentionTerms.consumed(1, 2)


def test_budget_in_blocks_or_a_share_of_the_engine() -> None:
    assert RetentionTerms(budget_blocks=7).budget(1000) == 7
    assert RetentionTerms().budget(1000) == 250 and RetentionTerms(budget_fraction=0.5).budget(3) == 1
    assert RetentionTerms(budget_fraction=0.01).budget(10) == 1  # at least one block
    assert RetentionTerms().budget() is None  # the engine's size unknown (a bare ledger): no bound
    with pytest.raises(RetentionArgumentError, match="num_blocks"):
        RetentionTerms().budget(-1)


# ------------------------------------------------------------------------------- the ledger and terms
def test_the_ledger_follows_its_terms_and_kwargs_override_them() -> None:
    env = make(terms=RetentionTerms(ttl_s=10.0, read_mode="use_once", budget_blocks=3))
    assert env.ledger.terms.ttl_s == 10.0 and env.ledger.mode == "use_once" and env.ledger.budget_blocks == 3
    handle = retain(env, [1])
    assert handle.ttl_s == pytest.approx(10.0)
    advance(env, 10.0)
    with pytest.raises(HandleExpiredError):
        env.ledger.claim(handle.handle_id, handle.generation)
    override = make(terms=RetentionTerms(ttl_s=10.0), ttl_s=20.0, mode="use_once", max_ttl_s=30.0, budget_blocks=2)
    assert override.ledger.terms == RetentionTerms(ttl_s=20.0, read_mode="use_once", max_ttl_s=30.0,
                                                   budget_blocks=2)
    with pytest.raises(RetentionArgumentError, match="terms"):
        make(terms={"ttl_s": 10.0})


def test_the_ledger_evicts_in_its_policy_order(monkeypatch: pytest.MonkeyPatch) -> None:
    class MostRecentFirst(LeastRecentlyUsed):
        """A policy a tier could bring: here the newest evictable handle goes first."""

        def victim(self) -> str:
            return next(reversed(self._order))

    monkeypatch.setitem(EVICTION_POLICIES, "mru", MostRecentFirst)
    env = make(terms=RetentionTerms(budget_blocks=2, eviction="mru"))
    first, second = retain(env, [1], tag="a"), retain(env, [2], tag="b")
    retain(env, [3], tag="c")  # over budget: the policy names the newest evictable one (second)
    env.ledger.claim(first.handle_id, first.generation)
    with pytest.raises(HandleEvictedError):
        env.ledger.claim(second.handle_id, second.generation)
    lru = make(budget_blocks=2)
    first, second = retain(lru, [1], tag="a"), retain(lru, [2], tag="b")
    lru.ledger.renew(first.handle_id)  # a touch: now second is the least recently used
    retain(lru, [3], tag="c")
    with pytest.raises(HandleEvictedError):
        lru.ledger.claim(second.handle_id, second.generation)
    assert lru.ledger.claim(first.handle_id, first.generation).num_tokens == BS


# ---------------------------------------------------------------------------------------------- LRU
def test_least_recently_used_order() -> None:
    lru = LeastRecentlyUsed()
    with pytest.raises(EvictionEmptyError):
        lru.victim()
    for name in "abc":
        lru.admit(name)
    lru.touch("a")  # b, c, a
    lru.touch("zzz")  # not evictable: nothing
    assert lru.victim() == "b" and len(lru) == 3
    lru.remove("b")
    lru.remove("b")  # absent: nothing
    assert lru.victim() == "c"
    lru.admit("c")  # evictable again after a read: a touch
    assert [lru.victim(), len(lru)] == ["a", 2]


# ------------------------------------------------------------------------- consumers take these defaults
def test_the_planner_and_the_router_take_their_defaults_from_the_terms() -> None:
    import argparse
    import inspect

    from kvshuttle.planner import cli as plan_cli
    from kvshuttle.planner.simulate import simulate
    from kvshuttle.router.main import add_arguments

    assert inspect.signature(simulate).parameters["ttl_s"].default == DEFAULT_TTL_S
    planner = argparse.ArgumentParser()
    plan_cli.add_arguments(planner)
    assert float(planner.parse_args([]).ttl.split(",")[-1]) == DEFAULT_TTL_S
    router = argparse.ArgumentParser()
    add_arguments(router)
    args = router.parse_args(["--prefill", "http://h:1", "--decode", "http://h:2"])
    assert (args.ttl, args.decode_ttl, args.reads) == (DEFAULT_ROUTER_TTL_S, DEFAULT_TTL_S, ROUTER_READ_MODE)
