// Writes the seed corpus of the fuzz targets with the library's own serialisers: a few valid values
// of each format, plus hand-picked malformed ones (each breaks one rule of the parser).
//   make_seeds <dir>   writes <dir>/<target>/<name>, replacing files of the same name.
// The committed corpus under tests/fuzz/corpus was produced by this program.
#include <cstdio>
#include <filesystem>
#include <functional>
#include <map>
#include <fstream>
#include <string>
#include <vector>

#include "fabric/error.h"
#include "fabric/types.h"
#include "kv/wire.h"
#include "providers/verbs/verbs_wire.h"

namespace fs = std::filesystem;
using Bytes = std::vector<uint8_t>;

namespace {

fs::path g_root;
int g_wrong = 0;

// Self-check: "valid-*" seeds must parse, "bad-*" seeds must be rejected with kMalformed.
bool accepts(const std::string& target, std::span<const uint8_t> b) {
  using namespace fabric;
  static const std::map<std::string, std::function<void(std::span<const uint8_t>)>> parsers = {
      {"netaddr_fuzz", [](auto b) { NetAddr::from_bytes(b); }},
      {"mrdesc_fuzz", [](auto b) { MrDesc::from_bytes(b); }},
      {"verbs_address_fuzz", [](auto b) { verbs::VerbsAddress::from_bytes(b); }},
      {"verbs_msg_fuzz", [](auto b) { verbs::HandshakeMsg::from_bytes(b); }},
      {"kv_wire_fuzz", [](auto b) {
         if (b.size() >= 4 && b[3] == 'V') kv::wire::parse_descriptor(b);
         else kv::wire::parse_admit(b);
       }},
      {"hex_fuzz", [](auto b) {
         std::string_view s(reinterpret_cast<const char*>(b.data()), b.size());
         try {
           NetAddr::from_hex(s);
         } catch (const Error&) {
           MrDesc::from_hex(s);
         }
       }},
  };
  auto it = parsers.find(target);
  if (it == parsers.end()) return true;
  try {
    it->second(b);
    return true;
  } catch (const fabric::Error& e) {
    if (e.code() != fabric::ErrorCode::kMalformed) throw;
    return false;
  }
}

void put(const std::string& target, const std::string& name, const Bytes& b) {
  bool valid = name.rfind("valid-", 0) == 0, bad = name.rfind("bad-", 0) == 0;
  if ((valid || bad) && accepts(target, b) != valid) {
    std::fprintf(stderr, "make_seeds: %s/%s is %s\n", target.c_str(), name.c_str(),
                 valid ? "rejected" : "accepted");
    g_wrong++;
  }
  fs::create_directories(g_root / target);
  std::ofstream(g_root / target / name, std::ios::binary).write(reinterpret_cast<const char*>(b.data()),
                                                                static_cast<std::streamsize>(b.size()));
}
void put(const std::string& target, const std::string& name, const std::string& s) {
  put(target, name, Bytes(s.begin(), s.end()));
}

Bytes cut(Bytes b, size_t n) {
  b.resize(n);
  return b;
}
Bytes set(Bytes b, size_t at, uint8_t v) {
  b.at(at) = v;
  return b;
}
Bytes plus(Bytes b, uint8_t v) {
  b.push_back(v);
  return b;
}

fabric::verbs::VerbsAddress verbs_addr(uint32_t qpn, bool ib) {
  fabric::verbs::VerbsAddress a;
  if (ib) {
    a.lid = 0x12;
    a.gid = {0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0x02, 0x11, 0x22, 0xff, 0xfe, 0x33, 0x44, 0x55};
  } else {  // RoCE v2, IPv4-mapped ::ffff:192.0.2.1
    a.gid = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 192, 0, 2, 1};
  }
  a.ud_qpn = qpn;
  a.nonce = 0x5eed0000c0ffee00ull + qpn;
  return a;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s <corpus dir>\n", argv[0]);
    return 2;
  }
  g_root = argv[1];
  using fabric::MrDesc;
  using fabric::NetAddr;
  using fabric::RemoteKey;
  using fabric::verbs::HandshakeMsg;
  using fabric::verbs::VerbsAddress;

  // --- NetAddr
  std::string vb = verbs_addr(0x11, false).to_bytes();
  std::vector<std::pair<std::string, NetAddr>> addrs = {
      {"tcp-1nic", NetAddr("tcp;ofi_rxm", {"fi_sockaddr_in://10.0.0.1:40001"})},
      {"shm-2nics", NetAddr("shm", {"fi_shm://1234/a", "fi_shm://1234/b"})},
      {"efa-4nics-local", NetAddr("efa", {std::string(32, '\x01'), std::string(32, '\x02'),
                                          std::string(32, '\x03'), std::string(32, '\x04')},
                                  "host-7f3a/cuda_ipc/0")},
      {"verbs-1nic", NetAddr("verbs", {vb})},
      {"max-lengths", NetAddr(std::string(64, 'p'), {std::string(256, 'n')}, std::string(100, 'l'))},
      // Text fields in multi-byte UTF-8 (2, 3 and 4 bytes, U+10FFFF); NIC addresses are binary and
      // may hold bytes that are not UTF-8 at all.
      {"utf8-text-binary-nic", NetAddr("tcp-\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80",
                                       {std::string("\xff\x00\xc0\xaf\xed\xa0\x80\xf4\x90", 9)},
                                       "host-\xf4\x8f\xbf\xbf/cuda_ipc/0")},
  };
  for (auto& [name, a] : addrs) put("netaddr_fuzz", "valid-" + name, a.to_bytes());
  Bytes a1 = addrs[0].second.to_bytes();
  put("netaddr_fuzz", "bad-truncated", cut(a1, a1.size() - 1));
  put("netaddr_fuzz", "bad-trailing-byte", plus(a1, 0));
  put("netaddr_fuzz", "bad-magic", set(a1, 0, 'X'));
  put("netaddr_fuzz", "bad-version-1", set(a1, 4, 1));
  put("netaddr_fuzz", "bad-provider-len-0", set(a1, 5, 0));
  size_t worker_count_at = 6 + addrs[0].second.provider().size();
  size_t nic_count_at = worker_count_at + 1;
  put("netaddr_fuzz", "bad-worker-count-0", set(a1, worker_count_at, 0));
  put("netaddr_fuzz", "bad-worker-count-9", set(a1, worker_count_at, 9));
  const NetAddr two_workers("tcp;ofi_rxm", std::vector<std::vector<std::string>>{{"a0", "a1"}, {"b0", "b1"}},
                            std::vector<std::string>{"", ""});
  put("netaddr_fuzz", "valid-two-workers", two_workers.to_bytes());
  put("mrdesc_fuzz", "valid-on-worker-1", MrDesc(two_workers, 0x1000, 4096, {{1, 0}, {2, 0}}, std::nullopt, 1).to_bytes());
  put("netaddr_fuzz", "bad-nic-count-0", set(a1, nic_count_at, 0));
  put("netaddr_fuzz", "bad-nic-count-5", set(a1, nic_count_at, 5));
  put("netaddr_fuzz", "bad-nic-len-0", set(set(a1, nic_count_at + 1, 0), nic_count_at + 2, 0));
  put("netaddr_fuzz", "bad-empty", Bytes{});
  // Text fields that are not UTF-8 (provider "tcp;ofi_rxm" starts at byte 6; the local endpoint of
  // efa-4nics-local is its last 20 bytes).
  put("netaddr_fuzz", "bad-provider-byte-ff", set(a1, 6, 0xff));
  put("netaddr_fuzz", "bad-provider-overlong", set(set(a1, 6, 0xc0), 7, 0xaf));
  put("netaddr_fuzz", "bad-provider-surrogate", set(set(set(a1, 6, 0xed), 7, 0xa0), 8, 0x80));
  put("netaddr_fuzz", "bad-provider-above-10ffff", set(set(set(set(a1, 6, 0xf4), 7, 0x90), 8, 0x80), 9, 0x80));
  put("netaddr_fuzz", "bad-provider-truncated-seq", set(a1, 6 + addrs[0].second.provider().size() - 1, 0xe2));
  Bytes a_local = addrs[2].second.to_bytes();
  put("netaddr_fuzz", "bad-local-not-utf8", set(a_local, a_local.size() - 5, 0x80));  // the local text, then u32 max_message

  // --- MrDesc
  NetAddr owner2 = addrs[1].second, owner4 = addrs[2].second;
  std::vector<std::pair<std::string, MrDesc>> descs = {
      {"1nic", MrDesc(addrs[0].second, 0x7f0000000000, 1 << 20, {{0x1000, 0x7f0000000000}})},
      {"2nics", MrDesc(owner2, 0x10000, 4096, {{1, 0}, {2, 0}})},
      {"4nics-and-local", MrDesc(owner4, 0x7f00deadb000, 1ull << 30, {{1, 2}, {3, 4}, {5, 6}, {7, 8}},
                                 RemoteKey{0xabc, 0x7f00deadb000})},
      {"local-only", MrDesc(owner4, 0x1000, 64, {}, RemoteKey{9, 0})},
      {"addr-len-at-limit", MrDesc(addrs[3].second, ~0ull - 10, 10, {{42, 0}})},
      {"len-0", MrDesc(addrs[3].second, 0, 0, {{42, 0}})},
      {"reserved-imms", MrDesc(owner2, 0x10000, 4096, {{1, 0}, {2, 0}}, std::nullopt, 0, fabric::ImmRange{0xF0000000, 28})},
  };
  for (auto& [name, d] : descs) put("mrdesc_fuzz", "valid-" + name, d.to_bytes());
  Bytes d1 = descs[0].second.to_bytes();
  size_t after_owner = 9 + a1.size();  // magic, version, u32 owner length, owner
  size_t key_count_at = after_owner + 1 + 16;  // worker, addr, len
  put("mrdesc_fuzz", "bad-worker-1-of-1", set(d1, after_owner, 1));
  put("mrdesc_fuzz", "bad-truncated", cut(d1, d1.size() - 1));
  put("mrdesc_fuzz", "bad-trailing-byte", plus(d1, 0));
  put("mrdesc_fuzz", "bad-magic", set(d1, 2, 'X'));
  put("mrdesc_fuzz", "bad-owner-len-too-long", set(d1, 5, 0xff));
  put("mrdesc_fuzz", "bad-owner-len-short", set(d1, 5, static_cast<uint8_t>(a1.size() - 1)));
  put("mrdesc_fuzz", "bad-key-count-2", set(d1, key_count_at, 2));
  constexpr size_t kImmTrailer = 5;  // u32 imm base, u8 imm bits: the last bytes
  const Bytes whole_space = {0, 0, 0, 0, 32};
  auto with_trailer = [&](Bytes b) {
    b.insert(b.end(), whole_space.begin(), whole_space.end());
    return b;
  };
  put("mrdesc_fuzz", "bad-local-flag-2", set(d1, d1.size() - 1 - kImmTrailer, 2));
  put("mrdesc_fuzz", "bad-no-key", with_trailer(cut(set(d1, key_count_at, 0), key_count_at + 2)));
  put("mrdesc_fuzz", "bad-imm-bits-0", set(d1, d1.size() - 1, 0));
  put("mrdesc_fuzz", "bad-imm-bits-33", set(d1, d1.size() - 1, 33));
  put("mrdesc_fuzz", "bad-imm-base-misaligned", set(descs.back().second.to_bytes(), descs.back().second.to_bytes().size() - kImmTrailer, 1));
  put("mrdesc_fuzz", "bad-addr-len-overflow", set(descs[4].second.to_bytes(), 9 + addrs[3].second.to_bytes().size() + 1 + 8, 11));
  Bytes local_no_endpoint = cut(descs[0].second.to_bytes(), d1.size() - kImmTrailer);  // has_local = 1 for an owner without one
  local_no_endpoint.back() = 1;
  for (int i = 0; i < 16; i++) local_no_endpoint.push_back(static_cast<uint8_t>(i));
  put("mrdesc_fuzz", "bad-local-key-no-endpoint", with_trailer(local_no_endpoint));
  put("mrdesc_fuzz", "bad-owner-provider-not-utf8", set(d1, 9 + 6, 0xff));  // owner's provider byte 0

  // --- hex (text)
  put("hex_fuzz", "valid-netaddr-tcp", addrs[0].second.to_hex());
  put("hex_fuzz", "valid-netaddr-verbs", addrs[3].second.to_hex());
  put("hex_fuzz", "valid-mrdesc-1nic", descs[0].second.to_hex());
  put("hex_fuzz", "valid-mrdesc-local-only", descs[3].second.to_hex());
  std::string upper = descs[1].second.to_hex();
  for (char& c : upper) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  put("hex_fuzz", "valid-mrdesc-2nics-upper", upper);
  put("hex_fuzz", "hex-not-a-value", std::string("00ff10aBcD"));
  std::string h = addrs[0].second.to_hex();
  put("hex_fuzz", "bad-odd-length", h.substr(0, h.size() - 1));
  put("hex_fuzz", "bad-char-g", h.substr(0, 10) + "g" + h.substr(11));
  put("hex_fuzz", "bad-space", " " + h.substr(1));

  // --- VerbsAddress
  std::vector<std::pair<std::string, VerbsAddress>> vas = {
      {"roce", verbs_addr(0x11, false)}, {"ib", verbs_addr(0x2a5, true)}, {"qpn-max", verbs_addr(0xffffff, false)}};
  for (auto& [name, a] : vas) put("verbs_address_fuzz", "valid-" + name, a.to_bytes());
  std::string v0s = vas[0].second.to_bytes();
  Bytes v0(v0s.begin(), v0s.end());
  put("verbs_address_fuzz", "bad-truncated", cut(v0, v0.size() - 1));
  put("verbs_address_fuzz", "bad-trailing-byte", plus(v0, 0));
  put("verbs_address_fuzz", "bad-version-2", set(v0, 0, 2));
  put("verbs_address_fuzz", "bad-reserved", set(v0, 1, 1));
  put("verbs_address_fuzz", "bad-qpn-0", set(v0, 4, 0));
  put("verbs_address_fuzz", "bad-qpn-25bit", set(v0, 7, 1));

  // --- HandshakeMsg
  auto msg = [&](uint8_t flags, uint8_t mtu, uint32_t psn) {
    HandshakeMsg m;
    m.flags = flags;
    m.mtu = mtu;
    m.from = verbs_addr(0x11, false);
    m.to_nonce = 0x5eed0000c0ffee00ull + 0x22;
    m.msg_qpn = 0x23;
    m.write_qpn = 0x24;
    m.msg_psn = psn;
    m.write_psn = psn ^ 0x5a5a5a;
    m.epoch = 1;
    if (flags & HandshakeMsg::kConnected) {  // the receiver's queue pairs it points at
      m.to_msg_qpn = 0x33;
      m.to_write_qpn = 0x34;
    }
    return m.to_bytes();
  };
  put("verbs_msg_fuzz", "valid-hello", msg(0, 3, 0x123456));
  put("verbs_msg_fuzz", "valid-connected", msg(HandshakeMsg::kConnected, 5, 1));
  put("verbs_msg_fuzz", "valid-ready", msg(HandshakeMsg::kConnected | HandshakeMsg::kReady, 1, 0xffffff));
  Bytes m0 = msg(HandshakeMsg::kConnected, 3, 7);
  put("verbs_msg_fuzz", "bad-truncated", cut(m0, m0.size() - 1));
  put("verbs_msg_fuzz", "bad-trailing-byte", plus(m0, 0));
  put("verbs_msg_fuzz", "bad-magic", set(m0, 0, 0));
  put("verbs_msg_fuzz", "bad-version", set(m0, 1, 1));  // version 1: no epoch
  put("verbs_msg_fuzz", "bad-flags-ready-only", set(m0, 2, HandshakeMsg::kReady));
  put("verbs_msg_fuzz", "bad-flags-unknown", set(m0, 2, 4));
  put("verbs_msg_fuzz", "bad-mtu-0", set(m0, 3, 0));
  put("verbs_msg_fuzz", "bad-mtu-6", set(m0, 3, 6));
  put("verbs_msg_fuzz", "bad-address-version", set(m0, 4, 0));
  put("verbs_msg_fuzz", "bad-qpn-0", set(set(m0, 44, 0), 45, 0));  // msg_qpn 0x23 -> 0
  put("verbs_msg_fuzz", "bad-psn-25bit", set(m0, 55, 1));
  put("verbs_msg_fuzz", "bad-epoch-0", set(m0, 60, 0));                       // epoch 1 -> 0
  put("verbs_msg_fuzz", "bad-connected-unnamed", set(m0, 64, 0));             // to_msg_qpn 0x33 -> 0
  put("verbs_msg_fuzz", "bad-named-not-connected", set(msg(0, 3, 7), 68, 1));  // to_write_qpn 0 -> 1
  put("verbs_msg_fuzz", "bad-to-qpn-25bit", set(m0, 67, 1));

  // --- Handshake simulation (format in verbs_handshake_fuzz.cpp): 4 header bytes, then ops.
  auto tick = [](uint8_t ms) { return static_cast<uint8_t>(ms & 63); };
  constexpr uint8_t kDeliver0 = 0x40, kLose0 = 0x80, kDup0 = 0xe0, kForge = 0xc0;
  put("verbs_handshake_fuzz", "a-starts-lossless", Bytes{0, 20, 100, 125, tick(0), kDeliver0, kDeliver0, kDeliver0, tick(1)});
  put("verbs_handshake_fuzz", "both-start-lossless",
      Bytes{1, 20, 100, 125, tick(0), kDeliver0, kDeliver0, kDeliver0, kDeliver0, kDeliver0, kDeliver0, tick(1)});
  put("verbs_handshake_fuzz", "lossy-retransmit",
      Bytes{0, 5, 40, 60, tick(0), kLose0, tick(5), kDeliver0, kLose0, tick(20), tick(20), kDeliver0, kDeliver0,
            kDeliver0});
  put("verbs_handshake_fuzz", "duplicated-and-reordered",
      Bytes{1, 10, 30, 50, tick(0), kDup0, kDup0, kDeliver0 | 2, kDeliver0 | 1, kDeliver0, kDeliver0, kDeliver0,
            kDeliver0, kDeliver0, kDeliver0});
  put("verbs_handshake_fuzz", "dead-peer-times-out", Bytes{0, 20, 60, 25, tick(63), tick(63), tick(63), tick(63)});
  put("verbs_handshake_fuzz", "forged-flags", Bytes{0, 20, 100, 125, kForge | 0x13, kForge | 0x01, tick(10), kDeliver0});
  put("verbs_handshake_fuzz", "zero-timings", Bytes{1, 0, 0, 0, tick(0), kDeliver0, tick(0)});

  // --- KV descriptor and admit message
  {
    using namespace fabric::kv;
    const NetAddr owner("tcp;ofi_rxm", {"fi_sockaddr_in://10.0.0.9:40009"});
    wire::Descriptor d;
    d.rank = {.group = 7, .tp = {2, 1}, .total_heads = 8};
    d.layout = {.num_layers = 2, .num_pages = 64, .page_tokens = 16, .kv_heads = 4, .head_dim = 128,
                .dtype_bytes = 2, .order = PageOrder::kTokenMajor, .page_stride = 0};
    for (uint64_t i = 0; i < 2; i++) {
      d.k.push_back(MrDesc(owner, 0x100000 * (2 * i + 1), 1 << 20, {{1 + i, 0}}));
      d.v.push_back(MrDesc(owner, 0x100000 * (2 * i + 2), 1 << 20, {{5 + i, 0}}));
    }
    Bytes plain = wire::encode(d);
    put("kv_wire_fuzz", "valid-descriptor", plain);
    d.extra_slots = 4;
    d.extra_bytes = 8192;
    d.extras = MrDesc(owner, 0x900000, 4 * 8192, {{9, 0}});
    put("kv_wire_fuzz", "valid-descriptor-extras", wire::encode(d));
    put("kv_wire_fuzz", "bad-descriptor-truncated", cut(plain, plain.size() - 1));
    put("kv_wire_fuzz", "bad-descriptor-trailing", plus(plain, 0));
    put("kv_wire_fuzz", "bad-descriptor-version", set(plain, 4, 1));
    const size_t layers_at = 4 + 1 + 8 + 4 + 4 + 4;
    put("kv_wire_fuzz", "bad-descriptor-layers-0", set(plain, layers_at, 0));
    put("kv_wire_fuzz", "bad-descriptor-tp-rank", set(plain, 4 + 1 + 8 + 4, 2));
    wire::Admit a{.group = 7, .request = 42, .prefill_size = 2, .extra_slot = std::nullopt, .pages = {3, 1, 4, 1, 5}};
    Bytes admit = wire::encode(a);
    put("kv_wire_fuzz", "valid-admit", admit);
    a.extra_slot = 3;
    put("kv_wire_fuzz", "valid-admit-extras", wire::encode(a));
    a.pages.clear();
    put("kv_wire_fuzz", "valid-admit-empty", wire::encode(a));
    const size_t flag_at = 4 + 1 + 8 + 8 + 4;
    put("kv_wire_fuzz", "bad-admit-flag-2", set(admit, flag_at, 2));
    put("kv_wire_fuzz", "bad-admit-slot-without-flag", set(admit, flag_at + 1, 1));
    put("kv_wire_fuzz", "bad-admit-page-count", set(admit, flag_at + 5, 9));
    put("kv_wire_fuzz", "bad-admit-trailing", plus(admit, 0));
  }
  return g_wrong ? 1 : 0;
}
