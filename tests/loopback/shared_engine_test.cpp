// One engine pair, several users at once (issue 28): KV requests, a weight update and two MoE
// all-to-alls run concurrently over the same two engines. Each user counts its immediates in a
// range of its own (ImmReservation), so none completes on another's WRITEs: every byte and every
// count is checked against what that user alone would produce. A user asking for a range that
// another holds is refused, naming the holder.
#include <gtest/gtest.h>

#include <future>
#include <random>
#include <thread>

#include "fabric/kv/transfer.h"
#include "loopback/moe_steps.h"
#include "test_support.h"
#include "weights_cluster.h"

namespace fabric::testing {
namespace {

using namespace fabric::kv;

constexpr uint32_t kLayers = 3, kPages = 16;

KvLayout kv_layout() {
  return KvLayout{.num_layers = kLayers, .num_pages = kPages, .page_tokens = 8, .kv_heads = 2, .head_dim = 16,
                  .dtype_bytes = 2, .order = PageOrder::kTokenMajor, .page_stride = 0};
}

// K and V per layer, one buffer each.
struct KvMemory {
  std::vector<std::vector<uint8_t>> k, v;
  KvTensors tensors;
  explicit KvMemory(const KvLayout& l, uint32_t seed) {
    for (uint32_t i = 0; i < kLayers; i++) {
      k.push_back(random_bytes(l.tensor_bytes(), seed + 2 * i));
      v.push_back(random_bytes(l.tensor_bytes(), seed + 2 * i + 1));
      tensors.k.push_back(k.back().data());
      tensors.v.push_back(v.back().data());
    }
  }
};

// `requests` KV requests from a prefill rank on `a` to a decode rank on `b`, one after another
// (TP 1 -> 1: each decode page is a copy of its prefill page). "" or the first mismatch.
std::string kv_requests(KvSender& tx, KvReceiver& rx, const KvLayout& l, KvMemory& src, KvMemory& dst, int requests) {
  std::mt19937 rng(5);
  for (int q = 0; q < requests; q++) {
    std::vector<uint32_t> all(kPages);
    for (uint32_t i = 0; i < kPages; i++) all[i] = i;
    std::shuffle(all.begin(), all.end(), rng);
    const size_t n = 1 + rng() % 6;
    const std::vector<uint32_t> sp(all.begin(), all.begin() + n), dp(all.rbegin(), all.rbegin() + n);
    const uint64_t id = 100 + q;
    std::atomic<int> landed{kDonePending}, sent{kDonePending};
    auto admit = rx.admit({.request = id, .pages = dp, .prefill_size = 1, .timeout = std::chrono::seconds(60),
                           .on_done = OnDone::flag(&landed)});
    tx.begin({.admit = admit, .src_pages = sp, .on_sent = OnDone::flag(&sent)});
    for (uint32_t layer = 0; layer < kLayers; layer++) tx.layer_done(id, layer);
    if (!wait_until([&] { return landed.load() != kDonePending && sent.load() != kDonePending; }))
      return fmt::format("KV request {} never ended", id);
    if (landed.load() != kDoneSucceeded || sent.load() != kDoneSucceeded) return fmt::format("KV request {} failed", id);
    const uint64_t page = l.page_bytes();
    for (uint32_t layer = 0; layer < kLayers; layer++)
      for (size_t i = 0; i < n; i++)
        for (bool v : {false, true}) {
          const auto& from = v ? src.v[layer] : src.k[layer];
          const auto& to = v ? dst.v[layer] : dst.k[layer];
          if (std::memcmp(&from[sp[i] * page], &to[dp[i] * page], page) != 0)
            return fmt::format("KV request {}: layer {} {} page {} differs", id, layer, v ? "V" : "K", dp[i]);
        }
  }
  return "";
}

class SharedEngine : public ::testing::TestWithParam<ProviderCase> {};

TEST_P(SharedEngine, KvWeightsAndTwoAllToAllsRunAtOnceOnOneEnginePairEveryByteAndCountExact) {
  const ProviderCase pc = GetParam();
  TransferEngine a(config_for(pc)), b(config_for(pc));

  // KV: prefill on a, decode on b.
  const KvLayout l = kv_layout();
  KvMemory prefill(l, 1), decode(l, 1000);
  KvSender tx(a, l, prefill.tensors, KvRank{.group = 3, .tp = {1, 0}, .total_heads = 2});
  KvReceiver rx(b, l, decode.tensors, KvRank{.group = 7, .tp = {1, 0}, .total_heads = 2});
  tx.add_decoder(rx.descriptor());
  // Another KV receiver may not take that range.
  KvMemory other(l, 2000);
  expect_error(ErrorCode::kInvalidArgument, "held by 'kv receiver: group 7 rank 0'", [&] {
    KvReceiver(b, l, other.tensors, KvRank{.group = 8, .tp = {1, 0}, .total_heads = 2},
               KvReceiverOptions{.imm_base = rx.imm_range().base});
  });

  // Weights: a random model (remote gathers, more units than slots), its ranks alternating over
  // a and b, several of them on one engine (each with a range of its own).
  weights::Cluster w(weights::testing::random_model(10), pc, /*window=*/2, /*sets=*/2, /*owner_rows=*/128,
                     std::chrono::seconds(60), {&a, &b});

  // Two all-to-alls: 2 ranks as 2 nodes, rank 0 on a, rank 1 on b, each instance's steps in
  // lockstep with the other's, so their (kind, step, rank) values coincide; the second keeps two
  // dispatches in flight (its two buffer sets' ranges on each engine as well).
  const MoeCase mc{pc, 2, 1, 8, 4, 1024, 16, 4, moe::Dtype::kFp8};
  auto moe_a = std::async(std::launch::async, [&] { return run_steps(mc, 40, "shared-a", {.shared = {&a, &b}, .seed = 1}); });
  auto moe_b = std::async(std::launch::async, [&] { return run_steps(mc, 40, "shared-b", {.shared = {&a, &b}, .seed = 2, .overlap = true}); });
  auto kv = std::async(std::launch::async, [&] { return kv_requests(tx, rx, l, prefill, decode, 8); });
  for (uint64_t step = 0; step < 6; step++) {
    w.new_weights(static_cast<uint32_t>(step + 1));
    for (const std::string& e : w.step(step)) ASSERT_EQ(e, "") << "weight step " << step;
    weights::testing::expect_exact(w.model, w.set_bytes(step % 2));
  }
  EXPECT_EQ(kv.get(), "");
  for (const auto& f : {moe_a.get(), moe_b.get()})
    for (uint32_t r = 0; r < mc.ranks; r++) EXPECT_EQ(f[r], "") << "rank " << r;
  for (TransferEngine* e : {&a, &b})
    for (const NicStats& s : e->nic_stats()) EXPECT_EQ(s.imms_dropped, 0u) << s.nic;
  if (pc.host_ipc)  // every WRITE of the four users went through the local domain, none on the NIC
    for (TransferEngine* e : {&a, &b}) {
      const std::vector<NicStats> s = e->nic_stats();
      EXPECT_EQ(s.back().nic, "host_ipc");
      EXPECT_GT(s.back().writes_posted, 0u);
      EXPECT_EQ(s.front().writes_posted, 0u);
    }
}

INSTANTIATE_TEST_SUITE_P(Loopback, SharedEngine,
                         ::testing::Values(ProviderCase{"tcp;ofi_rxm", 1, false}, ProviderCase{"shm", 1, false},
                                           ProviderCase{"tcp;ofi_rxm", 1, false, true}),
                         case_name);

}  // namespace
}  // namespace fabric::testing
