// coconet runtime: the Python binding of a generated CPU module, compiled once per machine and
// linked into every module (entries.h). It exposes the module's functions (its table,
// coconet_module_entries) and what the Python side reads besides: CallArgs, _batch, _shm_runs,
// _hier_runs, _units, _map. The Python side (coconetc/runtime) checks every argument on every rank
// before it calls, so nothing here validates user input. A lazy table's function (entries.h) is
// mapped from its unit's shared object on its first call (dlopen, dlsym), with the GIL held, so
// two threads never map one twice; a unit that is missing or does not load raises RuntimeError
// naming its file on that call. The Python side maps a call's unit in its checks (_map), before
// the ranks agree on the call, so that such an error is raised on every rank.
#define COCONET_LINKS_RUNTIME  // the runtime's state is the compiled runtime's (state.h)
#include <dlfcn.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "coconet/entries.h"
#include "coconet/module.h"

namespace py = pybind11;
using Fn = void (*)(const coconet::CallArgs&);

// The table of the module this copy of the binding is linked into (its module.cpp).
extern "C" __attribute__((visibility("hidden"))) const coconet::Entries<coconet::CallArgs>* coconet_module_entries();

namespace {

// The function of entry i: the linked one, or the lazy table's mapped now from its unit.
Fn function(int i) {
  const auto& e = coconet_module_entries()->entries[i];
  if (e.fn != nullptr) return e.fn;
  static std::vector<Fn> mapped(static_cast<size_t>(coconet_module_entries()->count), nullptr);
  Fn& f = mapped[static_cast<size_t>(i)];
  if (f != nullptr) return f;
  void* unit = dlopen(e.unit, RTLD_NOW | RTLD_LOCAL);
  const char* why = unit == nullptr ? dlerror() : nullptr;
  void* sym = unit != nullptr ? dlsym(unit, e.symbol) : nullptr;
  if (sym == nullptr) {
    why = why != nullptr ? why : dlerror();
    throw std::runtime_error(std::string("coconet: cannot load the compiled unit of ") + e.name + " from " +
                             e.unit + ": " + (why != nullptr ? why : "no such function") +
                             " (load the module again to rebuild it)");
  }
  f = reinterpret_cast<Fn>(sym);
  return f;
}

// The units of a lazy table mapped so far in this process, by path (what a test reads).
std::vector<std::string> units() {
  std::vector<std::string> out;
  const auto* t = coconet_module_entries();
  for (int i = 0; i < t->count; ++i) {
    const char* path = t->entries[i].unit;
    if (path == nullptr) continue;
    void* h = dlopen(path, RTLD_LAZY | RTLD_NOLOAD);
    if (h == nullptr) continue;
    dlclose(h);  // (NOLOAD took a reference)
    out.emplace_back(path);
  }
  return out;
}

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
  m.def("_trace_on", &coconet::trace::set_on, py::arg("on"), py::arg("max_events"),
        "records the units of every call in this process from now on (coconet/trace.h), or stops");
  m.def("_trace_take", [] {
    int64_t dropped = 0;
    std::vector<coconet::trace::Event> events = coconet::trace::take(&dropped);
    py::list out;
    for (const auto& e : events)
      out.append(py::make_tuple(e.unit, e.chunk, e.what ? py::str(e.what) : py::str(""), e.t0, e.t1, e.thread));
    return py::make_tuple(out, dropped);
  }, "the events recorded since the last take: ([(unit, chunk, what, t0_ns, t1_ns, thread)], dropped)");
  m.def("_units", &units, "the shared objects of this module's units mapped in this process");
  m.def("_map", [](const std::string& name) { function(coconet::entry_index(*coconet_module_entries(), name)); },
        "maps the unit of function NAME now (a call's checks: a unit that does not load raises on every rank)");
  m.def("_batch", [](const std::string& name, const std::vector<coconet::CallArgs>& calls) {
    Fn f = function(coconet::entry_index(*coconet_module_entries(), name));
    py::gil_scoped_release release;
    coconet::run_batch(f, calls);
  }, "calls of one function run as one step whose reductions span them (coconet/batch.h)");
  for (int i = 0; i < t->count; ++i)
    m.def(t->entries[i].name, [i](const coconet::CallArgs& a) { call(function(i), a); });
}
