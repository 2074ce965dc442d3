// MoE dispatch/combine for Python (include/fabric/moe/all_to_all.h). fabric_lib/moe/ wraps it for
// torch tensors; here the calls take raw addresses. The constructor and the halves release the GIL
// (the host receive halves block until every rank's rows arrived); the all-gather callable the
// constructor calls twice runs under the GIL, taken again inside the C++ callback.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstring>

#include "fabric/moe/all_to_all.h"
#include "py_support.h"

namespace fabric::py {

using namespace nb::literals;
using namespace fabric::moe;

namespace {

inline constexpr char kMoeAllToAll[] = "MoE AllToAll";
using PyAllToAll = EngineBound<AllToAll, kMoeAllToAll>;

// bytes -> std::vector<std::byte> and back.
std::vector<std::byte> to_vector(nb::handle b) {
  if (!PyBytes_Check(b.ptr())) throw nb::type_error("all_gather must return a list of bytes");
  const char* p = PyBytes_AS_STRING(b.ptr());
  const auto n = static_cast<size_t>(PyBytes_GET_SIZE(b.ptr()));
  std::vector<std::byte> out(n);
  if (n) std::memcpy(out.data(), p, n);
  return out;
}
nb::bytes to_bytes(const std::vector<std::byte>& v) {
  return nb::bytes(reinterpret_cast<const char*>(v.data()), v.size());
}

// A Python callable(bytes) -> list[bytes] as the constructor's AllGather. The constructor runs
// without the GIL, so the callback takes it; a Python error (a store timeout, a wrong return
// type) becomes a fabric::Error that ends the construction, so no Python exception object crosses
// the GIL-less C++ frames.
AllGather python_all_gather(nb::handle fn) {
  if (!PyCallable_Check(fn.ptr()))
    throw nb::type_error("all_gather must be a callable(bytes) -> list[bytes]");
  auto ref = std::make_shared<PyRef>(nb::borrow(fn));
  return [ref](const std::vector<std::byte>& mine) {
    std::vector<std::vector<std::byte>> out;
    bool ran = with_python([&] {
      try {
        nb::object got = ref->obj(to_bytes(mine));
        for (nb::handle item : got) out.push_back(to_vector(item));
      } catch (nb::python_error& e) {
        throw Error(ErrorCode::kInvalidArgument,
                    std::string("MoE: the all_gather callable raised: ") + e.what());
      } catch (nb::builtin_exception& e) {
        throw Error(ErrorCode::kInvalidArgument,
                    std::string("MoE: the all_gather callable: ") + e.what());
      }
    });
    if (!ran)
      throw Error(ErrorCode::kShutdown, "MoE: Python is exiting: all_gather was not called");
    return out;
  };
}

template <class T>
T* ptr(uintptr_t p) {
  return reinterpret_cast<T*>(p);
}

}  // namespace

void bind_moe(nb::module_& m) {
  nb::enum_<Dtype>(m, "MoeDtype",
                   "What dispatch moves: FP8 e4m3 with fp32 scales per 128 values, or BF16.")
      .value("FP8", Dtype::kFp8)
      .value("BF16", Dtype::kBf16);
  nb::enum_<Quantize>(m, "MoeQuantize",
                      "Who quantizes an FP8 dispatch's tokens: NONE, the caller (e4m3 x with "
                      "x_scales); AMAX or POW2, the send half, from BF16 x, with scales amax / 448 "
                      "or a power of two (DeepEP's round_scale).")
      .value("NONE", Quantize::kNone)
      .value("AMAX", Quantize::kAmax)
      .value("POW2", Quantize::kPow2);
  nb::enum_<KernelSide>(m, "MoeKernelSide",
                        "Who runs the halves: the calling thread (HOST) or CUDA kernels (CUDA).")
      .value("HOST", KernelSide::kHost)
      .value("CUDA", KernelSide::kCuda);
  nb::enum_<RdmaBuffers>(
      m, "MoeRdmaBuffers",
      "Where the regions between nodes live: HOST memory (every provider), or DEVICE memory (CUDA "
      "kernels; written through the engine's cuda_ipc domain on one host, or a NIC with FI_HMEM).")
      .value("HOST", RdmaBuffers::kHost)
      .value("DEVICE", RdmaBuffers::kDevice);

  nb::class_<AllToAllConfig>(m, "AllToAllConfig",
                             "One rank's MoE all-to-all (include/fabric/moe/all_to_all.h).")
      .def(
          "__init__",
          [](AllToAllConfig* c, uint32_t rank, uint32_t ranks, uint32_t node_size, uint32_t experts,
             uint32_t topk, uint32_t hidden, uint32_t max_tokens, Dtype dispatch_dtype,
             uint32_t private_rows, double timeout_s, KernelSide side, int cuda_device,
             std::string job, bool proxy_busy_poll, std::optional<uint32_t> imm_base,
             uint32_t buffers, uint32_t num_sms, RdmaBuffers rdma_buffers, bool shrink) {
            new (c) AllToAllConfig{
                .rank = rank,
                .ranks = ranks,
                .node_size = node_size,
                .experts = experts,
                .topk = topk,
                .hidden = hidden,
                .max_tokens = max_tokens,
                .dispatch_dtype = dispatch_dtype,
                .private_rows = private_rows,
                .timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000)),
                .side = side,
                .cuda_device = cuda_device,
                .job = std::move(job),
                .proxy_busy_poll = proxy_busy_poll,
                .imm_base = imm_base,
                .buffers = buffers,
                .num_sms = num_sms,
                .rdma_buffers = rdma_buffers,
                .shrink = shrink};
          },
          nb::kw_only(), "rank"_a = 0, "ranks"_a = 1, "node_size"_a = 1, "experts"_a = 0,
          "topk"_a = 8, "hidden"_a = 7168, "max_tokens"_a = 128, "dispatch_dtype"_a = Dtype::kFp8,
          "private_rows"_a = 32, "timeout_s"_a = 10.0, "side"_a = KernelSide::kHost,
          "cuda_device"_a = 0, "job"_a = "moe", "proxy_busy_poll"_a = false,
          "imm_base"_a = nb::none(), "buffers"_a = 2, "num_sms"_a = 0,
          "rdma_buffers"_a = RdmaBuffers::kHost, "shrink"_a = false)
      .def_rw("rank", &AllToAllConfig::rank)
      .def_rw("ranks", &AllToAllConfig::ranks)
      .def_rw("node_size", &AllToAllConfig::node_size, "ranks per NVLink domain (1-8)")
      .def_rw("experts", &AllToAllConfig::experts, "a multiple of ranks")
      .def_rw("topk", &AllToAllConfig::topk, "experts per token (1-8)")
      .def_rw("hidden", &AllToAllConfig::hidden, "a multiple of 128")
      .def_rw("max_tokens", &AllToAllConfig::max_tokens, "per rank and call")
      .def_rw("dispatch_dtype", &AllToAllConfig::dispatch_dtype)
      .def_rw("private_rows", &AllToAllConfig::private_rows)
      .def_prop_rw(
          "timeout_s",
          [](const AllToAllConfig& c) { return static_cast<double>(c.timeout.count()) / 1000.0; },
          [](AllToAllConfig& c, double s) {
            c.timeout = std::chrono::milliseconds(static_cast<int64_t>(s * 1000));
          })
      .def_rw("side", &AllToAllConfig::side)
      .def_rw("cuda_device", &AllToAllConfig::cuda_device)
      .def_rw("job", &AllToAllConfig::job, "names the node region: unique per job on a host")
      .def_rw("proxy_busy_poll", &AllToAllConfig::proxy_busy_poll)
      .def_rw("imm_base", &AllToAllConfig::imm_base,
              "where this rank's immediates go in its engine's space: 2**28 per buffer set, set i "
              "at imm_base + i * 2**28 (None: the highest free blocks)")
      .def_rw("rdma_buffers", &AllToAllConfig::rdma_buffers)
      .def_rw("shrink", &AllToAllConfig::shrink,
              "a missing or failing rank is masked, not a failure")
      .def_rw("buffers", &AllToAllConfig::buffers,
              "buffer sets (1-4): dispatches in flight at once")
      .def_rw("num_sms", &AllToAllConfig::num_sms,
              "CUDA kernels: the most blocks (one per SM) each half takes (0: min(SMs, 16)), "
              "leaving SMs to the other halves and to compute");

  nb::class_<Handle>(m, "MoeHandle",
                     "One dispatch in flight: its buffer set, its number (from 1) and its tokens. "
                     "Returned by dispatch_send; the later halves of that dispatch take it.")
      .def_ro("buffer", &Handle::buffer)
      .def_ro("step", &Handle::step)
      .def_ro("num_tokens", &Handle::num_tokens)
      .def("__repr__", [](const Handle& h) {
        return "MoeHandle(buffer=" + std::to_string(h.buffer) + ", step=" + std::to_string(h.step) +
               ", num_tokens=" + std::to_string(h.num_tokens) + ")";
      });
  m.attr("MOE_INVALID_COUNT") = kInvalidCount;

  nb::class_<ProxyStats>(
      m, "MoeProxyStats",
      "What one rank's proxy did: steps, writes posted, bytes, CPU ms of its thread, and host ms "
      "spent waiting on the other nodes (dispatch_wait_ms, combine_wait_ms: sums over steps, from "
      "this rank's first post of the half to the other nodes' rows counted).")
      .def_ro("steps", &ProxyStats::steps)
      .def_ro("writes", &ProxyStats::writes)
      .def_ro("bytes", &ProxyStats::bytes)
      .def_ro("cpu_ms", &ProxyStats::cpu_ms)
      .def_ro("dispatch_wait_ms", &ProxyStats::dispatch_wait_ms)
      .def_ro("combine_wait_ms", &ProxyStats::combine_wait_ms)
      .def("__repr__", [](const ProxyStats& s) {
        return "MoeProxyStats(steps=" + std::to_string(s.steps) +
               ", writes=" + std::to_string(s.writes) + ", bytes=" + std::to_string(s.bytes) +
               ", cpu_ms=" + std::to_string(s.cpu_ms) +
               ", dispatch_wait_ms=" + std::to_string(s.dispatch_wait_ms) +
               ", combine_wait_ms=" + std::to_string(s.combine_wait_ms) + ")";
      });

  nb::class_<DispatchOutput>(
      m, "MoeDispatchOutput",
      "Addresses of the dispatch output (host or device memory the AllToAll owns): x "
      "[local_experts][rows_per_expert][hidden], scales (FP8; 0 for BF16), counts, src, runs.")
      .def_prop_ro("x", [](const DispatchOutput& o) { return reinterpret_cast<uintptr_t>(o.x); })
      .def_prop_ro("scales",
                   [](const DispatchOutput& o) { return reinterpret_cast<uintptr_t>(o.scales); })
      .def_prop_ro("counts",
                   [](const DispatchOutput& o) { return reinterpret_cast<uintptr_t>(o.counts); })
      .def_prop_ro("src",
                   [](const DispatchOutput& o) { return reinterpret_cast<uintptr_t>(o.src); })
      .def_prop_ro("runs",
                   [](const DispatchOutput& o) { return reinterpret_cast<uintptr_t>(o.runs); })
      .def_ro("local_experts", &DispatchOutput::local_experts)
      .def_ro("rows_per_expert", &DispatchOutput::rows_per_expert);

  nb::class_<PyAllToAll>(
      m, "AllToAll",
      "MoE dispatch/combine of one rank (include/fabric/moe/all_to_all.h); raw addresses.")
      .def(
          "__init__",
          [](PyAllToAll* self, PyEngine& engine, AllToAllConfig config, nb::callable all_gather) {
            TransferEngine& eng = engine.get();
            AllGather gather = python_all_gather(all_gather);
            std::unique_ptr<AllToAll> obj;
            {
              nb::gil_scoped_release release;  // collective: waits for every rank, twice
              obj = std::make_unique<AllToAll>(eng, std::move(config), gather);
            }
            // Built only once nothing can throw: a failed construction leaves no half-made holder.
            new (self) PyAllToAll();
            self->h->obj = std::move(obj);
            engine.add_dependent(self->h);
          },
          "engine"_a, "config"_a, "all_gather"_a, nb::keep_alive<1, 2>(),
          "Collective: every rank builds its AllToAll at once; all_gather(bytes) -> list[bytes] "
          "(every rank's bytes in rank order) is called twice, under the GIL.")
      .def(
          "dispatch_send",
          [](PyAllToAll& a, uint32_t num_tokens, uintptr_t x, uintptr_t x_scales,
             uintptr_t topk_idx, uintptr_t stream, Quantize quantize) {
            AllToAll& obj = a.get();
            const DispatchArgs args{.num_tokens = num_tokens,
                                    .x = ptr<const void>(x),
                                    .x_scales = ptr<const float>(x_scales),
                                    .topk_idx = ptr<const int64_t>(topk_idx),
                                    .stream = ptr<void>(stream),
                                    .quantize = quantize};
            nb::gil_scoped_release release;
            return obj.dispatch_send(args);
          },
          "num_tokens"_a, "x"_a, "x_scales"_a, "topk_idx"_a, "stream"_a = 0,
          "quantize"_a = Quantize::kNone,
          "x [num_tokens][hidden] (FP8 bytes or BF16; BF16 for an FP8 dispatch with quantize), "
          "x_scales [num_tokens][hidden/128] fp32 (FP8 without quantize), topk_idx "
          "[num_tokens][topk] int64 (-1: unused); stream: a cudaStream_t (CUDA kernels). Returns "
          "the dispatch's handle.")
      .def(
          "dispatch_recv",
          [](PyAllToAll& a, const Handle& h, uintptr_t stream, uintptr_t wait_ns) {
            AllToAll& obj = a.get();
            nb::gil_scoped_release release;
            obj.dispatch_recv(h, ptr<void>(stream), ptr<int64_t>(wait_ns));
          },
          "handle"_a, "stream"_a = 0, "wait_ns"_a = 0,
          "Waits for every rank's rows of this dispatch (host kernels block, GIL released). "
          "wait_ns: 0, or an int64 [ranks] the per-source wait (ns) is added to.")
      .def(
          "combine_send",
          [](PyAllToAll& a, const Handle& h, uintptr_t expert_out, uintptr_t stream) {
            AllToAll& obj = a.get();
            const CombineArgs args{.expert_out = ptr<const uint16_t>(expert_out),
                                   .stream = ptr<void>(stream)};
            nb::gil_scoped_release release;
            obj.combine_send(h, args);
          },
          "handle"_a, "expert_out"_a, "stream"_a = 0,
          "expert_out: BF16 in the dispatch output's layout.")
      .def(
          "combine_recv",
          [](PyAllToAll& a, const Handle& h, uintptr_t topk_weights, uintptr_t out,
             uintptr_t stream, uintptr_t wait_ns) {
            AllToAll& obj = a.get();
            const CombineArgs args{.topk_weights = ptr<const float>(topk_weights),
                                   .out = ptr<uint16_t>(out),
                                   .stream = ptr<void>(stream),
                                   .wait_ns = ptr<int64_t>(wait_ns)};
            nb::gil_scoped_release release;
            obj.combine_recv(h, args);
          },
          "handle"_a, "topk_weights"_a, "out"_a, "stream"_a = 0, "wait_ns"_a = 0,
          "topk_weights [num_tokens][topk] fp32; out: [num_tokens of the handle][hidden] BF16.")
      .def(
          "output", [](PyAllToAll& a, const Handle& h) { return a.get().output(h); }, "handle"_a,
          "The dispatch output of the handle's buffer set (fixed addresses).")
      .def(
          "output_of_set",
          [](PyAllToAll& a, uint32_t buffer) { return a.get().output(Handle{.buffer = buffer}); },
          "buffer"_a, "The dispatch output of buffer set `buffer` (fixed addresses).")
      .def(
          "check", nogil<PyAllToAll>(&AllToAll::check),
          "Raises FabricError for the first failure seen (a proxy's transfer, a kernel's timed-out "
          "wait).")
      .def("proxy_stats", [](PyAllToAll& a) { return a.get().proxy_stats(); })
      .def(
          "masked_ranks", [](PyAllToAll& a) { return a.get().masked_ranks(); },
          "Shrink mode: the ranks masked on this rank (timed out, failed, or set_masked).")
      .def(
          "set_masked",
          [](PyAllToAll& a, uint32_t rank, bool masked) { a.get().set_masked(rank, masked); },
          "rank"_a, "masked"_a, "Shrink mode: masks (or unmasks) `rank` on this rank.")
      .def_prop_ro("config", [](PyAllToAll& a) { return a.get().config(); })
      .def_prop_ro("closed", [](PyAllToAll& a) { return !a.h->obj; })
      .def(
          "close", [](PyAllToAll& a) { a.h->close(); },
          "Frees the buffers (the dispatch output with them) and stops the proxy; later calls "
          "raise.");
}

}  // namespace fabric::py
