// Python binding of the read planner: outputs are numpy arrays the C++ pass fills in place.
//
// Big row arrays come from the row buffer pool (row_buffer_pool.h); a buffer goes back to it when numpy
// frees the array that owns it.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "kvshuttle/descriptor_plan.h"
#include "kvshuttle/errors.h"
#include "row_buffer_pool.h"

namespace py = pybind11;

namespace kvshuttle {
namespace {
using Bases = py::array_t<uint64_t, py::array::c_style | py::array::forcecast>;
using Indices = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;
using Rows = py::array_t<uint64_t, py::array::c_style>;

constexpr size_t kRowBytes = 3 * sizeof(uint64_t);

// A [capacity, 3] uint64 array for the pass to fill; `shrink` then trims it to the rows written.
class RowArray {
 public:
  explicit RowArray(int64_t capacity) : capacity_(capacity) {
    const size_t bytes = static_cast<size_t>(capacity) * kRowBytes;
    if (bytes >= kPooledMinBytes) {
      pooled_ = row_pool().acquire(bytes);
    } else {
      plain_ = Rows({static_cast<py::ssize_t>(capacity), py::ssize_t{3}});
    }
  }
  RowArray(const RowArray&) = delete;
  RowArray& operator=(const RowArray&) = delete;
  ~RowArray() {
    if (pooled_ != nullptr) row_pool().release(pooled_);
  }

  uint64_t* data() { return pooled_ != nullptr ? pooled_ : plain_.mutable_data(); }

  // The first `rows` rows as a numpy array, handing a pooled buffer over to it when most of it is used.
  Rows take(int64_t rows) {
    const std::vector<py::ssize_t> shape{static_cast<py::ssize_t>(rows), 3};
    if (pooled_ == nullptr) {
      if (rows != capacity_) plain_.resize(shape, false);  // ours alone: no reference check
      return std::move(plain_);
    }
    if (rows * 4 < capacity_) {  // mostly unused: copy the rows out, keep the buffer cached
      Rows exact(shape);
      std::copy(pooled_, pooled_ + 3 * rows, exact.mutable_data());
      return exact;
    }
    uint64_t* owned = std::exchange(pooled_, nullptr);
    py::capsule owner(owned, [](void* p) { row_pool().release(static_cast<uint64_t*>(p)); });
    return Rows(shape, owned, owner);
  }

 private:
  int64_t capacity_;
  uint64_t* pooled_ = nullptr;
  Rows plain_;
};

// None when the ids are not sorted by local id, repeat a local id or fall outside a cache: the caller
// sorts or rejects them with a named error and calls again.
py::object plan_read(const ReadPlanSpec& spec, const Indices& walk_group_planes, const Bases& local_bases,
                     const Indices& local_ids, const Bases& remote_bases, const Indices& remote_ids,
                     int64_t local_blocks, int64_t remote_blocks) {
  check_read_plan(spec, walk_group_planes.data(), walk_group_planes.size(), local_bases.size(), remote_bases.size());
  if (local_ids.size() != remote_ids.size()) {
    throw BlockIdError("local and remote id arrays differ in length; pass one remote id per local id");
  }
  const int64_t num_ids = local_ids.size();
  if (!read_ids_are_ready(local_ids.data(), remote_ids.data(), num_ids, local_blocks, remote_blocks)) {
    return py::none();
  }
  // Room for one row per piece: pages past the rows written are never touched, and a mostly unused
  // pooled buffer is copied out of (take), so coalesced plans cost only their rows.
  RowArray local(spec.num_pieces(num_ids)), remote(spec.num_pieces(num_ids));
  int64_t rows = 0;
  {
    py::gil_scoped_release release;
    rows = plan_read_descriptors(spec, walk_group_planes.data(), local_bases.data(), local_ids.data(),
                                 remote_bases.data(), remote_ids.data(), num_ids, local.data(),
                                 remote.data());
  }
  return py::make_tuple(local.take(rows), remote.take(rows));
}
}  // namespace

void register_plan(py::module_& m) {
  py::class_<ReadPlanSpec>(m, "ReadPlanSpec")
      .def(py::init<>())
      .def_readwrite("num_walk_groups", &ReadPlanSpec::num_walk_groups)
      .def_readwrite("planes_per_walk_group", &ReadPlanSpec::planes_per_walk_group)
      .def_readwrite("piece_bytes", &ReadPlanSpec::piece_bytes)
      .def_readwrite("local_block_stride", &ReadPlanSpec::local_block_stride)
      .def_readwrite("remote_block_stride", &ReadPlanSpec::remote_block_stride)
      .def_readwrite("local_device", &ReadPlanSpec::local_device)
      .def_readwrite("remote_device", &ReadPlanSpec::remote_device)
      .def("num_pieces", &ReadPlanSpec::num_pieces, py::arg("num_ids"));
  m.def("plan_read_descriptors", &plan_read, py::arg("spec"), py::arg("walk_group_planes"), py::arg("local_bases"),
        py::arg("local_ids"), py::arg("remote_bases"), py::arg("remote_ids"), py::arg("local_blocks"),
        py::arg("remote_blocks"),
        "Rows (addr, len, dev) for both sides of a read, coalesced where both sides are contiguous; "
        "None unless the local ids rise strictly and all ids are in range.");
}

}  // namespace kvshuttle
