// The fi_info attributes the libfabric domain codes for, read once from the entry fi_getinfo
// returned. Every branch of the domain that depends on the provider tests these fields (never a
// provider name, except where EFA itself is meant); the EFA-like test provider (efa_sim) rewrites
// them to EFA's values, so the same branches run on tcp underneath.
#pragma once

#include <rdma/fabric.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace fabric {

struct ProviderAttrs {
  std::string prov_name;       // fabric_attr->prov_name: "efa" where the provider is EFA
  uint32_t api_version = 0;    // fabric_attr->api_version: the API the entry was opened at
  uint64_t caps = 0;           // FI_HMEM etc.
  uint64_t mode = 0;           // FI_RX_CQ_DATA etc.
  uint64_t mr_mode = 0;        // FI_MR_LOCAL, FI_MR_VIRT_ADDR, FI_MR_PROV_KEY, ...
  size_t mr_key_size = 8;      // bytes of an application-chosen key
  size_t cq_data_size = 8;     // bytes of remote CQ data (EFA: 4)
  size_t max_msg_size = 0;     // largest single operation (ep_attr)
  size_t inject_size = 0;      // tx_attr
  size_t tx_size = 0;          // tx_attr
  std::string domain_name;     // domain_attr->name: the NIC ("rdmap16s27-rdm", "lo", "shm")
  fi_progress data_progress = FI_PROGRESS_UNSPEC;  // domain_attr: FI_PROGRESS_MANUAL, _AUTO
  uint64_t link_speed = 0;     // nic->link_attr->speed in bits/s; 0 where the provider says none

  static ProviderAttrs of(const fi_info* info) {
    ProviderAttrs a;
    a.prov_name = info->fabric_attr->prov_name ? info->fabric_attr->prov_name : "";
    a.api_version = info->fabric_attr->api_version;
    a.caps = info->caps;
    a.mode = info->mode;
    a.mr_mode = static_cast<uint64_t>(info->domain_attr->mr_mode);
    a.mr_key_size = info->domain_attr->mr_key_size;
    a.cq_data_size = info->domain_attr->cq_data_size;
    a.max_msg_size = info->ep_attr->max_msg_size;
    a.inject_size = info->tx_attr->inject_size;
    a.tx_size = info->tx_attr->size;
    a.domain_name = info->domain_attr->name ? info->domain_attr->name : "";
    a.data_progress = info->domain_attr->data_progress;
    if (info->nic && info->nic->link_attr) a.link_speed = info->nic->link_attr->speed;
    return a;
  }
};

}  // namespace fabric
