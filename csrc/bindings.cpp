// Python bindings only: every function here forwards to csrc/cpu, csrc/cuda or build_info, and the native
// exceptions (kvshuttle/errors.h) are translated to kvshuttle.errors' classes of the same name.
#include <pybind11/native_enum.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <exception>
#include <new>
#include <string>
#include <vector>

#include "kvshuttle/async_copier.h"
#include "kvshuttle/build_info.h"
#include "kvshuttle/cpu_copy.h"
#include "kvshuttle/cuda_copy.h"
#include "kvshuttle/descriptor_plan.h"
#include "kvshuttle/errors.h"
#include "kvshuttle/lane_tuner.h"
#include "kvshuttle/thread_pool.h"

namespace py = pybind11;
using namespace kvshuttle;

namespace {
using PlaneTable = py::array_t<uint64_t, py::array::c_style | py::array::forcecast>;
using BlockIds = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

// Sets kvshuttle.errors.<name>(message) as the Python error. Looked up when raised (a sys.modules hit), so the
// extension holds no Python object of its own.
void set_named_error(const char* name, const char* message) {
  py::set_error(py::module_::import("kvshuttle.errors").attr(name), message);
}

// Local to this module: other pybind11 extensions in the process keep their own translation.
void register_errors() {
  py::register_local_exception_translator([](std::exception_ptr failure) {
    try {
      std::rethrow_exception(failure);
    } catch (const py::error_already_set&) {
      throw;  // a Python error already: pybind11 restores it
    } catch (const py::builtin_exception&) {
      throw;  // pybind11's own (argument casts): its default translation
    } catch (const LayoutError& e) {
      set_named_error("LayoutError", e.what());
    } catch (const BlockIdError& e) {
      set_named_error("BlockIdError", e.what());
    } catch (const StagingError& e) {
      set_named_error("StagingError", e.what());
    } catch (const CudaError& e) {
      set_named_error("CudaError", e.what());
    } catch (const BackendError& e) {
      set_named_error("BackendError", e.what());
    } catch (const std::bad_alloc&) {
      set_named_error("NativeMemoryError",
                      "kvshuttle native code ran out of host memory; free memory or move fewer blocks per call");
    } catch (const std::exception& e) {
      set_named_error("BackendError", (std::string("kvshuttle native code failed unexpectedly (") + e.what() +
                                       "); please report it with the call that raised it")
                                          .c_str());
    }
  });
}

void register_types(py::module_& m) {
  // Real enum.Enum classes (what _native.pyi declares), not pybind11's enum look-alikes.
  py::native_enum<TokenOrder>(m, "TokenOrder", "enum.Enum")
      .value("NHD", TokenOrder::NHD)
      .value("HND", TokenOrder::HND)
      .finalize();
  py::native_enum<Direction>(m, "Direction", "enum.Enum")
      .value("PACK", Direction::Pack)
      .value("UNPACK", Direction::Unpack)
      .finalize();
  py::class_<PagedCopySpec>(m, "PagedCopySpec")
      .def(py::init<>())
      .def(py::init<const PagedCopySpec&>(), py::arg("other"))
      .def_readwrite("num_layers", &PagedCopySpec::num_layers)
      .def_readwrite("planes_per_layer", &PagedCopySpec::planes_per_layer)
      .def_readwrite("num_blocks", &PagedCopySpec::num_blocks)
      .def_readwrite("block_stride", &PagedCopySpec::block_stride)
      .def_readwrite("block_size", &PagedCopySpec::block_size)
      .def_readwrite("num_heads", &PagedCopySpec::num_heads)
      .def_readwrite("head_offset", &PagedCopySpec::head_offset)
      .def_readwrite("token_stride", &PagedCopySpec::token_stride)
      .def_readwrite("head_stride", &PagedCopySpec::head_stride)
      .def_readwrite("staging_addr", &PagedCopySpec::staging_addr)
      .def_readwrite("staging_bytes", &PagedCopySpec::staging_bytes)
      .def_readwrite("staging_block_size", &PagedCopySpec::staging_block_size)
      .def_readwrite("staging_heads", &PagedCopySpec::staging_heads)
      .def_readwrite("staging_order", &PagedCopySpec::staging_order)
      .def_readwrite("row_bytes", &PagedCopySpec::row_bytes)
      .def_readwrite("num_tokens", &PagedCopySpec::num_tokens)
      .def("required_staging_bytes", &PagedCopySpec::required_staging_bytes);
  py::class_<CopyShape>(m, "CopyShape")
      .def_static("of", &CopyShape::of, py::arg("spec"), py::arg("direction"), py::arg("threads"))
      .def_readonly("direction", &CopyShape::direction)
      .def_readonly("block_size", &CopyShape::block_size)
      .def_readonly("num_heads", &CopyShape::num_heads)
      .def_readonly("token_stride", &CopyShape::token_stride)
      .def_readonly("head_stride", &CopyShape::head_stride)
      .def_readonly("planes_per_layer", &CopyShape::planes_per_layer)
      .def_readonly("staging_block_size", &CopyShape::staging_block_size)
      .def_readonly("staging_heads", &CopyShape::staging_heads)
      .def_readonly("row_bytes", &CopyShape::row_bytes)
      .def_readonly("staging_order", &CopyShape::staging_order)
      .def_readonly("threads", &CopyShape::threads);
  py::class_<LaneTuning>(m, "LaneTuning")
      .def_readonly("shape", &LaneTuning::shape)
      .def_readonly("lanes", &LaneTuning::lanes)
      .def_readonly("decisions", &LaneTuning::decisions)
      .def_readonly("timed", &LaneTuning::timed)
      .def_readonly("median_gbps", &LaneTuning::median_gbps);
  py::class_<LaneTuner> tuner(m, "LaneTuner");
  tuner.def(py::init<int>(), py::arg("explore_every") = LaneTuner::kExploreEvery)
      .def("choose", &LaneTuner::choose, py::arg("shape"), py::arg("prior"), py::arg("timed"))
      .def("record", &LaneTuner::record, py::arg("shape"), py::arg("lanes"), py::arg("bytes_per_second"))
      .def("snapshot", &LaneTuner::snapshot)
      .def("reset", &LaneTuner::reset);
  tuner.attr("candidates") = py::make_tuple(LaneTuner::kCandidates[0], LaneTuner::kCandidates[1]);
  tuner.attr("window") = LaneTuner::kWindow;
  tuner.attr("warmup") = LaneTuner::kWarmup;
  tuner.attr("max_shapes") = LaneTuner::kMaxShapes;
  py::class_<BuildInfo>(m, "BuildInfo")
      .def_readonly("version", &BuildInfo::version)
      .def_readonly("cuda", &BuildInfo::cuda)
      .def_readonly("cuda_archs", &BuildInfo::cuda_archs)
      .def_readonly("cuda_runtime_version", &BuildInfo::cuda_runtime_version);
  py::class_<CudaLaunchStats>(m, "CudaLaunchStats")
      .def_readonly("launches", &CudaLaunchStats::launches)
      .def_readonly("device_allocations", &CudaLaunchStats::device_allocations)
      .def_readonly("host_allocations", &CudaLaunchStats::host_allocations)
      .def_readonly("reuse_waits", &CudaLaunchStats::reuse_waits);
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
  m.def("streaming_min_bytes", &streaming_min_bytes, py::arg("direction"));
  m.def("set_streaming_min_bytes", &set_streaming_min_bytes, py::arg("nbytes"), py::arg("direction"));
  m.def("copy_lanes", &copy_lanes, py::arg("direction"));
  m.def("set_copy_lanes", &set_copy_lanes, py::arg("lanes"), py::arg("direction"));
  m.def("copy_tuning", [] { return lane_tuner().snapshot(); });
  m.def("reset_copy_tuning", [] { lane_tuner().reset(); });
  m.def("bytes_per_thread", &bytes_per_thread);
  m.def("set_bytes_per_thread", &set_bytes_per_thread, py::arg("nbytes"));
  m.def("build_info", &build_info);
  m.def("cuda_device_count", &cuda_device_count);
  m.def("cuda_launch_stats", &cuda_launch_stats);
}
void register_async(py::module_& m) {
  py::class_<CopyTicket, std::shared_ptr<CopyTicket>>(m, "CopyTicket")
      .def("done", &CopyTicket::done)
      .def("wait", &CopyTicket::wait, py::arg("timeout_s"), py::call_guard<py::gil_scoped_release>())
      .def("result", &CopyTicket::result);
  py::class_<AsyncCopier>(m, "AsyncCopier")
      .def(py::init<>())
      .def(
          "submit",
          [](AsyncCopier& self, const PagedCopySpec& spec, const PlaneTable& bases, const BlockIds& ids,
             Direction direction) {
            return self.submit(spec, std::vector<uint64_t>(bases.data(), bases.data() + bases.size()),
                               std::vector<int64_t>(ids.data(), ids.data() + ids.size()), direction);
          },
          py::arg("spec"), py::arg("plane_bases"), py::arg("block_ids"), py::arg("direction"))
      .def("close", &AsyncCopier::close, py::call_guard<py::gil_scoped_release>())
      .def("pending", &AsyncCopier::pending);
}
}  // namespace

PYBIND11_MODULE(_native, m) {
  m.doc() = "kvshuttle native core: paged KV pack/unpack (CPU, CUDA)";
  register_errors();
  register_types(m);
  register_copies(m);
  register_async(m);
  register_plan(m);
}
