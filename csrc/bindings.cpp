// Python bindings only: every function here forwards to csrc/cpu, csrc/cuda or build_info.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "kvshuttle/build_info.h"
#include "kvshuttle/cpu_copy.h"
#include "kvshuttle/cuda_copy.h"
#include "kvshuttle/descriptor_plan.h"
#include "kvshuttle/thread_pool.h"

namespace py = pybind11;
using namespace kvshuttle;

namespace {
using PlaneTable = py::array_t<uint64_t, py::array::c_style | py::array::forcecast>;
using BlockIds = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

void register_types(py::module_& m) {
  py::enum_<TokenOrder>(m, "TokenOrder").value("NHD", TokenOrder::NHD).value("HND", TokenOrder::HND);
  py::enum_<Direction>(m, "Direction").value("PACK", Direction::Pack).value("UNPACK", Direction::Unpack);
  py::class_<PagedCopySpec>(m, "PagedCopySpec")
      .def(py::init<>())
      .def_readwrite("num_layers", &PagedCopySpec::num_layers)
      .def_readwrite("planes_per_layer", &PagedCopySpec::planes_per_layer)
      .def_readwrite("num_blocks", &PagedCopySpec::num_blocks)
      .def_readwrite("block_stride", &PagedCopySpec::block_stride)
      .def_readwrite("block_size", &PagedCopySpec::block_size)
      .def_readwrite("num_heads", &PagedCopySpec::num_heads)
      .def_readwrite("head_offset", &PagedCopySpec::head_offset)
      .def_readwrite("order", &PagedCopySpec::order)
      .def_readwrite("staging_addr", &PagedCopySpec::staging_addr)
      .def_readwrite("staging_bytes", &PagedCopySpec::staging_bytes)
      .def_readwrite("staging_block_size", &PagedCopySpec::staging_block_size)
      .def_readwrite("staging_heads", &PagedCopySpec::staging_heads)
      .def_readwrite("staging_order", &PagedCopySpec::staging_order)
      .def_readwrite("row_bytes", &PagedCopySpec::row_bytes)
      .def_readwrite("num_tokens", &PagedCopySpec::num_tokens)
      .def("required_staging_bytes", &PagedCopySpec::required_staging_bytes);
  py::class_<BuildInfo>(m, "BuildInfo")
      .def_readonly("version", &BuildInfo::version)
      .def_readonly("cuda", &BuildInfo::cuda)
      .def_readonly("cuda_archs", &BuildInfo::cuda_archs)
      .def_readonly("cuda_runtime_version", &BuildInfo::cuda_runtime_version);
}

void register_copies(py::module_& m) {
  m.def(
      "paged_copy_cpu",
      [](const PagedCopySpec& spec, const PlaneTable& bases, const BlockIds& ids, Direction direction) {
        py::gil_scoped_release release;
        paged_copy_cpu(spec, bases.data(), bases.size(), ids.data(), ids.size(), direction);
      },
      py::arg("spec"), py::arg("plane_bases"), py::arg("block_ids"), py::arg("direction"));
  m.def(
      "paged_copy_cuda",
      [](const PagedCopySpec& spec, const PlaneTable& bases, const BlockIds& ids, Direction direction,
         uint64_t stream) {
        py::gil_scoped_release release;
        paged_copy_cuda(spec, bases.data(), bases.size(), ids.data(), ids.size(), direction, stream);
      },
      py::arg("spec"), py::arg("plane_bases"), py::arg("block_ids"), py::arg("direction"),
      py::arg("stream") = 0);
  m.def("parallel_memcpy", &parallel_memcpy, py::arg("dst"), py::arg("src"), py::arg("nbytes"),
        py::call_guard<py::gil_scoped_release>());
  m.def("num_threads", &num_threads);
  m.def("set_num_threads", &set_num_threads, py::arg("n"));
  m.def("build_info", &build_info);
  m.def("cuda_device_count", &cuda_device_count);
}
}  // namespace

PYBIND11_MODULE(_native, m) {
  m.doc() = "kvshuttle native core: paged KV pack/unpack (CPU, CUDA)";
  register_types(m);
  register_copies(m);
  register_plan(m);
}
