#pragma once

#include <string>

namespace kvshuttle {

struct BuildInfo {
  std::string version;
  bool cuda = false;         // CUDA kernels compiled in
  std::string cuda_archs;    // e.g. "80,90"; empty without CUDA
  int cuda_runtime_version = 0;
};

BuildInfo build_info();

}  // namespace kvshuttle
