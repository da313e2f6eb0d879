// A small ring of pinned upload slots for the kernels' per-call tables (plane bases, block ids).
//
// Each slot is a pinned host buffer (cudaHostAlloc) with a device buffer allocated once (grown when a call needs
// more, never per call) and an event recorded after the kernel that reads the device buffer. A slot is handed
// out again only when that event has completed, so the host never overwrites a table an enqueued copy or kernel
// still reads; with kUploadSlots slots, that many back-to-back calls overlap before a caller waits.
// Nothing here touches the device until the first launch (the module imports without a driver).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <mutex>

#include "kvshuttle/cuda_copy.h"

namespace kvshuttle {

constexpr int kUploadSlots = 8;

struct UploadSlot {
  char* host = nullptr;     // pinned: the copy to the device is truly asynchronous
  char* device = nullptr;   // what the kernel reads
  size_t capacity = 0;      // bytes of both buffers
  cudaEvent_t done = nullptr;  // recorded after the last kernel that read `device`
  bool recorded = false;
};

// One ring per device; every call holds the ring's lock from the slot's acquisition until its event is
// recorded, so concurrent callers (an owner's pack thread, a reader's unpack thread) never share a slot.
class UploadRing {
 public:
  // With lock() held: the next slot, after its previous launch finished, grown to hold `bytes`.
  UploadSlot& acquire(size_t bytes);
  // Uploads the first `bytes` of the slot's host buffer on `stream` (stream-ordered before the kernel).
  void upload(UploadSlot& slot, size_t bytes, cudaStream_t stream);
  // Records the slot's event on `stream` after the kernel that reads it.
  void retire(UploadSlot& slot, cudaStream_t stream);
  std::mutex& lock() { return mutex_; }
  CudaLaunchStats stats() const { return stats_; }

 private:
  UploadSlot slots_[kUploadSlots];
  int next_ = 0;
  std::mutex mutex_;
  CudaLaunchStats stats_;
};

// The ring of the current device (created on first use; kept for the process's life: freeing pinned memory
// while the driver shuts down at exit is not safe).
UploadRing& upload_ring_for_current_device();

}  // namespace kvshuttle
