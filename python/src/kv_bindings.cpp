// KV-cache transfer endpoints for Python (include/fabric/kv/transfer.h). fabric_lib/kv.py wraps
// them for tensors; here they take raw addresses. Every call releases the GIL (they reach the
// engine's worker); Python callables run on the callback thread under the GIL.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "fabric/kv/transfer.h"
#include "py_support.h"

namespace fabric::py {

using namespace nb::literals;
using namespace fabric::kv;

namespace {

inline constexpr char kKvEndpoint[] = "KV endpoint";
using PyKvReceiver = EngineBound<KvReceiver, kKvEndpoint>;
using PyKvSender = EngineBound<KvSender, kKvEndpoint>;

struct TensorArgs {
  std::vector<uintptr_t> k, v;
  std::optional<int> cuda_device;
  uintptr_t extras = 0;
  uint32_t extra_slots = 0;
  uint64_t extra_bytes = 0;
};

KvTensors tensors_of(const TensorArgs& a) {
  KvTensors t;
  for (uintptr_t p : a.k) t.k.push_back(reinterpret_cast<void*>(p));
  for (uintptr_t p : a.v) t.v.push_back(reinterpret_cast<void*>(p));
  t.extras = reinterpret_cast<void*>(a.extras);
  t.extra_slots = a.extra_slots;
  t.extra_bytes = a.extra_bytes;
  t.device = a.cuda_device ? Device::cuda(*a.cuda_device) : Device::host();
  return t;
}

std::chrono::milliseconds ms(double s) {
  return std::chrono::milliseconds(static_cast<int64_t>(s * 1000));
}

// A callable(layer) run on the callback thread.
std::function<void(uint32_t)> layer_callback(nb::handle fn) {
  if (fn.is_none()) return {};
  if (!PyCallable_Check(fn.ptr()))
    throw nb::type_error("on_layer must be None or a callable(layer)");
  auto ref = std::make_shared<PyRef>(nb::borrow(fn));
  return [ref](uint32_t layer) {
    with_python([&] {
      try {
        ref->obj(layer);
      } catch (nb::python_error& e) {
        e.discard_as_unraisable("in a fabric_lib KV on_layer callback");
      }
    });
  };
}

std::span<const uint8_t> bytes_view(const nb::bytes& b) {
  return {reinterpret_cast<const uint8_t*>(b.c_str()), b.size()};
}
nb::bytes to_bytes(const std::vector<uint8_t>& v) {
  return nb::bytes(reinterpret_cast<const char*>(v.data()), v.size());
}

}  // namespace

void bind_kv(nb::module_& m) {
  nb::enum_<PageOrder>(m, "PageOrder")
      .value("TOKEN_MAJOR", PageOrder::kTokenMajor,
             "[page_tokens, kv_heads, head_dim] (vLLM, SGLang)")
      .value("HEAD_MAJOR", PageOrder::kHeadMajor, "[kv_heads, page_tokens, head_dim]");

  nb::class_<KvLayout>(m, "KvLayout", "One rank's paged KV cache (include/fabric/kv/layout.h).")
      .def(nb::init<>())
      .def_rw("num_layers", &KvLayout::num_layers)
      .def_rw("num_pages", &KvLayout::num_pages)
      .def_rw("page_tokens", &KvLayout::page_tokens)
      .def_rw("kv_heads", &KvLayout::kv_heads, "the heads this rank holds")
      .def_rw("head_dim", &KvLayout::head_dim)
      .def_rw("dtype_bytes", &KvLayout::dtype_bytes)
      .def_rw("order", &KvLayout::order)
      .def_rw("page_stride", &KvLayout::page_stride,
              "0: page_bytes (separate K and V); 2 x page_bytes: interleaved")
      .def_prop_ro("page_bytes", &KvLayout::page_bytes)
      .def_prop_ro("tensor_bytes", &KvLayout::tensor_bytes);

  m.def(
      "kv_read_admit",
      [](nb::bytes admit) {
        KvAdmitInfo a = read_admit(bytes_view(admit));
        return nb::make_tuple(a.group, a.request, a.prefill_size, a.extra_slot, a.pages);
      },
      "admit"_a, "(group, request, prefill_size, extra_slot, pages) of an admit message.");
  m.def("kv_layer_imm", &layer_imm, "request"_a, "layer"_a,
        "The immediate of one layer of one request: a local value of the decode rank's range "
        "(KvReceiver.imm_base).");
  m.attr("KV_MAX_LAYERS") = kMaxLayers;
  m.attr("KV_EXTRAS_LAYER") = kExtrasLayer;

  nb::class_<PyKvReceiver>(m, "KvReceiver", "A decode rank (include/fabric/kv/transfer.h).")
      .def(
          "__init__",
          [](PyKvReceiver* self, PyEngine& engine, const KvLayout& layout, std::vector<uintptr_t> k,
             std::vector<uintptr_t> v, uint64_t group, uint32_t tp_size, uint32_t tp_rank,
             uint32_t total_heads, std::optional<int> cuda_device, uintptr_t extras,
             uint32_t extra_slots, uint64_t extra_bytes, double late_writes_s,
             std::optional<uint32_t> imm_base) {
            new (self) PyKvReceiver();
            TransferEngine& eng = engine.get();
            TensorArgs args{std::move(k), std::move(v), cuda_device,
                            extras,       extra_slots,  extra_bytes};
            {
              nb::gil_scoped_release release;
              self->h->obj = std::make_unique<KvReceiver>(
                  eng, layout, tensors_of(args), KvRank{group, {tp_size, tp_rank}, total_heads},
                  KvReceiverOptions{.late_writes = ms(late_writes_s), .imm_base = imm_base});
            }
            engine.add_dependent(self->h);
          },
          "engine"_a, "layout"_a, "k"_a, "v"_a, nb::kw_only(), "group"_a, "tp_size"_a, "tp_rank"_a,
          "total_heads"_a, "cuda_device"_a = nb::none(), "extras"_a = 0, "extra_slots"_a = 0,
          "extra_bytes"_a = 0, "late_writes_s"_a = 60.0, "imm_base"_a = nb::none(),
          nb::keep_alive<1, 2>(),
          "imm_base: where this rank's 2**28 immediates go in its engine's space (none: the "
          "highest free block)")
      .def("descriptor", [](PyKvReceiver& r) { return to_bytes(r.get().descriptor()); })
      .def_prop_ro("imm_base", [](PyKvReceiver& r) { return r.get().imm_range().base; })
      .def(
          "admit",
          [](PyKvReceiver& r, uint64_t request, std::vector<uint32_t> pages, uint32_t prefill_size,
             std::optional<uint32_t> extra_slot, double timeout_s, nb::handle on_layer,
             nb::handle landed, nb::handle on_done) {
            KvReceiver& rx = r.get();
            if (!landed.is_none() && !nb::isinstance<GpuCounter>(landed))
              throw nb::type_error("landed must be None or a GpuCounter (alloc_gpu_counter)");
            KvAdmit a{
                .request = request,
                .pages = std::move(pages),
                .prefill_size = prefill_size,
                .extra_slot = extra_slot,
                .timeout = ms(timeout_s),
                .on_layer = layer_callback(on_layer),
                .landed = landed.is_none() ? nullptr : nb::cast<const GpuCounter&>(landed).host,
                .on_done = make_on_done(on_done)};
            std::vector<uint8_t> msg;
            {
              nb::gil_scoped_release release;
              msg = rx.admit(std::move(a));
            }
            return to_bytes(msg);
          },
          nb::kw_only(), "request"_a, "pages"_a, "prefill_size"_a = 1, "extra_slot"_a = nb::none(),
          "timeout_s"_a = 30.0, "on_layer"_a = nb::none(), "landed"_a = nb::none(),
          "on_done"_a = nb::none(),
          "Arms the request's layers (and extras) and returns its admit message for the prefill "
          "ranks.")
      .def("fail",
           nogil<PyKvReceiver>(&KvReceiver::fail),  // on_done runs now, and takes the GIL itself
           "request"_a, "reason"_a,
           "Ends a request in flight with kCancelled and `reason` (its prefill side refused it); "
           "False when unknown or ended.")
      .def_prop_ro("in_flight", [](PyKvReceiver& r) { return r.get().in_flight(); })
      .def(
          "close", [](PyKvReceiver& r) { r.h->close(); },
          "Deregisters the cache (also done when the engine closes).");

  nb::class_<PyKvSender>(m, "KvSender", "A prefill rank (include/fabric/kv/transfer.h).")
      .def(
          "__init__",
          [](PyKvSender* self, PyEngine& engine, const KvLayout& layout, std::vector<uintptr_t> k,
             std::vector<uintptr_t> v, uint64_t group, uint32_t tp_size, uint32_t tp_rank,
             uint32_t total_heads, std::optional<int> cuda_device, uintptr_t extras,
             uint32_t extra_slots, uint64_t extra_bytes) {
            new (self) PyKvSender();
            TransferEngine& eng = engine.get();
            TensorArgs args{std::move(k), std::move(v), cuda_device,
                            extras,       extra_slots,  extra_bytes};
            {
              nb::gil_scoped_release release;
              self->h->obj = std::make_unique<KvSender>(
                  eng, layout, tensors_of(args), KvRank{group, {tp_size, tp_rank}, total_heads});
            }
            engine.add_dependent(self->h);
          },
          "engine"_a, "layout"_a, "k"_a, "v"_a, nb::kw_only(), "group"_a, "tp_size"_a, "tp_rank"_a,
          "total_heads"_a, "cuda_device"_a = nb::none(), "extras"_a = 0, "extra_slots"_a = 0,
          "extra_bytes"_a = 0, nb::keep_alive<1, 2>())
      .def(
          "add_decoder",
          [](PyKvSender& s, nb::bytes descriptor) {
            KvSender& tx = s.get();
            nb::gil_scoped_release release;  // `descriptor` stays referenced by the caller's frame
            tx.add_decoder(bytes_view(descriptor));
          },
          "descriptor"_a)
      .def("remove_decoder", nogil<PyKvSender>(&KvSender::remove_decoder), "group"_a,
           "Forgets a decode group: its regions and peers go, its requests end cancelled.")
      .def(
          "begin",
          [](PyKvSender& s, nb::bytes admit, std::vector<uint32_t> src_pages,
             std::optional<uint32_t> extra_slot, nb::handle on_sent) {
            KvSender& tx = s.get();
            KvSend send{.admit = bytes_view(admit),
                        .src_pages = std::move(src_pages),
                        .extra_slot = extra_slot,
                        .on_sent = make_on_done(on_sent)};
            nb::gil_scoped_release release;
            tx.begin(std::move(send));
          },
          "admit"_a, "src_pages"_a, nb::kw_only(), "extra_slot"_a = nb::none(),
          "on_sent"_a = nb::none())
      .def("layer_done", nogil<PyKvSender>(&KvSender::layer_done), "request"_a, "layer"_a)
      .def("extras_done", nogil<PyKvSender>(&KvSender::extras_done), "request"_a)
      .def("cancel", nogil<PyKvSender>(&KvSender::cancel), "request"_a)
      .def("gpu_trigger", nogil<PyKvSender>(&KvSender::gpu_trigger),
           "The word the prefill kernels increment after each layer and after the extras (CUDA "
           "builds).")
      .def("begin_forward", nogil<PyKvSender>(&KvSender::begin_forward), "requests"_a)
      .def("trigger_reached", nogil<PyKvSender>(&KvSender::trigger_reached), "value"_a)
      .def_prop_ro("in_flight", [](PyKvSender& s) { return s.get().in_flight(); })
      .def(
          "close", [](PyKvSender& s) { s.h->close(); },
          "Deregisters the cache (also done when the engine closes).");
}

}  // namespace fabric::py
