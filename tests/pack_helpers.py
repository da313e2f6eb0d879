"""Pack/unpack checks shared by the CPU test files: native against the numpy reference (and, with
:func:`check_against_oracle`, against direct indexing of the user's arrays), byte for byte over whole
poisoned destinations."""

from __future__ import annotations

from conftest import (
    Geo,
    HostCache,
    assert_bytes_equal,
    assert_caches_equal,
    make_cache,
    oracle_pack,
    oracle_unpack,
    poisoned,
    random_bytes,
    staging_layout,
)
from kvshuttle import pack, staging_nbytes, unpack

TAIL = 37  # staging bytes past the used part, which must stay as they were


def tokens_of(geo: Geo, ids, num_tokens):
    return len(ids) * geo.block_size if num_tokens is None else num_tokens


def pack_both(host: HostCache, ids, *, layout=None, num_tokens=None, head_offset=0, init=None,
              offset=0):
    """Pack with both backends into identically initialised staging; check they agree on every byte.

    ``offset`` shifts the staging start inside its allocation (misaligned addresses).
    """
    cache = host.cache()
    need = staging_nbytes(cache, tokens_of(host.geo, ids, num_tokens), layout)
    init = poisoned(offset + need + TAIL) if init is None else init[: offset + need + TAIL]
    before = host.snapshot()
    out = {}
    for backend in ("native", "reference"):
        buf = init.copy()
        pack(cache, ids, buf[offset: offset + need + TAIL], num_tokens=num_tokens, layout=layout,
             head_offset=head_offset, backend=backend)
        out[backend] = buf
    assert_caches_equal(host.raws, before, "source cache after pack")
    assert_bytes_equal(out["native"], out["reference"], "staging (native vs reference)")
    assert_bytes_equal(out["native"][:offset], init[:offset], "bytes before the staging")
    assert_bytes_equal(out["native"][offset + need:], init[offset + need:], "staging tail")
    return out["native"][offset: offset + need]


def unpack_both(staging, dest: HostCache, ids, *, layout=None, num_tokens=None, head_offset=0):
    """Unpack with both backends into two identical caches; check they agree on every byte. Returns
    the native result (``dest`` itself)."""
    copies = {"native": dest, "reference": dest.clone()}
    staged_before = staging.copy()
    for backend, host in copies.items():
        unpack(staging, host.cache(), ids, num_tokens=num_tokens, layout=layout, head_offset=head_offset,
               backend=backend)
    assert_bytes_equal(staging, staged_before, "staging after unpack")
    assert_caches_equal(copies["native"].raws, copies["reference"].raws, "cache (native vs reference)")
    return dest


def check_both_directions(rng, geo: Geo, ids, *, layout=None, num_tokens=None, head_offset=0):
    host = make_cache(rng, geo)
    staging = pack_both(host, ids, layout=layout, num_tokens=num_tokens, head_offset=head_offset)
    dest = make_cache(rng, geo)
    unpack_both(random_bytes(rng, staging.size + TAIL), dest, ids, layout=layout, num_tokens=num_tokens,
                head_offset=head_offset)


def check_against_oracle(rng, geo: Geo, ids, *, layout=None, num_tokens=None, head_offset=0) -> None:
    """Both directions, native and reference, against the oracles on poisoned and random destinations."""
    layout = layout or staging_layout(geo)
    host = make_cache(rng, geo)
    staging = pack_both(host, ids, layout=layout, num_tokens=num_tokens, head_offset=head_offset)
    tokens = tokens_of(geo, ids, num_tokens)
    want = poisoned(staging.size)
    oracle_pack(host, ids, want, layout, tokens, head_offset)
    assert_bytes_equal(staging, want, "staging vs direct indexing")
    dest = make_cache(rng, geo)
    expected = dest.clone()
    source = random_bytes(rng, staging.size + TAIL)
    unpack_both(source, dest, ids, layout=layout, num_tokens=num_tokens, head_offset=head_offset)
    oracle_unpack(source, expected, ids, layout, tokens, head_offset)
    assert_caches_equal(dest.raws, expected.raws, "cache vs direct indexing")
