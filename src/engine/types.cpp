// Wire formats of NetAddr and MrDesc, with strict validation of everything that comes back in.
//
// Text fields (the provider name and the local endpoint "<scope>/<name>") must be well-formed UTF-8:
// they end up in error messages and Python str. NIC endpoint addresses are binary (sockaddr bytes,
// verbs addresses) and may hold any bytes.
//
// NetAddr: "FBNA" u8 version u8 provider_len provider u8 worker_count u8 nic_count
//          { { u16 len, bytes }*nic_count u16 local_len local }*worker_count u32 max_message
// MrDesc:  "FBMD" u8 version NetAddr-bytes(u32 len + bytes) u8 worker u64 addr u64 len
//          u8 n { u64 rkey u64 base }* u8 has_local [u64 rkey u64 base] u32 imm_base u8 imm_bits
#include "fabric/types.h"

#include <cstring>

#include "util/bytes.h"

namespace fabric {

namespace {
constexpr char kAddrMagic[4] = {'F', 'B', 'N', 'A'};
constexpr char kDescMagic[4] = {'F', 'B', 'M', 'D'};
constexpr uint8_t kAddrVersion = 4;  // 3: several workers per engine; 4: the longest message
constexpr uint8_t kDescVersion = 4;  // 4: the immediate range

void check_magic(util::ByteReader& r, const char (&magic)[4], uint8_t version) {
  for (char m : magic)
    if (r.u8("magic") != static_cast<uint8_t>(m)) r.fail("bad magic (not a fabric-lib value)");
  uint8_t v = r.u8("version");
  if (v != version) r.fail("unsupported version " + std::to_string(v));
}

void validate_nic_count(size_t n, const char* what) {
  if (n < 1 || n > kMaxNics)
    throw Error(ErrorCode::kMalformed, std::string(what) + ": NIC count " + std::to_string(n) +
                                           " outside 1.." + std::to_string(kMaxNics));
}
}  // namespace

NetAddr::NetAddr(std::string provider, std::vector<std::string> nic_addrs, std::string local)
    : NetAddr(std::move(provider), std::vector<std::vector<std::string>>{std::move(nic_addrs)},
              std::vector<std::string>{std::move(local)}) {}

NetAddr::NetAddr(std::string provider, std::vector<std::vector<std::string>> nic_addrs,
                 std::vector<std::string> locals, uint32_t max_message)
    : provider_(std::move(provider)), nics_(std::move(nic_addrs)), locals_(std::move(locals)),
      max_message_(max_message) {
  if (nics_.empty() || nics_.size() > kMaxWorkers)
    throw Error(ErrorCode::kInvalidArgument,
                "NetAddr: worker count " + std::to_string(nics_.size()) + " outside 1.." +
                    std::to_string(kMaxWorkers));
  if (locals_.size() != nics_.size())
    throw Error(ErrorCode::kInvalidArgument, "NetAddr: one local endpoint (or \"\") per worker");
  validate_nic_count(nics_[0].size(), "NetAddr");
  if (provider_.empty() || provider_.size() > kMaxProviderNameLen)
    throw Error(ErrorCode::kInvalidArgument, "NetAddr: provider name length must be 1..64");
  for (auto& worker : nics_) {
    if (worker.size() != nics_[0].size())
      throw Error(ErrorCode::kInvalidArgument,
                  "NetAddr: every worker must have the same number of NICs (rail-aligned)");
    for (auto& n : worker)
      if (n.empty() || n.size() > kMaxNicAddrLen)
        throw Error(ErrorCode::kInvalidArgument, "NetAddr: NIC address length must be 1..256");
  }
  for (auto& local : locals_) {
    if (local.size() > kMaxNicAddrLen)
      throw Error(ErrorCode::kInvalidArgument, "NetAddr: local endpoint longer than 256 bytes");
    if (!util::is_utf8(local))
      throw Error(ErrorCode::kInvalidArgument, "NetAddr: local endpoint is not valid UTF-8");
  }
  if (!util::is_utf8(provider_))
    throw Error(ErrorCode::kInvalidArgument, "NetAddr: provider name is not valid UTF-8");
}

const std::string& NetAddr::local() const {
  static const std::string none;
  return locals_.empty() ? none : locals_[0];
}

NetAddr NetAddr::worker(size_t w) const {
  if (w >= nics_.size())
    throw Error(ErrorCode::kInvalidArgument,
                "NetAddr: worker " + std::to_string(w) + " of an engine with " +
                    std::to_string(nics_.size()) + " workers");
  if (nics_.size() == 1) return *this;
  return NetAddr(provider_, {nics_[w]}, {locals_[w]}, max_message_);
}

std::vector<uint8_t> NetAddr::to_bytes() const {
  util::ByteWriter w;
  w.raw(kAddrMagic, 4);
  w.u8(kAddrVersion);
  w.u8(static_cast<uint8_t>(provider_.size()));
  w.raw(provider_.data(), provider_.size());
  w.u8(static_cast<uint8_t>(nics_.size()));
  w.u8(static_cast<uint8_t>(nic_count()));
  for (size_t g = 0; g < nics_.size(); g++) {
    for (auto& n : nics_[g]) {
      w.u16(static_cast<uint16_t>(n.size()));
      w.raw(n.data(), n.size());
    }
    w.u16(static_cast<uint16_t>(locals_[g].size()));
    w.raw(locals_[g].data(), locals_[g].size());
  }
  w.u32(max_message_);
  return w.take();
}

static NetAddr read_net_addr(util::ByteReader& r) {
  check_magic(r, kAddrMagic, kAddrVersion);
  uint8_t plen = r.u8("provider length");
  if (plen == 0 || plen > kMaxProviderNameLen) r.fail("provider name length " + std::to_string(plen));
  std::string provider = r.text(plen, "provider");
  uint8_t workers = r.u8("worker count");
  if (workers < 1 || workers > kMaxWorkers)
    r.fail("worker count " + std::to_string(workers) + " outside 1.." + std::to_string(kMaxWorkers));
  uint8_t n = r.u8("NIC count");
  if (n < 1 || n > kMaxNics) r.fail("NIC count " + std::to_string(n) + " outside 1..4");
  std::vector<std::vector<std::string>> nics(workers);
  std::vector<std::string> locals;
  for (auto& worker : nics) {
    for (uint8_t i = 0; i < n; i++) {
      uint16_t len = r.u16("NIC address length");
      if (len == 0 || len > kMaxNicAddrLen) r.fail("NIC address length " + std::to_string(len));
      worker.push_back(r.str(len, "NIC address"));
    }
    uint16_t local_len = r.u16("local endpoint length");
    if (local_len > kMaxNicAddrLen) r.fail("local endpoint length " + std::to_string(local_len));
    locals.push_back(r.text(local_len, "local endpoint"));
  }
  const uint32_t max_message = r.u32("longest message");
  return NetAddr(std::move(provider), std::move(nics), std::move(locals), max_message);
}

NetAddr NetAddr::from_bytes(std::span<const uint8_t> bytes) {
  util::ByteReader r(bytes, "NetAddr");
  NetAddr a = read_net_addr(r);
  r.expect_end();
  return a;
}

std::string NetAddr::to_hex() const { return util::to_hex(to_bytes()); }
NetAddr NetAddr::from_hex(std::string_view hex) { return from_bytes(util::from_hex(hex, "NetAddr")); }

uint32_t ImmRange::imm(uint64_t local) const {
  if (!fits(local))
    throw Error(ErrorCode::kInvalidArgument, "immediate " + std::to_string(local) + " does not fit in its range of " +
                                                 std::to_string(bits) + " bits at " + std::to_string(base));
  return static_cast<uint32_t>(base + local);
}

void ImmRange::validate(const char* what) const {
  if (bits < 1 || bits > 32)
    throw Error(ErrorCode::kInvalidArgument,
                std::string(what) + ": an immediate range of " + std::to_string(bits) + " bits (1 to 32)");
  if (base % size() != 0)
    throw Error(ErrorCode::kInvalidArgument, std::string(what) + ": immediate base " + std::to_string(base) +
                                                 " is not a multiple of 2^" + std::to_string(bits) +
                                                 " (a range is an aligned block)");
}

MrDesc::MrDesc(NetAddr owner, uint64_t addr, uint64_t len, std::vector<RemoteKey> keys,
               std::optional<RemoteKey> local_key, uint32_t worker, ImmRange imms)
    : owner_(std::move(owner)), addr_(addr), len_(len), keys_(std::move(keys)), local_key_(local_key),
      worker_(worker), imms_(imms) {
  imms_.validate("MrDesc");
  if (worker_ >= owner_.worker_count())
    throw Error(ErrorCode::kInvalidArgument,
                "MrDesc: worker " + std::to_string(worker_) + " of an owner with " +
                    std::to_string(owner_.worker_count()) + " workers");
  if (keys_.size() != owner_.nic_count() && !(keys_.empty() && local_key_))
    throw Error(ErrorCode::kInvalidArgument,
                "MrDesc: " + std::to_string(keys_.size()) + " keys for an owner with " +
                    std::to_string(owner_.nic_count()) + " NICs");
  if (local_key_ && owner_.local(worker_).empty())
    throw Error(ErrorCode::kInvalidArgument, "MrDesc: a local key for an owner with no local endpoint");
}

std::vector<uint8_t> MrDesc::to_bytes() const {
  util::ByteWriter w;
  w.raw(kDescMagic, 4);
  w.u8(kDescVersion);
  auto owner = owner_.to_bytes();
  w.u32(static_cast<uint32_t>(owner.size()));
  w.raw(owner.data(), owner.size());
  w.u8(static_cast<uint8_t>(worker_));
  w.u64(addr_);
  w.u64(len_);
  w.u8(static_cast<uint8_t>(keys_.size()));
  for (auto& k : keys_) {
    w.u64(k.rkey);
    w.u64(k.base);
  }
  w.u8(local_key_ ? 1 : 0);
  if (local_key_) {
    w.u64(local_key_->rkey);
    w.u64(local_key_->base);
  }
  w.u32(imms_.base);
  w.u8(imms_.bits);
  return w.take();
}

MrDesc MrDesc::from_bytes(std::span<const uint8_t> bytes) {
  util::ByteReader r(bytes, "MrDesc");
  check_magic(r, kDescMagic, kDescVersion);
  uint32_t owner_len = r.u32("owner length");
  if (owner_len > r.remaining()) r.fail("owner length " + std::to_string(owner_len) + " exceeds input");
  auto owner_bytes = bytes.subspan(bytes.size() - r.remaining(), owner_len);
  NetAddr owner = NetAddr::from_bytes(owner_bytes);
  r.str(owner_len, "owner");  // skip what NetAddr parsed
  uint8_t worker = r.u8("worker");
  if (worker >= owner.worker_count())
    r.fail("worker " + std::to_string(worker) + " of an owner with " +
           std::to_string(owner.worker_count()) + " workers");
  uint64_t addr = r.u64("addr");
  uint64_t len = r.u64("len");
  uint8_t n = r.u8("key count");
  if (n != owner.nic_count() && n != 0)
    r.fail("key count " + std::to_string(n) + " does not match the owner's NIC count " +
           std::to_string(owner.nic_count()));
  std::vector<RemoteKey> keys(n);
  for (auto& k : keys) {
    k.rkey = r.u64("rkey");
    k.base = r.u64("base");
  }
  std::optional<RemoteKey> local;
  uint8_t has_local = r.u8("local key flag");
  if (has_local > 1) r.fail("local key flag " + std::to_string(has_local));
  if (has_local) local = RemoteKey{r.u64("local rkey"), r.u64("local base")};
  if (n == 0 && !local) r.fail("no key at all (neither NIC keys nor a local key)");
  if (local && owner.local(worker).empty()) r.fail("a local key for an owner with no local endpoint");
  if (addr + len < addr) r.fail("addr + len overflows");
  ImmRange imms;
  imms.base = r.u32("imm base");
  imms.bits = r.u8("imm bits");
  if (imms.bits < 1 || imms.bits > 32 || imms.base % imms.size() != 0)
    r.fail("immediate range of " + std::to_string(imms.bits) + " bits at " + std::to_string(imms.base));
  r.expect_end();
  return MrDesc(std::move(owner), addr, len, std::move(keys), local, worker, imms);
}

std::string MrDesc::to_hex() const { return util::to_hex(to_bytes()); }
MrDesc MrDesc::from_hex(std::string_view hex) { return from_bytes(util::from_hex(hex, "MrDesc")); }

std::string_view to_string(ErrorCode code) {
  switch (code) {
    case ErrorCode::kOk: return "ok";
    case ErrorCode::kInvalidArgument: return "invalid argument";
    case ErrorCode::kOutOfBounds: return "out of bounds";
    case ErrorCode::kNotFound: return "not found";
    case ErrorCode::kMalformed: return "malformed";
    case ErrorCode::kProvider: return "provider error";
    case ErrorCode::kTimeout: return "timeout";
    case ErrorCode::kShutdown: return "shutdown";
    case ErrorCode::kResourceExhausted: return "resource exhausted";
    case ErrorCode::kUnsupported: return "unsupported";
    case ErrorCode::kCancelled: return "cancelled";
  }
  return "unknown";
}

}  // namespace fabric
