// fabric-kv-bench: layer-by-layer KV-cache transfer against sending everything after prefill.
// One prefill rank and one decode rank (two engines in this process), a Qwen3-235B-like shard per
// rank by default (94 layers, 32 KiB pages of 128 tokens: 1 KV head x 128 x bf16 per token), one
// request of --tokens. "Compute" is a busy wait of --compute-us per layer on the application
// thread; the layer's pages are sent the moment it ends (KvSender::layer_done). Reported:
//   per-layer transfer: layer_done to the decode rank counting that layer (p50, max);
//   exposed: the end of the prefill compute to the request complete on the decode rank (what TTFT
//     pays). A layer's K and V go out --send-at of the way through its compute (after attention),
//     so the last layer's transfer overlaps that layer's MLP;
//   end of prefill: the same request sent only after the last layer (every layer_done at once),
//     from the end of the compute to complete;
//   post: CPU time of one layer_done (K and V paged writes of all the layer's pages).
// Every byte of the decode rank's pages is checked after each mode. With --cuda-device (CUDA
// builds) both caches are in that GPU's memory and the layers go through cuda_ipc.
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <vector>

#include "fabric/kv/transfer.h"
#ifdef FABRIC_KV_BENCH_CUDA
#include <cuda_runtime_api.h>
#endif

using namespace fabric;
using namespace fabric::kv;
using Clock = std::chrono::steady_clock;

namespace {

struct Options {
  std::string provider = "tcp;ofi_rxm";
  uint32_t layers = 94;
  uint32_t tokens = 4096;
  uint32_t page_tokens = 128;
  uint32_t head_dim = 128;
  double compute_us = 1000;
  double send_at = 0.5;
  bool busy = false;
  int cuda_device = -1;  // -1: host memory
};

double us_since(Clock::time_point t) { return std::chrono::duration<double, std::micro>(Clock::now() - t).count(); }

void spin_for(double us) {
  auto end = Clock::now() + std::chrono::duration<double, std::micro>(us);
  while (Clock::now() < end) {
  }
}

// One rank's cache: per layer K then V, in host memory or on a GPU.
struct Side {
  TransferEngine engine;
  int gpu;
  std::vector<std::vector<uint8_t>> mem;  // host: per layer K then V
  std::vector<void*> gpu_mem;             // GPU: the same, one allocation per layer
  KvTensors tensors;
  uint64_t layer_bytes;
  Side(const EngineConfig& c, const KvLayout& l, int gpu_) : engine(c), gpu(gpu_), layer_bytes(2 * l.tensor_bytes()) {
    for (uint32_t i = 0; i < l.num_layers; i++) {
      uint8_t* base = nullptr;
      if (gpu < 0) {
        mem.emplace_back(layer_bytes, 0);
        base = mem.back().data();
      } else {
#ifdef FABRIC_KV_BENCH_CUDA
        void* p = nullptr;
        if (cudaSetDevice(gpu) != cudaSuccess || cudaMalloc(&p, layer_bytes) != cudaSuccess)
          throw std::runtime_error("cudaMalloc failed");
        gpu_mem.push_back(p);
        base = static_cast<uint8_t*>(p);
#endif
      }
      tensors.k.push_back(base);
      tensors.v.push_back(base + l.tensor_bytes());
    }
    if (gpu >= 0) tensors.device = Device::cuda(gpu);
  }
  ~Side() {
#ifdef FABRIC_KV_BENCH_CUDA
    for (void* p : gpu_mem) cudaFree(p);
#endif
  }
  void set(uint32_t layer, uint8_t fill_seed) {
    std::vector<uint8_t> bytes(layer_bytes);
    for (uint64_t b = 0; b < layer_bytes; b++) bytes[b] = static_cast<uint8_t>(b * 31 + layer * 7 + fill_seed);
    put(layer, bytes);
  }
  void put(uint32_t layer, const std::vector<uint8_t>& bytes) {
    if (gpu < 0) {
      mem[layer] = bytes;
      return;
    }
#ifdef FABRIC_KV_BENCH_CUDA
    cudaMemcpy(gpu_mem[layer], bytes.data(), layer_bytes, cudaMemcpyDefault);
#endif
  }
  std::vector<uint8_t> get(uint32_t layer) const {
    if (gpu < 0) return mem[layer];
    std::vector<uint8_t> out(layer_bytes);
#ifdef FABRIC_KV_BENCH_CUDA
    cudaMemcpy(out.data(), gpu_mem[layer], layer_bytes, cudaMemcpyDefault);
#endif
    return out;
  }
};

struct Result {
  double layer_p50_ms = 0, layer_max_ms = 0, complete_after_last_ms = 0, post_us = 0;
  bool verified = false;
};

Result run_mode(const Options& o, const KvLayout& l, Side& prefill, Side& decode, KvSender& tx, KvReceiver& rx,
                uint64_t request, bool layer_by_layer) {
  const uint32_t pages = (o.tokens + o.page_tokens - 1) / o.page_tokens;
  std::vector<uint32_t> src(pages), dst(pages);
  for (uint32_t i = 0; i < pages; i++) {
    src[i] = i;
    dst[i] = pages - 1 - i;  // a different page order on the decode side
  }
  const std::vector<uint8_t> zeros(decode.layer_bytes, 0);
  for (uint32_t layer = 0; layer < l.num_layers; layer++) {
    decode.put(layer, zeros);
    prefill.set(layer, static_cast<uint8_t>(request));
  }

  std::mutex mu;
  std::vector<Clock::time_point> sent_at(l.num_layers), landed_at(l.num_layers);
  std::atomic<int> done{kDonePending};
  Clock::time_point done_at{};
  auto msg = rx.admit({.request = request,
                       .pages = dst,
                       .prefill_size = 1,
                       .timeout = std::chrono::seconds(120),
                       .on_layer = [&](uint32_t layer) {
                         std::lock_guard g(mu);
                         landed_at[layer] = Clock::now();
                       },
                       .on_done = OnDone::callback([&](const Status& st) {
                         {
                           std::lock_guard g(mu);
                           done_at = Clock::now();
                         }
                         done = st.ok() ? kDoneSucceeded : kDoneFailed;
                         done.notify_all();
                       })});
  std::atomic<int> sent{kDonePending};
  tx.begin({.admit = msg, .src_pages = src, .on_sent = OnDone::flag(&sent)});
  std::vector<double> post_us;
  auto send_layer = [&](uint32_t layer) {
    auto t = Clock::now();
    {
      std::lock_guard g(mu);
      sent_at[layer] = t;
    }
    tx.layer_done(request, layer);
    post_us.push_back(us_since(t));
  };
  // A layer's K and V are ready after its attention (--send-at of its compute); its MLP follows.
  const double before_send = o.compute_us * o.send_at, after_send = o.compute_us - before_send;
  for (uint32_t layer = 0; layer < l.num_layers; layer++) {
    spin_for(before_send);
    if (layer_by_layer) send_layer(layer);
    spin_for(after_send);
  }
  const Clock::time_point compute_end = Clock::now();
  if (!layer_by_layer)
    for (uint32_t layer = 0; layer < l.num_layers; layer++) send_layer(layer);
  done.wait(kDonePending);
  double complete_ms;
  {
    std::lock_guard g(mu);  // 0 when the request had landed before the compute ended
    complete_ms = std::max(0.0, std::chrono::duration<double, std::milli>(done_at - compute_end).count());
  }
  sent.wait(kDonePending);

  Result r;
  r.complete_after_last_ms = complete_ms;
  std::vector<double> per_layer;
  {
    std::lock_guard g(mu);
    for (uint32_t i = 0; i < l.num_layers; i++)
      per_layer.push_back(std::chrono::duration<double, std::milli>(landed_at[i] - sent_at[i]).count());
  }
  std::sort(per_layer.begin(), per_layer.end());
  r.layer_p50_ms = per_layer[per_layer.size() / 2];
  r.layer_max_ms = per_layer.back();
  std::sort(post_us.begin(), post_us.end());
  r.post_us = post_us[post_us.size() / 2];
  r.verified = done.load() == kDoneSucceeded && sent.load() == kDoneSucceeded;
  for (uint32_t layer = 0; layer < l.num_layers && r.verified; layer++) {
    const std::vector<uint8_t> got = decode.get(layer), sent_bytes = prefill.get(layer);
    for (uint64_t tensor : {uint64_t{0}, l.tensor_bytes()})
      for (uint32_t i = 0; i < pages; i++)
        r.verified &= std::memcmp(got.data() + tensor + dst[i] * l.page_bytes(),
                                  sent_bytes.data() + tensor + src[i] * l.page_bytes(), l.page_bytes()) == 0;
  }
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"fabric-kv-bench: layer-by-layer KV-cache transfer against sending after prefill"};
  app.add_option("--provider", o.provider, "tcp;ofi_rxm or shm");
  app.add_option("--layers", o.layers)->check(CLI::Range(1, 255));
  app.add_option("--tokens", o.tokens, "prompt tokens of the request")->check(CLI::Range(1, 1 << 20));
  app.add_option("--page-tokens", o.page_tokens)->check(CLI::Range(1, 4096));
  app.add_option("--head-dim", o.head_dim, "bytes per token = head_dim x 2 (one KV head, bf16)")->check(CLI::Range(1, 4096));
  app.add_option("--compute-us", o.compute_us, "simulated compute per layer");
  app.add_option("--send-at", o.send_at, "where in a layer's compute its K and V are ready (after attention; the MLP follows)")
      ->check(CLI::Range(0.0, 1.0));
  app.add_flag("--busy", o.busy, "busy-poll the workers (a core each)");
#ifdef FABRIC_KV_BENCH_CUDA
  app.add_option("--cuda-device", o.cuda_device, "caches on this GPU, layers through cuda_ipc");
#endif
  CLI11_PARSE(app, argc, argv);

  const uint32_t pages = (o.tokens + o.page_tokens - 1) / o.page_tokens;
  KvLayout l{.num_layers = o.layers, .num_pages = pages, .page_tokens = o.page_tokens, .kv_heads = 1,
             .head_dim = o.head_dim, .dtype_bytes = 2, .order = PageOrder::kTokenMajor, .page_stride = 0};
  EngineConfig c;
  c.provider = o.provider;
  c.nics = {o.provider == "shm" ? NicConfig{} : NicConfig{"", "127.0.0.1"}};
  c.worker_poll = o.busy ? PollMode::kBusy : PollMode::kAdaptive;
  c.transfer_timeout = std::chrono::seconds(120);
  if (o.cuda_device >= 0) {
    c.cuda_device = o.cuda_device;
    c.cuda_ipc = true;
  }
  try {
    Side prefill(c, l, o.cuda_device), decode(c, l, o.cuda_device);
    KvReceiver rx(decode.engine, l, decode.tensors, {.group = 1, .tp = {1, 0}, .total_heads = 1});
    KvSender tx(prefill.engine, l, prefill.tensors, {.group = 2, .tp = {1, 0}, .total_heads = 1});
    tx.add_decoder(rx.descriptor());
    run_mode(o, l, prefill, decode, tx, rx, 1, true);  // warm-up: connections, first touches
    Result by_layer = run_mode(o, l, prefill, decode, tx, rx, 2, true);
    Result at_end = run_mode(o, l, prefill, decode, tx, rx, 3, false);
    const double mib = 2.0 * pages * l.page_bytes() / 1048576.0;
    fmt::print("fabric-kv-bench: {}{} ({} polling), {} layers, {} tokens = {} pages of {} KiB per tensor, "
               "K+V {:.1f} MiB per layer, compute {:.0f} us per layer (K and V ready at {:.0f}% of it)\n",
               o.provider, o.cuda_device >= 0 ? fmt::format(" + cuda_ipc, GPU {}", o.cuda_device) : "",
               o.busy ? "busy" : "adaptive", l.num_layers, o.tokens, pages, l.page_bytes() / 1024, mib,
               o.compute_us, 100 * o.send_at);
    fmt::print("layer by layer: per-layer transfer p50 {:.3f} ms, max {:.3f} ms; exposed after the compute "
               "{:.3f} ms; post {:.1f} us per layer; verified {}\n",
               by_layer.layer_p50_ms, by_layer.layer_max_ms, by_layer.complete_after_last_ms, by_layer.post_us,
               by_layer.verified ? "OK" : "FAILED");
    fmt::print("after prefill: all layers sent at the end, complete {:.3f} ms after the compute; verified {}\n",
               at_end.complete_after_last_ms, at_end.verified ? "OK" : "FAILED");
    fmt::print("kv layers={} pages_per_layer={} exposed_ms={:.3f} end_of_prefill_ms={:.3f} post_us_per_layer={:.1f}\n",
               l.num_layers, 2 * pages, by_layer.complete_after_last_ms, at_end.complete_after_last_ms, by_layer.post_us);
    return by_layer.verified && at_end.verified ? 0 : 1;
  } catch (const std::exception& e) {
    fmt::print(stderr, "fabric-kv-bench: {}\n", e.what());
    return 1;
  }
}
