// NetAddr and MrDesc wire formats: round trips, and strict rejection of malformed input.
#include <gtest/gtest.h>

#include <random>

#include "fabric/error.h"
#include "fabric/types.h"
#include "util/bytes.h"

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
  constexpr size_t kImmTrailer = 5;  // u32 imm base, u8 imm bits
  bad_d[d.size() - kImmTrailer - 1 - 2 * 16 - 1] = 3;  // (flag byte, then the imm range) key count no longer matches
  expect_malformed(bad_d, true);
  for (uint8_t bits : {uint8_t{0}, uint8_t{33}}) {  // an immediate range of no bits, or more than 32
    bad_d = d;
    bad_d.back() = bits;
    expect_malformed(bad_d, true);
  }
  bad_d = MrDesc(sample_addr(2), 0x1000, 64, {{1, 0}, {2, 0}}, std::nullopt, 0, ImmRange{0x10000000, 28}).to_bytes();
  bad_d[bad_d.size() - kImmTrailer] = 1;  // base 0x10000001: not a multiple of 2^28
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
  const size_t flag_at = bytes.size() - 5 - 17;  // before the local key and the imm range
  bytes[flag_at] = 0;                            // clear the local-key flag: no key left
  bytes.erase(bytes.begin() + static_cast<std::ptrdiff_t>(flag_at) + 1, bytes.begin() + static_cast<std::ptrdiff_t>(flag_at) + 17);
  expect_malformed(bytes, true);
}

TEST(Serialization, TheImmediateRangeRoundTripsAndBadRangesAreRefused) {
  const MrDesc whole = sample_desc(1);
  EXPECT_EQ(whole.imms(), (ImmRange{0, 32})) << "an unreserved region takes its immediates as they come";
  MrDesc reserved(sample_addr(2), 0x1000, 64, {{1, 0}, {2, 0}}, std::nullopt, 0, ImmRange{0xF0000000, 28});
  const MrDesc back = MrDesc::from_bytes(reserved.to_bytes());
  EXPECT_EQ(back, reserved);
  EXPECT_EQ(back.imms(), (ImmRange{0xF0000000, 28}));
  EXPECT_NE(back, MrDesc(sample_addr(2), 0x1000, 64, {{1, 0}, {2, 0}}, std::nullopt, 0, ImmRange{0xE0000000, 28}));
  EXPECT_THROW(MrDesc(sample_addr(1), 0, 1, {{1, 0}}, std::nullopt, 0, ImmRange{0x100, 28}), Error);  // misaligned
  EXPECT_THROW(MrDesc(sample_addr(1), 0, 1, {{1, 0}}, std::nullopt, 0, ImmRange{0, 0}), Error);
  const ImmRange r{0xF0000000, 28};
  EXPECT_EQ(r.imm(5), 0xF0000005u);
  EXPECT_TRUE(r.contains(0xFFFFFFFF));
  EXPECT_FALSE(r.contains(0xEFFFFFFF));
  EXPECT_THROW(r.imm(1u << 28), Error);
  EXPECT_TRUE(r.overlaps(ImmRange{0, 32}));
  EXPECT_FALSE(r.overlaps(ImmRange{0xE0000000, 28}));
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

// --- Text fields must be UTF-8 (they reach error messages and Python str); NIC addresses are binary.

// Byte sequences that are not well-formed UTF-8, and ones that are (the boundaries of each length).
const std::vector<std::string> kNotUtf8 = {
    "\xff", "\xfe", "\x80", "\xbf",          // never a lead byte / a lone continuation byte
    "\xc0\xaf", "\xc1\xbf",                 // overlong two-byte forms ('/', U+007F)
    "\xe0\x80\xaf", "\xe0\x9f\xbf",        // overlong three-byte forms
    "\xf0\x80\x80\xaf", "\xf0\x8f\xbf\xbf", // overlong four-byte forms
    "\xed\xa0\x80", "\xed\xbf\xbf",        // surrogates U+D800, U+DFFF
    "\xf4\x90\x80\x80", "\xf5\x80\x80\x80", "\xf7\xbf\xbf\xbf",  // above U+10FFFF
    "\xf8\x88\x80\x80\x80", "\xfc\x84\x80\x80\x80\x80",   // five- and six-byte forms
    "\xc3", "\xe2\x82", "\xf0\x9f\x98",     // truncated at the end
    "\xc3(", "\xe2\x82(", "\xf0\x9f\x98(",  // truncated before an ASCII byte
};
const std::vector<std::string> kUtf8 = {
    std::string("\0", 1), "\x7f", "\xc2\x80", "\xc3\xa9", "\xdf\xbf", "\xe0\xa0\x80", "\xe2\x82\xac",
    "\xed\x9f\xbf", "\xee\x80\x80", "\xef\xbf\xbf", "\xf0\x90\x80\x80", "\xf0\x9f\x98\x80",
    "\xf4\x8f\xbf\xbf",
};

// An independent decoder: lead byte gives the length, continuation bytes 10xxxxxx, then the code
// point must be minimal for its length, not a surrogate, at most U+10FFFF.
bool oracle_utf8(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    auto b = static_cast<uint8_t>(s[i]);
    size_t len = b < 0x80 ? 1 : (b >> 5) == 6 ? 2 : (b >> 4) == 14 ? 3 : (b >> 3) == 30 ? 4 : 0;
    if (len == 0 || s.size() - i < len) return false;
    uint32_t cp = b & (0xffu >> (len + (len > 1)));
    for (size_t k = 1; k < len; k++) {
      auto c = static_cast<uint8_t>(s[i + k]);
      if ((c & 0xc0) != 0x80) return false;
      cp = cp << 6 | (c & 0x3f);
    }
    const uint32_t min[] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < min[len] || (cp >= 0xd800 && cp <= 0xdfff) || cp > 0x10ffff) return false;
    i += len;
  }
  return true;
}

TEST(Utf8, ValidatorAgreesWithAnIndependentDecoderOnEveryShortSequence) {
  for (auto& s : kNotUtf8) EXPECT_FALSE(util::is_utf8(s)) << util::to_hex({reinterpret_cast<const uint8_t*>(s.data()), s.size()});
  for (auto& s : kUtf8) EXPECT_TRUE(util::is_utf8(s)) << util::to_hex({reinterpret_cast<const uint8_t*>(s.data()), s.size()});
  // Every string of 1, 2 and 3 bytes, and every 4-byte string with a lead byte >= 0xf0 (the
  // only four-byte leads) over a spread of continuation bytes.
  std::string s;
  for (uint32_t v = 0; v < (1u << 24); v++) {
    size_t len = v < 0x100 ? 1 : v < 0x10000 ? 2 : 3;
    s.assign(len, 0);
    for (size_t k = 0; k < len; k++) s[k] = static_cast<char>(v >> (8 * k));
    ASSERT_EQ(util::is_utf8(s), oracle_utf8(s)) << std::hex << v;
  }
  s.assign(4, 0);
  const uint8_t conts[] = {0x00, 0x7f, 0x80, 0x8f, 0x90, 0x9f, 0xa0, 0xbf, 0xc0, 0xff};
  for (uint32_t lead = 0xf0; lead <= 0xff; lead++)
    for (uint32_t b1 = 0; b1 < 256; b1++)
      for (uint8_t b2 : conts)
        for (uint8_t b3 : conts) {
          s = {static_cast<char>(lead), static_cast<char>(b1), static_cast<char>(b2), static_cast<char>(b3)};
          ASSERT_EQ(util::is_utf8(s), oracle_utf8(s)) << std::hex << lead << " " << b1;
        }
  EXPECT_EQ(util::utf8_error_offset("ab\xc3\xa9\xff" "cd"), 4u);
  EXPECT_EQ(util::utf8_error_offset("abc\xe2\x82"), 3u);
  EXPECT_EQ(util::utf8_error_offset("abc"), std::string_view::npos);
}

// The bytes of sample_addr(2) with `field` ("provider" or "local") replaced by `text`, written
// in place of a placeholder of the same length (the constructor refuses non-UTF-8 text).
std::vector<uint8_t> addr_with_text(const std::string& field, const std::string& text) {
  std::string placeholder(text.size(), 'x');
  NetAddr a = field == "provider" ? NetAddr(placeholder, {"nic0", "nic1"}, "host/ipc")
                                  : NetAddr("tcp;ofi_rxm", {"nic0", "nic1"}, placeholder);
  auto b = a.to_bytes();
  size_t at = field == "provider" ? 6 : b.size() - 4 - text.size();  // the local text, then u32 max_message
  std::copy(text.begin(), text.end(), b.begin() + static_cast<std::ptrdiff_t>(at));
  return b;
}

void expect_rejected_naming(std::span<const uint8_t> bytes, bool desc, const std::string& field) {
  try {
    if (desc) MrDesc::from_bytes(bytes);
    else NetAddr::from_bytes(bytes);
    ADD_FAILURE() << "accepted a " << field << " that is not UTF-8";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kMalformed);
    std::string what = e.what();
    EXPECT_NE(what.find("'" + field + "'"), std::string::npos) << what;
    EXPECT_NE(what.find("not valid UTF-8"), std::string::npos) << what;
    EXPECT_TRUE(util::is_utf8(what)) << "the message itself must be UTF-8";
  }
}

TEST(Serialization, TextFieldsThatAreNotUtf8AreRejectedNamingTheField) {
  for (const std::string field : {"provider", "local"}) {
    for (auto& bad : kNotUtf8) {
      for (const std::string& text : {bad, "tcp" + bad, bad + "rxm", "a\xc3\xa9" + bad + "z"}) {
        auto b = addr_with_text(field, text);
        expect_rejected_naming(b, false, field == "provider" ? "provider" : "local endpoint");
        // The same owner inside a descriptor.
        NetAddr placeholder_owner = NetAddr::from_bytes(addr_with_text(field, std::string(text.size(), 'x')));
        auto d = MrDesc(placeholder_owner, 0x1000, 64, {{1, 0}, {2, 0}}, RemoteKey{3, 0}).to_bytes();
        std::copy(b.begin(), b.end(), d.begin() + 9);  // magic, version, u32 owner length
        expect_rejected_naming(d, true, field == "provider" ? "provider" : "local endpoint");
      }
    }
  }
}

TEST(Serialization, Utf8TextAndBinaryNicAddressesRoundTrip) {
  for (auto& good : kUtf8) {
    for (const std::string field : {"provider", "local"}) {
      auto b = addr_with_text(field, "t" + good + "/x");
      NetAddr a = NetAddr::from_bytes(b);
      EXPECT_EQ(a.to_bytes(), b);
      EXPECT_EQ(field == "provider" ? a.provider() : a.local(), "t" + good + "/x");
    }
  }
  // NIC addresses are sockaddr / verbs bytes: anything goes, including what is not UTF-8.
  std::vector<std::string> nics;
  for (auto& bad : kNotUtf8) nics.push_back(bad + std::string("\0\xff", 2));
  nics.resize(kMaxNics);
  NetAddr a("efa", nics, "boot-id/fabric-ipc-1-0");
  EXPECT_EQ(NetAddr::from_bytes(a.to_bytes()), a);
  MrDesc d(a, 0x1000, 64, {{1, 0}, {2, 0}, {3, 0}, {4, 0}}, RemoteKey{5, 0});
  EXPECT_EQ(MrDesc::from_bytes(d.to_bytes()), d);
}

TEST(Serialization, ConstructorsRejectTextThatIsNotUtf8) {
  for (auto& bad : kNotUtf8) {
    try {
      NetAddr("tcp" + bad, {"nic0"});
      ADD_FAILURE() << "constructed a provider that is not UTF-8";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    }
    EXPECT_THROW(NetAddr("tcp", {"nic0"}, "host/" + bad), Error);
    EXPECT_NO_THROW(NetAddr("tcp", {"nic" + bad}));
  }
}

}  // namespace
}  // namespace fabric
