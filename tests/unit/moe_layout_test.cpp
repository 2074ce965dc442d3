// The MoE receive region's index arithmetic between nodes (src/moe/layout.h), which the host
// kernels, the CUDA receive kernel and the proxy all follow: every row a remote source can send
// lands inside the region, in a place of its own.
#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <tuple>

#include "moe/layout.h"

namespace fabric::moe::detail {
namespace {

Dims dims(uint32_t ranks, uint32_t node_size, uint32_t experts, uint32_t topk, uint32_t tokens,
          uint32_t priv) {
  Dims d;
  d.ranks = ranks, d.node_size = node_size, d.experts = experts, d.local_experts = experts / ranks;
  d.topk = topk, d.hidden = 256, d.max_tokens = tokens, d.private_rows = priv, d.fp8 = true;
  return d;
}

class MoeLayoutRows : public testing::TestWithParam<
                          std::tuple<uint32_t, uint32_t, uint32_t, uint32_t, uint32_t, uint32_t>> {
};

TEST_P(MoeLayoutRows, EveryRowFromAnotherNodeHasAPlaceOfItsOwnInsideTheReceiveRegion) {
  const auto [ranks, node_size, experts, topk, tokens, priv] = GetParam();
  const Dims d = dims(ranks, node_size, experts, topk, tokens, priv);
  const Layout l = make_layout(d);
  const uint64_t R = d.row_bytes();
  ASSERT_EQ(d.slot_rows(), uint64_t{tokens} * std::min(topk, d.local_experts));
  for (uint32_t dst = 0; dst < ranks; ++dst) {
    std::set<uint32_t> slots;
    std::set<uint64_t> places;
    for (uint32_t src = 0; src < ranks; ++src) {
      if (d.same_node(src, dst)) continue;
      const uint32_t slot = remote_slot(d, src, dst);
      EXPECT_LT(slot, d.remote_ranks()) << src << " -> " << dst;
      EXPECT_TRUE(slots.insert(slot).second)
          << "two sources share slot " << slot << " of rank " << dst;
      // Every index a source can send (its rows to dst number at most slot_rows).
      for (uint32_t i = 0; i < d.slot_rows(); ++i) {
        const uint64_t at = received_row_offset(d, l.recv, src, dst, i);
        EXPECT_TRUE(places.insert(at).second)
            << "row " << i << " of rank " << src << " overlaps another";
        if (i < d.private_rows) {
          EXPECT_GE(at, l.recv.priv);
          EXPECT_LE(at + R, l.recv.priv + uint64_t{ranks} * d.private_rows * R);
        } else {
          EXPECT_GE(at, l.recv.shared);
          EXPECT_LE(at + R, l.recv.combine)
              << "row " << i << " of rank " << src << " runs past the shared region";
        }
      }
      // The proxy's one WRITE of the rows past the private ones (proxy.cpp): n rows staged for
      // dst, the last n - min(n, P) of them from index min(n, P) on, inside src's slot.
      for (uint64_t n :
           {uint64_t{0}, std::min<uint64_t>(d.private_rows, d.slot_rows()), d.slot_rows()}) {
        const uint64_t p = std::min<uint64_t>(n, d.private_rows);
        const uint64_t first = l.recv.shared + (uint64_t{slot} * d.slot_rows() + p) * R;
        EXPECT_LE(first + (n - p) * R, l.recv.shared + (uint64_t{slot} + 1) * d.slot_rows() * R);
        if (n > p) {
          EXPECT_EQ(first, received_row_offset(d, l.recv, src, dst, static_cast<uint32_t>(p)));
        }
      }
    }
  }
}

// ranks, node size, experts, top-k, tokens, private rows: one node of several and several of
// one, more local experts than top-k and fewer, no private rows and more than a slot holds.
INSTANTIATE_TEST_SUITE_P(Dims, MoeLayoutRows,
                         testing::Values(std::make_tuple(2u, 1u, 8u, 2u, 4u, 0u),
                                         std::make_tuple(4u, 2u, 16u, 8u, 4u, 3u),
                                         std::make_tuple(8u, 2u, 16u, 8u, 3u, 2u),
                                         std::make_tuple(8u, 4u, 64u, 4u, 5u, 64u),
                                         std::make_tuple(6u, 3u, 12u, 1u, 7u, 1u)));

}  // namespace
}  // namespace fabric::moe::detail
