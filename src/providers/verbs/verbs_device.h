// One opened verbs device port: context, protection domain, attributes, and the GID to use.
#pragma once

#include <infiniband/verbs.h>

#include <cerrno>
#include <optional>
#include <string>

namespace fabric::verbs {

struct DeviceContext {
  // Opens `name` (empty: the first device) and queries port `port`; picks the GID (see
  // VerbsConfig::gid_index). Throws fabric::Error naming what is missing.
  DeviceContext(const std::string& name, uint8_t port, std::optional<int> gid_index);
  ~DeviceContext();
  DeviceContext(const DeviceContext&) = delete;
  DeviceContext& operator=(const DeviceContext&) = delete;

  bool roce() const { return port_attr.link_layer == IBV_LINK_LAYER_ETHERNET; }
  // Address vector towards a peer's port (GRH on RoCE, LID on InfiniBand), in this context's
  // traffic class and service level.
  ibv_ah_attr ah_attr(const ibv_gid& dgid, uint16_t dlid) const;

  std::string name;
  uint8_t port = 1;
  ibv_context* ctx = nullptr;
  ibv_pd* pd = nullptr;
  ibv_device_attr dev_attr{};
  ibv_port_attr port_attr{};
  int gid_index = 0;
  ibv_gid gid{};
  // Put into every address vector (VerbsConfig::traffic_class / service_level).
  uint8_t traffic_class = 0;
  uint8_t service_level = 0;
};

// The port's link speed in Gb/s (active_speed per lane x active_width lanes, as ibv_devinfo
// shows them); 0 where either code is not one this table knows.
double link_gbps(const ibv_port_attr& port);

// How the provider's files report a failed verbs call, so that every message names the call and
// the device the same way.
std::string errno_text(int err);  // "Cannot allocate memory (12)"
// Throws fabric::Error kProvider: "verbs: <call> on <device> failed: <errno text>".
[[noreturn]] void fail(const char* call, int err, const std::string& device);
// `p`, or fail(call, errno, device) where the call returned null.
template <class T>
T* check_ptr(T* p, const char* call, const std::string& device) {
  if (!p) fail(call, errno, device);
  return p;
}

}  // namespace fabric::verbs
