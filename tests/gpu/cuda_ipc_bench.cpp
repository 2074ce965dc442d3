// cuda_ipc benchmark: the engine against raw CUDA copies between the same two buffers, in one run.
//   single: back-to-back 16 MiB WRITEs vs cudaMemcpyAsync of the same bytes (target >= 0.95)
//   paged:  10,000 random 64 KiB pages in one submit_paged_writes vs one cudaMemcpyAsync per page
//           (target >= 5x) and vs one contiguous copy of the same total bytes
//   curve:  single WRITEs from 4 KiB to 256 MiB, engine and raw
//   batch:  the same 10,000 pages through the cuda_ipc Domain's post_write_batch, in batches of
//           caps().max_write_batch as the engine's worker posts them, vs one contiguous copy (target
//           >= 0.80); the same with an immediate per page; one post_write per page; the gather
//           kernel alone
//   watcher: GPU store -> watcher callback -> GPU sees the answer, timed by the GPU's clock,
//           beside the minimal ping-pong (the floor) and variants that each change one thing
// Two processes: the receiver on GPU 1 where there are two, on GPU 0 with the sender otherwise.
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <numeric>
#include <random>

#include "cuda_ipc_bench_parts.h"
#include "gpu_kernels.h"
#include "gpu_support.h"
#include "process_pair.h"

namespace fabric::gpu_test {
namespace {

using Clock = std::chrono::steady_clock;
constexpr size_t kBuf = 1ull << 30;
constexpr size_t kPage = 64 << 10;
constexpr uint32_t kPages = 10000;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Sender {
  TransferEngine& engine;
  MrHandle src;
  MrDesc dst;
  uint8_t* src_ptr;
  uint8_t* raw_dst;  // the receiver's buffer, opened through IPC for the raw copies
  cudaStream_t stream;

  // GB/s of `count` WRITEs of len bytes (engine), all submitted, then waited for.
  double engine_single(uint64_t len, int count) {
    std::atomic<uint64_t> ok{0}, failed{0};
    auto t0 = Clock::now();
    for (int i = 0; i < count; i++)
      engine.submit(SingleWrite{.len = len, .src = {src, (i * len) % (kBuf - len + 1)}, .dst = {engine.add_remote(dst), 0}},
                    OnDone::counter(&ok, &failed));
    if (!wait_for(ok, count) || failed.load()) throw std::runtime_error("engine single writes failed");
    return len * count / seconds_since(t0) / 1e9;
  }
  double raw_single(uint64_t len, int count) {
    auto t0 = Clock::now();
    for (int i = 0; i < count; i++)
      ck(cudaMemcpyAsync(raw_dst, src_ptr + (i * len) % (kBuf - len + 1), len, cudaMemcpyDefault, stream), "copy");
    ck(cudaStreamSynchronize(stream), "sync");
    return len * count / seconds_since(t0) / 1e9;
  }
  double engine_paged(const Pages& s, const Pages& d) {
    std::atomic<uint64_t> ok{0}, failed{0};
    auto t0 = Clock::now();
    engine.submit(PagedWrites{.page_len = kPage, .src = src, .src_pages = s, .dst = engine.add_remote(dst), .dst_pages = d},
                  OnDone::counter(&ok, &failed));
    if (!wait_for(ok, 1) || failed.load()) throw std::runtime_error("engine paged write failed");
    return double(kPage) * kPages / seconds_since(t0) / 1e9;
  }
  double raw_paged(const Pages& s, const Pages& d) {
    auto t0 = Clock::now();
    for (uint32_t i = 0; i < kPages; i++)
      ck(cudaMemcpyAsync(raw_dst + d.stride * d.indices[i], src_ptr + s.stride * s.indices[i], kPage,
                         cudaMemcpyDefault, stream), "copy");
    ck(cudaStreamSynchronize(stream), "sync");
    return double(kPage) * kPages / seconds_since(t0) / 1e9;
  }
};

std::vector<double> ping_pong(TransferEngine& engine, bool through_engine, cudaStream_t stream) {
  constexpr uint32_t kRounds = 20000;
  GpuCounter ack = engine.alloc_gpu_counter();
  uint64_t* out = nullptr;
  ck(cudaMalloc(reinterpret_cast<void**>(&out), kRounds * 8), "cudaMalloc");
  std::vector<uint64_t> ns(kRounds);
  if (through_engine) {
    UvmWatcher w = engine.alloc_uvm_watcher([&](uint64_t, uint64_t v) {
      ack.host->store(v, std::memory_order_release);
    });
    ck(launch_ping_pong(w.device, ack.device, kRounds, out, stream), "ping_pong");
    ck(cudaStreamSynchronize(stream), "sync");
    engine.free_uvm_watcher(w);
  } else {  // the floor: a bare thread polling a bare word
    GpuCounter word = engine.alloc_gpu_counter();
    std::atomic<bool> stop{false};
    std::thread t([&] {
      uint64_t last = 0;
      while (!stop.load(std::memory_order_relaxed)) {
        uint64_t v = word.host->load(std::memory_order_acquire);
        if (v != last) ack.host->store(last = v, std::memory_order_release);
      }
    });
    ck(launch_ping_pong(const_cast<uint64_t*>(word.device), ack.device, kRounds, out, stream), "ping_pong");
    ck(cudaStreamSynchronize(stream), "sync");
    stop = true;
    t.join();
    engine.free_gpu_counter(word);
  }
  ck(cudaMemcpy(ns.data(), out, kRounds * 8, cudaMemcpyDefault), "copy back");
  cudaFree(out);
  engine.free_gpu_counter(ack);
  std::vector<double> us;
  for (uint32_t i = 100; i < kRounds; i++) us.push_back(ns[i] / 1000.0);
  return us;
}

std::string stats_json(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  double mean = std::accumulate(v.begin(), v.end(), 0.0) / v.size();
  char buf[256];
  std::snprintf(buf, sizeof buf, "{\"n\": %zu, \"mean_us\": %.3f, \"p50_us\": %.3f, \"p90_us\": %.3f, \"p99_us\": %.3f, \"max_us\": %.3f}",
                v.size(), mean, v[v.size() / 2], v[v.size() * 9 / 10], v[v.size() * 99 / 100], v.back());
  return buf;
}

int run_sender(tools::Channel& ch, const std::string& json_path) {
  int dev = 0;
  TransferEngine engine(gpu_engine_config(dev));
  MrDesc dst = MrDesc::from_bytes(ch.recv_bytes());
  std::string handle_bytes = ch.recv();
  cudaIpcMemHandle_t handle;
  std::memcpy(&handle, handle_bytes.data(), sizeof handle);
  void* raw_dst = nullptr;
  ck(cudaSetDevice(dev), "cudaSetDevice");
  if (gpu_count() > 1) cudaDeviceEnablePeerAccess(1, 0);
  ck(cudaIpcOpenMemHandle(&raw_dst, handle, cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle");
  std::string batch_peer = ch.recv();  // the receiver's own cuda_ipc domain over the same buffer
  uint64_t batch_rkey = std::stoull(ch.recv());
  DeviceBuffer src(kBuf, dev);
  src.upload(pattern(64 << 20, 9));
  auto [h, desc] = engine.reg_mr(src.ptr, kBuf, Device::cuda(dev));
  cudaStream_t stream;
  ck(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  Sender s{engine, h, dst, src.ptr, static_cast<uint8_t*>(raw_dst), stream};

  std::string json = "{\n  \"gpus\": " + std::to_string(gpu_count()) + ",\n";
  // single 16 MiB
  s.engine_single(16 << 20, 20);
  s.raw_single(16 << 20, 20);
  std::vector<double> e16, r16;
  for (int rep = 0; rep < 7; rep++) {
    e16.push_back(s.engine_single(16 << 20, 100));
    r16.push_back(s.raw_single(16 << 20, 100));
  }
  double single_ratio = median(e16) / median(r16);
  std::printf("single 16 MiB x100: engine %.1f GB/s  raw cudaMemcpyAsync %.1f GB/s  ratio %.3f\n",
              median(e16), median(r16), single_ratio);
  // paged
  std::vector<uint32_t> si(kBuf / kPage), di(kBuf / kPage);
  std::iota(si.begin(), si.end(), 0);
  std::iota(di.begin(), di.end(), 0);
  std::mt19937 rng(11);
  std::shuffle(si.begin(), si.end(), rng);
  std::shuffle(di.begin(), di.end(), rng);
  si.resize(kPages);
  di.resize(kPages);
  Pages sp{si, kPage, 0}, dp{di, kPage, 0};
  s.engine_paged(sp, dp);
  std::vector<double> ep, rp, rc;
  for (int rep = 0; rep < 5; rep++) {
    ep.push_back(s.engine_paged(sp, dp));
    rp.push_back(s.raw_paged(sp, dp));
    rc.push_back(s.raw_single(uint64_t(kPage) * kPages, 1));
  }
  std::printf("paged 10000 x 64 KiB: engine %.1f GB/s  raw per-page %.1f GB/s (ratio %.1fx)  "
              "raw contiguous %.1f GB/s (ratio %.3f)\n",
              median(ep), median(rp), median(ep) / median(rp), median(rc), median(ep) / median(rc));
  char buf[512];
  std::snprintf(buf, sizeof buf,
                "  \"single_16m\": {\"engine_gb_per_s\": %.2f, \"raw_gb_per_s\": %.2f, \"ratio\": %.4f},\n"
                "  \"paged_64k_x10000\": {\"engine_gb_per_s\": %.2f, \"raw_per_page_gb_per_s\": %.2f, "
                "\"raw_contiguous_gb_per_s\": %.2f, \"ratio_per_page\": %.3f, \"ratio_contiguous\": %.4f},\n",
                median(e16), median(r16), single_ratio, median(ep), median(rp), median(rc),
                median(ep) / median(rp), median(ep) / median(rc));
  json += buf;
  // curve
  json += "  \"curve\": [";
  std::printf("%10s %12s %12s %8s\n", "bytes", "engine GB/s", "raw GB/s", "ratio");
  for (uint64_t len = 4096; len <= (256ull << 20); len *= 4) {
    int count = static_cast<int>(std::clamp<uint64_t>((512ull << 20) / len, 8, 2000));
    s.engine_single(len, std::min(count, 50));
    double e = s.engine_single(len, count), r = s.raw_single(len, count);
    std::printf("%10llu %12.2f %12.2f %8.3f\n", static_cast<unsigned long long>(len), e, r, e / r);
    std::snprintf(buf, sizeof buf, "%s{\"bytes\": %llu, \"count\": %d, \"engine_gb_per_s\": %.3f, \"raw_gb_per_s\": %.3f}",
                  len == 4096 ? "" : ", ", static_cast<unsigned long long>(len), count, e, r);
    json += buf;
  }
  json += "],\n";
  // paged through post_write_batch on a cuda_ipc Domain of our own, against the same contiguous
  // copy as above (rc), in the same run
  std::vector<double> bp, bpi, bs, gk, gk1, host_share;
  uint64_t batch_imms_sent = 0;
  size_t batch_size = 0;
  {
    bench::BatchSender bsend(dev, src.ptr, kBuf, batch_peer, batch_rkey);
    batch_size = bsend.max_write_batch();
    std::vector<uint64_t> so(kPages), doff(kPages);
    for (uint32_t i = 0; i < kPages; i++) {
      so[i] = uint64_t{si[i]} * kPage;
      doff[i] = uint64_t{di[i]} * kPage;
    }
    bsend.paged_batches(so, doff, kPage, false);  // warm-up: mappings, events, descriptor pages
    for (int rep = 0; rep < 5; rep++) {
      bp.push_back(bsend.paged_batches(so, doff, kPage, false));
      host_share.push_back(bsend.last_host_share);
      bpi.push_back(bsend.paged_batches(so, doff, kPage, true));
      batch_imms_sent += kPages;
      bs.push_back(bsend.paged_single_posts(so, doff, kPage));
      gk.push_back(bench::gather_kernel_alone(src.ptr, static_cast<uint8_t*>(raw_dst), so, doff, kPage, 2048, stream));
      gk1.push_back(bench::gather_kernel_alone(src.ptr, static_cast<uint8_t*>(raw_dst), so, doff, kPage, kPages, stream));
    }
  }
  double batch_ratio = median(bp) / median(rc);
  std::printf("paged 10000 x 64 KiB through post_write_batch (batches of %zu): %.1f GB/s, with an "
              "immediate per page %.1f GB/s; contiguous %.1f GB/s: ratio %.3f (target >= 0.80), "
              "with immediates %.3f\n",
              batch_size, median(bp), median(bpi), median(rc), batch_ratio, median(bpi) / median(rc));
  std::printf("  the same pages, one post_write each: %.1f GB/s (ratio %.3f); the gather kernel alone "
              "(5 launches of 2048, event-timed): %.1f GB/s (ratio %.3f)\n",
              median(bs), median(bs) / median(rc), median(gk), median(gk) / median(rc));
  std::printf("  the gather kernel alone in one launch of %u: %.1f GB/s (ratio %.3f); the batch row's host "
              "side (WriteOps, checks, descriptors) ended at %.0f%% of its time\n",
              kPages, median(gk1), median(gk1) / median(rc), 100 * median(host_share));
  std::snprintf(buf, sizeof buf,
                "  \"paged_64k_x10000_batch\": {\"batch\": %zu, \"batch_gb_per_s\": %.2f, \"batch_imm_gb_per_s\": %.2f, "
                "\"single_posts_gb_per_s\": %.2f, \"gather_kernel_gb_per_s\": %.2f, \"raw_contiguous_gb_per_s\": %.2f, "
                "\"ratio_contiguous\": %.4f, \"ratio_contiguous_imm\": %.4f},\n",
                batch_size, median(bp), median(bpi), median(bs), median(gk), median(rc), batch_ratio,
                median(bpi) / median(rc));
  json += buf;
  ch.send(std::to_string(batch_imms_sent));  // done with the receiver's buffer; how many it should count
  uint64_t batch_imms_seen = std::stoull(ch.recv());
  std::printf("  immediates: %llu sent in batches, %llu counted by the receiver%s\n",
              static_cast<unsigned long long>(batch_imms_sent), static_cast<unsigned long long>(batch_imms_seen),
              batch_imms_seen == batch_imms_sent ? "" : "  MISMATCH");
  if (batch_imms_seen != batch_imms_sent) throw std::runtime_error("batch immediates miscounted");
  // watcher latency
  auto floor = ping_pong(engine, false, stream);
  auto watcher = ping_pong(engine, true, stream);
  std::printf("watcher round trip (GPU store -> callback -> GPU sees ack): %s\n", stats_json(watcher).c_str());
  std::printf("bare polling thread round trip (floor):                  %s\n", stats_json(floor).c_str());
  json += "  \"watcher_round_trip\": " + stats_json(watcher) + ",\n  \"bare_thread_round_trip\": " +
          stats_json(floor) + ",\n";
  // The minimal ping-pong (the floor) and variants, each one change away from it, same run.
  std::vector<std::pair<std::string, std::vector<double>>> rows;
  int cpu_minimal = -1;
  rows.emplace_back("minimal: store+fence, own words 4 KiB apart, bare thread",
                    bench::minimal_ping_pong(PingPongSignal::kStoreThenFence, 4096, stream, &cpu_minimal));
  rows.emplace_back("  kernel st.release.sys (fence before the store)",
                    bench::minimal_ping_pong(PingPongSignal::kReleaseStore, 4096, stream));
  rows.emplace_back("  kernel fence, then store", bench::minimal_ping_pong(PingPongSignal::kFenceThenStore, 4096, stream));
  rows.emplace_back("  kernel store, no fence", bench::minimal_ping_pong(PingPongSignal::kStoreOnly, 4096, stream));
  rows.emplace_back("  words in adjacent 64-byte lines", bench::minimal_ping_pong(PingPongSignal::kStoreThenFence, 64, stream));
  rows.emplace_back("  words in one 64-byte line", bench::minimal_ping_pong(PingPongSignal::kStoreThenFence, 8, stream));
  rows.emplace_back("bare thread on the engine's GPU counters, store+fence",
                    bench::engine_words_ping_pong(engine, PingPongSignal::kStoreThenFence, stream));
  int cpu_watcher = -1;
  rows.emplace_back("engine watcher, store+fence",
                    bench::watcher_ping_pong(engine, PingPongSignal::kStoreThenFence, stream, &cpu_watcher));
  rows.emplace_back("engine watcher, st.release.sys", bench::watcher_ping_pong(engine, PingPongSignal::kReleaseStore, stream));
  double floor_p50 = bench::p50(rows[0].second);
  std::printf("round trips GPU -> CPU -> GPU, same run (GPU %d on NUMA node %d; minimal's thread on CPU %d "
              "node %d, watcher thread on CPU %d node %d):\n",
              dev, bench::node_of_gpu(dev), cpu_minimal, bench::node_of_cpu(cpu_minimal), cpu_watcher,
              bench::node_of_cpu(cpu_watcher));
  json += "  \"round_trips\": [";
  for (size_t r = 0; r < rows.size(); r++) {
    double q = bench::p50(rows[r].second);
    std::printf("  %-58s p50 %6.3f us (%5.2fx the minimal)  %s\n", rows[r].first.c_str(), q,
                floor_p50 > 0 ? q / floor_p50 : 0.0, bench::stats_line(rows[r].second).c_str());
    json += std::string(r ? ", " : "") + "{\"what\": \"" + rows[r].first.substr(rows[r].first.find_first_not_of(' ')) +
            "\", \"stats\": " + bench::stats_line(rows[r].second) + "}";
  }
  double watcher_vs_floor = floor_p50 > 0 ? bench::p50(rows[7].second) / floor_p50 : 0.0;
  std::printf("watcher (store+fence) / minimal ping-pong, p50: %.3f (target <= 1.2)\n", watcher_vs_floor);
  json += "],\n  \"minimal_ping_pong\": " + bench::stats_line(rows[0].second) +
          ",\n  \"watcher_store_fence_round_trip\": " + bench::stats_line(rows[7].second) +
          ",\n  \"watcher_vs_minimal_p50\": " + std::to_string(watcher_vs_floor) + "\n}\n";
  if (!json_path.empty()) std::ofstream(json_path) << json;
  std::printf("ratio single16m=%.3f paged_vs_per_page=%.1f paged_vs_contiguous=%.3f batch_vs_contiguous=%.3f "
              "watcher_vs_minimal_p50=%.3f watcher_p50_us=%.2f watcher_p99_us=%.2f\n",
              single_ratio, median(ep) / median(rp), median(ep) / median(rc), batch_ratio, watcher_vs_floor,
              [&] { auto v = watcher; std::sort(v.begin(), v.end()); return v[v.size() / 2]; }(),
              [&] { auto v = watcher; std::sort(v.begin(), v.end()); return v[v.size() * 99 / 100]; }());
  cudaIpcCloseMemHandle(raw_dst);
  return 0;
}

int run_receiver(tools::Channel& ch) {
  int dev = gpu_count() > 1 ? 1 : 0;
  TransferEngine engine(gpu_engine_config(dev));
  DeviceBuffer dst(kBuf, dev);
  auto [h, desc] = engine.reg_mr(dst.ptr, kBuf, Device::cuda(dev));
  ch.send(desc.to_bytes());
  cudaIpcMemHandle_t handle;
  ck(cudaIpcGetMemHandle(&handle, dst.ptr), "cudaIpcGetMemHandle");
  ch.send(std::string(reinterpret_cast<const char*>(&handle), sizeof handle));
  bench::BatchReceiver batches(dev, dst.ptr, kBuf);  // for the sender's post_write_batch run
  ch.send(batches.address());
  ch.send(std::to_string(batches.rkey()));
  uint64_t want = std::stoull(ch.recv());  // the sender is done with our buffer
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (batches.imms() < want && std::chrono::steady_clock::now() < deadline)  // still in our inbox
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  std::this_thread::sleep_for(std::chrono::milliseconds(20));  // a surplus would show
  ch.send(std::to_string(batches.imms()));
  return 0;
}

}  // namespace
}  // namespace fabric::gpu_test

int main(int argc, char** argv) {
  using namespace fabric::gpu_test;
  std::string json = argc > 2 && std::string(argv[1]) == "--json" ? argv[2] : "";
  if (gpu_count() == 0) {
    std::fprintf(stderr, "cuda_ipc_bench: no CUDA device visible\n");
    return 2;
  }
  auto r = fabric::tools::run_process_pair([&](fabric::tools::Channel& ch) { return run_sender(ch, json); },
                                           run_receiver);
  return r.ok() ? 0 : 1;
}
