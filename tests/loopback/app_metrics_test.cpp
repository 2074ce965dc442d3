// The applications' own metrics (issue 46 item 2) in their engine's metrics_text(): KV requests,
// weight updates and MoE dispatches over loopback engines, each counter read back exactly as many
// as the test moved (requests, layers, bytes, steps, failures), and every family gone once its
// endpoint is destroyed.
#include <gtest/gtest.h>

#include <cstdlib>
#include <sstream>
#include <thread>

#include "fabric/kv/transfer.h"
#include "loopback/moe_steps.h"
#include "test_support.h"
#include "weights_cluster.h"

namespace fabric::testing {
namespace {

// The value of one series (its name and labels exactly as the writer prints them:
// name{a="x",b="y"}), or NaN when the text has no such line.
double value_of(const std::string& text, const std::string& series) {
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);)
    if (line.size() > series.size() && line.compare(0, series.size(), series) == 0 &&
        line[series.size()] == ' ')
      return std::strtod(line.c_str() + series.size() + 1, nullptr);
  return std::nan("");
}

constexpr uint32_t kLayers = 3, kPages = 16;

kv::KvLayout kv_layout() {
  return kv::KvLayout{.num_layers = kLayers,
                      .num_pages = kPages,
                      .page_tokens = 8,
                      .kv_heads = 2,
                      .head_dim = 16,
                      .dtype_bytes = 2,
                      .order = kv::PageOrder::kTokenMajor,
                      .page_stride = 0};
}

TEST(AppMetrics, KvRequestsLayersBytesAndFailuresCountedOnBothSides) {
  const ProviderCase pc{"tcp;ofi_rxm", 1, false};
  TransferEngine a(config_for(pc)), b(config_for(pc));
  const kv::KvLayout l = kv_layout();
  std::vector<std::vector<uint8_t>> mem;
  auto tensors = [&] {
    kv::KvTensors t;
    for (uint32_t i = 0; i < kLayers; i++) {
      t.k.push_back(mem.emplace_back(l.tensor_bytes()).data());
      t.v.push_back(mem.emplace_back(l.tensor_bytes()).data());
    }
    return t;
  };
  mem.reserve(4 * kLayers);
  const std::string pre = R"({side="prefill",group="3",tp_rank="0"})",
                    dec = R"({side="decode",group="7",tp_rank="0"})";
  {
    kv::KvSender tx(a, l, tensors(), kv::KvRank{.group = 3, .tp = {1, 0}, .total_heads = 2});
    kv::KvReceiver rx(b, l, tensors(), kv::KvRank{.group = 7, .tp = {1, 0}, .total_heads = 2});
    tx.add_decoder(rx.descriptor());
    // Three requests of 1, 2 and 3 pages land; a fourth is admitted and begun, then failed by its
    // decode side and cancelled on the prefill side before any layer goes.
    uint64_t pages = 0;
    for (uint32_t q = 1; q <= 3; q++) {
      std::vector<uint32_t> p;
      for (uint32_t i = 0; i < q; i++) p.push_back(i);
      pages += q;
      std::atomic<int> landed{kDonePending}, sent{kDonePending};
      auto admit =
          rx.admit({.request = q, .pages = p, .prefill_size = 1, .on_done = OnDone::flag(&landed)});
      tx.begin({.admit = admit, .src_pages = p, .on_sent = OnDone::flag(&sent)});
      for (uint32_t layer = 0; layer < kLayers; layer++) tx.layer_done(q, layer);
      ASSERT_TRUE(
          wait_until([&] { return landed.load() != kDonePending && sent.load() != kDonePending; }));
      ASSERT_EQ(landed.load(), kDoneSucceeded);
      ASSERT_EQ(sent.load(), kDoneSucceeded);
    }
    std::atomic<int> landed{kDonePending}, sent{kDonePending};
    auto admit =
        rx.admit({.request = 9, .pages = {5}, .prefill_size = 1, .on_done = OnDone::flag(&landed)});
    tx.begin({.admit = admit, .src_pages = {5}, .on_sent = OnDone::flag(&sent)});
    ASSERT_TRUE(rx.fail(9, "the test fails it"));
    ASSERT_TRUE(tx.cancel(9));
    ASSERT_EQ(landed.load(), kDoneFailed);
    ASSERT_EQ(sent.load(), kDoneFailed);

    const double bytes =
        2.0 * l.page_bytes() * pages * kLayers;  // K and V of every page of every layer
    const std::string ta = a.metrics_text(), tb = b.metrics_text();
    EXPECT_EQ(value_of(ta, "fabric_kv_requests_begun_total" + pre), 4) << ta;
    EXPECT_EQ(value_of(ta, "fabric_kv_requests_completed_total" + pre), 3);
    EXPECT_EQ(value_of(ta, "fabric_kv_requests_failed_total" + pre), 1);
    EXPECT_EQ(value_of(ta, "fabric_kv_layers_total" + pre), 3 * kLayers);
    EXPECT_EQ(value_of(ta, "fabric_kv_bytes_total" + pre), bytes);
    EXPECT_EQ(value_of(ta, "fabric_kv_exposed_seconds_count" + pre), 3);
    EXPECT_GT(value_of(ta, "fabric_kv_exposed_seconds_sum" + pre), 0);
    EXPECT_EQ(value_of(tb, "fabric_kv_requests_admitted_total" + dec), 4) << tb;
    EXPECT_EQ(value_of(tb, "fabric_kv_requests_completed_total" + dec), 3);
    EXPECT_EQ(value_of(tb, "fabric_kv_requests_failed_total" + dec), 1);
    EXPECT_EQ(value_of(tb, "fabric_kv_layers_total" + dec), 3 * kLayers);
    EXPECT_EQ(value_of(tb, "fabric_kv_bytes_total" + dec), bytes);
    // Each side's families only on its own engine.
    EXPECT_EQ(ta.find("side=\"decode\""), std::string::npos);
    EXPECT_EQ(tb.find("side=\"prefill\""), std::string::npos);
  }
  // The endpoints are gone, and their metrics with them.
  EXPECT_EQ(a.metrics_text().find("fabric_kv_"), std::string::npos);
  EXPECT_EQ(b.metrics_text().find("fabric_kv_"), std::string::npos);
}

TEST(AppMetrics, WeightUpdatesBytesAndFailedStepsCountedPerRank) {
  const ProviderCase pc{"tcp;ofi_rxm", 1, false};
  TransferEngine a(config_for(pc)), b(config_for(pc));
  {
    weights::Cluster w(weights::testing::random_model(3), pc, /*window=*/2, /*sets=*/2,
                       /*owner_rows=*/128, std::chrono::seconds(60), {&a, &b});
    for (uint64_t step = 0; step < 2; step++) {
      w.new_weights(static_cast<uint32_t>(step + 1));
      for (const std::string& e : w.step(step)) ASSERT_EQ(e, "") << "weight step " << step;
    }
    const uint32_t ns = static_cast<uint32_t>(w.senders.size()),
                   nd = static_cast<uint32_t>(w.receivers.size());
    auto text_of = [&](TransferEngine* e) { return e->metrics_text(); };
    for (uint32_t r = 0; r < ns; r++) {
      const std::string t = text_of(w.train_engines[r]),
                        s = fmt::format(R"({{side="train",rank="{}"}})", r);
      EXPECT_EQ(value_of(t, "fabric_weights_updates_total" + s), 2) << t;
      EXPECT_EQ(value_of(t, "fabric_weights_failed_steps_total" + s), 0);
      EXPECT_EQ(value_of(t, "fabric_weights_update_seconds_count" + s), 2);
      const double last = value_of(t, "fabric_weights_last_update_bytes" + s);
      // The same plan each step: the same bytes.
      EXPECT_EQ(value_of(t, "fabric_weights_bytes_total" + s), 2 * last);
      EXPECT_GE(value_of(t, "fabric_weights_last_update_bytes_per_second" + s), last > 0 ? 1 : 0);
    }
    for (uint32_t r = 0; r < nd; r++) {
      const std::string t = text_of(w.infer_engines[r]),
                        s = fmt::format(R"({{side="inference",rank="{}"}})", r);
      EXPECT_EQ(value_of(t, "fabric_weights_updates_total" + s), 2) << t;
      // The plan writes every destination byte once per step.
      EXPECT_EQ(value_of(t, "fabric_weights_bytes_total" + s), 2.0 * w.model.dst_size[r]);
      EXPECT_EQ(value_of(t, "fabric_weights_failed_steps_total" + s), 0);
    }
    // New senders with a short timeout (the old ones go first: their metrics and the new ones'
    // share labels), then training rank 0 sits out step 2: every inference rank's wait times
    // out; a training rank fails if it waits for rank 0 (a gather or credit), else its update
    // completes. The new senders count from zero.
    for (auto& s : w.senders) s.reset();
    w.new_senders(2, std::chrono::milliseconds(1500));
    const std::vector<std::string> errors = w.step(2, {0}, std::chrono::milliseconds(1500));
    double train_failed = 0, train_updates = 0;
    for (uint32_t r = 1; r < ns; r++) {
      const std::string t = text_of(w.train_engines[r]),
                        s = fmt::format(R"({{side="train",rank="{}"}})", r);
      train_failed += value_of(t, "fabric_weights_failed_steps_total" + s);
      train_updates += value_of(t, "fabric_weights_updates_total" + s);
    }
    double infer_failed = 0;
    for (uint32_t r = 0; r < nd; r++)
      infer_failed += value_of(
          text_of(w.infer_engines[r]),
          fmt::format(R"(fabric_weights_failed_steps_total{{side="inference",rank="{}"}})", r));
    EXPECT_EQ(infer_failed, nd);
    size_t sender_errors = 0;
    for (uint32_t i = 0; i + 1 < ns; i++) sender_errors += !errors[i].empty();
    EXPECT_EQ(train_failed, static_cast<double>(sender_errors));
    EXPECT_EQ(train_updates, static_cast<double>(ns - 1 - sender_errors));
  }
  EXPECT_EQ(a.metrics_text().find("fabric_weights_"), std::string::npos);
  EXPECT_EQ(b.metrics_text().find("fabric_weights_"), std::string::npos);
}

TEST(AppMetrics, MoeDispatchesCombinesAndProxyStepsCountedPerRank) {
  const ProviderCase pc{"tcp;ofi_rxm", 1, false};
  TransferEngine a(config_for(pc)), b(config_for(pc));
  std::vector<TransferEngine*> engines{&a, &b};
  const MoeCase mc{
      pc, 2, 1, 8, 4, 1024, 16, 4, moe::Dtype::kFp8};  // 2 nodes of 1: the proxies carry every row
  constexpr uint32_t kSteps = 3;
  ThreadGather gather(mc.ranks);
  std::barrier done(2);
  std::vector<std::string> texts(mc.ranks);
  const std::vector<std::string> failures = on_rank_threads(
      mc.ranks,
      [&](uint32_t r) -> std::string {
        const AllToAllConfig cfg = config_of(mc, r, "metrics");
        moe::AllToAll a2a(*engines[r], cfg, gather.for_rank(r));
        for (uint32_t step = 1; step <= kSteps; step++) {
          const moe::ReferenceInput in = make_input(cfg, r, step);
          const moe::Handle h = a2a.dispatch({.num_tokens = in.num_tokens,
                                              .x = in.x.data(),
                                              .x_scales = in.x_scales.data(),
                                              .topk_idx = in.topk_idx.data()});
          const moe::DispatchOutput out = a2a.output(h);
          std::vector<uint16_t> y(uint64_t{out.local_experts} * out.rows_per_expert * cfg.hidden,
                                  0);
          std::vector<uint16_t> combined(uint64_t{in.num_tokens} * cfg.hidden);
          a2a.combine(h, {.expert_out = y.data(),
                          .topk_weights = in.topk_weights.data(),
                          .out = combined.data()});
        }
        // The proxy counts a half once it posted it, which the peer may see before the count.
        const std::string s = fmt::format(R"({{moe_job="metrics",rank="{}",half="combine"}})", r);
        if (!wait_until([&] {
              return value_of(engines[r]->metrics_text(), "fabric_moe_proxy_steps_total" + s) ==
                     kSteps;
            }))
          return "the proxy's combine steps never reached " + std::to_string(kSteps);
        texts[r] = engines[r]->metrics_text();
        done.arrive_and_wait();  // no AllToAll goes while the other still reads
        return "";
      },
      [&] { done.arrive_and_drop(); });
  for (uint32_t r = 0; r < mc.ranks; r++) {
    ASSERT_EQ(failures[r], "") << "rank " << r;
    const std::string& t = texts[r];
    const std::string l = fmt::format(R"({{moe_job="metrics",rank="{}"}})", r);
    EXPECT_EQ(value_of(t, "fabric_moe_dispatches_total" + l), kSteps) << t;
    EXPECT_EQ(value_of(t, "fabric_moe_combines_total" + l), kSteps);
    EXPECT_EQ(value_of(t, "fabric_moe_dispatch_seconds_count" + l), kSteps);
    EXPECT_EQ(value_of(t, "fabric_moe_combine_seconds_count" + l), kSteps);
    EXPECT_GT(value_of(t, "fabric_moe_dispatch_seconds_sum" + l), 0);
    EXPECT_EQ(value_of(t, "fabric_moe_timeouts_total" + l), 0);
    EXPECT_EQ(value_of(t, "fabric_moe_masked_ranks" + l), 0);
    EXPECT_EQ(value_of(t, "fabric_moe_failed" + l), 0);
    EXPECT_EQ(
        value_of(
            t, fmt::format(
                   R"(fabric_moe_proxy_steps_total{{moe_job="metrics",rank="{}",half="dispatch"}})",
                   r)),
        kSteps);
    // Per dispatch: the counts row and the private and shared rows to the one other rank; per
    // combine: its rows back.
    EXPECT_EQ(value_of(t, "fabric_moe_proxy_writes_total" + l), 4 * kSteps);
    EXPECT_GT(value_of(t, "fabric_moe_proxy_bytes_total" + l), 0);
  }
  for (TransferEngine* e : engines)
    EXPECT_EQ(e->metrics_text().find("fabric_moe_"), std::string::npos);
}

}  // namespace
}  // namespace fabric::testing
