// GPU signals for Python: UVM watchers (a word GPU kernels write, a Python callback on each
// change) and GPU counters (a word the engine counts completions into, that kernels or a stream
// wait on). Device addresses are plain ints, for PyTorch/Triton kernels and CUDA graphs.
#include <nanobind/stl/function.h>
#include <nanobind/stl/optional.h>

#include "py_support.h"

namespace fabric::py {

using namespace nb::literals;

void bind_gpu_signals(nb::module_& m) {
  nb::class_<UvmWatcher>(m, "UvmWatcher", "A 64-bit word of pinned, device-mapped host memory, watched by the engine.")
      .def_prop_ro("device_ptr", [](const UvmWatcher& w) { return reinterpret_cast<uintptr_t>(w.device); },
                   "the word's address for GPU kernels (int)")
      .def_prop_ro("value", [](const UvmWatcher& w) { return w.host ? *w.host : 0; }, "the word, read by the CPU")
      .def_ro("worker", &UvmWatcher::worker);

  nb::class_<GpuCounter>(m, "GpuCounter",
                         "A completion counter in pinned, device-mapped host memory: pass it as on_done (it counts "
                         "completions) and let a kernel wait on device_ptr.")
      .def_prop_ro("device_ptr", [](const GpuCounter& c) { return reinterpret_cast<uintptr_t>(c.device); })
      .def_prop_ro("value", [](const GpuCounter& c) { return c.host ? c.host->load() : 0; })
      .def_ro("worker", &GpuCounter::worker);

  m.def(
      "alloc_uvm_watcher",
      [](PyEngine& e, nb::callable callback, std::optional<int> cuda_device) {
        TransferEngine& eng = e.get();
        auto ref = std::make_shared<PyRef>(nb::borrow(callback));
        UvmCallback cb = [ref](uint64_t old_value, uint64_t new_value) {
          with_python([&] {  // on the engine's watcher thread
            try {
              ref->obj(old_value, new_value);
            } catch (nb::python_error& err) {
              err.discard_as_unraisable("in a fabric_lib UVM watcher callback");
            }
          });
        };
        nb::gil_scoped_release release;
        return eng.alloc_uvm_watcher(std::move(cb), cuda_device);
      },
      "engine"_a, "callback"_a, "cuda_device"_a = nb::none(),
      "callback(old, new) runs on the engine's watcher thread, under the GIL, on every change of the word.");
  m.def(
      "free_uvm_watcher",
      [](PyEngine& e, const UvmWatcher& w) {
        TransferEngine& eng = e.get();
        nb::gil_scoped_release release;  // the watcher thread may be waiting for the GIL
        eng.free_uvm_watcher(w);
      },
      "engine"_a, "watcher"_a);
  m.def(
      "alloc_gpu_counter",
      [](PyEngine& e, std::optional<int> cuda_device) {
        TransferEngine& eng = e.get();
        nb::gil_scoped_release release;
        return eng.alloc_gpu_counter(cuda_device);
      },
      "engine"_a, "cuda_device"_a = nb::none());
  m.def(
      "free_gpu_counter",
      [](PyEngine& e, const GpuCounter& c) {
        TransferEngine& eng = e.get();
        nb::gil_scoped_release release;
        eng.free_gpu_counter(c);
      },
      "engine"_a, "counter"_a);
  m.def(
      "gpu_stream_wait",
      [](uintptr_t cuda_stream, const GpuCounter& c, uint64_t at_least) {
        nb::gil_scoped_release release;
        TransferEngine::gpu_stream_wait(reinterpret_cast<void*>(cuda_stream), c, at_least);
      },
      "cuda_stream"_a, "counter"_a, "at_least"_a,
      "Makes the CUDA stream (a cudaStream_t as int, e.g. torch.cuda.current_stream().cuda_stream) wait "
      "until the counter reaches at_least.");
}

}  // namespace fabric::py
