// CUDA entry points. Declared always; defined by csrc/cuda/*.cu when built with CUDA.
#pragma once

#include <cstdint>
#include <string>

#include "kvshuttle/paged_copy.h"

namespace kvshuttle {

// Enqueues one launch on `stream` (a cudaStream_t as an integer; 0 = legacy default stream) covering all
// blocks, layers and planes. plane_bases and ids are host arrays; they are copied to device memory.
void paged_copy_cuda(const PagedCopySpec& spec, const uint64_t* plane_bases,
                     int64_t num_plane_bases, const int64_t* ids, int64_t num_ids, Direction direction,
                     uint64_t stream);

// Number of usable CUDA devices now (0 when the driver is missing or too old).
int cuda_device_count();

}  // namespace kvshuttle
