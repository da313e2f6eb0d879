// CPU entry points (run on the thread pool; call with the GIL released).
#pragma once

#include <cstddef>
#include <cstdint>

#include "kvshuttle/paged_copy.h"

namespace kvshuttle {

void paged_copy_cpu(const PagedCopySpec& spec, const uint64_t* plane_bases,
                    int64_t num_plane_bases, const int64_t* ids, int64_t num_ids, Direction direction);

// Copies in `direction` of at least this many bytes in all use non-temporal stores, from several source pages
// at once (csrc/cpu/run_copier.h); smaller ones use memcpy. Defaults: packs from 16 MiB (a small staging chunk is
// read next by the transport, from the cache), unpacks always (the paged cache is not read again soon, and a
// packed read's staging chunk stays in the cache for the next one). A negative value restores the default.
int64_t streaming_min_bytes(Direction direction);
void set_streaming_min_bytes(int64_t nbytes, Direction direction);

// Source pages a streamed copy in `direction` reads at once (csrc/cpu/run_copier.h). 0 (the default): chosen per
// kind of copy by measurement (kvshuttle/lane_tuner.h); 1..4 fixes it (tests, benchmarks, an operator's choice);
// larger values take 4, negative ones 0.
int copy_lanes(Direction direction);
void set_copy_lanes(int lanes, Direction direction);

// A copy (pack, unpack, parallel_memcpy) uses one pool thread per this many bytes, at least one, at most the
// pool's size. 0: always the whole pool (tests); a negative value restores the default (2 MiB).
int64_t bytes_per_thread();
void set_bytes_per_thread(int64_t nbytes);

// memcpy of nbytes split over the same pool: the physical baseline the benchmarks compare against.
void parallel_memcpy(uint64_t dst, uint64_t src, int64_t nbytes);

}  // namespace kvshuttle
