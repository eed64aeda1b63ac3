// coconet runtime: what a generated module hands to its Python binding (bind.cpp, cuda/bind.cu).
//
// A module's .so is its generated functions (module.cpp or module.cu, no pybind11 in them), a
// table of them (below) and the binding, which is compiled once per machine and linked into every
// module (coconetc/toolchain). The table TU includes only this header, so a module's own code
// never parses pybind11: a new schedule recompiles its function and the table, nothing else.
#pragma once

#include <cstring>
#include <stdexcept>
#include <string>

struct _object;  // PyObject

namespace coconet {

// One generated function: its Python name and the function (Args: coconet::CallArgs on the CPU,
// coconet::cuda::CallArgs on CUDA).
template <class Args>
struct Entry {
  const char* name;
  void (*fn)(const Args&);
};

// The module's functions and the .ccn file they came from (for the module's docstring).
template <class Args>
struct Entries {
  const char* file;
  const Entry<Args>* entries;
  int count;
};

// The function of the table named NAME, for a batch of calls (_batch); std::invalid_argument
// when the module has none.
template <class Args>
void (*find_entry(const Entries<Args>& t, const std::string& name))(const Args&) {
  for (int i = 0; i < t.count; ++i)
    if (std::strcmp(t.entries[i].name, name.c_str()) == 0) return t.entries[i].fn;
  throw std::invalid_argument("no module function " + name);
}

}  // namespace coconet

// The binding's module definition (PyInit_coconet_bound, pybind11's multi-phase init: the module
// takes its name from the import, so one compiled binding serves every module). A generated
// module's PyInit_<name> returns it; modules link with -Bsymbolic-functions, so each one's call
// resolves to its own copy of the binding, which reads its own table (coconet_module_entries).
extern "C" _object* PyInit_coconet_bound();
