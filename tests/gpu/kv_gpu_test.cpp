// KV-cache transfer on the GPU: a prefill process whose "model" is a captured CUDA graph (per layer:
// compute, the layer's K and V pages written, the KvSender trigger bumped; then the extras) and a
// decode process on the same GPU, through cuda_ipc. The decode side's kernel waits on the request's
// landed counter; every byte of every page and of the extras is checked on the host.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <thread>

#include "fabric/kv/transfer.h"
#include "../loopback/test_support.h"  // wait_until
#include "gpu_kernels.h"
#include "gpu_support.h"
#include "process_pair.h"

namespace fabric::gpu_test {
namespace {

using namespace fabric::kv;
using testing::wait_until;
using tools::Channel;

constexpr uint32_t kLayers = 6, kPages = 64, kPromptPages = 24, kHeads = 2;
constexpr uint32_t kExtraSlots = 4, kExtraBytes = 4096;
constexpr uint64_t kComputeNs = 200'000;  // per layer
constexpr uint64_t kRequests[] = {1, 2, 3};

KvLayout layout() {
  return KvLayout{.num_layers = kLayers, .num_pages = kPages, .page_tokens = 16, .kv_heads = kHeads,
                  .head_dim = 64, .dtype_bytes = 2, .order = PageOrder::kTokenMajor, .page_stride = 0};
}

std::vector<uint32_t> pick_pages(uint32_t seed) {
  std::vector<uint32_t> v(kPages);
  std::iota(v.begin(), v.end(), 0);
  std::shuffle(v.begin(), v.end(), std::mt19937(seed));
  v.resize(kPromptPages);
  return v;
}

struct Cache {
  std::vector<std::unique_ptr<DeviceBuffer>> k, v;
  DeviceBuffer extras{uint64_t{kExtraSlots} * kExtraBytes, 0};
  KvTensors tensors;
  explicit Cache(const KvLayout& l) {
    for (uint32_t i = 0; i < kLayers; i++) {
      k.push_back(std::make_unique<DeviceBuffer>(l.tensor_bytes(), 0));
      v.push_back(std::make_unique<DeviceBuffer>(l.tensor_bytes(), 0));
      k.back()->fill(0);
      v.back()->fill(0);
      tensors.k.push_back(k.back()->ptr);
      tensors.v.push_back(v.back()->ptr);
    }
    extras.fill(0);
    tensors.extras = extras.ptr;
    tensors.extra_slots = kExtraSlots;
    tensors.extra_bytes = kExtraBytes;
    tensors.device = Device::cuda(0);
  }
};

int prefill(Channel& ch) {
  const KvLayout l = layout();
  TransferEngine engine(gpu_engine_config(0));
  Cache cache(l);
  KvSender tx(engine, l, cache.tensors, {.group = 2, .tp = {1, 0}, .total_heads = kHeads});
  tx.add_decoder(ch.recv_bytes());
  UvmWatcher trigger = tx.gpu_trigger();

  // The graph reads its request's pages, seed and extras slot from device memory the host sets
  // before each launch: one capture serves every request of this shape.
  DeviceBuffer pages(kPromptPages * sizeof(uint32_t), 0), seed(sizeof(uint64_t), 0), slot(sizeof(uint32_t), 0);
  cudaStream_t s;
  ck(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  ck(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal), "capture");
  auto* page_list = reinterpret_cast<const uint32_t*>(pages.ptr);
  auto* seed_word = reinterpret_cast<const uint64_t*>(seed.ptr);
  for (uint32_t layer = 0; layer < kLayers; layer++) {
    ck(launch_spin_ns(kComputeNs, s), "compute");
    ck(launch_fill_kv_pages(cache.k[layer]->ptr, l.page_bytes(), page_list, kPromptPages, seed_word, layer, false, s), "K");
    ck(launch_fill_kv_pages(cache.v[layer]->ptr, l.page_bytes(), page_list, kPromptPages, seed_word, layer, true, s), "V");
    ck(launch_signal_next(trigger.device, s), "trigger");
  }
  ck(launch_fill_kv_pages(cache.extras.ptr, kExtraBytes, reinterpret_cast<const uint32_t*>(slot.ptr), 1, seed_word,
                          kExtrasLayer, false, s),
     "extras");
  ck(launch_signal_next(trigger.device, s), "trigger (extras)");
  ck(cudaStreamEndCapture(s, &graph), "end capture");
  ck(cudaGraphInstantiate(&exec, graph, 0), "instantiate");

  for (uint64_t request : kRequests) {
    std::vector<uint8_t> admit = ch.recv_bytes();
    KvAdmitInfo info = read_admit(admit);
    EXPECT_EQ(info.request, request);
    EXPECT_EQ(info.pages.size(), kPromptPages);
    std::vector<uint32_t> src = pick_pages(static_cast<uint32_t>(request) + 100);
    const uint32_t src_slot = static_cast<uint32_t>(request % kExtraSlots);
    ck(cudaMemcpy(pages.ptr, src.data(), src.size() * sizeof(uint32_t), cudaMemcpyDefault), "pages");
    ck(cudaMemcpy(seed.ptr, &request, sizeof request, cudaMemcpyDefault), "seed");
    ck(cudaMemcpy(slot.ptr, &src_slot, sizeof src_slot, cudaMemcpyDefault), "slot");
    std::atomic<uint64_t> sent{0}, failed{0};
    tx.begin({.admit = admit, .src_pages = src, .extra_slot = src_slot, .on_sent = OnDone::counter(&sent, &failed)});
    tx.begin_forward({request});
    ck(cudaGraphLaunch(exec, s), "graph launch");
    ck(cudaStreamSynchronize(s), "sync");
    EXPECT_TRUE(wait_until([&] { return sent.load() + failed.load() > 0; })) << "request " << request << " was not sent";
    EXPECT_EQ(failed.load(), 0u);
    EXPECT_EQ(tx.in_flight(), 0u);
  }
  EXPECT_EQ(ch.recv(), "verified");
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(s);
  return ::testing::Test::HasFailure() ? 1 : 0;
}

int decode(Channel& ch) {
  const KvLayout l = layout();
  TransferEngine engine(gpu_engine_config(0));
  Cache cache(l);
  KvReceiver rx(engine, l, cache.tensors, {.group = 1, .tp = {1, 0}, .total_heads = kHeads});
  ch.send(rx.descriptor());
  GpuCounter landed = engine.alloc_gpu_counter(0);
  DeviceBuffer sum(sizeof(uint64_t), 0);
  cudaStream_t s;
  ck(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");
  uint64_t target = 0;
  for (uint64_t request : kRequests) {
    std::vector<uint32_t> dst = pick_pages(static_cast<uint32_t>(request));
    const uint32_t dst_slot = static_cast<uint32_t>((request + 1) % kExtraSlots);
    std::atomic<int> done{kDonePending};
    target += kLayers + 1;
    ch.send(rx.admit({.request = request, .pages = dst, .prefill_size = 1, .extra_slot = dst_slot,
                            .timeout = std::chrono::seconds(60), .landed = landed.host,
                            .on_done = OnDone::flag(&done)}));
    // A decode kernel queued now runs once the last layer and the extras have landed.
    sum.fill(0);
    const uint64_t last_page = uint64_t{dst.back()} * l.page_bytes();
    ck(launch_wait_then_sum(landed.device, target, cache.v[kLayers - 1]->ptr + last_page, l.page_bytes(),
                            reinterpret_cast<uint64_t*>(sum.ptr), s),
       "decode kernel");
    const bool ended = wait_until([&] { return done.load() != kDonePending; }, std::chrono::seconds(90));
    EXPECT_TRUE(ended && done.load() == kDoneSucceeded) << "request " << request;
    if (landed.host->load() < target) landed.host->store(target);  // never leave the kernel spinning
    ck(cudaStreamSynchronize(s), "sync");
    EXPECT_EQ(landed.host->load(), target) << "one count per layer and one for the extras";

    uint64_t bad = 0, want_sum = 0;
    for (uint32_t layer = 0; layer < kLayers; layer++)
      for (uint32_t value = 0; value < 2; value++) {
        auto& t = value ? cache.v[layer] : cache.k[layer];
        for (uint32_t i = 0; i < kPromptPages; i++) {
          auto got = t->download(uint64_t{dst[i]} * l.page_bytes(), l.page_bytes());
          for (uint64_t b = 0; b < got.size(); b++) bad += got[b] != kv_byte(request, layer, value, i, b);
        }
      }
    auto extras = cache.extras.download(uint64_t{dst_slot} * kExtraBytes, kExtraBytes);
    for (uint64_t b = 0; b < kExtraBytes; b++) bad += extras[b] != kv_byte(request, kExtrasLayer, 0, 0, b);
    EXPECT_EQ(bad, 0u) << "request " << request << ": bytes that differ";
    auto page = cache.v[kLayers - 1]->download(last_page, l.page_bytes());
    for (uint64_t w = 0; w < page.size() / 8; w++) {
      uint64_t x;
      std::memcpy(&x, page.data() + 8 * w, 8);
      want_sum += x;
    }
    uint64_t got_sum = 0;
    ck(cudaMemcpy(&got_sum, sum.ptr, sizeof got_sum, cudaMemcpyDefault), "sum");
    EXPECT_EQ(got_sum, want_sum) << "the decode kernel read the landed page";
  }
  EXPECT_EQ(rx.in_flight(), 0u);
  engine.free_gpu_counter(landed);
  cudaStreamDestroy(s);
  ch.send("verified");
  return ::testing::Test::HasFailure() ? 1 : 0;
}

TEST(KvGpu, AGraphOfLayersTriggersEachLayerAndADecodeKernelWaitsForTheRequest) {
  if (gpu_count() == 0) GTEST_SKIP() << "no CUDA device visible";
  auto r = tools::run_process_pair(prefill, decode);
  EXPECT_TRUE(r.ok()) << "prefill rc " << r.parent_rc << ", decode status " << r.child_status;
}

}  // namespace
}  // namespace fabric::gpu_test
