// engine_config_for: a topology becomes one worker per chosen GPU with its rail and cores.
#include <gtest/gtest.h>

#include "fabric/fabric.h"
#include "fabric/topology.h"

namespace fabric {
namespace {

TopoNic nic(const std::string& name, const std::string& provider) {
  TopoNic n;
  n.name = name;
  n.provider = provider;
  n.domain = provider == "efa" ? name + "-rdm" : name;
  n.active = true;
  n.link_gbps = 100;
  return n;
}

// Two GPUs, each with `per_gpu` NICs of its own, cores 2/3 and 4/5.
Topology two_gpus(size_t per_gpu, const std::string& provider = "efa") {
  Topology t;
  t.provider = provider;
  for (int g = 0; g < 2; g++) {
    TopoGpu gpu;
    gpu.cuda_index = g;
    gpu.numa_node = 0;
    gpu.worker_cpu = 2 + 2 * g;
    gpu.watcher_cpu = 3 + 2 * g;
    gpu.affinity = NicAffinity::kSwitch;
    for (size_t k = 0; k < per_gpu; k++) {
      gpu.nics.push_back(t.nics.size());
      t.nics.push_back(nic("rdmap" + std::to_string(g) + "s" + std::to_string(k), provider));
    }
    t.gpus.push_back(gpu);
  }
  return t;
}

TEST(ConfigFromTopology, EveryGpuBecomesAWorkerWithItsRailAndCores) {
  EngineConfig base;
  base.transfer_timeout = std::chrono::milliseconds(1234);
  EngineConfig c = engine_config_for(two_gpus(4), base);
  EXPECT_EQ(c.provider, "efa");
  EXPECT_EQ(c.transfer_timeout, base.transfer_timeout);
  ASSERT_EQ(c.workers.size(), 2u);
  for (int g = 0; g < 2; g++) {
    const WorkerConfig& w = c.workers[g];
    EXPECT_EQ(w.cuda_device, g);
    EXPECT_EQ(w.worker_cpu, 2 + 2 * g);
    EXPECT_EQ(w.watcher_cpu, 3 + 2 * g);
    ASSERT_EQ(w.nics.size(), 4u);
    for (size_t k = 0; k < 4; k++)
      EXPECT_EQ(w.nics[k].domain, "rdmap" + std::to_string(g) + "s" + std::to_string(k) + "-rdm");
  }
}

TEST(ConfigFromTopology, AChosenSubsetInTheGivenOrderAndUnknownGpusAreRejected) {
  const std::vector<int> one{1};
  EngineConfig c = engine_config_for(two_gpus(2, "verbs"), {}, one);
  EXPECT_EQ(c.provider, "verbs");
  ASSERT_EQ(c.workers.size(), 1u);
  EXPECT_EQ(c.workers[0].cuda_device, 1);
  EXPECT_EQ(c.workers[0].nics[0].domain, "rdmap1s0");
  const std::vector<int> missing{0, 7};
  try {
    engine_config_for(two_gpus(2), {}, missing);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kNotFound);
    EXPECT_NE(std::string(e.what()).find("no GPU 7"), std::string::npos) << e.what();
  }
}

TEST(ConfigFromTopology, TheRailIsTheSmallestNicCountAndAtMostFour) {
  Topology t = two_gpus(6);
  t.gpus[1].nics.resize(3);
  EngineConfig c = engine_config_for(t);
  ASSERT_EQ(c.workers.size(), 2u);
  EXPECT_EQ(c.workers[0].nics.size(), 3u);
  EXPECT_EQ(c.workers[1].nics.size(), 3u);
  EXPECT_EQ(engine_config_for(two_gpus(6)).workers[0].nics.size(), kMaxNics);
}

TEST(ConfigFromTopology, WithoutRdmaNicsWorkersUseTheBaseNicsAndWithoutGpusOneHostWorker) {
  Topology no_nics = two_gpus(0, "");
  no_nics.nics.clear();
  EngineConfig base;
  base.provider = "shm";
  base.nics = {NicConfig{}, NicConfig{}};
  EngineConfig c = engine_config_for(no_nics, base);
  EXPECT_EQ(c.provider, "shm");
  ASSERT_EQ(c.workers.size(), 2u);
  EXPECT_EQ(c.workers[1].nics.size(), 2u);

  Topology cpu_only;
  EngineConfig host = engine_config_for(cpu_only, base);
  EXPECT_TRUE(host.workers.empty()) << "one worker made of the top-level fields";
  EXPECT_EQ(host.nics.size(), 2u);
  Topology cpu_with_nics = two_gpus(2, "verbs");
  cpu_with_nics.gpus.clear();
  EngineConfig nics_only = engine_config_for(cpu_with_nics, base);
  EXPECT_EQ(nics_only.provider, "verbs");
  ASSERT_EQ(nics_only.nics.size(), 4u);
  EXPECT_EQ(nics_only.nics[3].domain, "rdmap1s1");
}

}  // namespace
}  // namespace fabric
