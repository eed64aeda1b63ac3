// coconet runtime: the Python binding of a generated CUDA module (and of its host emulation,
// compiled as C++ with -DCOCONET_EMULATE), compiled once per machine and linked into every module
// (coconet/entries.h). It exposes the module's functions (its table, coconet_module_entries) and
// what the Python side reads besides: CallArgs, _batch, NCCL communicators, symmetric windows.
// coconetc/runtime/cuda.py checks every argument (dtype, shape, device) before calling, so
// nothing here validates user input.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>

#include "coconet/cuda/runtime.cuh"
#include "coconet/entries.h"

namespace py = pybind11;
using Fn = void (*)(const coconet::cuda::CallArgs&);

// The table of the module this copy of the binding is linked into (its module.cu).
extern "C" __attribute__((visibility("hidden"))) const coconet::Entries<coconet::cuda::CallArgs>* coconet_module_entries();

namespace {

void call(Fn f, const coconet::cuda::CallArgs& a) {
  py::gil_scoped_release release;
  f(a);
#ifdef COCONET_EMULATE
  // host emulation: whatever the call queued on other streams must be ordered before its end
  ::coconet::cuda::emu::call_end(reinterpret_cast<cudaStream_t>(a.stream));
#endif
}

// The calls run as one batch (coconet/cuda/batch.cuh), with the GIL released; an error in any
// of them raises here.
void call_batch(const std::string& name, const std::vector<coconet::cuda::CallArgs>& calls) {
  Fn f = coconet::find_entry(*coconet_module_entries(), name);
  py::gil_scoped_release release;
  coconet::cuda::run_batch(f, calls);
#ifdef COCONET_EMULATE
  if (!calls.empty()) ::coconet::cuda::emu::call_end(reinterpret_cast<cudaStream_t>(calls[0].stream));
#endif
}

}  // namespace

PYBIND11_MODULE(coconet_bound, m) {
  const auto* t = coconet_module_entries();
  m.doc() = std::string("coconet CUDA module generated from ") + t->file;
  py::class_<coconet::cuda::CallArgs>(m, "CallArgs", py::module_local())
      .def(py::init<>())
      .def_readwrite("tensors", &coconet::cuda::CallArgs::tensors)
      .def_readwrite("outputs", &coconet::cuda::CallArgs::outputs)
      .def_readwrite("seg_ptrs", &coconet::cuda::CallArgs::seg_ptrs)
      .def_readwrite("seg_sizes", &coconet::cuda::CallArgs::seg_sizes)
      .def_readwrite("sizes", &coconet::cuda::CallArgs::sizes)
      .def_readwrite("scalars", &coconet::cuda::CallArgs::scalars)
      .def_readwrite("iscalars", &coconet::cuda::CallArgs::iscalars)
      .def_readwrite("stream", &coconet::cuda::CallArgs::stream)
      .def_readwrite("comm", &coconet::cuda::CallArgs::comm)
      .def_readwrite("groups", &coconet::cuda::CallArgs::groups)
      .def_readwrite("in_place", &coconet::cuda::CallArgs::in_place);
  m.def("_batch", &call_batch,
        "calls of one function run as one step whose reductions span them (coconet/cuda/batch.cuh)");
  m.def("nccl_unique_id", []() { return py::bytes(coconet::cuda::unique_id()); });
  m.def("nccl_comm_init", [](py::bytes id, int nranks, int rank) {
    std::string s = id;
    py::gil_scoped_release release;
    return coconet::cuda::comm_init(s, nranks, rank);
  });
  m.def("nccl_comm_destroy", &coconet::cuda::comm_destroy);
  m.def("window_empty", [](uintptr_t comm, uintptr_t stream, size_t bytes) {
    py::gil_scoped_release release;
    return coconet::cuda::window_empty(comm, stream, bytes);
  }, "bytes the symmetric kernel reads in place (collective over comm): their address");
  m.def("window_index", &coconet::cuda::window_index, py::call_guard<py::gil_scoped_release>(),
        "which of comm's window_empty windows the symmetric kernel reads in place holds the bytes (-1: none)");
  m.def("_trace_on", &coconet::trace::set_on, py::arg("on"), py::arg("max_events"),
        "records the units of every call in this process from now on (coconet/cuda/trace.cuh), or stops");
  m.def("_trace_take", [] {
    int64_t dropped = 0;
    std::vector<coconet::trace::Event> events;
    {
      py::gil_scoped_release release;
      coconet::cuda::trace::resolve();  // waits for the GPU to reach the marks' events
      events = coconet::trace::take(&dropped);
    }
    py::list out;
    for (const auto& e : events)
      out.append(py::make_tuple(e.unit, e.chunk, e.what ? py::str(e.what) : py::str(""), e.t0, e.t1, e.thread));
    return py::make_tuple(out, dropped);
  }, "the events recorded since the last take, as the CPU module's: ([(unit, chunk, what, t0_ns, t1_ns, track)], "
     "dropped); a track from coconet::cuda::trace::kStreamTrack on is a stream's");
  m.attr("fused_trial_calls") = coconet::cuda::kTrialCalls;  // auto's first calls of a fused unit try both algorithms
#ifdef COCONET_EMULATE
  m.attr("emulated") = true;
  m.def("synchronize", []() {
    py::gil_scoped_release release;
    COCONET_CUDA(cudaDeviceSynchronize());
  });
  m.def("emulation_counts", []() {  // pointwise kernels launched on the vector path or not, vector accesses, kernels with 32- or 64-bit indices
    const auto& c = coconet::cuda::emu::counts();
    py::dict d;
    d["vector_kernels"] = c.vector_kernels.load();
    d["scalar_kernels"] = c.scalar_kernels.load();
    d["vector_accesses"] = c.vector_accesses.load();
    d["index32_kernels"] = c.index32_kernels.load();
    d["index64_kernels"] = c.index64_kernels.load();
    return d;
  });
#endif
  for (int i = 0; i < t->count; ++i) {
    Fn f = t->entries[i].fn;
    m.def(t->entries[i].name, [f](const coconet::cuda::CallArgs& a) { call(f, a); });
  }
}
