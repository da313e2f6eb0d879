#include "kvshuttle/build_info.h"

#include "kvshuttle/cuda_copy.h"
#include "kvshuttle/errors.h"

#ifdef KVSHUTTLE_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

#ifndef KVSHUTTLE_VERSION
#define KVSHUTTLE_VERSION "0.0.0"
#endif

namespace kvshuttle {

BuildInfo build_info() {
  BuildInfo info;
  info.version = KVSHUTTLE_VERSION;
#ifdef KVSHUTTLE_WITH_CUDA
  info.cuda = true;
  info.cuda_archs = KVSHUTTLE_CUDA_ARCHS;
  info.cuda_runtime_version = CUDART_VERSION;
#endif
  return info;
}

#ifndef KVSHUTTLE_WITH_CUDA
void paged_copy_cuda(const PagedCopySpec&, const uint64_t*, int64_t, const int64_t*, int64_t, Direction, uint64_t) {
  throw BackendError("kvshuttle was built without CUDA (set KVSHUTTLE_CUDA=ON and reinstall)");
}
int cuda_device_count() { return 0; }
CudaLaunchStats cuda_launch_stats() { return {}; }
#endif

}  // namespace kvshuttle
