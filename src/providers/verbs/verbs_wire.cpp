#include "providers/verbs/verbs_wire.h"

#include <arpa/inet.h>
#include <fmt/format.h>

#include "util/bytes.h"

namespace fabric::verbs {
namespace {

constexpr uint8_t kAddressVersion = 1;
constexpr uint8_t kHandshakeMagic = 0xFB;
constexpr uint8_t kHandshakeVersion = 2;  // 2: the epoch
constexpr uint32_t kMaxQpn = (1u << 24) - 1;  // queue pair numbers and PSNs are 24-bit

void write_address(util::ByteWriter& w, const VerbsAddress& a) {
  w.u8(kAddressVersion);
  w.u8(0);  // reserved
  w.u16(a.lid);
  w.u32(a.ud_qpn);
  w.u64(a.nonce);
  w.raw(a.gid.data(), a.gid.size());
}

VerbsAddress read_address(util::ByteReader& r) {
  VerbsAddress a;
  if (uint8_t v = r.u8("version"); v != kAddressVersion)
    r.fail(fmt::format("unknown address version {}", v));
  if (r.u8("reserved") != 0) r.fail("reserved byte is not zero");
  a.lid = r.u16("lid");
  a.ud_qpn = r.u32("ud_qpn");
  if (a.ud_qpn == 0 || a.ud_qpn > kMaxQpn) r.fail(fmt::format("queue pair number {} out of range", a.ud_qpn));
  a.nonce = r.u64("nonce");
  std::string gid = r.str(a.gid.size(), "gid");
  std::copy(gid.begin(), gid.end(), a.gid.begin());
  return a;
}

uint32_t read_24bit(util::ByteReader& r, const char* field) {
  uint32_t v = r.u32(field);
  if (v > kMaxQpn) r.fail(fmt::format("{} {} does not fit in 24 bits", field, v));
  return v;
}

}  // namespace

std::string VerbsAddress::to_bytes() const {
  util::ByteWriter w;
  write_address(w, *this);
  auto v = w.take();
  return std::string(v.begin(), v.end());
}

VerbsAddress VerbsAddress::from_bytes(std::span<const uint8_t> bytes) {
  util::ByteReader r(bytes, "verbs address");
  VerbsAddress a = read_address(r);
  r.expect_end();
  return a;
}

std::string VerbsAddress::describe() const {
  char text[INET6_ADDRSTRLEN] = "?";
  inet_ntop(AF_INET6, gid.data(), text, sizeof text);
  return lid ? fmt::format("lid {} qpn {}", lid, ud_qpn) : fmt::format("gid {} qpn {}", text, ud_qpn);
}

std::vector<uint8_t> HandshakeMsg::to_bytes() const {
  util::ByteWriter w;
  w.u8(kHandshakeMagic);
  w.u8(kHandshakeVersion);
  w.u8(flags);
  w.u8(mtu);
  write_address(w, from);
  w.u64(to_nonce);
  w.u32(msg_qpn);
  w.u32(write_qpn);
  w.u32(msg_psn);
  w.u32(write_psn);
  w.u32(epoch);
  w.u32(to_msg_qpn);
  w.u32(to_write_qpn);
  return w.take();
}

HandshakeMsg HandshakeMsg::from_bytes(std::span<const uint8_t> bytes) {
  util::ByteReader r(bytes, "verbs handshake message");
  if (r.u8("magic") != kHandshakeMagic) r.fail("bad magic byte (not a fabric-lib handshake)");
  if (uint8_t v = r.u8("version"); v != kHandshakeVersion) r.fail(fmt::format("unknown version {}", v));
  HandshakeMsg m;
  m.flags = r.u8("flags");
  if (m.flags & ~(kConnected | kReady)) r.fail(fmt::format("unknown flags 0x{:x}", m.flags));
  if ((m.flags & kReady) && !(m.flags & kConnected)) r.fail("ready without connected");
  m.mtu = r.u8("mtu");
  if (m.mtu < 1 || m.mtu > 5) r.fail(fmt::format("MTU code {} out of range 1..5", m.mtu));
  m.from = read_address(r);
  m.to_nonce = r.u64("to_nonce");
  m.msg_qpn = read_24bit(r, "msg_qpn");
  m.write_qpn = read_24bit(r, "write_qpn");
  if (m.msg_qpn == 0 || m.write_qpn == 0) r.fail("queue pair number 0");
  m.msg_psn = read_24bit(r, "msg_psn");
  m.write_psn = read_24bit(r, "write_psn");
  m.epoch = r.u32("epoch");
  if (m.epoch == 0) r.fail("epoch 0");
  m.to_msg_qpn = read_24bit(r, "to_msg_qpn");
  m.to_write_qpn = read_24bit(r, "to_write_qpn");
  bool named = m.to_msg_qpn != 0 && m.to_write_qpn != 0, none = m.to_msg_qpn == 0 && m.to_write_qpn == 0;
  if ((m.flags & kConnected) ? !named : !none)
    r.fail((m.flags & kConnected) ? "connected without the receiver's queue pair numbers"
                                  : "receiver's queue pair numbers without connected");
  r.expect_end();
  return m;
}

}  // namespace fabric::verbs
