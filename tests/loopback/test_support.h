// Helpers shared by the loopback tests: engine configurations per provider, waiting with a
// deadline, deterministic test data.
#pragma once

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <ostream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "fabric/fabric.h"

namespace fabric::testing {

struct ProviderCase {
  std::string provider;
  size_t nics;
  bool reorder;
  bool host_ipc = false;  // EngineConfig::host_ipc: same-host host memory through the local domain
};

// Readable in ctest's listing (gtest would print the raw bytes of the struct).
inline void PrintTo(const ProviderCase& c, std::ostream* os) {
  *os << c.provider << ", " << c.nics << " NIC(s)" << (c.reorder ? ", reordered" : "")
      << (c.host_ipc ? ", host_ipc" : "");
}

inline std::string case_name(const ::testing::TestParamInfo<ProviderCase>& info) {
  const std::string& name = info.param.provider;
  std::string p = name == "tcp;ofi_rxm" ? "tcp" : name == "efa-sim" ? "efasim" : name;
  return p + "_" + std::to_string(info.param.nics) + "nic" + (info.param.reorder ? "_reordered" : "") +
         (info.param.host_ipc ? "_host_ipc" : "");
}

// The shared provider suite (docs/providers.md): every NIC provider, one line each. The
// ProviderContract suite (provider_contract_test.cpp) drives two Domains of each directly; the
// EnginePair suite (engine_pair_test.cpp) runs engines on each of `nics` NIC counts, and again
// under the reordering wrapper on each of `reordered`. A new provider joins both with its line.
struct SuiteProvider {
  std::string name;               // EngineConfig::provider
  std::vector<size_t> nics;       // NIC counts per engine
  std::vector<size_t> reordered;  // NIC counts also run with EngineConfig::reorder
};
inline const std::vector<SuiteProvider>& suite_providers() {
  static const std::vector<SuiteProvider> providers = {
      {"tcp;ofi_rxm", {1, 2, 4}, {1, 2, 4}},
      {"shm", {1, 2, 4}, {1, 2, 4}},
      {"verbs", {1, 2}, {2}},       // skips without an RDMA device: runs in make test-rxe
      {"efa-sim", {1, 2}, {1, 2}},  // a test provider (FABRIC_TEST_PROVIDERS, on in test builds)
  };
  return providers;
}
// The engine-level cases of the suite: each provider's NIC counts, then its reordered ones.
inline std::vector<ProviderCase> suite_cases() {
  std::vector<ProviderCase> cases;
  for (const SuiteProvider& p : suite_providers()) {
    for (size_t n : p.nics) cases.push_back({p.name, n, false});
    for (size_t n : p.reordered) cases.push_back({p.name, n, true});
  }
  return cases;
}

// verbs needs an RDMA device: on hosts without one (CI outside the Soft-RoCE VM) its cases skip.
inline bool verbs_device_present() {
  std::error_code ec;
  return std::filesystem::exists("/sys/class/infiniband", ec) &&
         !std::filesystem::is_empty("/sys/class/infiniband", ec);
}
#define FABRIC_SKIP_WITHOUT_DEVICE(pc)                                                       \
  if ((pc).provider == "verbs" && !::fabric::testing::verbs_device_present())               \
  GTEST_SKIP() << "no RDMA device (the verbs cases run in the Soft-RoCE VM: make test-rxe)"

// The verbs device the tests use: FABRIC_VERBS_DEVICE, else the first one.
inline std::string verbs_device() {
  const char* d = std::getenv("FABRIC_VERBS_DEVICE");
  return d ? d : "";
}

// tcp: NIC k of every engine binds 127.0.0.(2+k), so several domains act as several NICs.
// verbs: every NIC opens the same device (one rxe device per VM), each with its own queue pairs.
inline EngineConfig config_for(const ProviderCase& c) {
  EngineConfig cfg;
  cfg.provider = c.provider;
  cfg.nics.clear();
  for (size_t k = 0; k < c.nics; k++) {
    if (c.provider == "shm") cfg.nics.push_back(NicConfig{});
    else if (c.provider == "verbs") cfg.nics.push_back(NicConfig{verbs_device(), ""});
    else cfg.nics.push_back(NicConfig{"", "127.0.0." + std::to_string(2 + k)});
  }
  cfg.worker_poll = PollMode::kAdaptive;  // 2 cores, several engines
  cfg.callback_poll = PollMode::kAdaptive;
  cfg.reorder.enabled = c.reorder;
  cfg.reorder.seed = 42;
  cfg.host_ipc = c.host_ipc;
  cfg.transfer_timeout = std::chrono::seconds(60);
  return cfg;
}

// f() throws fabric::Error with `code` and a message containing `fragment`.
template <class F>
void expect_error(ErrorCode code, const std::string& fragment, F&& f) {
  try {
    f();
    ADD_FAILURE() << "no error; expected " << to_string(code);
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos)
        << "message '" << e.what() << "' lacks '" << fragment << "'";
  }
}

inline bool wait_until(const std::function<bool()>& done,
                       std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!done()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  return true;
}

inline std::vector<uint8_t> random_bytes(size_t n, uint32_t seed) {
  std::vector<uint8_t> v(n);
  std::mt19937 rng(seed);
  for (auto& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

// Distinct random indices in [0, range).
inline std::vector<uint32_t> random_indices(size_t n, uint32_t range, uint32_t seed) {
  std::vector<uint32_t> all(range);
  for (uint32_t i = 0; i < range; i++) all[i] = i;
  std::shuffle(all.begin(), all.end(), std::mt19937(seed));
  all.resize(n);
  return all;
}

// The engine still works (after a peer died, say): a WRITE from `src` (holding `bytes`) to a fresh
// region of its own lands, its immediate is counted and every byte arrives. Local completion only
// says the WRITE left (on tcp: reached the kernel); the immediate says it landed.
inline void expect_write_to_self_works(TransferEngine& engine, const MrHandle& src,
                                       const std::vector<uint8_t>& bytes, size_t nics) {
  constexpr uint32_t kImm = 0x55;
  std::vector<uint8_t> mine(bytes.size(), 0);
  auto [h, d] = engine.reg_mr(mine.data(), mine.size());
  std::atomic<int> flag{kDonePending}, landed{kDonePending};
  engine.expect_imm_count(kImm, single_write_imm_count(bytes.size(), nics, false), OnDone::flag(&landed));
  engine.submit(SingleWrite{.len = bytes.size(), .src = {src, 0}, .dst = {engine.add_remote(d), 0}, .imm = kImm},
                OnDone::flag(&flag));
  EXPECT_TRUE(wait_until([&] { return flag.load() != kDonePending && landed.load() != kDonePending; }));
  EXPECT_EQ(flag.load(), kDoneSucceeded);
  EXPECT_EQ(landed.load(), kDoneSucceeded);
  EXPECT_EQ(mine, bytes);
  engine.dereg_mr(h);
}

// The exit code of a test role: non-zero if any gtest expectation failed in this process.
inline int role_result() { return ::testing::Test::HasFailure() ? 1 : 0; }

}  // namespace fabric::testing
