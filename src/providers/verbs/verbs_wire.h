// Wire formats of the verbs provider: the endpoint address a domain publishes (inside NetAddr) and
// the connection handshake message carried over UD. Both arrive from outside the process, so the
// parsers are strict: fixed sizes, known versions, no trailing bytes (fabric::Error kMalformed).
// No libibverbs here, so that unit tests and fuzz targets build everywhere.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace fabric::verbs {

// Where a domain's handshake (UD) queue pair listens, plus a random incarnation number: a restarted
// process may get the same queue pair number again, never the same nonce.
struct VerbsAddress {
  std::array<uint8_t, 16> gid{};  // RoCE v2: IPv4-mapped or IPv6 address; InfiniBand: port GID
  uint16_t lid = 0;               // InfiniBand only (0 on RoCE)
  uint32_t ud_qpn = 0;
  uint64_t nonce = 0;
  bool operator==(const VerbsAddress&) const = default;

  static constexpr size_t kSize = 32;
  std::string to_bytes() const;
  static VerbsAddress from_bytes(std::span<const uint8_t> bytes);
  std::string describe() const;  // "gid ::ffff:192.0.2.1 qpn 17" for messages
};

// One handshake message. Each side sends its two RC queue pair numbers and first packet sequence
// numbers; the flags say how far the sender has got, which is all the state machine needs. The
// epoch numbers the connection between the two domains: a side whose queue pairs failed (or that
// forgot the peer) makes new ones under a higher epoch, and the other side then replaces its own
// (epoch_step in handshake.h).
struct HandshakeMsg {
  static constexpr uint8_t kConnected = 1;  // sender's RC QPs point at the receiver's (RTR/RTS)
  static constexpr uint8_t kReady = 2;      // sender knows the receiver's QPs are connected too
  uint8_t flags = 0;
  uint8_t mtu = 0;  // sender's active MTU (enum ibv_mtu value, 1..5)
  VerbsAddress from;
  uint64_t to_nonce = 0;  // receiver's incarnation: messages for a previous process are dropped
  uint32_t msg_qpn = 0, write_qpn = 0;
  uint32_t msg_psn = 0, write_psn = 0;  // 24-bit
  uint32_t epoch = 1;                   // the sender's connection epoch with the receiver, >= 1
  // With kConnected: the receiver's queue pairs that the sender's point at (else 0), so that a
  // receiver that made new ones (it forgot the sender, and started at the same epoch) can tell.
  uint32_t to_msg_qpn = 0, to_write_qpn = 0;
  bool operator==(const HandshakeMsg&) const = default;

  static constexpr size_t kSize = 4 + VerbsAddress::kSize + 8 + 16 + 12;
  std::vector<uint8_t> to_bytes() const;
  static HandshakeMsg from_bytes(std::span<const uint8_t> bytes);
};

}  // namespace fabric::verbs
