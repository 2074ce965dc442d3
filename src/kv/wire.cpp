#include "kv/wire.h"

#include <string>

#include "util/bytes.h"

namespace fabric::kv::wire {

namespace {

constexpr char kDescMagic[4] = {'F', 'B', 'K', 'V'};
constexpr char kAdmitMagic[4] = {'F', 'B', 'K', 'A'};
constexpr uint8_t kVersion = 2;  // 2: extras

void write_magic(util::ByteWriter& w, const char (&m)[4]) {
  w.raw(m, 4);
  w.u8(kVersion);
}
void read_magic(util::ByteReader& r, const char (&m)[4]) {
  for (char c : m)
    if (r.u8("magic") != static_cast<uint8_t>(c)) r.fail("bad magic");
  if (r.u8("version") != kVersion) r.fail("unsupported version");
}

void write_desc(util::ByteWriter& w, const MrDesc& d) {
  auto b = d.to_bytes();
  w.u32(static_cast<uint32_t>(b.size()));
  w.raw(b.data(), b.size());
}
MrDesc read_desc(util::ByteReader& r) {
  uint32_t n = r.u32("descriptor length");
  if (n > r.remaining()) r.fail("descriptor length exceeds the input");
  std::string s = r.str(n, "descriptor");
  return MrDesc::from_bytes(std::span(reinterpret_cast<const uint8_t*>(s.data()), s.size()));
}

}  // namespace

std::vector<uint8_t> encode(const Descriptor& d) {
  const KvLayout& l = d.layout;
  util::ByteWriter w;
  write_magic(w, kDescMagic);
  w.u64(d.rank.group);
  w.u32(d.rank.tp.size);
  w.u32(d.rank.tp.rank);
  w.u32(d.rank.total_heads);
  for (uint32_t v : {l.num_layers, l.num_pages, l.page_tokens, l.kv_heads, l.head_dim, l.dtype_bytes}) w.u32(v);
  w.u8(static_cast<uint8_t>(l.order));
  w.u64(l.page_stride);
  w.u32(d.extra_slots);
  w.u64(d.extra_bytes);
  for (uint32_t i = 0; i < l.num_layers; i++) {
    write_desc(w, d.k.at(i));
    write_desc(w, d.v.at(i));
  }
  if (d.extra_slots) write_desc(w, d.extras.value());
  return w.take();
}

Descriptor parse_descriptor(std::span<const uint8_t> bytes) {
  util::ByteReader r(bytes, "KV descriptor");
  read_magic(r, kDescMagic);
  Descriptor d;
  d.rank.group = r.u64("group");
  d.rank.tp.size = r.u32("tp size");
  d.rank.tp.rank = r.u32("tp rank");
  d.rank.total_heads = r.u32("total heads");
  KvLayout& l = d.layout;
  l.num_layers = r.u32("layers");
  l.num_pages = r.u32("pages");
  l.page_tokens = r.u32("page tokens");
  l.kv_heads = r.u32("kv heads");
  l.head_dim = r.u32("head dim");
  l.dtype_bytes = r.u32("dtype bytes");
  uint8_t order = r.u8("order");
  if (order > 1) r.fail("page order " + std::to_string(order));
  l.order = static_cast<PageOrder>(order);
  l.page_stride = r.u64("page stride");
  d.extra_slots = r.u32("extra slots");
  d.extra_bytes = r.u64("extra bytes");
  if (l.num_layers == 0 || l.num_layers > kMaxLayers) r.fail("layer count " + std::to_string(l.num_layers));
  if (d.rank.tp.size == 0 || d.rank.tp.rank >= d.rank.tp.size) r.fail("tp rank outside its group");
  if ((d.extra_slots == 0) != (d.extra_bytes == 0)) r.fail("extra slots without extra bytes, or bytes without slots");
  for (uint32_t i = 0; i < l.num_layers; i++) {
    d.k.push_back(read_desc(r));
    d.v.push_back(read_desc(r));
  }
  if (d.extra_slots) d.extras = read_desc(r);
  r.expect_end();
  return d;
}

std::vector<uint8_t> encode(const Admit& a) {
  util::ByteWriter w;
  write_magic(w, kAdmitMagic);
  w.u64(a.group);
  w.u64(a.request);
  w.u32(a.prefill_size);
  w.u8(a.extra_slot.has_value());
  w.u32(a.extra_slot.value_or(0));
  w.u32(static_cast<uint32_t>(a.pages.size()));
  for (uint32_t p : a.pages) w.u32(p);
  return w.take();
}

Admit parse_admit(std::span<const uint8_t> bytes) {
  util::ByteReader r(bytes, "KV admit message");
  read_magic(r, kAdmitMagic);
  Admit a;
  a.group = r.u64("group");
  a.request = r.u64("request");
  a.prefill_size = r.u32("prefill size");
  uint8_t has_extra = r.u8("has extra");
  if (has_extra > 1) r.fail("has-extra flag " + std::to_string(has_extra));
  uint32_t slot = r.u32("extra slot");
  if (has_extra) a.extra_slot = slot;
  else if (slot != 0) r.fail("an extra slot without the has-extra flag");
  uint32_t n = r.u32("page count");
  if (uint64_t{n} * 4 > r.remaining()) r.fail("page count exceeds the input");
  for (uint32_t i = 0; i < n; i++) a.pages.push_back(r.u32("page"));
  r.expect_end();
  return a;
}

}  // namespace fabric::kv::wire

namespace fabric::kv {

KvAdmitInfo read_admit(std::span<const uint8_t> admit) {
  wire::Admit a = wire::parse_admit(admit);
  return {.group = a.group, .request = a.request, .prefill_size = a.prefill_size, .extra_slot = a.extra_slot,
          .pages = std::move(a.pages)};
}

}  // namespace fabric::kv
