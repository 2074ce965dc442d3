// GPU tests (run on the lent GPU machine by tests/gpu/run.sh; skipped where no GPU is visible).
// Two processes, each on its own GPU where there are two, both on GPU 0 otherwise: every API call
// with GPU buffers and data checks, cuda_ipc routing next to tcp, UVM watchers inside a CUDA
// graph, and an immediate count that releases a waiting kernel.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <numeric>
#include <random>

#include "gpu_kernels.h"
#include "gpu_support.h"
#include "process_pair.h"

namespace fabric::gpu_test {
namespace {

using tools::Channel;

constexpr size_t kGpuLen = 64 << 20;
constexpr size_t kHostLen = 4 << 20;
constexpr size_t kPage = 16 << 10;
constexpr uint32_t kPages = 512;

#define REQUIRE_GPU() \
  if (gpu_count() == 0) GTEST_SKIP() << "no CUDA device visible"

int sender_device() { return 1 % gpu_count(); }

std::vector<uint32_t> shuffled(uint32_t n, uint32_t seed) {
  std::vector<uint32_t> v(n);
  std::iota(v.begin(), v.end(), 0);
  std::shuffle(v.begin(), v.end(), std::mt19937(seed));
  return v;
}

struct Done {
  std::atomic<uint64_t> ok{0}, failed{0};
  OnDone on_done() { return OnDone::counter(&ok, &failed); }
};

// Sender: every kind of WRITE from GPU and host memory to the receiver's GPU and host regions.
int send_everything(Channel& ch) {
  TransferEngine engine(gpu_engine_config(sender_device()));
  NetAddr peer = NetAddr::from_bytes(ch.recv_bytes());
  MrDesc gdst = MrDesc::from_bytes(ch.recv_bytes());
  MrDesc hdst = MrDesc::from_bytes(ch.recv_bytes());
  DeviceBuffer gsrc(kGpuLen, sender_device());
  gsrc.upload(pattern(kGpuLen, 1));
  std::vector<uint8_t> hsrc = pattern(kHostLen, 2);
  auto [g, gdesc] = engine.reg_mr(gsrc.ptr, kGpuLen, Device::cuda(sender_device()));
  auto [h, hdesc] = engine.reg_mr(hsrc.data(), kHostLen);
  if (!gdesc.keys().empty() || !gdesc.local_key()) return 10;  // tcp cannot reach GPU memory

  Done done;
  int expected = 0;
  engine.submit_single_write(16 << 20, g, 0, gdst, 0, done.on_done(), WriteOptions{1, std::nullopt});
  Pages src{shuffled(1024, 3), kPage, 16 << 20}, dst{shuffled(1024, 4), kPage, 16 << 20};
  src.indices.resize(kPages);
  dst.indices.resize(kPages);
  engine.submit_paged_writes(kPage, g, src, gdst, dst, done.on_done(), WriteOptions{2, std::nullopt});
  engine.submit_single_write(1 << 20, h, 0, gdst, 32 << 20, done.on_done(), WriteOptions{3, std::nullopt});
  std::vector<ScatterDst> slices;
  for (uint64_t k = 0; k < 4; k++) slices.push_back({(k + 1) * 4096, (48 << 20) + k * 65536, gdst, (40 << 20) + k * 65536});
  engine.submit_scatter(std::nullopt, g, slices, done.on_done(), WriteOptions{5, std::nullopt});
  engine.submit_barrier(std::nullopt, 6, {gdst}, done.on_done());
  engine.submit_single_write(1 << 20, h, 1 << 20, hdst, 0, done.on_done(), WriteOptions{7, std::nullopt});  // tcp
  expected = 6;
  std::string hello = "hello from the GPU sender";
  engine.submit_send(peer, std::as_bytes(std::span(hello)), done.on_done());
  expected++;
  // GPU memory that the NIC cannot read, to host memory reachable only by NIC: refused at once.
  try {
    engine.submit_single_write(4096, g, 0, hdst, 0, OnDone::none());
    return 11;
  } catch (const Error& e) {
    if (e.code() != ErrorCode::kUnsupported) return 12;
  }
  if (!wait_for(done.ok, static_cast<uint64_t>(expected))) return 13;
  if (done.failed.load() != 0) return 14;
  auto stats = engine.nic_stats();
  if (stats.size() != 2 || stats[1].writes_posted < kPages) return 15;  // cuda_ipc did the GPU work
  ch.send(std::string("done"));
  ch.recv();  // the receiver has checked everything
  return 0;
}

TEST(GpuTransfers, EveryCallWithGpuBuffersAcrossProcesses) {
  REQUIRE_GPU();
  auto result = tools::run_process_pair(
      [](Channel& ch) {
        TransferEngine engine(gpu_engine_config(0));
        DeviceBuffer gdst(kGpuLen, 0);
        gdst.fill(0);
        std::vector<uint8_t> hdst(kHostLen, 0);
        auto [g, gdesc] = engine.reg_mr(gdst.ptr, kGpuLen, Device::cuda(0));
        auto [h, hdesc] = engine.reg_mr(hdst.data(), kHostLen);
        EXPECT_TRUE(gdesc.keys().empty());
        EXPECT_TRUE(gdesc.local_key().has_value());
        EXPECT_FALSE(hdesc.local_key().has_value());  // host memory: NICs only
        std::atomic<uint64_t> messages{0};
        std::string message;
        engine.submit_recvs(256, 4, [&](std::span<const std::byte> b) {
          message.assign(reinterpret_cast<const char*>(b.data()), b.size());
          messages.fetch_add(1);
        });
        std::array<std::atomic<uint64_t>, 8> imms{};
        const std::array<uint64_t, 8> counts = {0, 1, kPages, 1, 0, 4, 1, 1};
        for (uint32_t imm = 1; imm < 8; imm++)
          if (counts[imm]) engine.expect_imm_count(imm, counts[imm], OnDone::counter(&imms[imm]));
        ch.send(engine.main_address().to_bytes());
        ch.send(gdesc.to_bytes());
        ch.send(hdesc.to_bytes());
        if (ch.recv() != "done") return 1;
        for (uint32_t imm = 1; imm < 8; imm++)
          if (counts[imm]) {
            EXPECT_TRUE(wait_for(imms[imm], 1)) << "imm " << imm;
          }
        EXPECT_TRUE(wait_for(messages, 1));
        EXPECT_EQ(message, "hello from the GPU sender");

        auto src = pattern(kGpuLen, 1);
        auto host_src = pattern(kHostLen, 2);
        auto got = gdst.download(0, kGpuLen);
        EXPECT_TRUE(std::equal(got.begin(), got.begin() + (16 << 20), src.begin())) << "single write";
        auto sp = shuffled(1024, 3), dp = shuffled(1024, 4);
        for (uint32_t i = 0; i < kPages; i++) {
          size_t s = (16 << 20) + sp[i] * kPage, d = (16 << 20) + dp[i] * kPage;
          if (!std::equal(got.begin() + d, got.begin() + d + kPage, src.begin() + s)) {
            ADD_FAILURE() << "page " << i;
            break;
          }
        }
        EXPECT_TRUE(std::equal(got.begin() + (32 << 20), got.begin() + (33 << 20), host_src.begin()))
            << "host to GPU";
        for (size_t k = 0; k < 4; k++) {
          size_t s = (48 << 20) + k * 65536, d = (40 << 20) + k * 65536, n = (k + 1) * 4096;
          EXPECT_TRUE(std::equal(got.begin() + d, got.begin() + d + n, src.begin() + s)) << "slice " << k;
          EXPECT_EQ(got[d + n], 0) << "slice " << k << " wrote past its end";
        }
        EXPECT_TRUE(std::equal(hdst.begin(), hdst.begin() + (1 << 20), host_src.begin() + (1 << 20)))
            << "host to host over tcp";
        ch.send(std::string("checked"));
        return ::testing::Test::HasFailure() ? 1 : 0;
      },
      send_everything);
  EXPECT_TRUE(result.ok()) << "parent rc " << result.parent_rc << ", child status "
                           << WEXITSTATUS(result.child_status);
}

// A kernel launched before the data arrives spins on a GPU counter; the engine bumps the counter
// when the immediate count is reached; the kernel then reads the data. A second stream waits with
// gpu_stream_wait instead of a spinning kernel.
TEST(GpuTransfers, ImmCountReleasesWaitingKernels) {
  REQUIRE_GPU();
  constexpr size_t kLen = 4 << 20;
  auto result = tools::run_process_pair(
      [](Channel& ch) {
        TransferEngine engine(gpu_engine_config(0));
        DeviceBuffer dst(2 * kLen, 0);
        dst.fill(0);
        DeviceBuffer sums(16, 0);
        sums.fill(0);
        auto [h, desc] = engine.reg_mr(dst.ptr, 2 * kLen, Device::cuda(0));
        GpuCounter spin = engine.alloc_gpu_counter(), waited = engine.alloc_gpu_counter();
        cudaStream_t s1, s2;
        ck(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking), "stream");
        ck(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking), "stream");
        auto* sum = reinterpret_cast<uint64_t*>(sums.ptr);
        ck(launch_wait_then_sum(spin.device, 1, dst.ptr, kLen, sum, s1), "wait_then_sum");
        TransferEngine::gpu_stream_wait(s2, waited, 1);
        ck(launch_sum(dst.ptr + kLen, kLen, sum + 1, s2), "sum");
        engine.expect_imm_count(9, 1, OnDone::counter(spin.host));
        engine.expect_imm_count(10, 1, OnDone::counter(waited.host));
        ch.send(engine.main_address().to_bytes());
        ch.send(desc.to_bytes());
        ck(cudaStreamSynchronize(s1), "sync");
        ck(cudaStreamSynchronize(s2), "sync");
        auto got = sums.download(0, 16);
        uint64_t expect[2] = {0, 0};
        auto data = pattern(2 * kLen, 5);
        for (size_t k = 0; k < 2; k++)
          for (size_t i = 0; i < kLen; i += 8) {
            uint64_t w;
            std::memcpy(&w, data.data() + k * kLen + i, 8);
            expect[k] += w;
          }
        uint64_t have[2];
        std::memcpy(have, got.data(), 16);
        EXPECT_EQ(have[0], expect[0]) << "the spinning kernel read before the data landed";
        EXPECT_EQ(have[1], expect[1]) << "the waiting stream ran before the data landed";
        EXPECT_EQ(spin.host->load(), 1u);
        engine.free_gpu_counter(spin);
        engine.free_gpu_counter(waited);
        ch.send(std::string("checked"));
        return ::testing::Test::HasFailure() ? 1 : 0;
      },
      [](Channel& ch) {
        TransferEngine engine(gpu_engine_config(sender_device()));
        (void)NetAddr::from_bytes(ch.recv_bytes());
        MrDesc dst = MrDesc::from_bytes(ch.recv_bytes());
        DeviceBuffer src(2 * kLen, sender_device());
        src.upload(pattern(2 * kLen, 5));
        auto [h, desc] = engine.reg_mr(src.ptr, 2 * kLen, Device::cuda(sender_device()));
        std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the kernels are waiting
        Done done;
        engine.submit_single_write(kLen, h, 0, dst, 0, done.on_done(), WriteOptions{9, std::nullopt});
        engine.submit_single_write(kLen, h, kLen, dst, kLen, done.on_done(), WriteOptions{10, std::nullopt});
        if (!wait_for(done.ok, 2) || done.failed.load()) return 1;
        ch.recv();
        return 0;
      });
  EXPECT_TRUE(result.ok());
}

// Two engines in one process: cuda_ipc uses the exporter's own addresses (CUDA cannot open an
// IPC handle in the process that made it); errors are clear; deregistration is seen by writers.
TEST(GpuTransfers, SameProcessEnginesAndErrors) {
  REQUIRE_GPU();
  auto result = tools::run_process_pair(
      [](Channel&) {
        TransferEngine a(gpu_engine_config(0)), b(gpu_engine_config(0));
        TransferEngine no_ipc(gpu_engine_config(0, false));
        DeviceBuffer src(1 << 20, 0), dst(1 << 20, 0);
        src.upload(pattern(1 << 20, 7));
        dst.fill(0);
        try {
          no_ipc.reg_mr(dst.ptr, 1 << 20, Device::cuda(0));
          ADD_FAILURE() << "tcp registered GPU memory without FI_HMEM";
        } catch (const Error& e) {
          EXPECT_EQ(e.code(), ErrorCode::kUnsupported);
          EXPECT_NE(std::string(e.what()).find("FI_HMEM"), std::string::npos) << e.what();
        }
        auto [hs, ds] = a.reg_mr(src.ptr, 1 << 20, Device::cuda(0));
        auto [hd, dd] = b.reg_mr(dst.ptr, 1 << 20, Device::cuda(0));
        std::vector<uint8_t> host(4096);
        auto [hh, dh] = no_ipc.reg_mr(host.data(), host.size());
        try {
          no_ipc.submit_single_write(4096, hh, 0, dd, 0, OnDone::none());
          ADD_FAILURE() << "a write to a cuda_ipc-only region from an engine without cuda_ipc";
        } catch (const Error& e) {
          EXPECT_EQ(e.code(), ErrorCode::kUnsupported) << e.what();
        }
        Done done;
        a.submit_paged_writes(4096, hs, Pages{{0, 1, 2, 3}, 4096, 0}, dd, Pages{{3, 2, 1, 0}, 4096, 0},
                              done.on_done(), WriteOptions{1, std::nullopt});
        EXPECT_TRUE(wait_for(done.ok, 1));
        auto want = pattern(1 << 20, 7);
        auto got = dst.download(0, 4 * 4096);
        for (size_t p = 0; p < 4; p++)
          EXPECT_TRUE(std::equal(got.begin() + (3 - p) * 4096, got.begin() + (4 - p) * 4096,
                                 want.begin() + p * 4096))
              << "page " << p;
        EXPECT_EQ(b.imm_count(1), 4u);
        b.dereg_mr(hd);
        std::atomic<int> flag{kDonePending};
        a.submit_single_write(4096, hs, 0, dd, 0, OnDone::flag(&flag));
        flag.wait(kDonePending);
        EXPECT_EQ(flag.load(), kDoneFailed) << "a write to a deregistered region succeeded";
        return ::testing::Test::HasFailure() ? 1 : 0;
      },
      [](Channel&) { return 0; });
  EXPECT_TRUE(result.ok());
}

// A kernel captured in a CUDA graph bumps a watched word; the callback sees every value in order.
TEST(GpuSignals, WatcherSeesEveryStoreFromACudaGraph) {
  REQUIRE_GPU();
  auto result = tools::run_process_pair(
      [](Channel&) {
        EngineConfig cfg = gpu_engine_config(0, false);
        TransferEngine engine(cfg);
        constexpr uint64_t kStores = 200;
        std::vector<std::pair<uint64_t, uint64_t>> seen;
        std::atomic<uint64_t> last{0};
        UvmWatcher w = engine.alloc_uvm_watcher([&](uint64_t old_value, uint64_t new_value) {
          seen.emplace_back(old_value, new_value);
          last.store(new_value, std::memory_order_release);
        });
        cudaStream_t s;
        ck(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");
        cudaGraph_t graph;
        cudaGraphExec_t exec;
        ck(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal), "capture");
        ck(launch_bump(w.device, kStores, 50000, s), "bump");
        ck(cudaStreamEndCapture(s, &graph), "end capture");
        ck(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
        ck(cudaGraphLaunch(exec, s), "graph launch");
        ck(cudaStreamSynchronize(s), "sync");
        EXPECT_TRUE(wait_for(last, kStores));
        engine.free_uvm_watcher(w);
        // Stores 50 us apart: the thread sees nearly all (one it missed while descheduled is
        // coalesced into the next change, as documented); the values form one increasing chain.
        EXPECT_GE(seen.size(), kStores * 9 / 10);
        if (seen.empty()) return 1;
        EXPECT_EQ(seen.front().first, 0u);
        EXPECT_EQ(seen.back().second, kStores);
        for (size_t i = 0; i < seen.size(); i++) {
          EXPECT_LT(seen[i].first, seen[i].second) << "change " << i;
          if (i > 0) {
            EXPECT_EQ(seen[i].first, seen[i - 1].second) << "change " << i;
          }
        }
        EXPECT_THROW(engine.free_uvm_watcher(w), Error);  // twice
        return ::testing::Test::HasFailure() ? 1 : 0;
      },
      [](Channel&) { return 0; });
  EXPECT_TRUE(result.ok());
}

// Watchers allocated and freed from inside a callback while another thread does the same: freeing
// once waited for the watcher thread while holding the allocation lock, which a callback that
// allocates then waited for (a deadlock; this test hung then).
TEST(GpuSignals, WatchersMayComeAndGoFromCallbacksAndOtherThreadsAtOnce) {
  REQUIRE_GPU();
  auto result = tools::run_process_pair(
      [](Channel&) {
        TransferEngine engine(gpu_engine_config(0, false));
        std::atomic<uint64_t> callbacks{0}, churned{0};
        UvmWatcher trigger = engine.alloc_uvm_watcher([&](uint64_t, uint64_t) {
          UvmWatcher w = engine.alloc_uvm_watcher([](uint64_t, uint64_t) {});
          engine.free_uvm_watcher(w);  // inside a callback: released by the thread afterwards
          callbacks.fetch_add(1, std::memory_order_release);
        });
        std::atomic<bool> stop{false};
        std::thread churn([&] {
          while (!stop.load()) {
            UvmWatcher w = engine.alloc_uvm_watcher([](uint64_t, uint64_t) {});
            engine.free_uvm_watcher(w);
            churned++;
          }
        });
        constexpr uint64_t kRounds = 2000;
        uint64_t answered = 0;
        for (uint64_t v = 1; v <= kRounds; v++) {
          uint64_t before = callbacks.load(std::memory_order_acquire);
          *trigger.host = v;  // the watcher thread polls this word
          auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
          while (callbacks.load(std::memory_order_acquire) == before && std::chrono::steady_clock::now() < deadline)
            std::this_thread::yield();
          answered += callbacks.load() > before;
        }
        stop = true;
        churn.join();
        EXPECT_EQ(answered, kRounds);
        EXPECT_GT(churned.load(), 0u);
        engine.free_uvm_watcher(trigger);
        // Every slot came back: as many watchers as ever can be allocated again.
        std::vector<UvmWatcher> all;
        for (int i = 0; i < 4000; i++) all.push_back(engine.alloc_uvm_watcher([](uint64_t, uint64_t) {}));
        for (auto& w : all) engine.free_uvm_watcher(w);
        return ::testing::Test::HasFailure() ? 1 : 0;
      },
      [](Channel&) { return 0; });
  EXPECT_TRUE(result.ok());
}

}  // namespace
}  // namespace fabric::gpu_test
