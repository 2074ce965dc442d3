// KV-cache transfer over real engines (tcp;ofi_rxm on loopback, host-memory caches): prefill ranks
// send each layer when told, decode ranks count each layer and complete each request; every byte
// of every admitted page is checked against the heads that rank must hold, for prefill TP 2 into
// decode TP 1 (token-major, separate K/V) and TP 1 into TP 2 (head-major, interleaved K/V).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <random>
#include <set>
#include <thread>

#include "fabric/kv/transfer.h"
#include "test_support.h"

namespace fabric::testing {
namespace {

using namespace fabric::kv;

constexpr uint32_t kHeads = 4, kLayers = 3, kPageTokens = 8, kHeadDim = 16, kPages = 24;

KvLayout layout(uint32_t tp, PageOrder order, bool interleaved) {
  KvLayout l{.num_layers = kLayers, .num_pages = kPages, .page_tokens = kPageTokens, .kv_heads = kHeads / tp,
             .head_dim = kHeadDim, .dtype_bytes = 2, .order = order, .page_stride = 0};
  if (interleaved) l.page_stride = 2 * l.page_bytes();
  return l;
}

uint64_t at(const KvLayout& l, uint32_t p, uint32_t t, uint32_t h, uint64_t b) {
  uint64_t in_page = l.order == PageOrder::kTokenMajor ? (uint64_t{t} * l.kv_heads + h) * l.head_bytes()
                                                       : (uint64_t{h} * l.page_tokens + t) * l.head_bytes();
  return p * l.stride() + in_page + b;
}

uint8_t value(uint64_t request, uint32_t layer, bool v, uint32_t head, uint32_t prompt_page, uint32_t t, uint64_t b) {
  return static_cast<uint8_t>(1 + (request * 97 + layer * 53 + v * 131 + head * 31 + prompt_page * 17 + t * 7 + b) % 251);
}

// One rank: an engine and its per-layer K/V memory (one buffer per layer; V a page after K when
// interleaved, else in the second half).
struct Rank {
  KvLayout l;
  bool interleaved;
  TransferEngine engine{config_for({"tcp;ofi_rxm", 1, false})};
  std::vector<std::vector<uint8_t>> mem;
  KvTensors tensors;
  Rank(KvLayout layout_, bool inter) : l(layout_), interleaved(inter) {
    for (uint32_t i = 0; i < kLayers; i++) {
      mem.emplace_back(inter ? l.tensor_bytes() + l.page_bytes() : 2 * l.tensor_bytes(), 0);
      tensors.k.push_back(mem.back().data());
      tensors.v.push_back(mem.back().data() + (inter ? l.page_bytes() : l.tensor_bytes()));
    }
  }
  uint8_t* tensor(uint32_t layer, bool v) { return static_cast<uint8_t*>(v ? tensors.v[layer] : tensors.k[layer]); }
};

// How an operation ended, and its message. Declare it before the engines whose callbacks set it.
struct Outcome {
  std::mutex mu;
  std::string why;
  std::atomic<int> state{kDonePending};
  OnDone on_done() {
    return OnDone::callback([this](const Status& st) {
      {
        std::lock_guard l(mu);
        why = st.message();
      }
      state = st.ok() ? kDoneSucceeded : kDoneFailed;
    });
  }
  bool ended(std::chrono::seconds timeout = std::chrono::seconds(30)) {
    return wait_until([&] { return state.load() != kDonePending; }, timeout);
  }
  std::string message() {
    std::lock_guard l(mu);
    return why;
  }
};

void run(uint32_t ptp, uint32_t dtp, PageOrder order, bool interleaved) {
  SCOPED_TRACE(::testing::Message() << "prefill TP " << ptp << " -> decode TP " << dtp);
  std::vector<std::unique_ptr<Rank>> prefill, decode;
  std::vector<std::unique_ptr<KvSender>> senders;
  std::vector<std::unique_ptr<KvReceiver>> receivers;
  for (uint32_t q = 0; q < dtp; q++) {
    decode.push_back(std::make_unique<Rank>(layout(dtp, order, interleaved), interleaved));
    receivers.push_back(std::make_unique<KvReceiver>(decode[q]->engine, decode[q]->l, decode[q]->tensors,
                                                     KvRank{.group = 7, .tp = {dtp, q}, .total_heads = kHeads}));
  }
  for (uint32_t r = 0; r < ptp; r++) {
    prefill.push_back(std::make_unique<Rank>(layout(ptp, order, interleaved), interleaved));
    senders.push_back(std::make_unique<KvSender>(prefill[r]->engine, prefill[r]->l, prefill[r]->tensors,
                                                 KvRank{.group = 3, .tp = {ptp, r}, .total_heads = kHeads}));
    for (auto& rc : receivers) senders[r]->add_decoder(rc->descriptor());
  }

  std::mt19937 rng(ptp * 16 + dtp);
  std::vector<uint32_t> free_dst(kPages), free_src(kPages);
  for (uint32_t i = 0; i < kPages; i++) free_dst[i] = free_src[i] = i;
  std::shuffle(free_dst.begin(), free_dst.end(), rng);
  std::shuffle(free_src.begin(), free_src.end(), rng);
  struct Req {
    uint64_t id;
    std::vector<uint32_t> src, dst;
  };
  std::vector<Req> reqs;
  size_t next = 0;
  for (uint64_t id : {11u, 12u, 13u}) {  // random lengths, pages from the free lists
    size_t n = 1 + rng() % 6;
    reqs.push_back({id, {free_src.begin() + next, free_src.begin() + next + n},
                    {free_dst.begin() + next, free_dst.begin() + next + n}});
    next += n;
  }

  // Fill the prefill ranks' pages: rank r holds global heads [r * H/P, ...).
  for (uint32_t r = 0; r < ptp; r++)
    for (const Req& q : reqs)
      for (uint32_t layer = 0; layer < kLayers; layer++)
        for (bool v : {false, true})
          for (uint32_t i = 0; i < q.src.size(); i++)
            for (uint32_t t = 0; t < kPageTokens; t++)
              for (uint32_t h = 0; h < prefill[r]->l.kv_heads; h++)
                for (uint64_t b = 0; b < prefill[r]->l.head_bytes(); b++)
                  prefill[r]->tensor(layer, v)[at(prefill[r]->l, q.src[i], t, h, b)] =
                      value(q.id, layer, v, r * prefill[r]->l.kv_heads + h, i, t, b);

  std::mutex mu;
  std::set<std::tuple<uint32_t, uint64_t, uint32_t>> layers_seen;  // (decode rank, request, layer)
  std::vector<std::unique_ptr<std::atomic<int>>> landed, sent;
  for (const Req& q : reqs) {
    std::vector<uint8_t> msg;
    for (uint32_t d = 0; d < dtp; d++) {
      landed.push_back(std::make_unique<std::atomic<int>>(kDonePending));
      msg = receivers[d]->admit(KvAdmit{.request = q.id,
                                        .pages = q.dst,
                                        .prefill_size = ptp,
                                        .timeout = std::chrono::seconds(60),
                                        .on_layer = [&mu, &layers_seen, d, id = q.id](uint32_t layer) {
                                          std::lock_guard l(mu);
                                          layers_seen.insert({d, id, layer});
                                        },
                                        .on_done = OnDone::flag(landed.back().get())});
    }
    for (uint32_t r = 0; r < ptp; r++) {
      sent.push_back(std::make_unique<std::atomic<int>>(kDonePending));
      senders[r]->begin({.admit = msg, .src_pages = q.src, .on_sent = OnDone::flag(sent.back().get())});
    }
  }
  // Layers as a model computes them: layer by layer, every request, every prefill rank.
  for (uint32_t layer = 0; layer < kLayers; layer++)
    for (const Req& q : reqs)
      for (auto& s : senders) s->layer_done(q.id, layer);

  auto all = [](auto& flags) {
    return wait_until([&] {
      for (auto& f : flags)
        if (f->load() == kDonePending) return false;
      return true;
    });
  };
  ASSERT_TRUE(all(sent));
  ASSERT_TRUE(all(landed));
  for (auto& f : sent) EXPECT_EQ(f->load(), kDoneSucceeded);
  for (auto& f : landed) EXPECT_EQ(f->load(), kDoneSucceeded);
  EXPECT_EQ(layers_seen.size(), size_t{dtp} * reqs.size() * kLayers) << "each layer of each request, once";

  for (uint32_t d = 0; d < dtp; d++) {
    Rank& rk = *decode[d];
    std::vector<std::vector<uint8_t>> want;
    for (uint32_t i = 0; i < kLayers; i++) want.emplace_back(rk.mem[i].size(), 0);
    for (const Req& q : reqs)
      for (uint32_t layer = 0; layer < kLayers; layer++)
        for (bool v : {false, true}) {
          uint8_t* base = want[layer].data() + (v ? (interleaved ? rk.l.page_bytes() : rk.l.tensor_bytes()) : 0);
          for (uint32_t i = 0; i < q.dst.size(); i++)
            for (uint32_t t = 0; t < kPageTokens; t++)
              for (uint32_t h = 0; h < rk.l.kv_heads; h++)
                for (uint64_t b = 0; b < rk.l.head_bytes(); b++)
                  base[at(rk.l, q.dst[i], t, h, b)] = value(q.id, layer, v, d * rk.l.kv_heads + h, i, t, b);
        }
    for (uint32_t i = 0; i < kLayers; i++) EXPECT_EQ(rk.mem[i], want[i]) << "decode rank " << d << ", layer " << i;
  }
}

TEST(KvTransfer, TwoPrefillRanksIntoOneDecodeRankTokenMajor) { run(2, 1, PageOrder::kTokenMajor, false); }
TEST(KvTransfer, OnePrefillRankIntoTwoDecodeRanksTokenMajorInterleaved) { run(1, 2, PageOrder::kTokenMajor, true); }
TEST(KvTransfer, OnePrefillRankIntoTwoDecodeRanksHeadMajor) { run(1, 2, PageOrder::kHeadMajor, false); }

TEST(KvTransfer, AMissingLayerFailsTheRequestAtItsTimeoutAndItsTagWaitsOutItsLateWrites) {
  const auto late_writes = std::chrono::milliseconds(1500);
  Outcome ended;
  Rank d(layout(1, PageOrder::kTokenMajor, false), false), p(layout(1, PageOrder::kTokenMajor, false), false);
  Rank p2(layout(1, PageOrder::kTokenMajor, false), false);
  KvReceiver rx(d.engine, d.l, d.tensors, {.group = 1, .tp = {1, 0}, .total_heads = kHeads}, {.late_writes = late_writes});
  KvSender tx(p.engine, p.l, p.tensors, {.group = 2, .tp = {1, 0}, .total_heads = kHeads});
  KvSender retry_tx(p2.engine, p2.l, p2.tensors, {.group = 3, .tp = {1, 0}, .total_heads = kHeads});
  tx.add_decoder(rx.descriptor());
  retry_tx.add_decoder(rx.descriptor());
  std::atomic<int> sent{kDonePending};
  auto msg = rx.admit({.request = 5, .pages = {1, 2}, .prefill_size = 1,
                       .timeout = std::chrono::milliseconds(500), .on_done = ended.on_done()});
  tx.begin({.admit = msg, .src_pages = {3, 4}, .on_sent = OnDone::flag(&sent)});
  tx.layer_done(5, 0);  // layers 1 and 2 do not come in time
  ASSERT_TRUE(ended.ended());
  const auto failed_at = std::chrono::steady_clock::now();
  EXPECT_EQ(ended.state.load(), kDoneFailed);
  EXPECT_NE(ended.message().find("did not land"), std::string::npos) << ended.message();
  EXPECT_EQ(rx.in_flight(), 0u);
  expect_error(ErrorCode::kInvalidArgument, "late WRITEs",
               [&] { rx.admit({.request = 5, .pages = {1}, .prefill_size = 1}); });

  // A late layer of the failed request lands and is counted with nobody waiting for it.
  tx.layer_done(5, 1);
  const uint64_t per_layer = layer_writes_into(p.l, kHeads, 1, {1, 0}, 2);
  ASSERT_TRUE(wait_until([&] { return rx.imm_count(5, 1) == per_layer; }));
  EXPECT_TRUE(tx.cancel(5)) << "the prefill side ends it too";
  ASSERT_TRUE(wait_until([&] { return sent.load() != kDonePending; }));
  EXPECT_EQ(sent.load(), kDoneFailed);
  expect_error(ErrorCode::kNotFound, "not begun", [&] { tx.layer_done(5, 2); });
  EXPECT_FALSE(tx.cancel(5));

  // Past the window the tag is taken again, and what the failed request left is not counted.
  std::this_thread::sleep_until(failed_at + late_writes + std::chrono::milliseconds(100));
  std::atomic<uint64_t> landed{0};
  std::atomic<int> retried{kDonePending};
  rx.admit({.request = 6, .pages = {9}, .prefill_size = 1, .timeout = std::chrono::seconds(60)});
  EXPECT_EQ(rx.imm_count(5, 1), 0u) << "the next admit, of any id, discarded the late immediates";
  auto again = rx.admit({.request = 5, .pages = {7}, .prefill_size = 1, .timeout = std::chrono::seconds(60),
                         .landed = &landed, .on_done = OnDone::flag(&retried)});
  retry_tx.begin({.admit = again, .src_pages = {0}});
  retry_tx.layer_done(5, 0);
  retry_tx.layer_done(5, 1);
  ASSERT_TRUE(wait_until([&] { return landed.load() == 2; })) << "layers 0 and 1 of the retry";
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_EQ(retried.load(), kDonePending) << "layer 2 has not been sent: the stale layer-1 count must not finish it";
  retry_tx.layer_done(5, 2);
  ASSERT_TRUE(wait_until([&] { return retried.load() != kDonePending; }));
  EXPECT_EQ(retried.load(), kDoneSucceeded);
  EXPECT_EQ(landed.load(), uint64_t{kLayers});
}

// Extras (a request's hidden state and logits) go last, from prefill TP rank 0 to every decode
// rank, and the layers come from trigger steps as a CUDA graph would count them.
TEST(KvTransfer, TriggerStepsSendEachLayerAndTheExtrasLast) {
  constexpr uint32_t kSlots = 4, kExtraBytes = 320;
  std::vector<std::unique_ptr<Rank>> prefill, decode;
  std::vector<std::vector<uint8_t>> extras;
  std::vector<std::unique_ptr<KvSender>> senders;
  std::vector<std::unique_ptr<KvReceiver>> receivers;
  for (uint32_t q = 0; q < 2; q++) {
    decode.push_back(std::make_unique<Rank>(layout(2, PageOrder::kTokenMajor, false), false));
    extras.emplace_back(kSlots * kExtraBytes, 0);
    KvTensors t = decode[q]->tensors;
    t.extras = extras.back().data();
    t.extra_slots = kSlots;
    t.extra_bytes = kExtraBytes;
    receivers.push_back(std::make_unique<KvReceiver>(decode[q]->engine, decode[q]->l, t,
                                                     KvRank{.group = 9, .tp = {2, q}, .total_heads = kHeads}));
  }
  for (uint32_t r = 0; r < 2; r++) {
    prefill.push_back(std::make_unique<Rank>(layout(2, PageOrder::kTokenMajor, false), false));
    extras.emplace_back(kSlots * kExtraBytes, 0);
    for (uint64_t b = 0; b < kExtraBytes; b++) extras.back()[2 * kExtraBytes + b] = static_cast<uint8_t>(r * 100 + b % 97 + 1);
    KvTensors t = prefill[r]->tensors;
    t.extras = extras.back().data();
    t.extra_slots = kSlots;
    t.extra_bytes = kExtraBytes;
    senders.push_back(std::make_unique<KvSender>(prefill[r]->engine, prefill[r]->l, t,
                                                 KvRank{.group = 8, .tp = {2, r}, .total_heads = kHeads}));
    for (auto& rc : receivers) senders[r]->add_decoder(rc->descriptor());
  }
  std::atomic<uint64_t> landed[2] = {0, 0};
  std::atomic<int> done[2] = {kDonePending, kDonePending}, sent[2] = {kDonePending, kDonePending};
  std::vector<uint8_t> msg;
  for (uint32_t q = 0; q < 2; q++)
    msg = receivers[q]->admit({.request = 21, .pages = {5, 6}, .prefill_size = 2, .extra_slot = 3,
                               .timeout = std::chrono::seconds(60), .landed = &landed[q],
                               .on_done = OnDone::flag(&done[q])});
  for (uint32_t r = 0; r < 2; r++) {
    senders[r]->begin({.admit = msg, .src_pages = {0, 1}, .extra_slot = 2, .on_sent = OnDone::flag(&sent[r])});
    senders[r]->begin_forward({21});
  }
  // Layer 0, then layers 1 and 2 seen at once (the watcher coalesces): the extras are not yet computed.
  for (auto& s : senders) s->trigger_reached(1);
  for (auto& s : senders) s->trigger_reached(kLayers);
  ASSERT_TRUE(wait_until([&] { return landed[0].load() == kLayers && landed[1].load() == kLayers; }));
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_EQ(done[0].load(), kDonePending) << "the extras have not been sent";
  EXPECT_EQ(std::count(extras[0].begin(), extras[0].end(), 0), static_cast<long>(extras[0].size()));
  for (auto& s : senders) s->trigger_reached(kLayers + 1);
  for (uint32_t q = 0; q < 2; q++) {
    ASSERT_TRUE(wait_until([&] { return done[q].load() != kDonePending; }));
    EXPECT_EQ(done[q].load(), kDoneSucceeded);
    EXPECT_EQ(landed[q].load(), kLayers + 1u);
    for (uint64_t b = 0; b < kSlots * kExtraBytes; b++) {
      const uint8_t want = b / kExtraBytes == 3 ? static_cast<uint8_t>(b % kExtraBytes % 97 + 1) : 0;
      ASSERT_EQ(extras[q][b], want) << "decode rank " << q << ", byte " << b << ": rank 0's slot 2 into slot 3";
    }
  }
  for (uint32_t r = 0; r < 2; r++) {
    ASSERT_TRUE(wait_until([&] { return sent[r].load() != kDonePending; }));
    EXPECT_EQ(sent[r].load(), kDoneSucceeded);
    EXPECT_EQ(senders[r]->in_flight(), 0u);
  }
  EXPECT_EQ(receivers[0]->in_flight(), 0u);
}

TEST(KvTransfer, RemovingADecodeGroupCancelsItsRequestsAndLeavesNoPeer) {
  Outcome sent;
  Rank d(layout(1, PageOrder::kTokenMajor, false), false), p(layout(1, PageOrder::kTokenMajor, false), false);
  KvReceiver rx(d.engine, d.l, d.tensors, {.group = 1, .tp = {1, 0}, .total_heads = kHeads});
  KvSender tx(p.engine, p.l, p.tensors, {.group = 2, .tp = {1, 0}, .total_heads = kHeads});
  tx.add_decoder(rx.descriptor());
  auto msg = rx.admit({.request = 3, .pages = {0, 1}, .prefill_size = 1, .timeout = std::chrono::seconds(2)});
  tx.begin({.admit = msg, .src_pages = {0, 1}, .on_sent = sent.on_done()});
  tx.layer_done(3, 0);
  ASSERT_TRUE(wait_until([&] { return p.engine.peer_count() == 1; }));
  EXPECT_TRUE(tx.remove_decoder(1));
  ASSERT_TRUE(sent.ended());
  EXPECT_NE(sent.message().find("decode group 1 was removed"), std::string::npos) << sent.message();
  EXPECT_TRUE(wait_until([&] { return p.engine.peer_count() == 0; })) << "the decoder's peer went with it";
  EXPECT_EQ(tx.in_flight(), 0u);
  EXPECT_FALSE(tx.remove_decoder(1));
  expect_error(ErrorCode::kNotFound, "never added", [&] { tx.begin({.admit = msg, .src_pages = {0, 1}}); });
  expect_error(ErrorCode::kNotFound, "not begun", [&] { tx.layer_done(3, 1); });
}

// The engine lets a peer go by itself (or the application removes it) while a request to it is
// under way: its regions turn stale, the next layer's writes are refused, and the request ends
// with that error instead of waiting for writes that were never posted.
TEST(KvTransfer, ARequestWhoseDecodeRankWasLetGoEndsAtItsNextLayer) {
  Outcome sent;
  Rank d(layout(1, PageOrder::kTokenMajor, false), false), p(layout(1, PageOrder::kTokenMajor, false), false);
  KvReceiver rx(d.engine, d.l, d.tensors, {.group = 1, .tp = {1, 0}, .total_heads = kHeads});
  KvSender tx(p.engine, p.l, p.tensors, {.group = 2, .tp = {1, 0}, .total_heads = kHeads});
  tx.add_decoder(rx.descriptor());
  auto msg = rx.admit({.request = 4, .pages = {0, 1}, .prefill_size = 1, .timeout = std::chrono::seconds(2)});
  tx.begin({.admit = msg, .src_pages = {2, 3}, .on_sent = sent.on_done()});
  ASSERT_EQ(p.engine.peer_count(), 1u) << "add_decoder resolved the decode rank";
  p.engine.remove_peer(d.engine.main_address());  // nothing in flight to it: no other outcome
  EXPECT_NO_THROW(tx.layer_done(4, 0)) << "the refusal is reported through on_sent";
  ASSERT_TRUE(sent.ended());
  EXPECT_EQ(sent.state.load(), kDoneFailed);
  EXPECT_NE(sent.message().find("was refused"), std::string::npos) << sent.message();
  EXPECT_EQ(tx.in_flight(), 0u);
  expect_error(ErrorCode::kNotFound, "not begun", [&] { tx.layer_done(4, 1); });
}

TEST(KvTransfer, BadCallsAreRejectedWithAClearError) {
  Rank d(layout(1, PageOrder::kTokenMajor, false), false), p(layout(1, PageOrder::kTokenMajor, false), false);
  KvReceiver rx(d.engine, d.l, d.tensors, {.group = 1, .tp = {1, 0}, .total_heads = kHeads});
  KvSender tx(p.engine, p.l, p.tensors, {.group = 2, .tp = {1, 0}, .total_heads = kHeads});
  expect_error(ErrorCode::kOutOfBounds, "page 24", [&] {
    rx.admit({.request = 1, .pages = {kPages}, .prefill_size = 1, .timeout = {}, .on_layer = {}, .on_done = {}});
  });
  auto msg = rx.admit({.request = 2, .pages = {0}, .prefill_size = 1, .timeout = std::chrono::seconds(5),
                       .on_layer = {}, .on_done = {}});
  expect_error(ErrorCode::kInvalidArgument, "already in flight", [&] {
    rx.admit({.request = 2, .pages = {0}, .prefill_size = 1, .timeout = {}, .on_layer = {}, .on_done = {}});
  });
  expect_error(ErrorCode::kNotFound, "never added", [&] { tx.begin({.admit = msg, .src_pages = {0}}); });
  tx.add_decoder(rx.descriptor());
  tx.begin({.admit = msg, .src_pages = {0}});
  tx.layer_done(2, 0);
  expect_error(ErrorCode::kInvalidArgument, "already sent", [&] { tx.layer_done(2, 0); });
  expect_error(ErrorCode::kOutOfBounds, "layer 9", [&] { tx.layer_done(2, 9); });
  expect_error(ErrorCode::kNotFound, "not begun", [&] { tx.layer_done(99, 0); });
  Rank other(layout(1, PageOrder::kHeadMajor, false), false);
  KvReceiver wrong(other.engine, other.l, other.tensors, {.group = 4, .tp = {1, 0}, .total_heads = kHeads});
  expect_error(ErrorCode::kInvalidArgument, "page order", [&] { tx.add_decoder(wrong.descriptor()); });
  expect_error(ErrorCode::kInvalidArgument, "extra slot 0 of 0", [&] {
    rx.admit({.request = 6, .pages = {0}, .prefill_size = 1, .extra_slot = 0});
  });
  expect_error(ErrorCode::kInvalidArgument, "extras need", [&] {
    KvTensors t = d.tensors;
    t.extra_slots = 2;
    KvReceiver bad(d.engine, d.l, t, {.group = 5, .tp = {1, 0}, .total_heads = kHeads});
  });
  expect_error(ErrorCode::kMalformed, "KV descriptor", [&] {
    std::vector<uint8_t> junk{1, 2, 3};
    tx.add_decoder(junk);
  });
}

}  // namespace
}  // namespace fabric::testing
