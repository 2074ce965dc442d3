// GPU signals for Python: UVM watchers (a word GPU kernels write, a Python callback on each
// change) and GPU counters (a word the engine counts completions into, that kernels or a stream
// wait on), and waits on either that spin on the word with the GIL released (no callback, no GIL
// taken per change). Device addresses are plain ints, for PyTorch/Triton kernels and CUDA graphs.
#include <nanobind/stl/function.h>
#include <nanobind/stl/optional.h>

#include <cstdio>

#include "arg_check.h"
#include "py_support.h"

namespace fabric::py {

using namespace nb::literals;

namespace {

// Waits, GIL released, until `read()` >= at_least; returns the value seen. Raises
// FabricTimeoutError (a TimeoutError) naming what was waited for and what was seen, and FabricError
// when the engine closes meanwhile.
template <class Read>
uint64_t wait_at_least(PyEngine& e, Read read, uint64_t at_least, std::optional<double> timeout_s,
                       const char* what) {
  PyEngine::Wait guard(e);
  uint64_t seen = 0;
  WaitEnd end = wait_released([&] { return (seen = read()) >= at_least; },
                              [&] { return guard.stopping(); }, timeout_s);
  if (end == WaitEnd::kStopped)
    throw Error(ErrorCode::kShutdown, std::string(what) + ": the engine was closed while waiting");
  if (end == WaitEnd::kTimedOut) {
    char msg[256];
    std::snprintf(
        msg, sizeof msg,
        "%s: the word reads %llu, not yet %llu, after %g s (is the kernel or transfer that sets it "
        "running?)",
        what, static_cast<unsigned long long>(seen), static_cast<unsigned long long>(at_least),
        timeout_s.value_or(0));
    throw Error(ErrorCode::kTimeout, msg);  // FabricTimeoutError: a FabricError and a TimeoutError
  }
  return seen;
}

bool is_engine(nb::handle h) { return nb::isinstance<PyEngine>(h); }
bool is_watcher(nb::handle h) { return nb::isinstance<UvmWatcher>(h); }
bool is_counter(nb::handle h) { return nb::isinstance<GpuCounter>(h); }

ArgSpec engine_arg() { return object_arg("engine", "a TransferEngine", is_engine, true); }
ArgSpec watcher_arg() {
  return object_arg("watcher", "a UvmWatcher (from alloc_uvm_watcher)", is_watcher, true);
}
ArgSpec counter_arg() {
  return object_arg("counter", "a GpuCounter (from alloc_gpu_counter)", is_counter, true);
}
ArgSpec device_arg() { return uint_arg("cuda_device", INT32_MAX, false, true); }
ArgSpec at_least_arg() { return uint_arg("at_least", UINT64_MAX, true); }

}  // namespace

void bind_gpu_signals(nb::module_& m) {
  nb::class_<UvmWatcher>(
      m, "UvmWatcher", "A 64-bit word of pinned, device-mapped host memory, watched by the engine.")
      .def_prop_ro(
          "device_ptr", [](const UvmWatcher& w) { return reinterpret_cast<uintptr_t>(w.device); },
          "the word's address for GPU kernels (int)")
      .def_prop_ro(
          "value", [](const UvmWatcher& w) { return w.host ? *w.host : 0; },
          "the word, read by the CPU")
      .def_ro("worker", &UvmWatcher::worker)
      .def("__repr__", [](const UvmWatcher& w) {
        return "UvmWatcher(id=" + std::to_string(w.id) + ", worker=" + std::to_string(w.worker) +
               ", value=" + std::to_string(w.host ? *w.host : 0) + ")";
      });

  nb::class_<GpuCounter>(
      m, "GpuCounter",
      "A completion counter in pinned, device-mapped host memory: pass it as on_done (it counts "
      "completions) and let a kernel wait on device_ptr.")
      .def_prop_ro("device_ptr",
                   [](const GpuCounter& c) { return reinterpret_cast<uintptr_t>(c.device); })
      .def_prop_ro("value", [](const GpuCounter& c) { return c.host ? c.host->load() : 0; })
      .def_ro("worker", &GpuCounter::worker)
      .def("__repr__", [](const GpuCounter& c) {
        return "GpuCounter(id=" + std::to_string(c.id) + ", worker=" + std::to_string(c.worker) +
               ", value=" + std::to_string(c.host ? c.host->load() : 0) + ")";
      });

  def_checked_fn(
      m, "alloc_uvm_watcher",
      {engine_arg(), {"callback", ArgKind::kCallable, false, true, 0, "", nullptr}, device_arg()},
      3,
      [](PyEngine& e, std::optional<nb::callable> callback, std::optional<int> cuda_device) {
        TransferEngine& eng = e.get();
        UvmCallback cb = [](uint64_t, uint64_t) {};  // None: only wait_uvm_watcher reads the word
        if (callback) {
          auto ref = std::make_shared<PyRef>(nb::borrow(*callback));
          cb = [ref](uint64_t old_value, uint64_t new_value) {
            with_python([&] {  // on the engine's watcher thread
              try {
                ref->obj(old_value, new_value);
              } catch (nb::python_error& err) {
                err.discard_as_unraisable("in a fabric_lib UVM watcher callback");
              }
            });
          };
        }
        nb::gil_scoped_release release;
        return eng.alloc_uvm_watcher(std::move(cb), cuda_device);
      },
      "engine"_a, "callback"_a.none(), "cuda_device"_a = nb::none(),
      "callback(old, new) runs on the engine's watcher thread, under the GIL, on every change of "
      "the word; None: no callback (wait with wait_uvm_watcher, which takes no GIL per change).");
  def_checked_fn(
      m, "wait_uvm_watcher", {engine_arg(), watcher_arg(), at_least_arg(), timeout_arg()}, 4,
      [](PyEngine& e, const UvmWatcher& w, uint64_t at_least, std::optional<double> timeout_s) {
        if (!w.host)
          throw Error(ErrorCode::kInvalidArgument, "wait_uvm_watcher: not an allocated watcher");
        const volatile uint64_t* word = w.host;
        return wait_at_least(
            e,
            [word] {
              uint64_t v = *word;
              std::atomic_thread_fence(std::memory_order_acquire);  // what the GPU wrote before it
              return v;
            },
            at_least, timeout_s, "wait_uvm_watcher");
      },
      "engine"_a, "watcher"_a, "at_least"_a, "timeout_s"_a = nb::none(),
      "Blocks, GIL released, until the word reads at_least or more; returns the value read. Raises "
      "TimeoutError after timeout_s (None: no limit).");
  // Without the GIL: the watcher thread may be waiting for it.
  def_checked_fn(m, "free_uvm_watcher", {engine_arg(), watcher_arg()}, 2,
                 nogil<PyEngine>(&TransferEngine::free_uvm_watcher), "engine"_a, "watcher"_a);
  def_checked_fn(m, "alloc_gpu_counter", {engine_arg(), device_arg()}, 2,
                 nogil<PyEngine>(&TransferEngine::alloc_gpu_counter), "engine"_a,
                 "cuda_device"_a = nb::none());
  def_checked_fn(
      m, "wait_gpu_counter", {engine_arg(), counter_arg(), at_least_arg(), timeout_arg()}, 4,
      [](PyEngine& e, const GpuCounter& c, uint64_t at_least, std::optional<double> timeout_s) {
        if (!c.host)
          throw Error(ErrorCode::kInvalidArgument, "wait_gpu_counter: not an allocated counter");
        std::atomic<uint64_t>* word = c.host;
        return wait_at_least(
            e, [word] { return word->load(std::memory_order_acquire); }, at_least, timeout_s,
            "wait_gpu_counter");
      },
      "engine"_a, "counter"_a, "at_least"_a, "timeout_s"_a = nb::none(),
      "Blocks, GIL released, until the counter reaches at_least; returns its value. Raises "
      "TimeoutError after timeout_s (None: no limit).");
  def_checked_fn(m, "free_gpu_counter", {engine_arg(), counter_arg()}, 2,
                 nogil<PyEngine>(&TransferEngine::free_gpu_counter), "engine"_a, "counter"_a);
  def_checked_fn(
      m, "gpu_stream_wait",
      {uint_arg("cuda_stream", UINTPTR_MAX, true), counter_arg(), at_least_arg()}, 3,
      [](uintptr_t cuda_stream, const GpuCounter& c, uint64_t at_least) {
        nb::gil_scoped_release release;
        TransferEngine::gpu_stream_wait(reinterpret_cast<void*>(cuda_stream), c, at_least);
      },
      "cuda_stream"_a, "counter"_a, "at_least"_a,
      "Makes the CUDA stream (a cudaStream_t as int, e.g. torch.cuda.current_stream().cuda_stream) "
      "wait until the counter reaches at_least.");
}

}  // namespace fabric::py
