// fabric::verbs::HandshakeMsg::from_bytes on arbitrary bytes: the UD datagrams of the verbs
// connection handshake, which anyone on the fabric can send to a domain's handshake queue pair.
//
// Property: fixed 72-byte format (magic, version, flags, MTU, a VerbsAddress, the receiver's nonce,
// two queue pair numbers and two PSNs, the epoch, the receiver's two queue pair numbers), every
// field stored verbatim and range-checked, so an accepted input re-serialises to itself and parses
// again to an equal value. What the domain then relies on: flags are a valid state (ready implies
// connected), the MTU code is 1..5, queue pair numbers are non-zero, every 24-bit field fits in
// 24 bits, the epoch is at least 1, and the receiver's queue pairs are named exactly when the
// sender says it is connected.
#include <algorithm>

#include "fuzz_support.h"
#include "providers/verbs/verbs_wire.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using fabric::verbs::HandshakeMsg;
  std::span<const uint8_t> in(data, size);
  auto m = fuzz::parse([&] { return HandshakeMsg::from_bytes(in); });
  if (!m) return 0;

  FUZZ_CHECK(size == HandshakeMsg::kSize);
  auto bytes = fuzz::must([&] { return m->to_bytes(); });
  FUZZ_CHECK(std::equal(bytes.begin(), bytes.end(), in.begin(), in.end()));
  FUZZ_CHECK(fuzz::must([&] { return HandshakeMsg::from_bytes(bytes); }) == *m);

  constexpr uint32_t k24 = 1u << 24;
  uint8_t f = m->flags;
  FUZZ_CHECK((f & ~(HandshakeMsg::kConnected | HandshakeMsg::kReady)) == 0);
  FUZZ_CHECK(!(f & HandshakeMsg::kReady) || (f & HandshakeMsg::kConnected));
  FUZZ_CHECK(m->mtu >= 1 && m->mtu <= 5);
  FUZZ_CHECK(m->msg_qpn != 0 && m->write_qpn != 0 && m->from.ud_qpn != 0);
  FUZZ_CHECK(m->msg_qpn < k24 && m->write_qpn < k24 && m->msg_psn < k24 && m->write_psn < k24 &&
             m->from.ud_qpn < k24 && m->to_msg_qpn < k24 && m->to_write_qpn < k24);
  FUZZ_CHECK(m->epoch >= 1);
  if (f & HandshakeMsg::kConnected) FUZZ_CHECK(m->to_msg_qpn != 0 && m->to_write_qpn != 0);
  else FUZZ_CHECK(m->to_msg_qpn == 0 && m->to_write_qpn == 0);
  return 0;
}
