// coconet runtime: what a generated module hands to its Python binding (bind.cpp, cuda/bind.cu).
//
// A module's .so is a table of its generated functions (below) and the binding, which is compiled
// once per machine and linked into every module (coconetc/toolchain). The table TU includes only
// this header, so a module's own code never parses pybind11: a new schedule recompiles its
// function and the table, nothing else. Two kinds of table:
//   * linked (a CMake build, CUDA, the host emulation): each entry's `fn` is the function,
//     compiled into the same .so;
//   * lazy (coconetc's cached CPU builds): each function is in a shared object of its own (the
//     unit's, cached by content beside its object), named by the entry's `unit` (a path) and
//     `symbol`; the binding maps it (dlopen) and finds the function (dlsym) on the function's
//     first call, so importing the module maps no unit and a call maps the one it runs.
#pragma once

#include <cstring>
#include <stdexcept>
#include <string>

struct _object;  // PyObject

namespace coconet {

// One generated function: its Python name and the function (Args: coconet::CallArgs on the CPU,
// coconet::cuda::CallArgs on CUDA), or (fn null, a lazy table) the shared object that holds it
// and the function's (extern "C") name there.
template <class Args>
struct Entry {
  const char* name;
  void (*fn)(const Args&);
  const char* unit = nullptr;
  const char* symbol = nullptr;
};

// The module's functions and the .ccn file they came from (for the module's docstring).
template <class Args>
struct Entries {
  const char* file;
  const Entry<Args>* entries;
  int count;
};

// The index in the table of the function named NAME, for a batch of calls (_batch);
// std::invalid_argument when the module has none.
template <class Args>
int entry_index(const Entries<Args>& t, const std::string& name) {
  for (int i = 0; i < t.count; ++i)
    if (std::strcmp(t.entries[i].name, name.c_str()) == 0) return i;
  throw std::invalid_argument("no module function " + name);
}

// The function of a linked table named NAME (cuda/bind.cu).
template <class Args>
void (*find_entry(const Entries<Args>& t, const std::string& name))(const Args&) {
  return t.entries[entry_index(t, name)].fn;
}

}  // namespace coconet

// The binding's module definition (PyInit_coconet_bound, pybind11's multi-phase init: the module
// takes its name from the import, so one compiled binding serves every module). A generated
// module's PyInit_<name> returns it; modules link with -Bsymbolic-functions, so each one's call
// resolves to its own copy of the binding, which reads its own table (coconet_module_entries).
extern "C" _object* PyInit_coconet_bound();
