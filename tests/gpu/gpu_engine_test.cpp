// GPU tests (run on the lent GPU machine by tests/gpu/run.sh; skipped where no GPU is visible).
// Two processes, each on its own GPU where there are two, both on GPU 0 otherwise: every API call
// with GPU buffers and data checks, cuda_ipc routing next to tcp, UVM watchers inside a CUDA
// graph, and an immediate count that releases a waiting kernel. Then cuda_ipc's lifecycle:
// engines in other containers (IPC, mount and PID namespaces), peer removal returning GPU
// memory, deregistration against a streaming writer, and the stream wait's remote-write flush.
#include <fcntl.h>
#include <gtest/gtest.h>

#include <csignal>
#include <sched.h>
#include <sys/mman.h>
#include <sys/mount.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <functional>
#include <numeric>
#include <random>

#include "../../src/cuda/driver_api.h"  // the library's view of the device (the wait's flags)
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
  engine.submit(SingleWrite{.len = 16 << 20, .src = {g, 0}, .dst = {engine.add_remote(gdst), 0}, .imm = 1},
                done.on_done());
  std::vector<uint32_t> src_idx = shuffled(1024, 3), dst_idx = shuffled(1024, 4);
  src_idx.resize(kPages);
  dst_idx.resize(kPages);
  Pages src{src_idx, kPage, 16 << 20}, dst{dst_idx, kPage, 16 << 20};
  engine.submit(PagedWrites{.page_len = kPage, .src = g, .src_pages = src, .dst = engine.add_remote(gdst), .dst_pages = dst, .imm = 2},
                done.on_done());
  engine.submit(SingleWrite{.len = 1 << 20, .src = {h, 0}, .dst = {engine.add_remote(gdst), 32 << 20}, .imm = 3},
                done.on_done());
  const RemoteMr gremote = engine.add_remote(gdst);
  std::vector<ScatterSlice> slices;
  for (uint64_t k = 0; k < 4; k++)
    slices.push_back({(k + 1) * 4096, (48 << 20) + k * 65536, {gremote, (40 << 20) + k * 65536}});
  engine.submit(Scatter{.src = g, .slices = slices, .imm = 5}, done.on_done());
  const RemoteMr barrier_dsts[] = {gremote};
  engine.submit(Barrier{.dsts = barrier_dsts, .imm = 6}, done.on_done());
  engine.submit(SingleWrite{.len = 1 << 20, .src = {h, 1 << 20}, .dst = {engine.add_remote(hdst), 0}, .imm = 7},
                done.on_done());  // tcp
  expected = 6;
  std::string hello = "hello from the GPU sender";
  engine.submit_send(peer, std::as_bytes(std::span(hello)), done.on_done());
  expected++;
  // GPU memory that the NIC cannot read, to host memory reachable only by NIC: refused at once.
  try {
    engine.submit(SingleWrite{.len = 4096, .src = {g, 0}, .dst = {engine.add_remote(hdst), 0}},
                  OnDone::none());
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
        engine.submit(SingleWrite{.len = kLen, .src = {h, 0}, .dst = {engine.add_remote(dst), 0}, .imm = 9},
                      done.on_done());
        engine.submit(SingleWrite{.len = kLen, .src = {h, kLen}, .dst = {engine.add_remote(dst), kLen}, .imm = 10},
                      done.on_done());
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
          no_ipc.submit(SingleWrite{.len = 4096, .src = {hh, 0}, .dst = {no_ipc.add_remote(dd), 0}},
                        OnDone::none());
          ADD_FAILURE() << "a write to a cuda_ipc-only region from an engine without cuda_ipc";
        } catch (const Error& e) {
          EXPECT_EQ(e.code(), ErrorCode::kUnsupported) << e.what();
        }
        Done done;
        const std::vector<uint32_t> forward{0, 1, 2, 3}, backward{3, 2, 1, 0};
        a.submit(PagedWrites{.page_len = 4096, .src = hs, .src_pages = {forward, 4096, 0},
                             .dst = a.add_remote(dd), .dst_pages = {backward, 4096, 0}, .imm = 1},
                 done.on_done());
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
        a.submit(SingleWrite{.len = 4096, .src = {hs, 0}, .dst = {a.add_remote(dd), 0}},
                 OnDone::flag(&flag));
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


// ---- cuda_ipc in containers -------------------------------------------------------------------

constexpr int kNoNamespace = 77;
// CUDA refused to start as process 1 of a new PID namespace (seen on the lent H200: cudaSetDevice
// failed with 304, 'OS call failed or operation not supported on this OS').
constexpr int kNoCudaAsPid1 = 78;  // a process could not make its namespace here (needs root)

int exit_code(int status) { return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status); }

// The namespace tests' processes keep copies of the channel in waiting intermediates, so a dead
// peer does not close it: a read gives up after 20 s instead of hanging the run.
void bound_channel_reads(const Channel& ch) {
  timeval tv{20, 0};
  setsockopt(ch.fd(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
}

// Runs `body` as process 1 of a new PID namespace (a child unshares; its own child runs `body`),
// and returns body's result or kNoNamespace. Called before anything in this process uses CUDA.
int as_pid1(const std::function<int()>& body) {
  std::fflush(nullptr);
  pid_t c = fork();
  if (c == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (unshare(CLONE_NEWPID) != 0) _exit(kNoNamespace);
    pid_t g = fork();
    if (g == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      int rc = 1;
      if (cudaFree(nullptr) != cudaSuccess) {
        std::fprintf(stderr, "CUDA does not start as process 1 of a PID namespace here\n");
        std::fflush(nullptr);
        _exit(kNoCudaAsPid1);
      }
      try {
        rc = getpid() == 1 ? body() : 2;
      } catch (const std::exception& e) {
        std::fprintf(stderr, "process 1 of a PID namespace: %s\n", e.what());
      }
      std::fflush(nullptr);
      _exit(rc);
    }
    int status = 0;
    waitpid(g, &status, 0);
    _exit(exit_code(status));
  }
  int status = 0;
  waitpid(c, &status, 0);
  return exit_code(status);
}

// This process gets a private IPC namespace and its own /dev/shm, as a docker container by default.
bool enter_private_ipc_and_dev_shm() {
  if (unshare(CLONE_NEWIPC | CLONE_NEWNS) != 0) return false;
  if (mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) return false;  // stays here
  return mount("fabric-gpu-test-shm", "/dev/shm", "tmpfs", 0, "size=64m") == 0;
}

std::string scope_of(const NetAddr& a) { return a.local().substr(0, a.local().find('/')); }

bool segment_exists(const NetAddr& a) {
  std::string name = a.local().substr(a.local().find('/'));
  int fd = shm_open(name.c_str(), O_RDONLY, 0);
  if (fd < 0) return false;
  close(fd);
  return true;
}

// The owner of a host and a GPU region, for a writer that cuda_ipc cannot reach: the host region
// must be written over the NICs, and the owner's segment must survive the writer's start (its
// stale sweep).
int owner_for_a_foreign_writer(Channel& ch) {
  bound_channel_reads(ch);
  TransferEngine engine(gpu_engine_config(0));
  std::vector<uint8_t> host(1 << 20, 0);
  DeviceBuffer gpu(1 << 20, 0);
  auto [h, hdesc] = engine.reg_mr(host.data(), host.size());
  auto [g, gdesc] = engine.reg_mr(gpu.ptr, gpu.len, Device::cuda(0));
  std::atomic<uint64_t> imms{0};
  engine.expect_imm_count(4, 1, OnDone::counter(&imms));
  ch.send(engine.main_address().to_bytes());
  ch.send(hdesc.to_bytes());
  ch.send(gdesc.to_bytes());
  std::string said = ch.recv();
  if (said != "done") {
    std::fprintf(stderr, "owner: the writer said '%s'\n", said.c_str());
    return 20;
  }
  if (!wait_for(imms, 1)) return 21;
  if (host != pattern(1 << 20, 11)) return 22;
  if (!segment_exists(engine.main_address())) return 23;  // the writer's sweep deleted it
  ch.send(std::string("checked"));
  return 0;
}

// The writer: its engine starts after the owner's; the host region goes over the NICs (tcp) and
// the GPU region, which only cuda_ipc could reach, is refused at submit time.
int writer_from_another_container(Channel& ch) {
  bound_channel_reads(ch);
  NetAddr owner = NetAddr::from_bytes(ch.recv_bytes());
  MrDesc hdst = MrDesc::from_bytes(ch.recv_bytes());
  MrDesc gdst = MrDesc::from_bytes(ch.recv_bytes());
  auto fail = [&](int code, const std::string& why) {
    ch.send(why);
    return code;
  };
  TransferEngine engine(gpu_engine_config(sender_device()));
  if (scope_of(engine.main_address()) == scope_of(owner))
    return fail(30, "same host scope: " + scope_of(owner));
  std::vector<uint8_t> src = pattern(1 << 20, 11);
  auto [h, desc] = engine.reg_mr(src.data(), src.size());
  std::atomic<int> flag{kDonePending};
  Status status;
  engine.submit(SingleWrite{.len = src.size(), .src = {h, 0}, .dst = {engine.add_remote(hdst), 0}, .imm = 4},
                OnDone::callback([&](const Status& s) {
                               status = s;
                               flag.store(s.ok() ? kDoneSucceeded : kDoneFailed);
                               flag.notify_all();
                             }));
  flag.wait(kDonePending);
  if (flag.load() != kDoneSucceeded) return fail(31, "host write failed: " + status.message());
  auto stats = engine.nic_stats();
  if (stats.size() != 2 || stats[0].writes_posted == 0 || stats[1].writes_posted != 0)
    return fail(32, "the write did not go over the NIC");
  try {
    engine.submit(SingleWrite{.len = 4096, .src = {h, 0}, .dst = {engine.add_remote(gdst), 0}},
                  OnDone::none());
    return fail(33, "a write to a cuda_ipc-only region of another container was accepted");
  } catch (const Error& e) {
    if (e.code() != ErrorCode::kUnsupported) return fail(34, e.what());
  }
  ch.send(std::string("done"));
  return ch.recv() == "checked" ? 0 : 35;
}

// docker run twice (private IPC namespace and /dev/shm): the boot id is the same, but the peer's
// segment is invisible. The engines used to pick cuda_ipc and fail every transfer.
TEST(CudaIpcContainers, APeerWithItsOwnDevShmAndIpcNamespaceIsReachedOverTheNics) {
  REQUIRE_GPU();
  auto result = tools::run_process_pair(owner_for_a_foreign_writer, [](Channel& ch) {
    if (!enter_private_ipc_and_dev_shm()) {
      ch.send(std::string("no namespaces"));
      return kNoNamespace;
    }
    return writer_from_another_container(ch);
  });
  if (exit_code(result.child_status) == kNoNamespace) GTEST_SKIP() << "unshare/mount refused";
  EXPECT_TRUE(result.ok()) << "owner rc " << result.parent_rc << ", writer rc " << exit_code(result.child_status);
}

// docker run --ipc=host twice (shared /dev/shm, own PID namespaces): the writer is process 1 of
// its namespace, where kill(owner's pid, 0) says ESRCH; the old sweep deleted the owner's live
// segment, and legacy CUDA IPC handles do not open across PID namespaces: NICs.
TEST(CudaIpcContainers, APeerInAnotherPidNamespaceSharingDevShmIsReachedOverTheNics) {
  REQUIRE_GPU();
  // A writer that cannot start (no CUDA as process 1) leaves: the owner's next send must fail
  // with an error, not kill the test with SIGPIPE.
  std::signal(SIGPIPE, SIG_IGN);
  auto result = tools::run_process_pair(owner_for_a_foreign_writer, [](Channel& ch) {
    int rc = as_pid1([&] { return writer_from_another_container(ch); });
    if (rc == kNoNamespace || rc == kNoCudaAsPid1) ch.send(std::string("no namespaces"));
    return rc;
  });
  if (exit_code(result.child_status) == kNoNamespace) GTEST_SKIP() << "unshare refused";
  if (exit_code(result.child_status) == kNoCudaAsPid1)
    GTEST_SKIP() << "CUDA does not start as process 1 of a new PID namespace on this machine";
  EXPECT_TRUE(result.ok()) << "owner rc " << result.parent_rc << ", writer rc " << exit_code(result.child_status);
}

// Both engines are process 1 of their own PID namespaces with one /dev/shm: PID-based names
// collided ("/fabric-ipc-1-0": the second engine failed to start), and "same process" (equal
// PIDs) made the writer use the owner's pointers as its own.
TEST(CudaIpcContainers, TwoEnginesThatAreBothProcess1StartAndReachEachOther) {
  REQUIRE_GPU();
  std::signal(SIGPIPE, SIG_IGN);  // as above
  auto result = tools::run_process_pair(
      [](Channel& ch) { return as_pid1([&] { return owner_for_a_foreign_writer(ch); }); },
      [](Channel& ch) { return as_pid1([&] { return writer_from_another_container(ch); }); });
  if (result.parent_rc == kNoNamespace) GTEST_SKIP() << "unshare refused";
  if (result.parent_rc == kNoCudaAsPid1)
    GTEST_SKIP() << "CUDA does not start as process 1 of a new PID namespace on this machine";
  EXPECT_TRUE(result.ok()) << "owner rc " << result.parent_rc << ", writer rc " << exit_code(result.child_status);
}

// ---- peer removal -----------------------------------------------------------------------------

// A writer maps a 16 GiB region of its peer, then removes the peer (with writes in flight, every
// one of which must still end exactly once), writes to the same address again (re-inserted) and
// removes it again. The owner then frees the region: cudaMemGetInfo must show it back. Before
// remove_peer closed the IPC mapping, the writer kept the whole allocation alive.
TEST(CudaIpcPeers, RemovingAPeerClosesItsMappingsSoItsFreedGpuMemoryReturns) {
  REQUIRE_GPU();
  constexpr size_t kBig = 16ull << 30;
  constexpr uint64_t kBurst = 512;
  auto result = tools::run_process_pair(
      [](Channel& ch) {  // the writer
        TransferEngine engine(gpu_engine_config(sender_device()));
        NetAddr owner = NetAddr::from_bytes(ch.recv_bytes());
        MrDesc dst = MrDesc::from_bytes(ch.recv_bytes());
        DeviceBuffer src(1 << 20, sender_device());
        src.upload(pattern(1 << 20, 21));
        auto [h, desc] = engine.reg_mr(src.ptr, src.len, Device::cuda(sender_device()));
        auto write = [&](uint64_t dst_offset) {
          std::atomic<int> f{kDonePending};
          engine.submit(SingleWrite{.len = 1 << 20, .src = {h, 0}, .dst = {engine.add_remote(dst), dst_offset}},
                        OnDone::flag(&f));
          f.wait(kDonePending);
          return f.load() == kDoneSucceeded;
        };
        if (!write(0) || !write(kBig - (1 << 20))) return 40;
        std::atomic<uint64_t> ok{0}, failed{0};
        for (uint64_t i = 0; i < kBurst; i++)
          engine.submit(SingleWrite{.len = 1 << 20, .src = {h, 0}, .dst = {engine.add_remote(dst), (i % 1024) << 20}, .imm = 6},
                        OnDone::counter(&ok, &failed));
        engine.remove_peer(owner);
        auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
        while (ok.load() + failed.load() < kBurst && std::chrono::steady_clock::now() < deadline)
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
        if (ok.load() + failed.load() != kBurst) return 41;  // lost, or reported twice
        if (!write(2 << 20)) return 42;                      // the same address, inserted afresh
        engine.remove_peer(owner);
        ch.send(std::to_string(ok.load()) + " " + std::to_string(failed.load()));
        std::string back = ch.recv();
        std::printf("remove_peer: %llu writes in flight at removal: %llu ok, %llu failed; the "
                    "owner got %s GiB of its 16 GiB back after freeing it\n",
                    static_cast<unsigned long long>(kBurst), static_cast<unsigned long long>(ok.load()),
                    static_cast<unsigned long long>(failed.load()), back.c_str());
        return 0;
      },
      [](Channel& ch) {  // the owner
        TransferEngine engine(gpu_engine_config(0));
        ck(cudaSetDevice(0), "cudaSetDevice");
        void* big = nullptr;
        ck(cudaMalloc(&big, kBig), "cudaMalloc(16 GiB)");
        size_t with = 0, total = 0;
        ck(cudaMemGetInfo(&with, &total), "cudaMemGetInfo");
        auto [h, desc] = engine.reg_mr(big, kBig, Device::cuda(0));
        ch.send(engine.main_address().to_bytes());
        ch.send(desc.to_bytes());
        std::string counts = ch.recv();  // the writer has written, removed us, written, removed
        std::vector<uint8_t> got(1 << 20);
        ck(cudaMemcpy(got.data(), static_cast<uint8_t*>(big) + (2 << 20), got.size(), cudaMemcpyDefault), "download");
        bool landed = got == pattern(1 << 20, 21);
        engine.dereg_mr(h);
        ck(cudaFree(big), "cudaFree");
        size_t now = with;
        auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
        while (std::chrono::steady_clock::now() < deadline) {
          ck(cudaMemGetInfo(&now, &total), "cudaMemGetInfo");
          if (now >= with + kBig * 9 / 10) break;
          std::this_thread::sleep_for(std::chrono::milliseconds(20));
        }
        double back = now > with ? static_cast<double>(now - with) / (1ull << 30) : 0.0;
        char text[32];
        std::snprintf(text, sizeof text, "%.2f", back);
        ch.send(std::string(text));
        if (!landed) return 51;
        return now >= with + kBig * 9 / 10 ? 0 : 50;
      });
  EXPECT_TRUE(result.ok()) << "writer rc " << result.parent_rc << ", owner rc " << exit_code(result.child_status);
}

// A peer that dies (SIGKILL) while we map its memory: within a few hundred milliseconds the next
// WRITE to it fails saying so (the flock on its segment is free), and the engine releases the
// peer, which closes our mappings of its memory (they kept it allocated before).
TEST(CudaIpcPeers, APeerThatDiesIsDetectedAndReleased) {
  REQUIRE_GPU();
  auto result = tools::run_process_pair(
      [](Channel& ch) {  // the writer
        bound_channel_reads(ch);
        TransferEngine engine(gpu_engine_config(sender_device()));
        NetAddr owner = NetAddr::from_bytes(ch.recv_bytes());
        MrDesc dst = MrDesc::from_bytes(ch.recv_bytes());
        pid_t owner_pid = std::stoi(ch.recv());
        DeviceBuffer src(1 << 20, sender_device());
        auto [h, desc] = engine.reg_mr(src.ptr, src.len, Device::cuda(sender_device()));
        auto write = [&](std::string* why) {
          std::atomic<int> f{kDonePending};
          engine.submit(SingleWrite{.len = 1 << 20, .src = {h, 0}, .dst = {engine.add_remote(dst), 0}},
                        OnDone::callback([&](const Status& st) {
                                       if (why) *why = st.message();
                                       f.store(st.ok() ? kDoneSucceeded : kDoneFailed);
                                       f.notify_all();
                                     }));
          f.wait(kDonePending);
          return f.load() == kDoneSucceeded;
        };
        if (!write(nullptr)) return 70;
        if (engine.nic_stats().back().writes_posted != 1) return 71;  // through cuda_ipc
        kill(owner_pid, SIGKILL);
        auto t0 = std::chrono::steady_clock::now();
        std::string why;
        while (write(&why) && std::chrono::steady_clock::now() - t0 < std::chrono::seconds(10))
          std::this_thread::sleep_for(std::chrono::milliseconds(5));
        auto detected = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0);
        if (why.find("has ended") == std::string::npos) {
          std::fprintf(stderr, "writer: no failure naming the dead peer after %lld ms: '%s'\n",
                       static_cast<long long>(detected.count()), why.c_str());
          return 72;
        }
        while (engine.peer_count() != 0 && std::chrono::steady_clock::now() - t0 < std::chrono::seconds(10))
          std::this_thread::sleep_for(std::chrono::milliseconds(5));
        size_t left = engine.peer_count();
        std::printf("dead peer: the first WRITE failed %lld ms after the SIGKILL ('%s'); peers held "
                    "afterwards: %zu\n",
                    static_cast<long long>(detected.count()), why.c_str(), left);
        return left == 0 ? 0 : 73;
      },
      [](Channel& ch) -> int {  // the owner, killed by the writer
        TransferEngine engine(gpu_engine_config(0));
        DeviceBuffer dst(64 << 20, 0);
        auto [h, desc] = engine.reg_mr(dst.ptr, dst.len, Device::cuda(0));
        ch.send(engine.main_address().to_bytes());
        ch.send(desc.to_bytes());
        ch.send(std::to_string(getpid()));
        for (;;) pause();
      });
  EXPECT_EQ(result.parent_rc, 0);
}

// ---- deregistration against a streaming writer --------------------------------------------------

// A peer streams WRITEs (256 KiB ones through the gather kernel, 2 MiB ones through a copy
// engine, up to 2,048 in flight) into a 256 MiB region; the owner deregisters it mid-stream,
// zeroes it at once and looks again 0.5 s later: not one byte may have landed after dereg_mr
// returned. (Before, dereg_mr only bumped the generation: the writer's queued copies landed.)
TEST(CudaIpcDereg, NoWriteFromAPeerLandsAfterDeregReturns) {
  REQUIRE_GPU();
  constexpr size_t kRegion = 256 << 20;
  auto result = tools::run_process_pair(
      [](Channel& ch) {  // the owner
        TransferEngine engine(gpu_engine_config(0));
        DeviceBuffer dst(kRegion, 0);
        dst.fill(0);
        auto [h, desc] = engine.reg_mr(dst.ptr, kRegion, Device::cuda(0));
        ch.send(engine.main_address().to_bytes());
        ch.send(desc.to_bytes());
        auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
        while (engine.imm_count(3) < 2000 && std::chrono::steady_clock::now() < deadline)
          std::this_thread::sleep_for(std::chrono::microseconds(100));
        uint64_t before = engine.imm_count(3);
        auto t0 = std::chrono::steady_clock::now();
        engine.dereg_mr(h);
        auto took = std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - t0);
        dst.fill(0);
        ck(cudaDeviceSynchronize(), "sync");
        std::this_thread::sleep_for(std::chrono::milliseconds(500));
        auto got = dst.download(0, kRegion);
        size_t late = static_cast<size_t>(std::count_if(got.begin(), got.end(), [](uint8_t b) { return b != 0; }));
        ch.send(std::string("stop"));
        std::string writer = ch.recv();
        std::printf("dereg_mr mid-stream: %llu WRITEs had landed, dereg_mr took %lld us, %zu bytes "
                    "landed after it; %s\n",
                    static_cast<unsigned long long>(before), static_cast<long long>(took.count()), late,
                    writer.c_str());
        EXPECT_GE(before, 2000u) << "the writer was not streaming";
        EXPECT_EQ(late, 0u) << "bytes landed in a deregistered region";
        return ::testing::Test::HasFailure() ? 1 : 0;
      },
      [](Channel& ch) {  // the writer
        NetAddr owner = NetAddr::from_bytes(ch.recv_bytes());
        MrDesc dst = MrDesc::from_bytes(ch.recv_bytes());
        TransferEngine engine(gpu_engine_config(sender_device()));
        DeviceBuffer src(2 << 20, sender_device());
        src.fill(0xab);
        auto [h, desc] = engine.reg_mr(src.ptr, src.len, Device::cuda(sender_device()));
        std::atomic<bool> stop{false};
        std::thread listener([&] {
          ch.recv();
          stop = true;
        });
        std::atomic<uint64_t> ok{0}, failed{0};
        uint64_t submitted = 0, refused = 0;
        std::mt19937 rng(5);
        while (!stop.load()) {
          if (submitted - ok.load() - failed.load() >= 2048) {
            std::this_thread::yield();
            continue;
          }
          uint64_t len = submitted % 8 == 0 ? (2 << 20) : (256 << 10);
          uint64_t offset = rng() % (kRegion / len) * len;
          try {
            engine.submit(SingleWrite{.len = len, .src = {h, 0}, .dst = {engine.add_remote(dst), offset}, .imm = 3},
                          OnDone::counter(&ok, &failed));
            submitted++;
          } catch (const Error&) {
            refused++;
          }
        }
        auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
        while (ok.load() + failed.load() < submitted && std::chrono::steady_clock::now() < deadline)
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
        ch.send("writer: " + std::to_string(submitted) + " submitted, " + std::to_string(ok.load()) +
                " ok, " + std::to_string(failed.load()) + " failed, " + std::to_string(refused) +
                " refused at submit");
        listener.join();
        return ok.load() + failed.load() == submitted && failed.load() + refused > 0 ? 0 : 60;
      });
  EXPECT_TRUE(result.ok()) << "owner rc " << result.parent_rc << ", writer rc " << exit_code(result.child_status);
}

// ---- the stream wait's remote-write flush ---------------------------------------------------------

// gpu_stream_wait passes CU_STREAM_WAIT_VALUE_FLUSH exactly where the device reports
// CAN_FLUSH_REMOTE_WRITES (so NIC writes that reached the GPU before the counter are visible to
// the released work), and the wait with those flags holds the stream until the counter moves.
// gpu_stream_wait asks the stream to flush remote writes exactly where the device can, and the
// host-side flush runs only where the device neither orders GPUDirect RDMA writes nor flushes
// them from a stream. (An end-to-end variant, a kernel behind the wait summing data uploaded
// before the counter moved, crashed the lent H200 run in a way not diagnosed within the session;
// the data-before-counter path itself is covered by GpuTransfers.ImmCountReleasesWaitingKernels.)
TEST(GpuSignals, StreamWaitFlushesRemoteWritesWhereTheDeviceCan) {
  REQUIRE_GPU();
  cuda::RemoteWriteOrdering r = cuda::remote_write_ordering(0);
  unsigned flags = cuda::stream_wait_flags(0);
  std::printf("device 0: CAN_FLUSH_REMOTE_WRITES %d, GPU_DIRECT_RDMA_WRITES_ORDERING %d, "
              "GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS %#x; gpu_stream_wait flags %#x\n",
              r.stream_flush ? 1 : 0, r.ordering, static_cast<unsigned>(r.flush_options), flags);
  std::fflush(stdout);
  constexpr unsigned kFlush = 1u << 30;  // CU_STREAM_WAIT_VALUE_FLUSH
  EXPECT_EQ((flags & kFlush) != 0, r.stream_flush);
  EXPECT_EQ(flags & ~kFlush, 0u) << "GEQ (0) plus the flush";
  cudaStream_t s;
  ck(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");
  EXPECT_EQ(cuda::device_of_stream(s), 0);
  cudaStreamDestroy(s);
  constexpr int kOwner = 100;  // CU_GPU_DIRECT_RDMA_WRITES_ORDERING_OWNER
  constexpr unsigned kHost = 1;  // CU_FLUSH_GPU_DIRECT_RDMA_WRITES_OPTION_HOST
  bool needs_host_flush = r.ordering < kOwner && (r.flush_options & kHost);
  if (!needs_host_flush) {
    EXPECT_FALSE(cuda::flush_remote_writes(0)) << "nothing to flush here";
  }
}

}  // namespace
}  // namespace fabric::gpu_test
