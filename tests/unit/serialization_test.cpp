// NetAddr and MrDesc wire formats: round trips, and strict rejection of malformed input.
#include <gtest/gtest.h>

#include <random>

#include "fabric/error.h"
#include "fabric/types.h"

namespace fabric {
namespace {

NetAddr sample_addr(size_t nics) {
  std::vector<std::string> n;
  for (size_t i = 0; i < nics; i++) n.push_back(std::string(16 + i, static_cast<char>('a' + i)));
  return NetAddr("tcp;ofi_rxm", n);
}

MrDesc sample_desc(size_t nics) {
  std::vector<RemoteKey> keys;
  for (size_t i = 0; i < nics; i++) keys.push_back({0x1000 + i, 0x7f0000000000 + i});
  return MrDesc(sample_addr(nics), 0x7f0000000000, 1 << 20, keys);
}

void expect_malformed(std::span<const uint8_t> bytes, bool desc) {
  try {
    if (desc) MrDesc::from_bytes(bytes);
    else NetAddr::from_bytes(bytes);
    ADD_FAILURE() << "accepted " << bytes.size() << " malformed bytes";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kMalformed);
    EXPECT_NE(std::string(e.what()).find(desc ? "MrDesc" : "NetAddr"), std::string::npos);
  }
}

TEST(Serialization, NetAddrRoundTripsThroughBytesAndHex) {
  for (size_t n = 1; n <= kMaxNics; n++) {
    NetAddr a = sample_addr(n);
    EXPECT_EQ(NetAddr::from_bytes(a.to_bytes()), a);
    EXPECT_EQ(NetAddr::from_hex(a.to_hex()), a);
    EXPECT_EQ(a.to_hex().size(), a.to_bytes().size() * 2);
  }
}

TEST(Serialization, MrDescRoundTripsThroughBytesAndHex) {
  for (size_t n = 1; n <= kMaxNics; n++) {
    MrDesc d = sample_desc(n);
    EXPECT_EQ(MrDesc::from_bytes(d.to_bytes()), d);
    EXPECT_EQ(MrDesc::from_hex(d.to_hex()), d);
  }
}

TEST(Serialization, EveryTruncationIsRejected) {
  auto a = sample_addr(3).to_bytes();
  for (size_t len = 0; len < a.size(); len++) expect_malformed(std::span(a.data(), len), false);
  auto d = sample_desc(3).to_bytes();
  for (size_t len = 0; len < d.size(); len++) expect_malformed(std::span(d.data(), len), true);
}

TEST(Serialization, TrailingBytesAreRejected) {
  auto a = sample_addr(1).to_bytes();
  a.push_back(0);
  expect_malformed(a, false);
  auto d = sample_desc(1).to_bytes();
  d.push_back(0);
  expect_malformed(d, true);
}

TEST(Serialization, BadMagicVersionAndCountsAreRejected) {
  auto a = sample_addr(2).to_bytes();
  auto bad = a;
  bad[0] = 'X';
  expect_malformed(bad, false);
  bad = a;
  bad[4] = 99;  // version
  expect_malformed(bad, false);
  bad = a;
  size_t count_at = 6 + a[5];  // magic, version, provider length, provider
  bad[count_at] = 5;           // more NICs than allowed
  expect_malformed(bad, false);
  bad[count_at] = 0;
  expect_malformed(bad, false);

  auto d = sample_desc(2).to_bytes();
  auto bad_d = d;
  bad_d[d.size() - 1 - 2 * 16 - 1] = 3;  // (flag byte last) key count no longer matches the owner's NIC count
  expect_malformed(bad_d, true);
  expect_malformed(a, true);  // a NetAddr is not an MrDesc
  expect_malformed(d, false);
}

TEST(Serialization, LocalEndpointAndLocalKeyRoundTrip) {
  NetAddr a("tcp;ofi_rxm", {"nic0"}, "host-1/ipc-2");
  EXPECT_EQ(NetAddr::from_bytes(a.to_bytes()), a);
  EXPECT_EQ(NetAddr::from_bytes(a.to_bytes()).local(), "host-1/ipc-2");
  MrDesc with_both(a, 0x1000, 4096, {RemoteKey{7, 0}}, RemoteKey{(3ull << 32) | 1, 0});
  EXPECT_EQ(MrDesc::from_bytes(with_both.to_bytes()), with_both);
  MrDesc local_only(a, 0x1000, 4096, {}, RemoteKey{9, 0});  // NICs cannot reach this memory
  MrDesc back = MrDesc::from_bytes(local_only.to_bytes());
  EXPECT_EQ(back, local_only);
  EXPECT_TRUE(back.keys().empty());
  // A local key needs an owner with a local endpoint; no key at all is malformed.
  EXPECT_THROW(MrDesc(sample_addr(1), 0, 1, {}, RemoteKey{1, 0}), Error);
  auto bytes = local_only.to_bytes();
  bytes[bytes.size() - 17] = 0;  // clear the local-key flag: no key left
  bytes.resize(bytes.size() - 16);
  expect_malformed(bytes, true);
}

TEST(Serialization, BadHexIsRejected) {
  std::string hex = sample_addr(1).to_hex();
  EXPECT_THROW(NetAddr::from_hex(hex.substr(1)), Error);  // odd length
  hex[3] = 'g';
  EXPECT_THROW(NetAddr::from_hex(hex), Error);
  EXPECT_THROW(MrDesc::from_hex(""), Error);
}

TEST(Serialization, RandomGarbageNeverCrashes) {
  std::mt19937 rng(7);
  auto valid = sample_desc(4).to_bytes();
  for (int i = 0; i < 20000; i++) {
    std::vector<uint8_t> b = valid;
    int flips = 1 + static_cast<int>(rng() % 4);
    for (int f = 0; f < flips; f++) b[rng() % b.size()] = static_cast<uint8_t>(rng());
    if (rng() % 4 == 0) b.resize(rng() % b.size());
    try {
      MrDesc d = MrDesc::from_bytes(b);
      EXPECT_EQ(MrDesc::from_bytes(d.to_bytes()), d);  // anything accepted is self-consistent
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kMalformed);
    }
  }
}

TEST(Serialization, ConstructorsRejectInconsistentValues) {
  EXPECT_THROW(NetAddr("tcp", {}), Error);
  EXPECT_THROW(NetAddr("tcp", {"a", "b", "c", "d", "e"}), Error);
  EXPECT_THROW(NetAddr("", {"a"}), Error);
  EXPECT_THROW(MrDesc(sample_addr(2), 0, 10, {RemoteKey{}}), Error);  // 1 key, 2 NICs
}

}  // namespace
}  // namespace fabric
