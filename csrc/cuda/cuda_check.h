// CUDA runtime errors as kvshuttle's CudaError (translated to kvshuttle.errors.CudaError by the bindings).
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "kvshuttle/errors.h"

namespace kvshuttle {

inline void cuda_check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw CudaError(std::string("kvshuttle CUDA error in ") + what + ": " + cudaGetErrorString(err) +
                    " (check the device and that the arrays live on it; a sticky error needs a new process)");
  }
}

}  // namespace kvshuttle
