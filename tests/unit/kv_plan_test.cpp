// The KV write plan, checked by applying it byte by byte: every prefill rank's plan for one layer,
// copied run by run into zeroed decode tensors, must leave each decode rank holding exactly its
// heads of the requested pages, in both page orders, separate or interleaved K/V, for equal and
// unequal tensor parallelism, and write nothing else; the immediate counts the decoder derives
// must equal the runs planned for it.
#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "fabric/error.h"
#include "fabric/kv/layout.h"

namespace fabric::kv {
namespace {

constexpr uint32_t kHeads = 8, kPageTokens = 4, kHeadDim = 4, kPages = 16;

KvLayout layout(uint32_t tp, PageOrder order, bool interleaved) {
  KvLayout l;
  l.num_layers = 2;
  l.num_pages = kPages;
  l.page_tokens = kPageTokens;
  l.kv_heads = kHeads / tp;
  l.head_dim = kHeadDim;
  l.dtype_bytes = 2;
  l.order = order;
  l.page_stride = interleaved ? 2 * l.page_bytes() : 0;
  return l;
}

// Where byte b of (token t, local head h) of page p lies in a tensor.
uint64_t at(const KvLayout& l, uint32_t p, uint32_t t, uint32_t h, uint64_t b) {
  uint64_t in_page = l.order == PageOrder::kTokenMajor ? (uint64_t{t} * l.kv_heads + h) * l.head_bytes()
                                                       : (uint64_t{h} * l.page_tokens + t) * l.head_bytes();
  return p * l.stride() + in_page + b;
}

uint8_t value(bool v, uint32_t global_head, uint32_t prompt_page, uint32_t t, uint64_t b) {
  return static_cast<uint8_t>(1 + (v * 131 + global_head * 31 + prompt_page * 17 + t * 7 + b) % 251);
}

// K and V of one rank: separate buffers, or one buffer with V a page after K.
struct Tensors {
  std::vector<uint8_t> k, v;
  bool interleaved;
};
Tensors make(const KvLayout& l, bool interleaved) {
  Tensors t{{}, {}, interleaved};
  if (interleaved) t.k.assign(l.tensor_bytes() + l.page_bytes(), 0);
  else t.k.assign(l.tensor_bytes(), 0), t.v.assign(l.tensor_bytes(), 0);
  return t;
}
// Interleaved: V's page p starts a page after K's, both with the doubled stride.
uint8_t* tensor(Tensors& t, const KvLayout& l, bool v) {
  return t.interleaved ? t.k.data() + (v ? l.page_bytes() : 0) : (v ? t.v : t.k).data();
}

void run_case(uint32_t ptp, uint32_t dtp, PageOrder order, bool interleaved) {
  SCOPED_TRACE(::testing::Message() << "prefill TP " << ptp << ", decode TP " << dtp << ", "
                                    << (order == PageOrder::kTokenMajor ? "token-major" : "head-major")
                                    << (interleaved ? ", interleaved" : ""));
  const KvLayout pl = layout(ptp, order, interleaved), dl = layout(dtp, order, interleaved);
  std::mt19937 rng(ptp * 10 + dtp);
  std::vector<uint32_t> all(kPages);
  for (uint32_t i = 0; i < kPages; i++) all[i] = i;
  std::shuffle(all.begin(), all.end(), rng);
  const std::vector<uint32_t> src_pages(all.begin(), all.begin() + 5);
  std::shuffle(all.begin(), all.end(), rng);
  const std::vector<uint32_t> dst_pages(all.begin(), all.begin() + 5);

  std::vector<Tensors> prefill, decode;
  for (uint32_t r = 0; r < ptp; r++) {
    prefill.push_back(make(pl, interleaved));
    for (bool v : {false, true})
      for (uint32_t i = 0; i < src_pages.size(); i++)
        for (uint32_t t = 0; t < kPageTokens; t++)
          for (uint32_t h = 0; h < pl.kv_heads; h++)
            for (uint64_t b = 0; b < pl.head_bytes(); b++)
              tensor(prefill[r], pl, v)[at(pl, src_pages[i], t, h, b)] = value(v, r * pl.kv_heads + h, i, t, b);
  }
  for (uint32_t q = 0; q < dtp; q++) decode.push_back(make(dl, interleaved));

  std::vector<uint64_t> runs_into(dtp, 0);
  for (uint32_t r = 0; r < ptp; r++)
    for (const LayerWrite& w : plan_layer(pl, dl, kHeads, {ptp, r}, dtp, src_pages, dst_pages)) {
      ASSERT_EQ(w.src_index.size(), w.dst_index.size());
      const uint8_t* src = tensor(prefill[r], pl, w.value);
      uint8_t* dst = tensor(decode[w.decode_rank], dl, w.value);
      for (size_t i = 0; i < w.src_index.size(); i++)
        std::memcpy(dst + w.dst_offset + w.dst_stride * w.dst_index[i],
                    src + w.src_offset + w.src_stride * w.src_index[i], w.run_bytes);
      runs_into[w.decode_rank] += w.src_index.size();
    }

  for (uint32_t q = 0; q < dtp; q++) {
    EXPECT_EQ(runs_into[q], layer_writes_into(pl, kHeads, ptp, {dtp, q}, static_cast<uint32_t>(src_pages.size())))
        << "decode rank " << q << ": the immediates it expects";
    // Expected image: its heads of the requested pages, zero everywhere else.
    Tensors want = make(dl, interleaved);
    for (bool v : {false, true})
      for (uint32_t i = 0; i < dst_pages.size(); i++)
        for (uint32_t t = 0; t < kPageTokens; t++)
          for (uint32_t h = 0; h < dl.kv_heads; h++)
            for (uint64_t b = 0; b < dl.head_bytes(); b++)
              tensor(want, dl, v)[at(dl, dst_pages[i], t, h, b)] = value(v, q * dl.kv_heads + h, i, t, b);
    EXPECT_EQ(decode[q].k, want.k) << "decode rank " << q << " (K, or K and V interleaved)";
    EXPECT_EQ(decode[q].v, want.v) << "decode rank " << q << " (V)";
  }
}

TEST(KvPlan, EveryDecodeRankGetsExactlyItsHeadsOfTheRequestedPages) {
  for (PageOrder order : {PageOrder::kTokenMajor, PageOrder::kHeadMajor})
    for (bool interleaved : {false, true})
      for (auto [p, d] : {std::pair{1u, 1u}, {2u, 2u}, {2u, 1u}, {1u, 2u}, {4u, 2u}, {2u, 4u}, {8u, 4u}, {4u, 8u}, {1u, 8u}})
        run_case(p, d, order, interleaved);
}

TEST(KvPlan, WholePagesWhenTheySplitAlikeOneRunPerTokenWhenTokenMajorPagesSplitDifferently) {
  const std::vector<uint32_t> pages{3, 1};
  auto equal = plan_layer(layout(2, PageOrder::kTokenMajor, false), layout(2, PageOrder::kTokenMajor, false),
                          kHeads, {2, 1}, 2, pages, pages);
  ASSERT_EQ(equal.size(), 2u);  // K and V to decode rank 1
  EXPECT_EQ(equal[0].decode_rank, 1u);
  EXPECT_EQ(equal[0].src_index.size(), 2u);
  EXPECT_EQ(equal[0].run_bytes, layout(2, PageOrder::kTokenMajor, false).page_bytes());
  auto split = plan_layer(layout(1, PageOrder::kTokenMajor, false), layout(2, PageOrder::kTokenMajor, false),
                          kHeads, {1, 0}, 2, pages, pages);
  ASSERT_EQ(split.size(), 4u);  // K and V to each of 2 decode ranks
  EXPECT_EQ(split[0].src_index.size(), pages.size() * kPageTokens);
  EXPECT_EQ(split[0].run_bytes, (kHeads / 2) * kHeadDim * 2u);
  auto head_major = plan_layer(layout(1, PageOrder::kHeadMajor, false), layout(2, PageOrder::kHeadMajor, false),
                               kHeads, {1, 0}, 2, pages, pages);
  EXPECT_EQ(head_major[0].src_index.size(), pages.size()) << "head-major: one run per page";
}

TEST(KvPlan, BadGeometriesAreRejectedWithAClearError) {
  const std::vector<uint32_t> pages{0, 1}, one{0}, far{0, kPages};
  const KvLayout a = layout(2, PageOrder::kTokenMajor, false);
  auto expect = [](ErrorCode code, const char* fragment, auto&& f) {
    try {
      f();
      ADD_FAILURE() << "no error";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), code) << e.what();
      EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
    }
  };
  expect(ErrorCode::kInvalidArgument, "split evenly", [&] { head_overlaps(kHeads, {3, 0}, 2); });
  expect(ErrorCode::kInvalidArgument, "prefill rank 2", [&] { head_overlaps(kHeads, {2, 2}, 2); });
  expect(ErrorCode::kInvalidArgument, "hold", [&] { plan_layer(a, a, kHeads, {1, 0}, 2, pages, pages); });
  expect(ErrorCode::kInvalidArgument, "2 prefill pages but 1", [&] { plan_layer(a, a, kHeads, {2, 0}, 2, pages, one); });
  expect(ErrorCode::kOutOfBounds, "decode page 16", [&] { plan_layer(a, a, kHeads, {2, 0}, 2, pages, far); });
  KvLayout other = a;
  other.order = PageOrder::kHeadMajor;
  expect(ErrorCode::kInvalidArgument, "page order", [&] { plan_layer(a, other, kHeads, {2, 0}, 2, pages, pages); });
  KvLayout odd = a;
  odd.page_stride = a.page_bytes() + 1;
  expect(ErrorCode::kInvalidArgument, "page stride", [&] { plan_layer(odd, odd, kHeads, {2, 0}, 2, pages, pages); });
}

}  // namespace
}  // namespace fabric::kv
