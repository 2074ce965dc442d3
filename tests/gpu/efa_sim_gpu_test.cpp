// The libfabric domain's GPU-memory branch (FI_MR_DMABUF with a dma-buf from
// cuMemGetHandleForAddressRange, and FI_OPT_CUDA_API_PERMITTED required on a GPU domain), run on a
// GPU machine without EFA through efa-sim offering FI_HMEM: the shim checks what EFA would be
// handed (a real dma-buf fd, the region's address as base_addr + offset) and registers it; it never
// moves GPU memory (tcp cannot), and refuses to.
#include <gtest/gtest.h>

#include "domain/domain.h"
#include "gpu_support.h"
#include "providers/efa_sim/efa_sim.h"
#include "providers/open_domain.h"

namespace fabric::testing {
namespace {

using gpu_test::DeviceBuffer;
using gpu_test::gpu_count;

TEST(EfaSimGpu, GpuMemoryRegistersAsADmaBufAndTheDomainSetsCudaApiPermittedFalse) {
  if (gpu_count() == 0) GTEST_SKIP() << "no CUDA device visible";
  efa_sim::offer_hmem(true);
  EngineConfig cfg;
  cfg.provider = "efa-sim";
  cfg.nics = {NicConfig{"", "127.0.0.2"}};
  cfg.cuda_device = 0;
  const efa_sim::Stats before = efa_sim::stats();
  {
    std::unique_ptr<Domain> d = open_domain(cfg, 0);
    const efa_sim::Stats opened = efa_sim::stats();
    EXPECT_EQ(opened.cuda_api_permitted_false - before.cuda_api_permitted_false, 1u);
    EXPECT_EQ(opened.shared_memory_permitted_false - before.shared_memory_permitted_false, 1u);

    // Not page-aligned on purpose: the dma-buf covers whole pages, the region starts inside it.
    DeviceBuffer buf((2 << 20) + 8192, 0);
    uint8_t* ptr = buf.ptr + 4096 + 100;
    constexpr size_t kLen = 1 << 20;
    DomainRegion r = d->register_memory(ptr, kLen, Device::cuda(0));
    const efa_sim::Stats reg = efa_sim::stats();
    EXPECT_EQ(reg.dmabuf_regions - opened.dmabuf_regions, 1u) << "not registered as a dma-buf";
    EXPECT_EQ(reg.hmem_range_regions, opened.hmem_range_regions);
    EXPECT_EQ(reg.violations, before.violations) << efa_sim::last_violation();
    EXPECT_EQ(r.remote.base, reinterpret_cast<uint64_t>(ptr));
    EXPECT_EQ(r.remote.rkey & ((1ull << 48) - 1), reinterpret_cast<uint64_t>(ptr))
        << "the shim saw another address than the region's (base_addr + offset)";

    // A WRITE from GPU memory is refused by the shim (it cannot move it), through the real
    // descriptor check.
    PeerId self = d->insert_peer(d->address());
    WriteOp op;
    op.src = ptr;
    op.len = 4096;
    op.desc = r.desc;
    op.peer = self;
    op.remote_addr = r.remote.base;
    op.rkey = r.remote.rkey;
    OpContext ctx;
    EXPECT_EQ(d->post_write(op, &ctx), PostResult::kFailed);
    EXPECT_NE(efa_sim::last_violation().find("GPU memory"), std::string::npos) << efa_sim::last_violation();
    d->deregister_memory(r);
  }
  efa_sim::offer_hmem(false);
}

}  // namespace
}  // namespace fabric::testing
