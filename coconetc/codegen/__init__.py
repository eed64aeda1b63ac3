"""Code generation: the backends render execution plans (coconetc/plan) and decide nothing.

codegen/ holds what both backends share, as objects and functions each backend calls
(composed, not inherited):
  base.py       the function being written (Writer: lines, buffers, Lets, signature) and the
                C++ of shapes (every part of a renderer holds the function's Writer as
                self.w); Function, Signature
  dispatch.py   the function's layout, the declarations both write alike (output, alias,
                view), a unit to the backend's renderer of its kind, a collective (and an
                overlap chunk's collective) to the backend's call text of its kind
  emit.py       the math of one element of a pointwise expression (the precedence-aware emitter)
  indexing.py   where a loop reads each operand (slices, broadcasting, segments), whether it
                needs coordinates, dropout at the element's global index
  pointwise.py  the values of one element (every loop's, fused chunk's and kernel's body), the
                Lets computed before a loop, the layernorm of one row
  reductions.py the reduction table (sum, norm, segment_norm, max, min): each one's initial
                partial, partial of a run, combine and finish as the C++ both backends write
  extern.py     an extern operation's call
  library_calls.py  a Library unit's runtime call (its function and arguments), one for both
                backends
  naming.py     the names both backends give (module functions)
  extern_libs.py  what extern operations need from a build (headers, libraries)
  module.py     laying out a module: the templates' environment, one function per variant

cpu/ (C++, MPI) and cuda/ (CUDA, NCCL, cuBLAS) have the same files for the same jobs:
  __init__.py     generate(): the module's sources (Sources / CudaSources)
  render.py       one plan as one function: buffer declarations, each unit dispatched
  loops.py        Loop units (CPU loops / CUDA kernels)
  collectives.py  the call text of each collective
  fused.py        fused collectives
  overlap.py      overlap pipelines (a matmul in chunks, each chunk's collective in flight)
  templates/      the module source and its CMakeLists
and, CUDA only: support.py (what the CUDA renderer implements; `check --backend cuda`) and
notes.py (what the host emulation's race detection is told)."""
