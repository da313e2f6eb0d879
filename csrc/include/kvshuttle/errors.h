// Exceptions the native code throws on purpose. Each maps to the kvshuttle.errors class of the same name where
// the extension is bound (csrc/bindings.cpp), so Python callers of the raw entry points get named errors too.
// Messages say what is wrong and what to do.
#pragma once

#include <stdexcept>
#include <string>

namespace kvshuttle {

// A spec that does not describe a copyable geometry (plane table, strides, heads, sizes).
struct LayoutError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

// Block ids out of range, repeated, or not matching the token count.
struct BlockIdError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

// A staging buffer too small for the copy.
struct StagingError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

// A backend that was not built (CUDA entry point in a CPU-only build).
struct BackendError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A CUDA runtime call failed; the message names the call and CUDA's error string.
struct CudaError : BackendError {
  using BackendError::BackendError;
};

}  // namespace kvshuttle
