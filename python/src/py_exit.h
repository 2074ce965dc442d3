// Python's exit as the engine's threads see it: once it begins, a thread that Python does not own
// (callback, UVM watcher) no longer takes the GIL, so Python callbacks still due are dropped.
#pragma once

#include <nanobind/nanobind.h>

#include <atomic>
#include <chrono>
#include <thread>

namespace fabric::py {

namespace nb = nanobind;

// Set by begin_python_exit. `entering` counts the threads between the check in with_python and
// the end of their call into Python: begin_python_exit waits for them, so none is left waiting
// for the GIL when CPython finalizes. Both are seq_cst: a thread increments then reads the flag,
// the exit sets the flag then reads the count, so one of the two always sees the other.
inline std::atomic<bool> python_exit_begun{false};
inline std::atomic<int> threads_entering_python{0};

// True once Python is exiting. The interpreter's own state covers an exit that did not go through
// fabric_lib's atexit hook (an interpreter embedded in C++ that finalizes without atexit).
inline bool python_exiting() {
  if (python_exit_begun.load(std::memory_order_seq_cst)) return true;
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing() || !Py_IsInitialized();
#else
  return _Py_IsFinalizing() || !Py_IsInitialized();
#endif
}

// Runs f under the GIL unless Python is exiting; returns whether it ran. Taking the GIL while
// CPython finalizes ends the calling thread with pthread_exit, and its forced unwind through the
// engine thread's frames aborts the process ("terminate called without an active exception",
// issue 28), so a callback due then is dropped instead: nobody waits for it any more.
template <class F>
bool with_python(F&& f) {
  threads_entering_python.fetch_add(1, std::memory_order_seq_cst);
  struct Leave {  // after the GIL is released: declared before `gil`
    ~Leave() { threads_entering_python.fetch_sub(1, std::memory_order_seq_cst); }
  } leave;
  if (python_exiting()) return false;
  nb::gil_scoped_acquire gil;
  f();
  return true;
}

// Called with the GIL by fabric_lib's atexit hook, which runs before CPython finalizes: from now
// on with_python drops its call, and the calls already past its check finish (their threads get
// the GIL while this one waits without it). A callback that never returns would hold the exit
// here, as it would hold an engine's close.
inline void begin_python_exit() {
  python_exit_begun.store(true, std::memory_order_seq_cst);
  nb::gil_scoped_release release;
  while (threads_entering_python.load(std::memory_order_seq_cst) != 0)
    std::this_thread::sleep_for(std::chrono::microseconds(100));
}

}  // namespace fabric::py
