// Domain::caps() on real domains: the values each provider reports are the ones fi_getinfo gives
// for the entry the domain picked (tcp;ofi_rxm on the loopback NIC, shm), efa-sim's are EFA's that
// it presents, the test wrappers forward them (less write batches), and verbs reports its device
// (in the rxe VM). What every provider must report is checked by provider_contract_test.cpp.
#include <gtest/gtest.h>
#include <rdma/fabric.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>

#include "domain/domain.h"
#include "providers/efa_sim/efa_sim.h"
#include "providers/libfabric/fi_compat.h"
#include "providers/open_domain.h"
#include "test_support.h"

namespace fabric::testing {
namespace {

EngineConfig config(const std::string& provider, const std::string& node) {
  EngineConfig cfg;
  cfg.provider = provider;
  cfg.nics = {NicConfig{"", node}};
  return cfg;
}

void print(const char* what, const DomainCaps& c) {
  std::printf("%s: nic_name=%s gpu_memory=%d max_message=%zu inject_size=%zu link_gbps=%g manual_progress=%d\n",
              what, c.nic_name.c_str(), c.gpu_memory, c.max_message, c.inject_size, c.link_gbps,
              c.manual_progress);
}

// The first fi_getinfo entry for what the libfabric domain asks (its hints, asked here on their
// own), as `fi_info -p <provider>` shows it.
struct Expected {
  std::string domain_name;
  size_t max_msg_size = 0;
  size_t inject_size = 0;
  bool manual = false;
  bool hmem = false;
  double link_gbps = 0;
};

Expected expected_from_fi_getinfo(const std::string& provider, const std::string& node) {
  fi_info* hints = fi_allocinfo();
  hints->ep_attr->type = FI_EP_RDM;
  hints->caps = FI_MSG | FI_RMA;
  hints->mode = FI_CONTEXT | FI_CONTEXT2;
  hints->domain_attr->mr_mode =
      FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY | FI_MR_ENDPOINT | FI_MR_HMEM;
  hints->domain_attr->threading = FI_THREAD_DOMAIN;
  hints->domain_attr->cq_data_size = 4;
  hints->fabric_attr->prov_name = strdup(provider.c_str());
  if (!node.empty()) hints->addr_format = FI_SOCKADDR_IN;
  fi_info* list = nullptr;
  const uint32_t api = std::min(fi_compat::kWantedApi, fi_version());
  int rc = fi_getinfo(api, node.empty() ? nullptr : node.c_str(), nullptr, node.empty() ? 0 : FI_SOURCE,
                      hints, &list);
  fi_freeinfo(hints);
  Expected e;
  EXPECT_EQ(rc, 0) << "fi_getinfo(" << provider << "): " << fi_strerror(-rc);
  if (rc != 0 || !list) return e;
  e.domain_name = list->domain_attr->name ? list->domain_attr->name : "";
  e.max_msg_size = list->ep_attr->max_msg_size ? list->ep_attr->max_msg_size : SIZE_MAX;
  e.inject_size = list->tx_attr->inject_size;
  e.manual = list->domain_attr->data_progress == FI_PROGRESS_MANUAL;
  e.hmem = (list->caps & FI_HMEM) != 0;
  if (list->nic && list->nic->link_attr) e.link_gbps = static_cast<double>(list->nic->link_attr->speed) / 1e9;
  fi_freeinfo(list);
  return e;
}

void expect_as_fi_getinfo(const DomainCaps& c, const Expected& e) {
  EXPECT_FALSE(c.nic_name.empty());
  EXPECT_EQ(c.nic_name, e.domain_name);
  EXPECT_GT(c.max_message, 0u);
  EXPECT_EQ(c.max_message, e.max_msg_size);
  EXPECT_EQ(c.inject_size, e.inject_size);
  EXPECT_EQ(c.manual_progress, e.manual);
  EXPECT_DOUBLE_EQ(c.link_gbps, e.link_gbps);
  EXPECT_FALSE(c.gpu_memory) << "no EngineConfig::cuda_device: FI_HMEM is not asked for";
}

TEST(DomainCaps, TcpOnTheLoopbackNicReportsWhatFiGetinfoSays) {
  auto d = open_domain(config("tcp;ofi_rxm", "127.0.0.2"), 0);
  const DomainCaps& c = d->caps();
  print("tcp;ofi_rxm 127.0.0.2", c);
  // Bound to a source address, tcp names its domain after itself ("tcp" on libfabric 1.17).
  expect_as_fi_getinfo(c, expected_from_fi_getinfo("tcp;ofi_rxm", "127.0.0.2"));
  EXPECT_EQ(&d->caps(), &c) << "read once, the same object every time";
}

// NicConfig::domain picks the fi_getinfo entry by name: caps() names that entry, not the first.
TEST(DomainCaps, TcpPickedByDomainNameReportsThatName) {
  EngineConfig cfg;
  cfg.provider = "tcp;ofi_rxm";
  cfg.nics = {NicConfig{"lo", ""}};
  auto d = open_domain(cfg, 0);
  const DomainCaps& c = d->caps();
  print("tcp;ofi_rxm domain lo", c);
  EXPECT_EQ(c.nic_name, "lo");
  EXPECT_EQ(c.max_message, expected_from_fi_getinfo("tcp;ofi_rxm", "").max_msg_size);
  EXPECT_EQ(c.link_gbps, 0) << "the loopback interface has no speed";
  EXPECT_TRUE(c.manual_progress);
  EXPECT_FALSE(c.gpu_memory);
}

TEST(DomainCaps, ShmReportsWhatFiGetinfoSays) {
  auto d = open_domain(config("shm", ""), 0);
  const DomainCaps& c = d->caps();
  print("shm", c);
  expect_as_fi_getinfo(c, expected_from_fi_getinfo("shm", ""));
  EXPECT_EQ(c.nic_name, "shm");
  EXPECT_EQ(c.link_gbps, 0) << "shared memory has no link";
}

// efa-sim reports what it presents (EFA's max_msg_size and inject size, manual progress) on tcp's
// NIC, and the domain splits at that max_message.
TEST(DomainCaps, EfaSimReportsTheAttributesItPresents) {
  auto d = open_domain(config("efa-sim", "127.0.0.2"), 0);
  const DomainCaps& c = d->caps();
  print("efa-sim 127.0.0.2", c);
  const Expected tcp = expected_from_fi_getinfo(efa_sim::kUnderlying, "127.0.0.2");
  EXPECT_EQ(c.nic_name, tcp.domain_name) << "the NIC underneath is tcp's";
  EXPECT_EQ(c.max_message, efa_sim::kMaxMsgSize);
  EXPECT_EQ(c.inject_size, efa_sim::kInjectSize);
  EXPECT_TRUE(c.manual_progress);
  EXPECT_FALSE(c.gpu_memory) << "the shim offers FI_HMEM only with offer_hmem and a cuda_device";
  EXPECT_EQ(c.link_gbps, tcp.link_gbps);
  EXPECT_NE(c.max_message, tcp.max_msg_size) << "EFA's value, not tcp's";
}

// The reordering and fault wrappers report the wrapped domain's values.
TEST(DomainCaps, TestWrappersForwardTheWrappedDomains) {
  for (const char* provider : {"efa-sim", "tcp;ofi_rxm"}) {
    SCOPED_TRACE(provider);
    EngineConfig plain_cfg = config(provider, "127.0.0.2");
    EngineConfig wrapped_cfg = plain_cfg;
    wrapped_cfg.reorder.enabled = true;
    wrapped_cfg.faults.enabled = true;
    auto plain = open_domain(plain_cfg, 0);
    auto wrapped = open_domain(wrapped_cfg, 0);
    const DomainCaps &p = plain->caps(), &w = wrapped->caps();
    EXPECT_EQ(w.nic_name, p.nic_name);
    EXPECT_EQ(w.gpu_memory, p.gpu_memory);
    EXPECT_EQ(w.max_message, p.max_message);
    EXPECT_EQ(w.inject_size, p.inject_size);
    EXPECT_EQ(w.link_gbps, p.link_gbps);
    EXPECT_EQ(w.manual_progress, p.manual_progress);
    EXPECT_EQ(w.max_in_flight, p.max_in_flight);
    EXPECT_EQ(w.max_write_batch, 0u);
  }
}

// Wrapped, a local domain that takes write batches reports none: the wrappers act on single
// WRITEs, so the engine posts the pages one by one, as it always did under them.
TEST(DomainCaps, TestWrappersTakeNoWriteBatches) {
  EngineConfig cfg = config("tcp;ofi_rxm", "127.0.0.2");
  cfg.host_ipc = true;
  auto plain = open_local_domain(cfg);
  cfg.reorder.enabled = true;
  auto wrapped = open_local_domain(cfg);
  EXPECT_EQ(plain->caps().max_write_batch, 1024u);
  EXPECT_EQ(wrapped->caps().max_write_batch, 0u);
  EXPECT_EQ(wrapped->caps().max_in_flight, plain->caps().max_in_flight);
}

TEST(DomainCaps, VerbsReportsItsDevicePort) {
  const ProviderCase verbs{"verbs", 1, false};
  FABRIC_SKIP_WITHOUT_DEVICE(verbs);
  EngineConfig cfg = config_for(verbs);
  auto d = open_domain(cfg, 0);
  const DomainCaps& c = d->caps();
  print("verbs", c);
  EXPECT_FALSE(c.nic_name.empty());
  if (!verbs_device().empty()) {
    EXPECT_EQ(c.nic_name, verbs_device());
  }
  EXPECT_GE(c.max_message, 4096u);
  EXPECT_TRUE(c.inject_size == 0 || c.inject_size >= 64) << "asked for 64 bytes inline, or none: " << c.inject_size;
  EXPECT_GT(c.link_gbps, 0) << "an active port has a speed (rxe: its netdev's, at least SDR 1x)";
  EXPECT_TRUE(c.manual_progress);
}

}  // namespace
}  // namespace fabric::testing
