// coconet host emulation: kernels: a grid's blocks in turn on the stream's thread, a block's threads as fibers (emulate.h includes every part, in order).
#pragma once

#include "emulate_memory.h"

namespace coconet {
namespace cuda {
namespace emu {

// ---- kernels: blocks in turn, threads as fibers ------------------------------------------------

// A fiber switch: on x86-64 six callee-saved registers and the stack pointer (no system call);
// elsewhere ucontext (swapcontext saves the signal mask with a system call: slower).
#if defined(__x86_64__)
#define COCONET_EMU_FAST_SWITCH 1
extern "C" void coconet_emu_switch(void** save_sp, void* to_sp);
__asm__(
    ".text\n"
    ".weak coconet_emu_switch\n"
    ".type coconet_emu_switch, @function\n"
    "coconet_emu_switch:\n"
    "  pushq %rbp\n  pushq %rbx\n  pushq %r12\n  pushq %r13\n  pushq %r14\n  pushq %r15\n"
    "  movq %rsp, (%rdi)\n"
    "  movq %rsi, %rsp\n"
    "  popq %r15\n  popq %r14\n  popq %r13\n  popq %r12\n  popq %rbx\n  popq %rbp\n"
    "  ret\n"
    ".size coconet_emu_switch, .-coconet_emu_switch\n");
#endif

struct Fiber {
#ifdef COCONET_EMU_FAST_SWITCH
  void* sp = nullptr;
#else
  ucontext_t ctx;
#endif
  std::unique_ptr<char[]> stack;
  bool done = false;
  unsigned tid = 0;
};
constexpr size_t kFiberStack = 256 * 1024;
COCONET_EMU std::vector<std::unique_ptr<Fiber>>& fiber_pool() {  // per stream thread, kept across launches
  static thread_local std::vector<std::unique_ptr<Fiber>> pool;
  return pool;
}
struct BlockRun {
#ifdef COCONET_EMU_FAST_SWITCH
  void* sched = nullptr;
#else
  ucontext_t sched;
#endif
  Fiber* cur = nullptr;
  const std::function<void()>* body = nullptr;
  std::vector<std::unique_ptr<Fiber>>& fibers = fiber_pool();
  bool direct = false;
  std::string error;
};
COCONET_EMU_VAR(thread_local BlockRun* block_run, = nullptr)

COCONET_EMU void set_thread(unsigned t) {
  threadIdx.x = t % blockDim.x;
  threadIdx.y = (t / blockDim.x) % blockDim.y;
  threadIdx.z = t / (blockDim.x * blockDim.y);
}

// back to the block's scheduler (a barrier, or the thread's end)
COCONET_EMU void yield_fiber(BlockRun* b, Fiber* f) {
#ifdef COCONET_EMU_FAST_SWITCH
  coconet_emu_switch(&f->sp, b->sched);
#else
  swapcontext(&f->ctx, &b->sched);
#endif
}

COCONET_EMU void fiber_entry() {
  BlockRun* b = block_run;
  try {
    (*b->body)();
  } catch (const std::exception& e) {
    if (b->error.empty()) b->error = e.what();
  }
  b->cur->done = true;
#ifdef COCONET_EMU_FAST_SWITCH
  yield_fiber(b, b->cur);  // never resumed
  std::abort();
#endif
}

COCONET_EMU void resume(BlockRun& b, Fiber* f) {
  b.cur = f;
  set_thread(f->tid);
#ifdef COCONET_EMU_FAST_SWITCH
  coconet_emu_switch(&b.sched, f->sp);
#else
  swapcontext(&b.sched, &f->ctx);
#endif
  b.cur = nullptr;
}

COCONET_EMU void start(BlockRun& b, Fiber* f, unsigned tid) {
  if (!f->stack) f->stack.reset(new char[kFiberStack]);
  f->done = false;
  f->tid = tid;
#ifdef COCONET_EMU_FAST_SWITCH
  // the stack as coconet_emu_switch leaves it: six registers, then `ret` into fiber_entry,
  // which starts with the stack aligned as after a call
  uintptr_t top = (uintptr_t(f->stack.get()) + kFiberStack) & ~uintptr_t(15);
  void** p = reinterpret_cast<void**>(top);
  *--p = nullptr;  // fiber_entry's return address: it never returns
  *--p = reinterpret_cast<void*>(&fiber_entry);
  for (int k = 0; k < 6; ++k) *--p = nullptr;
  f->sp = p;
#else
  getcontext(&f->ctx);
  f->ctx.uc_stack.ss_sp = f->stack.get();
  f->ctx.uc_stack.ss_size = kFiberStack;
  f->ctx.uc_link = &b.sched;
  makecontext(&f->ctx, fiber_entry, 0);
#endif
  resume(b, f);
}

COCONET_EMU void run_block(BlockRun& b, unsigned nthreads) {
  if (b.fibers.empty()) b.fibers.emplace_back(new Fiber());
  start(b, b.fibers[0].get(), 0);
  if (b.fibers[0]->done) {  // no barrier in this block: the other threads as plain calls
    b.direct = true;
    for (unsigned t = 1; t < nthreads; ++t) {
      set_thread(t);
      (*b.body)();
    }
    b.direct = false;
    return;
  }
  while (b.fibers.size() < nthreads) b.fibers.emplace_back(new Fiber());
  for (unsigned t = 1; t < nthreads; ++t) start(b, b.fibers[t].get(), t);
  for (;;) {
    unsigned done = 0;
    for (unsigned t = 0; t < nthreads; ++t) done += b.fibers[t]->done;
    if (done == nthreads) return;
    if (done != 0) throw std::runtime_error("coconet emulate: __syncthreads not reached by every thread of a block");
    for (unsigned t = 0; t < nthreads; ++t) resume(b, b.fibers[t].get());
  }
}

COCONET_EMU void launch(dim3 grid, dim3 block, cudaStream_t cs, std::function<void()> body) {
  State& st = state();
  std::vector<Span> spans;
  {
    std::lock_guard<std::recursive_mutex> d(st.det);
    spans.swap(st.pending);
    st.pending_set = false;
  }
  op(cs, std::move(spans), "a kernel", [grid, block, body = std::move(body)] {
    BlockRun b;
    BlockRun* saved = block_run;
    block_run = &b;
    b.body = &body;
    blockDim = block;
    gridDim = grid;
    const unsigned nthreads = block.x * block.y * block.z;
    for (unsigned z = 0; z < grid.z; ++z)
      for (unsigned y = 0; y < grid.y; ++y)
        for (unsigned x = 0; x < grid.x; ++x) {
          blockIdx = dim3(x, y, z);
          run_block(b, nthreads);
          if (!b.error.empty()) break;
        }
    block_run = saved;
    if (!b.error.empty()) throw std::runtime_error(b.error);
  });
}

COCONET_EMU void declare(std::vector<Span> spans) {
  State& st = state();
  std::lock_guard<std::recursive_mutex> d(st.det);
  st.pending = std::move(spans);
  st.pending_set = true;
}

}  // namespace emu
}  // namespace cuda
}  // namespace coconet
