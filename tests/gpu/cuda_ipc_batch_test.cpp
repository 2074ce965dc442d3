// post_write_batch on the cuda_ipc Domain, driven directly (no engine): batches of every size up
// to and over the per-launch limit, odd lengths and alignments, 10,000 pages split as the engine
// splits them, immediates (exactly one per WRITE that carries one) and completions (exactly one
// per batch), and the error paths (removed peer before and after the post, an invalid WRITE
// before and after the first launch, a deregistered destination, a closed peer), and a
// deregistration that must wait for a batch in flight. In-process tests put two domains on GPU 0;
// the last test puts them in two processes (each on its own GPU where there are two).
// Built with CUDA only; runs on the GPU machine (tests/gpu/run.sh) and, against the host-only
// stand-in, here (tests/gpu/run_fake.sh).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <map>
#include <numeric>
#include <random>
#include <thread>

#include "domain/domain.h"
#include "gpu_support.h"
#include "process_pair.h"
#include "providers/cuda_ipc/cuda_ipc_domain.h"

namespace fabric::gpu_test {
namespace {

using tools::Channel;
using namespace std::chrono_literals;

#define REQUIRE_GPU() \
  if (gpu_count() == 0) GTEST_SKIP() << "no CUDA device visible"

EngineConfig domain_config(int device) {
  EngineConfig c;
  c.cuda_device = device;
  c.cuda_ipc = true;
  c.transfer_timeout = std::chrono::seconds(30);
  return c;
}

std::vector<uint32_t> shuffled(uint32_t n, uint32_t seed) {
  std::vector<uint32_t> v(n);
  std::iota(v.begin(), v.end(), 0);
  std::shuffle(v.begin(), v.end(), std::mt19937(seed));
  return v;
}

// What came back from polling a writer and its owner.
struct Seen {
  std::map<OpContext*, std::vector<Completion>> by_ctx;  // the writer's completions
  std::map<uint32_t, uint64_t> imms;                     // immediates at the owner
  uint64_t completions = 0;
  uint64_t imm_total = 0;
};

void poll_once(Domain& writer, Domain* owner, Seen& seen) {
  std::vector<Completion> out(256);
  size_t n = writer.poll(out);
  for (size_t i = 0; i < n; i++) {
    seen.by_ctx[out[i].context].push_back(std::move(out[i]));
    seen.completions++;
  }
  if (!owner) return;
  n = owner->poll(out);
  for (size_t i = 0; i < n; i++)
    if (out[i].kind == Completion::Kind::kRemoteImm) {
      seen.imms[out[i].imm]++;
      seen.imm_total++;
    }
}

// Polls until `done` holds (false after the timeout), then 20 ms more, so that a surplus
// completion or immediate would show.
bool poll_until(Domain& writer, Domain* owner, Seen& seen, const std::function<bool()>& done,
                std::chrono::seconds timeout = 60s) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!done()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    poll_once(writer, owner, seen);
  }
  auto settle = std::chrono::steady_clock::now() + 20ms;
  while (std::chrono::steady_clock::now() < settle) poll_once(writer, owner, seen);
  return true;
}

// Two domains on GPU 0 in this process: `writer` reaches `owner` as its peer; a source buffer
// registered with the writer, a destination registered with the owner.
struct Rig {
  std::unique_ptr<Domain> writer = open_cuda_ipc_domain(domain_config(0));
  std::unique_ptr<Domain> owner = open_cuda_ipc_domain(domain_config(0));
  PeerId peer = writer->insert_peer(owner->address());
  DeviceBuffer src, dst;
  std::vector<uint8_t> src_host;
  DomainRegion src_region, dst_region;
  Rig(size_t src_len, size_t dst_len) : src(src_len, 0), dst(dst_len, 0) {
    src_host = pattern(src_len, 17);
    src.upload(src_host);
    dst.fill(0xEE);
    src_region = writer->register_memory(src.ptr, src_len, Device::cuda(0));
    dst_region = owner->register_memory(dst.ptr, dst_len, Device::cuda(0));
  }
  ~Rig() {
    if (dst_region.provider) owner->deregister_memory(dst_region);
    if (src_region.provider) writer->deregister_memory(src_region);
  }
  WriteOp op(uint64_t src_off, uint64_t dst_off, uint64_t len, std::optional<uint32_t> imm) const {
    WriteOp w;
    w.src = src.ptr + src_off;
    w.len = len;
    w.desc = src_region.desc;
    w.peer = peer;
    w.remote_addr = dst_region.remote.base + dst_off;
    w.rkey = dst_region.remote.rkey;
    w.has_imm = imm.has_value();
    w.imm = imm.value_or(0);
    return w;
  }
};

// Exactly one completion for ctx, of this kind.
void expect_one(const Seen& seen, OpContext* ctx, Completion::Kind kind, const char* what) {
  auto it = seen.by_ctx.find(ctx);
  ASSERT_NE(it, seen.by_ctx.end()) << what << ": no completion";
  ASSERT_EQ(it->second.size(), 1u) << what << ": " << it->second.size() << " completions";
  EXPECT_EQ(it->second[0].kind, kind) << what << ": " << it->second[0].error;
}

// Every byte of dst: the pages written hold their source pages, the rest is still 0xEE.
void expect_pages(const Rig& rig, const std::vector<WriteOp>& ops) {
  std::vector<uint8_t> want(rig.dst.len, 0xEE);
  for (const WriteOp& w : ops) {
    uint64_t s = static_cast<const uint8_t*>(w.src) - rig.src.ptr;
    std::memcpy(want.data() + w.remote_addr - rig.dst_region.remote.base, rig.src_host.data() + s, w.len);
  }
  std::vector<uint8_t> got = rig.dst.download(0, rig.dst.len);
  size_t bad = 0, first = SIZE_MAX;
  for (size_t i = 0; i < got.size(); i++)
    if (got[i] != want[i]) {
      if (first == SIZE_MAX) first = i;
      bad++;
    }
  EXPECT_EQ(bad, 0u) << "first wrong byte at offset " << first;
}

TEST(CudaIpcBatch, BatchesOfEverySizeLandWithOneCompletionAndOneImmediatePerWrite) {
  REQUIRE_GPU();
  constexpr uint64_t kPage = 64 << 10;
  constexpr uint32_t kSlots = 4096;
  Rig rig(kPage * kSlots, kPage * kSlots);
  ASSERT_EQ(rig.writer->caps().max_write_batch, 4096u);
  // 1 and 7 pages; 2,048 (one full launch), 2,049 and 4,096 (over the per-launch limit: two).
  const std::vector<uint32_t> sizes = {1, 7, 2048, 2049, 4096};
  std::vector<OpContext> ctx(sizes.size());
  std::vector<WriteOp> all;
  Seen seen;
  for (size_t b = 0; b < sizes.size(); b++) {
    auto s = shuffled(kSlots, static_cast<uint32_t>(2 * b + 1)), d = shuffled(kSlots, static_cast<uint32_t>(2 * b + 2));
    std::vector<WriteOp> ops;
    for (uint32_t i = 0; i < sizes[b]; i++) ops.push_back(rig.op(s[i] * kPage, d[i] * kPage, kPage, 100 + b));
    ASSERT_EQ(rig.writer->post_write_batch(ops, &ctx[b]), PostResult::kPosted) << rig.writer->last_error();
    ASSERT_TRUE(poll_until(*rig.writer, rig.owner.get(), seen, [&] { return seen.by_ctx.count(&ctx[b]) > 0; }));
    expect_one(seen, &ctx[b], Completion::Kind::kLocal, "batch");
    EXPECT_EQ(seen.imms[100 + b], sizes[b]) << "one immediate per WRITE, batch of " << sizes[b];
    if (b + 1 == sizes.size()) all = ops;  // the last batch wrote 4,096 distinct pages: check it all
  }
  EXPECT_EQ(seen.completions, sizes.size());
  EXPECT_EQ(seen.imm_total, std::accumulate(sizes.begin(), sizes.end(), uint64_t{0}));
  expect_pages(rig, all);
}

TEST(CudaIpcBatch, OddLengthsAndAlignmentsLandExactlyWithNothingAroundThem) {
  REQUIRE_GPU();
  constexpr uint64_t kStride = 2 << 20;  // each WRITE's own 2 MiB of source and destination
  const std::vector<uint64_t> lens = {1,     2,     3,     7,         15,        16,
                                      17,    31,    4095,  4096,      4097,      65535,
                                      65536, 65540, 65549, (1 << 20) - 1, 1 << 20, (1 << 20) + 3};
  Rig rig(kStride * lens.size(), kStride * lens.size());
  std::vector<WriteOp> ops;
  for (size_t i = 0; i < lens.size(); i++) {
    // Source and destination offsets take every residue modulo 16, alike and not alike.
    uint64_t so = i % 16, doff = (i * 7 + (i % 3 == 0 ? 0 : 5)) % 16;
    ops.push_back(rig.op(i * kStride + so, i * kStride + 64 + doff, lens[i],
                         i % 2 ? std::optional<uint32_t>(9) : std::nullopt));
  }
  OpContext ctx;
  Seen seen;
  ASSERT_EQ(rig.writer->post_write_batch(ops, &ctx), PostResult::kPosted) << rig.writer->last_error();
  ASSERT_TRUE(poll_until(*rig.writer, rig.owner.get(), seen, [&] { return seen.completions > 0; }));
  expect_one(seen, &ctx, Completion::Kind::kLocal, "odd batch");
  EXPECT_EQ(seen.imms[9], lens.size() / 2);
  EXPECT_EQ(seen.imm_total, lens.size() / 2);
  expect_pages(rig, ops);
}

TEST(CudaIpcBatch, ImmediateOnlyWritesAndWritesWithoutImmediatesCountRight) {
  REQUIRE_GPU();
  Rig rig(1 << 20, 1 << 20);
  std::vector<WriteOp> ops;
  for (uint32_t i = 0; i < 300; i++) {
    if (i % 3 == 0) ops.push_back(rig.op(0, 0, 0, 5));                                // immediate only
    if (i % 3 == 1) ops.push_back(rig.op(i * 1024, i * 1024, 1024, std::nullopt));      // bytes only
    if (i % 3 == 2) ops.push_back(rig.op(i * 1024, i * 1024, 1024, 6));                 // both
  }
  OpContext ctx;
  Seen seen;
  ASSERT_EQ(rig.writer->post_write_batch(ops, &ctx), PostResult::kPosted) << rig.writer->last_error();
  ASSERT_TRUE(poll_until(*rig.writer, rig.owner.get(), seen, [&] { return seen.completions > 0; }));
  expect_one(seen, &ctx, Completion::Kind::kLocal, "mixed batch");
  EXPECT_EQ(seen.imms[5], 100u);
  EXPECT_EQ(seen.imms[6], 100u);
  EXPECT_EQ(seen.imm_total, 200u);
  std::vector<WriteOp> with_bytes;
  for (auto& w : ops)
    if (w.len) with_bytes.push_back(w);
  expect_pages(rig, with_bytes);
}

// 10,000 pages, split the way the engine's worker splits a paged transfer: batches of
// caps().max_write_batch pages, all posted before any is polled; one completion per batch.
TEST(CudaIpcBatch, TenThousandPagesInBatchesOfMaxWriteBatch) {
  REQUIRE_GPU();
  constexpr uint64_t kPage = 16 << 10;
  constexpr uint32_t kPages = 10000, kSlots = 12000;
  Rig rig(kPage * kSlots, kPage * kSlots);
  auto s = shuffled(kSlots, 31), d = shuffled(kSlots, 32);
  std::vector<WriteOp> all;
  for (uint32_t i = 0; i < kPages; i++) all.push_back(rig.op(s[i] * kPage, d[i] * kPage, kPage, 77));
  const size_t batch = rig.writer->caps().max_write_batch;
  const size_t posts = (kPages + batch - 1) / batch;
  std::vector<OpContext> ctx(posts);
  Seen seen;
  for (size_t k = 0; k < posts; k++) {
    std::span<const WriteOp> part(all.data() + k * batch, std::min(batch, kPages - k * batch));
    PostResult r;
    while ((r = rig.writer->post_write_batch(part, &ctx[k])) == PostResult::kRetry) poll_once(*rig.writer, rig.owner.get(), seen);
    ASSERT_EQ(r, PostResult::kPosted) << rig.writer->last_error();
  }
  ASSERT_TRUE(poll_until(*rig.writer, rig.owner.get(), seen,
                         [&] { return seen.completions >= posts && seen.imm_total >= kPages; }));
  for (auto& c : ctx) expect_one(seen, &c, Completion::Kind::kLocal, "batch of the 10,000");
  EXPECT_EQ(seen.completions, posts);
  EXPECT_EQ(seen.imm_total, kPages);
  expect_pages(rig, all);
}

TEST(CudaIpcBatch, RefusedBatchesPostNothing) {
  REQUIRE_GPU();
  constexpr uint64_t kPage = 4096;
  Rig rig(kPage * 8192, kPage * 8192);
  OpContext ctx;
  Seen seen;
  // Over caps().max_write_batch.
  std::vector<WriteOp> too_many(rig.writer->caps().max_write_batch + 1, rig.op(0, 0, kPage, 1));
  EXPECT_EQ(rig.writer->post_write_batch(too_many, &ctx), PostResult::kFailed);
  // An out-of-bounds WRITE before any launch: nothing of the batch lands, no completion.
  std::vector<WriteOp> ops;
  for (uint32_t i = 0; i < 100; i++) ops.push_back(rig.op(i * kPage, i * kPage, kPage, 2));
  ops[50].remote_addr = rig.dst_region.remote.base + rig.dst.len - 10;
  EXPECT_EQ(rig.writer->post_write_batch(ops, &ctx), PostResult::kFailed);
  EXPECT_NE(rig.writer->last_error().find("outside"), std::string::npos) << rig.writer->last_error();
  // A second peer inside the batch.
  auto other = open_cuda_ipc_domain(domain_config(0));
  PeerId other_peer = rig.writer->insert_peer(other->address());
  ops = {rig.op(0, 0, kPage, 3), rig.op(kPage, kPage, kPage, 3)};
  ops[1].peer = other_peer;
  EXPECT_EQ(rig.writer->post_write_batch(ops, &ctx), PostResult::kFailed);
  // An invalid key.
  ops = {rig.op(0, 0, kPage, 4)};
  ops[0].rkey ^= 2;  // an even generation
  EXPECT_EQ(rig.writer->post_write_batch(ops, &ctx), PostResult::kFailed);
  ASSERT_TRUE(poll_until(*rig.writer, rig.owner.get(), seen, [] { return true; }));
  EXPECT_EQ(seen.completions, 0u);
  EXPECT_EQ(seen.imm_total, 0u);
  expect_pages(rig, {});  // nothing landed
  // The destination deregistered: its key is refused.
  std::vector<WriteOp> stale = {rig.op(0, 0, kPage, 5)};
  rig.owner->deregister_memory(rig.dst_region);
  EXPECT_EQ(rig.writer->post_write_batch(stale, &ctx), PostResult::kFailed);
  EXPECT_NE(rig.writer->last_error().find("deregistered"), std::string::npos) << rig.writer->last_error();
  // The batch still works for a fresh registration.
  rig.dst_region = rig.owner->register_memory(rig.dst.ptr, rig.dst.len, Device::cuda(0));
  std::vector<WriteOp> fresh = {rig.op(0, 0, kPage, 6)};
  ASSERT_EQ(rig.writer->post_write_batch(fresh, &ctx), PostResult::kPosted) << rig.writer->last_error();
  ASSERT_TRUE(poll_until(*rig.writer, rig.owner.get(), seen, [&] { return seen.completions > 0; }));
  expect_one(seen, &ctx, Completion::Kind::kLocal, "after re-registration");
  EXPECT_EQ(seen.imms[6], 1u);
}

// Errors found once part of the batch runs on the GPU end the batch with exactly one error
// completion, and none of its immediates is delivered.
TEST(CudaIpcBatch, ABadWriteLateInABatchRefusesItWholeWithNothingPosted) {
  // Every WRITE is checked before the batch's launch starts (it starts with the first page), so a
  // bad one at page 3000 of 4096 refuses the batch as one at page 0 would: nothing lands.
  REQUIRE_GPU();
  constexpr uint64_t kPage = 4096;
  Rig rig(kPage * 4096, kPage * 4096);
  std::vector<WriteOp> ops;
  for (uint32_t i = 0; i < 4096; i++) ops.push_back(rig.op(i * kPage, i * kPage, kPage, 8));
  ops[3000].remote_addr = rig.dst_region.remote.base + rig.dst.len;  // past the end
  ops[3000].len = 1;
  OpContext ctx;
  Seen seen;
  EXPECT_EQ(rig.writer->post_write_batch(ops, &ctx), PostResult::kFailed);
  EXPECT_NE(rig.writer->last_error().find("outside"), std::string::npos) << rig.writer->last_error();
  ASSERT_TRUE(poll_until(*rig.writer, rig.owner.get(), seen, [] { return true; }));
  EXPECT_EQ(seen.completions, 0u);
  EXPECT_EQ(seen.imm_total, 0u);
  expect_pages(rig, {});  // nothing landed
}

TEST(CudaIpcBatch, ABatchToARemovedPeerEndsWithOneError) {
  REQUIRE_GPU();
  constexpr uint64_t kPage = 64 << 10;
  Rig rig(kPage * 4096, kPage * 4096);
  std::vector<WriteOp> ops;
  for (uint32_t i = 0; i < 4096; i++) ops.push_back(rig.op(i * kPage, i * kPage, kPage, 11));
  OpContext ctx;
  Seen seen;
  // Posted, then the peer removed before the batch completed: one error, no immediate.
  ASSERT_EQ(rig.writer->post_write_batch(ops, &ctx), PostResult::kPosted) << rig.writer->last_error();
  rig.writer->remove_peer(rig.peer);
  ASSERT_TRUE(poll_until(*rig.writer, rig.owner.get(), seen, [&] { return seen.completions > 0; }));
  expect_one(seen, &ctx, Completion::Kind::kError, "batch whose peer was removed");
  EXPECT_EQ(seen.imm_total, 0u);
  // Posted after the removal: refused.
  OpContext later;
  EXPECT_EQ(rig.writer->post_write_batch(ops, &later), PostResult::kFailed);
  EXPECT_NE(rig.writer->last_error().find("removed"), std::string::npos) << rig.writer->last_error();
  // The same address inserted again is a working peer.
  rig.peer = rig.writer->insert_peer(rig.owner->address());
  for (auto& w : ops) w.peer = rig.peer;
  OpContext again;
  ASSERT_EQ(rig.writer->post_write_batch(ops, &again), PostResult::kPosted) << rig.writer->last_error();
  ASSERT_TRUE(poll_until(*rig.writer, rig.owner.get(), seen, [&] { return seen.by_ctx.count(&again) > 0; }));
  expect_one(seen, &again, Completion::Kind::kLocal, "batch to the re-inserted peer");
  EXPECT_EQ(seen.imms[11], 4096u);
  expect_pages(rig, ops);
}

TEST(CudaIpcBatch, ABatchToAClosedPeerEndsWithOnePeerLostError) {
  REQUIRE_GPU();
  Rig rig(1 << 20, 1 << 20);
  std::vector<WriteOp> ops = {rig.op(0, 0, 4096, 1), rig.op(4096, 4096, 4096, 1)};
  rig.owner->deregister_memory(rig.dst_region);
  rig.owner.reset();  // its endpoint closes
  OpContext ctx;
  Seen seen;
  ASSERT_EQ(rig.writer->post_write_batch(ops, &ctx), PostResult::kPosted) << rig.writer->last_error();
  ASSERT_TRUE(poll_until(*rig.writer, nullptr, seen, [&] { return seen.completions > 0; }));
  expect_one(seen, &ctx, Completion::Kind::kError, "batch to a closed peer");
  EXPECT_TRUE(seen.by_ctx[&ctx][0].peer_lost);
}

// The owner deregisters its region while a batch into it runs: deregistration returns only once
// the batch's copies are done (its hold is released at its completion), so every byte is there
// when it returns.
TEST(CudaIpcBatch, DeregistrationWaitsForABatchInFlight) {
  REQUIRE_GPU();
  constexpr uint64_t kPage = 64 << 10;
  Rig rig(kPage * 4096, kPage * 4096);
  std::vector<WriteOp> ops;
  for (uint32_t i = 0; i < 4096; i++) ops.push_back(rig.op(i * kPage, (4095 - i) * kPage, kPage, std::nullopt));
  OpContext ctx;
  ASSERT_EQ(rig.writer->post_write_batch(ops, &ctx), PostResult::kPosted) << rig.writer->last_error();
  std::atomic<bool> done{false};
  Seen seen;
  std::thread poller([&] {  // the writer's worker
    poll_until(*rig.writer, nullptr, seen, [&] { return seen.completions > 0; });
    done = true;
  });
  auto t0 = std::chrono::steady_clock::now();
  rig.owner->deregister_memory(rig.dst_region);
  auto waited = std::chrono::steady_clock::now() - t0;
  std::vector<uint8_t> got = rig.dst.download(0, rig.dst.len);  // right after dereg_mr returned
  poller.join();
  ASSERT_TRUE(done.load());
  expect_one(seen, &ctx, Completion::Kind::kLocal, "batch during deregistration");
  EXPECT_LT(waited, 20s) << "deregistration ran into its timeout";
  size_t bad = 0;
  for (uint32_t i = 0; i < 4096; i++)
    bad += std::memcmp(got.data() + (4095 - i) * kPage, rig.src_host.data() + i * kPage, kPage) != 0;
  EXPECT_EQ(bad, 0u) << "pages not there when deregistration returned";
}

// Across processes (the IPC mapping path), each on its own GPU where there are two: 10,000
// pages of 64 KiB in batches of caps().max_write_batch, immediates counted by the owner.
TEST(CudaIpcBatch, AcrossProcessesTenThousandPagesLandWithTheirImmediates) {
  REQUIRE_GPU();
  constexpr uint64_t kPage = 64 << 10;
  constexpr uint32_t kPages = 10000, kSlots = 12000;
  const int writer_dev = 1 % gpu_count();
  auto result = tools::run_process_pair(
      [&](Channel& ch) {  // the writer
        auto writer = open_cuda_ipc_domain(domain_config(writer_dev));
        std::string address = ch.recv();
        uint64_t rkey = std::stoull(ch.recv());
        PeerId peer = writer->insert_peer(address);
        DeviceBuffer src(kPage * kSlots, writer_dev);
        src.upload(pattern(kPage * kSlots, 41));
        DomainRegion region = writer->register_memory(src.ptr, src.len, Device::cuda(writer_dev));
        auto s = shuffled(kSlots, 42), d = shuffled(kSlots, 43);
        std::vector<WriteOp> all(kPages);
        for (uint32_t i = 0; i < kPages; i++) {
          all[i].src = src.ptr + s[i] * kPage;
          all[i].len = kPage;
          all[i].desc = region.desc;
          all[i].peer = peer;
          all[i].remote_addr = d[i] * kPage;
          all[i].rkey = rkey;
          all[i].has_imm = true;
          all[i].imm = 21;
        }
        const size_t batch = writer->caps().max_write_batch;
        std::vector<OpContext> ctx((kPages + batch - 1) / batch);
        Seen seen;
        auto t0 = std::chrono::steady_clock::now();
        for (size_t k = 0; k < ctx.size(); k++) {
          std::span<const WriteOp> part(all.data() + k * batch, std::min<size_t>(batch, kPages - k * batch));
          PostResult r;
          while ((r = writer->post_write_batch(part, &ctx[k])) == PostResult::kRetry) poll_once(*writer, nullptr, seen);
          if (r != PostResult::kPosted) {
            std::fprintf(stderr, "writer: %s\n", writer->last_error().c_str());
            return 60;
          }
        }
        if (!poll_until(*writer, nullptr, seen, [&] { return seen.completions >= ctx.size(); })) return 61;
        double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() - 0.02;
        for (auto& c : ctx) {
          auto it = seen.by_ctx.find(&c);
          if (it == seen.by_ctx.end() || it->second.size() != 1) return 62;
          if (it->second[0].kind != Completion::Kind::kLocal) {
            std::fprintf(stderr, "writer: %s\n", it->second[0].error.c_str());
            return 63;
          }
        }
        if (seen.completions != ctx.size()) return 64;
        std::printf("batch across processes: %u pages of 64 KiB in %zu batches, %.1f GB/s (one "
                    "run, not a benchmark)\n",
                    kPages, ctx.size(), kPages * double(kPage) / secs / 1e9);
        ch.send(std::string("posted"));
        std::string verdict = ch.recv();
        writer->deregister_memory(region);
        return verdict == "ok" ? 0 : 65;
      },
      [&](Channel& ch) -> int {  // the owner
        auto owner = open_cuda_ipc_domain(domain_config(0));
        DeviceBuffer dst(kPage * kSlots, 0);
        dst.fill(0xEE);
        DomainRegion region = owner->register_memory(dst.ptr, dst.len, Device::cuda(0));
        ch.send(owner->address());
        ch.send(std::to_string(region.remote.rkey));
        // Count immediates while the writer writes (its message comes once its batches completed,
        // and it completes a batch only after pushing the batch's immediates).
        uint64_t imms = 0, wrong = 0;
        std::atomic<bool> posted{false};
        std::thread t([&] {
          ch.recv();
          posted = true;
        });
        std::vector<Completion> out(512);
        auto deadline = std::chrono::steady_clock::now() + 120s;
        while ((!posted.load() || imms < kPages) && std::chrono::steady_clock::now() < deadline) {
          size_t n = owner->poll(out);
          for (size_t i = 0; i < n; i++)
            if (out[i].kind == Completion::Kind::kRemoteImm) (out[i].imm == 21 ? imms : wrong)++;
        }
        t.join();
        auto settle = std::chrono::steady_clock::now() + 20ms;
        while (std::chrono::steady_clock::now() < settle) {
          size_t n = owner->poll(out);
          for (size_t i = 0; i < n; i++)
            if (out[i].kind == Completion::Kind::kRemoteImm) (out[i].imm == 21 ? imms : wrong)++;
        }
        auto src = pattern(kPage * kSlots, 41);
        auto s = shuffled(kSlots, 42), d = shuffled(kSlots, 43);
        std::vector<uint8_t> got = dst.download(0, dst.len);
        std::vector<bool> written(kSlots, false);
        size_t bad = 0;
        for (uint32_t i = 0; i < kPages; i++) {
          written[d[i]] = true;
          bad += std::memcmp(got.data() + d[i] * kPage, src.data() + s[i] * kPage, kPage) != 0;
        }
        for (uint32_t p = 0; p < kSlots; p++)
          if (!written[p])
            bad += std::any_of(got.begin() + p * kPage, got.begin() + (p + 1) * kPage, [](uint8_t b) { return b != 0xEE; });
        std::printf("owner: %llu immediates (%llu wrong), %zu bad pages\n", static_cast<unsigned long long>(imms),
                    static_cast<unsigned long long>(wrong), bad);
        bool ok = imms == kPages && wrong == 0 && bad == 0;
        ch.send(std::string(ok ? "ok" : "bad"));
        owner->deregister_memory(region);
        return ok ? 0 : 70;
      });
  EXPECT_TRUE(result.ok()) << "writer rc " << result.parent_rc << ", owner status " << result.child_status;
}

}  // namespace
}  // namespace fabric::gpu_test
