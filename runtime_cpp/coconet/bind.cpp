// coconet runtime: the Python binding of a generated CPU module, compiled once per machine and
// linked into every module (entries.h). It exposes the module's functions (its table,
// coconet_module_entries) and what the Python side reads besides: CallArgs, _batch, _shm_runs,
// _hier_runs. The Python side (coconetc/runtime) checks every argument on every rank before it
// calls, so nothing here validates user input.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>

#include "coconet/entries.h"
#include "coconet/module.h"

namespace py = pybind11;
using Fn = void (*)(const coconet::CallArgs&);

// The table of the module this copy of the binding is linked into (its module.cpp).
extern "C" __attribute__((visibility("hidden"))) const coconet::Entries<coconet::CallArgs>* coconet_module_entries();

namespace {

// Runs f on the call's arguments with the GIL released. Errors before communication starts
// (identical on every rank) become Python exceptions; later ones abort the job (errors.h).
void call(Fn f, const coconet::CallArgs& a) {
  py::gil_scoped_release release;
  f(a);
}

}  // namespace

PYBIND11_MODULE(coconet_bound, m) {
  const auto* t = coconet_module_entries();
  m.doc() = std::string("coconet module generated from ") + t->file;
  py::class_<coconet::CallArgs>(m, "CallArgs", py::module_local())  // each module its own
      .def(py::init<>())
      .def_readwrite("tensors", &coconet::CallArgs::tensors)
      .def_readwrite("seg_ptrs", &coconet::CallArgs::seg_ptrs)
      .def_readwrite("seg_sizes", &coconet::CallArgs::seg_sizes)
      .def_readwrite("outputs", &coconet::CallArgs::outputs)
      .def_readwrite("sizes", &coconet::CallArgs::sizes)
      .def_readwrite("scalars", &coconet::CallArgs::scalars)
      .def_readwrite("iscalars", &coconet::CallArgs::iscalars)
      .def_readwrite("comm", &coconet::CallArgs::comm)
      .def_readwrite("groups", &coconet::CallArgs::groups)
      .def_readwrite("fused", &coconet::CallArgs::fused)
      .def_readwrite("windows", &coconet::CallArgs::windows);
  m.def("_shm_runs", [] { return coconet::shm_runs().load(); },
        "collectives run through a shared-memory window in this process (which algorithm ran)");
  m.def("_hier_runs", [] { return coconet::hier_runs().load(); },
        "collectives run hierarchically (groups over several nodes) in this process");
  m.def("_batch", [](const std::string& name, const std::vector<coconet::CallArgs>& calls) {
    Fn f = coconet::find_entry(*coconet_module_entries(), name);
    py::gil_scoped_release release;
    coconet::run_batch(f, calls);
  }, "calls of one function run as one step whose reductions span them (coconet/batch.h)");
  for (int i = 0; i < t->count; ++i) {
    Fn f = t->entries[i].fn;
    m.def(t->entries[i].name, [f](const coconet::CallArgs& a) { call(f, a); });
  }
}
