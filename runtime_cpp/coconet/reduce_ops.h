// coconet runtime: the reduction operators sum, avg, prod, max, min.
//
// Native types use MPI's predefined operators.  MPI has no 16-bit float types, so half and
// bfloat16 travel as MPI_UINT16_T with user-defined MPI_Ops that combine in float and round back
// (created once, cached for the life of the process).  avg is a sum followed by a division by
// the group size (finish_avg); for integers that division truncates toward zero, as in C.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "dtypes.h"
#include "errors.h"

namespace coconet {

enum class Op { sum, avg, prod, max, min };

// The language's name of an op, for messages.
inline const char* op_name(Op op) {
  switch (op) {
    case Op::sum: return "sum";
    case Op::avg: return "avg";
    case Op::prod: return "prod";
    case Op::max: return "max";
    case Op::min: return "min";
  }
  return "?";
}

// Parses "sum" | "avg" | "prod" | "max" | "min".
inline Op parse_op(const std::string& name) {
  if (name == "sum") return Op::sum;
  if (name == "avg") return Op::avg;
  if (name == "prod") return Op::prod;
  if (name == "max") return Op::max;
  if (name == "min") return Op::min;
  throw std::invalid_argument("unknown reduction op '" + name + "'");
}

// a (op) b in a compute type; avg combines like sum.  max/min propagate NaN (as NumPy does).
template <class C>
COCONET_HD inline C combine(Op op, C a, C b) {
  switch (op) {
    case Op::sum:
    case Op::avg: return a + b;
    case Op::prod: return a * b;
    case Op::max: return (a != a || a > b) ? a : b;
    case Op::min: return (a != a || a < b) ? a : b;
  }
  return a;
}

// f(std::integral_constant<Op, op>{}): a loop given the op as a constant (combine(O::value, ...))
// has no switch per element, so it vectorizes.
template <class F>
inline void with_op(Op op, F&& f) {
  switch (op) {
    case Op::sum: f(std::integral_constant<Op, Op::sum>{}); return;
    case Op::avg: f(std::integral_constant<Op, Op::avg>{}); return;
    case Op::prod: f(std::integral_constant<Op, Op::prod>{}); return;
    case Op::max: f(std::integral_constant<Op, Op::max>{}); return;
    case Op::min: f(std::integral_constant<Op, Op::min>{}); return;
  }
}

// inout[i] = inout[i] (op) in[i] for storage type T (16-bit floats combine in float, round back).
template <class T>
inline void combine_into(Op op, const T* in, T* inout, int64_t n) {
  with_op(op, [&](auto o) {
    for (int64_t i = 0; i < n; ++i)
      inout[i] = from_compute<T>(combine(o.value, to_compute(inout[i]), to_compute(in[i])));
  });
}

// x[i] /= d: the second half of avg (integers truncate toward zero).
template <class T>
inline void divide_by(T* x, int64_t n, int d) {
  const compute_t<T> div = static_cast<compute_t<T>>(d);
  for (int64_t i = 0; i < n; ++i) x[i] = from_compute<T>(to_compute(x[i]) / div);
}

// Applies the avg division to a reduced buffer (no-op for the other ops).
template <class T>
inline void finish_avg(Op op, T* x, int64_t n, int group_size) {
  if (op == Op::avg && group_size > 1) divide_by(x, n, group_size);
}

// The MPI_User_function behind the half/bfloat16 ops.
template <class T, Op op>
void mpi_user_combine(void* in, void* inout, int* len, MPI_Datatype*) {
  combine_into(op, static_cast<const T*>(in), static_cast<T*>(inout), *len);
}

// The cached user-defined MPI_Op for a 16-bit float type.
template <class T, Op op>
MPI_Op half_like_op() {
  static MPI_Op cached = [] {
    MPI_Op o;
    COCONET_MPI(MPI_Op_create(&mpi_user_combine<T, op>, /*commute=*/1, &o));
    return o;
  }();
  return cached;
}

// The MPI_Op that reduces T with `op` (avg maps to the sum; divide afterwards with finish_avg).
template <class T>
MPI_Op mpi_op(Op op) {
  if constexpr (is_half_like<T>::value) {
    switch (op) {
      case Op::sum:
      case Op::avg: return half_like_op<T, Op::sum>();
      case Op::prod: return half_like_op<T, Op::prod>();
      case Op::max: return half_like_op<T, Op::max>();
      case Op::min: return half_like_op<T, Op::min>();
    }
  } else {
    switch (op) {
      case Op::sum:
      case Op::avg: return MPI_SUM;
      case Op::prod: return MPI_PROD;
      case Op::max: return MPI_MAX;
      case Op::min: return MPI_MIN;
    }
  }
  return MPI_SUM;
}

}  // namespace coconet
