#include "providers/verbs/verbs_device.h"

#include <arpa/inet.h>
#include <fmt/format.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "fabric/error.h"
#include "util/log.h"

namespace fabric::verbs {
namespace {

bool ipv4_mapped(const ibv_gid& g) {
  static const uint8_t prefix[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
  return std::memcmp(g.raw, prefix, sizeof prefix) == 0;
}

std::string gid_text(const ibv_gid& g) {
  char s[INET6_ADDRSTRLEN] = "?";
  inet_ntop(AF_INET6, g.raw, s, sizeof s);
  return s;
}

// RoCE v2 routes over IP; an IPv4-mapped entry is what most RoCE fabrics configure. InfiniBand
// ports have one entry type; index 0 is the port GID.
int pick_gid(ibv_context* ctx, uint8_t port, int table_len) {
  int best = -1, best_rank = -1;
  for (int i = 0; i < table_len; i++) {
    ibv_gid_entry e{};
    if (ibv_query_gid_ex(ctx, port, static_cast<uint32_t>(i), &e, 0) != 0) continue;  // empty slot
    ibv_gid g;
    std::memcpy(g.raw, e.gid.raw, sizeof g.raw);
    if (g.global.interface_id == 0 && g.global.subnet_prefix == 0) continue;
    int rank = e.gid_type == IBV_GID_TYPE_ROCE_V2 ? (ipv4_mapped(g) ? 3 : 2) : 1;
    if (rank > best_rank) {
      best = i;
      best_rank = rank;
    }
  }
  return best;
}

}  // namespace

DeviceContext::DeviceContext(const std::string& want, uint8_t port_num, std::optional<int> gid_idx)
    : port(port_num) {
  int n = 0;
  ibv_device** list = ibv_get_device_list(&n);
  if (!list || n == 0) {
    if (list) ibv_free_device_list(list);
    throw Error(ErrorCode::kNotFound,
                "verbs: no RDMA device found (ibv_get_device_list; is the driver loaded and "
                "ibverbs-providers installed? `ibv_devices` lists them)");
  }
  ibv_device* dev = nullptr;
  std::string names;
  for (int i = 0; i < n; i++) {
    const char* d = ibv_get_device_name(list[i]);
    names += (i ? ", " : "") + std::string(d);
    if (!dev && (want.empty() || want == d)) dev = list[i];
  }
  if (dev) {
    name = ibv_get_device_name(dev);
    ctx = ibv_open_device(dev);
  }
  int open_errno = errno;
  ibv_free_device_list(list);
  if (!dev)
    throw Error(ErrorCode::kNotFound, fmt::format("verbs: no device named '{}' (devices: {})", want, names));
  if (!ctx)
    throw Error(ErrorCode::kProvider,
                fmt::format("verbs: ibv_open_device({}) failed: {}", name, std::strerror(open_errno)));
  try {
    if (ibv_query_device(ctx, &dev_attr) != 0)
      throw Error(ErrorCode::kProvider, fmt::format("verbs: ibv_query_device({}) failed", name));
    if (port < 1 || port > dev_attr.phys_port_cnt || ibv_query_port(ctx, port, &port_attr) != 0)
      throw Error(ErrorCode::kInvalidArgument,
                  fmt::format("verbs: device {} has no port {} (it has {})", name, port, dev_attr.phys_port_cnt));
    if (port_attr.state != IBV_PORT_ACTIVE)
      throw Error(ErrorCode::kProvider, fmt::format("verbs: {} port {} is {}, not active", name, port,
                                                    ibv_port_state_str(port_attr.state)));
    gid_index = gid_idx ? *gid_idx : pick_gid(ctx, port, port_attr.gid_tbl_len);
    if (gid_index < 0 || gid_index >= port_attr.gid_tbl_len || ibv_query_gid(ctx, port, gid_index, &gid) != 0 ||
        (gid.global.interface_id == 0 && gid.global.subnet_prefix == 0))
      throw Error(ErrorCode::kInvalidArgument,
                  fmt::format("verbs: {} port {} has no usable GID{} (see `ibv_devinfo -v`; set "
                              "VerbsConfig::gid_index / FABRIC_GID_INDEX)",
                              name, port, gid_idx ? fmt::format(" at index {}", *gid_idx) : ""));
    pd = ibv_alloc_pd(ctx);
    if (!pd) throw Error(ErrorCode::kProvider, fmt::format("verbs: ibv_alloc_pd({}) failed", name));
  } catch (...) {
    ibv_close_device(ctx);
    throw;
  }
  log::info("verbs: {} port {} {} mtu {} gid[{}] {} max_msg {}", name, port, roce() ? "RoCE" : "IB",
            128 << port_attr.active_mtu, gid_index, gid_text(gid), port_attr.max_msg_sz);
}

DeviceContext::~DeviceContext() {
  if (pd) ibv_dealloc_pd(pd);
  if (ctx) ibv_close_device(ctx);
}

double link_gbps(const ibv_port_attr& port) {
  double lane = 0;  // Gb/s of data per lane (IBV_SPEED_*; FDR10 and QDR both 10)
  switch (port.active_speed) {
    case 1: lane = 2.5; break;    // SDR
    case 2: lane = 5; break;      // DDR
    case 4: lane = 10; break;     // QDR
    case 8: lane = 10; break;     // FDR10
    case 16: lane = 14; break;    // FDR
    case 32: lane = 25; break;    // EDR
    case 64: lane = 50; break;    // HDR
    case 128: lane = 100; break;  // NDR
    default: return 0;            // XDR and later need active_speed_ex (newer rdma-core)
  }
  switch (port.active_width) {  // IBV_WIDTH_*
    case 1: return lane;       // 1x
    case 2: return 4 * lane;   // 4x
    case 4: return 8 * lane;   // 8x
    case 8: return 12 * lane;  // 12x
    case 16: return 2 * lane;  // 2x
    default: return 0;
  }
}

std::string errno_text(int err) { return fmt::format("{} ({})", std::strerror(err), err); }

void fail(const char* call, int err, const std::string& device) {
  throw Error(ErrorCode::kProvider,
              fmt::format("verbs: {} on {} failed: {}", call, device, errno_text(err)));
}

ibv_ah_attr DeviceContext::ah_attr(const ibv_gid& dgid, uint16_t dlid) const {
  ibv_ah_attr a{};
  a.port_num = port;
  a.dlid = dlid;
  a.sl = service_level;
  if (roce() || dlid == 0) {  // RoCE always routes by GID; IB across subnets too
    a.is_global = 1;
    a.grh.dgid = dgid;
    a.grh.sgid_index = static_cast<uint8_t>(gid_index);
    a.grh.hop_limit = 64;
    a.grh.traffic_class = traffic_class;
  }
  return a;
}

}  // namespace fabric::verbs
