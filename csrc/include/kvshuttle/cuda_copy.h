// CUDA entry points. Declared always; defined by csrc/cuda/*.cu when built with CUDA.
#pragma once

#include <cstdint>
#include <string>

#include "kvshuttle/paged_copy.h"

namespace kvshuttle {

// Enqueues one launch on `stream` (a cudaStream_t as an integer; 0 = legacy default stream) covering all
// blocks, layers and planes. plane_bases and ids are host arrays, staged through a pinned upload slot of a
// small ring (csrc/cuda/upload_ring.h): no device allocation and no pageable copy per call.
void paged_copy_cuda(const PagedCopySpec& spec, const uint64_t* plane_bases,
                     int64_t num_plane_bases, const int64_t* ids, int64_t num_ids, Direction direction,
                     uint64_t stream);

// Counters of the upload rings (summed over devices): allocations stay flat across calls of one size.
struct CudaLaunchStats {
  int64_t launches = 0;            // tables uploaded
  int64_t device_allocations = 0;  // cudaMalloc calls (first use of a slot, or growth)
  int64_t host_allocations = 0;    // cudaHostAlloc calls
  int64_t reuse_waits = 0;         // launches that found their slot's previous kernel still running
};
CudaLaunchStats cuda_launch_stats();

// Number of usable CUDA devices now (0 when the driver is missing or too old).
int cuda_device_count();

}  // namespace kvshuttle
