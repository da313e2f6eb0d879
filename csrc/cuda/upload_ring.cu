// The pinned upload ring (upload_ring.h): slots reused only after the event of their last kernel completed.
#include "upload_ring.h"

#include <array>
#include <atomic>
#include <string>

#include "cuda_check.h"

namespace kvshuttle {
namespace {

constexpr size_t kMinSlotBytes = 4096;
constexpr int kMaxDevices = 64;

size_t grown_capacity(size_t bytes) {
  size_t capacity = kMinSlotBytes;
  while (capacity < bytes) capacity *= 2;  // doubling: a growing workload reallocates O(log n) times
  return capacity;
}

std::array<std::atomic<UploadRing*>, kMaxDevices>& rings() {
  static std::array<std::atomic<UploadRing*>, kMaxDevices> all{};
  return all;
}

}  // namespace

UploadSlot& UploadRing::acquire(size_t bytes) {
  UploadSlot& slot = slots_[next_];
  next_ = (next_ + 1) % kUploadSlots;
  if (slot.done == nullptr) {
    cuda_check(cudaEventCreateWithFlags(&slot.done, cudaEventDisableTiming), "cudaEventCreateWithFlags");
  }
  if (slot.recorded) {
    const cudaError_t state = cudaEventQuery(slot.done);
    if (state == cudaErrorNotReady) {
      ++stats_.reuse_waits;
      cuda_check(cudaEventSynchronize(slot.done), "cudaEventSynchronize (upload slot reuse)");
    } else {
      cuda_check(state, "cudaEventQuery (upload slot reuse)");
    }
    slot.recorded = false;
  }
  if (slot.capacity < bytes) {
    // The slot's last kernel finished (above), so its buffers can go.
    if (slot.device != nullptr) cuda_check(cudaFree(slot.device), "cudaFree (upload slot growth)");
    if (slot.host != nullptr) cuda_check(cudaFreeHost(slot.host), "cudaFreeHost (upload slot growth)");
    slot.device = nullptr;
    slot.host = nullptr;
    slot.capacity = 0;
    const size_t capacity = grown_capacity(bytes);
    cuda_check(cudaHostAlloc(reinterpret_cast<void**>(&slot.host), capacity, cudaHostAllocDefault),
               "cudaHostAlloc (upload slot)");
    ++stats_.host_allocations;
    cuda_check(cudaMalloc(reinterpret_cast<void**>(&slot.device), capacity), "cudaMalloc (upload slot)");
    ++stats_.device_allocations;
    slot.capacity = capacity;
  }
  return slot;
}

void UploadRing::upload(UploadSlot& slot, size_t bytes, cudaStream_t stream) {
  cuda_check(cudaMemcpyAsync(slot.device, slot.host, bytes, cudaMemcpyHostToDevice, stream),
             "cudaMemcpyAsync (block table upload)");
  ++stats_.launches;
}

void UploadRing::retire(UploadSlot& slot, cudaStream_t stream) {
  // Recorded even after a failed launch: the upload before it still reads the host buffer.
  cuda_check(cudaEventRecord(slot.done, stream), "cudaEventRecord (upload slot)");
  slot.recorded = true;
}

UploadRing& upload_ring_for_current_device() {
  int device = 0;
  cuda_check(cudaGetDevice(&device), "cudaGetDevice");
  if (device < 0 || device >= kMaxDevices) {
    throw CudaError("kvshuttle CUDA: device index " + std::to_string(device) + " beyond the 64 supported");
  }
  std::atomic<UploadRing*>& entry = rings()[static_cast<size_t>(device)];
  UploadRing* ring = entry.load(std::memory_order_acquire);
  if (ring == nullptr) {
    auto* fresh = new UploadRing();  // never freed: see upload_ring.h
    if (entry.compare_exchange_strong(ring, fresh, std::memory_order_acq_rel)) {
      ring = fresh;
    } else {
      delete fresh;  // another thread won; `ring` now holds its ring
    }
  }
  return *ring;
}

CudaLaunchStats cuda_launch_stats() {
  CudaLaunchStats total;
  for (auto& entry : rings()) {
    UploadRing* ring = entry.load(std::memory_order_acquire);
    if (ring == nullptr) continue;
    std::lock_guard<std::mutex> guard(ring->lock());
    const CudaLaunchStats s = ring->stats();
    total.launches += s.launches;
    total.device_allocations += s.device_allocations;
    total.host_allocations += s.host_allocations;
    total.reuse_waits += s.reuse_waits;
  }
  return total;
}

}  // namespace kvshuttle
