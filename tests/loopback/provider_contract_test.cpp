// The shared provider suite, Domain level (docs/providers.md): what src/domain/domain.h promises,
// checked on two Domains of every provider of suite_providers() (test_support.h) and of each local
// domain, driven by the test itself with no engine: complete and fixed caps, a WRITE with an
// immediate that lands once, cached and removable peers, and the answer of a provider that takes
// no write batches. A new NIC provider joins by its line in suite_providers().
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "domain/domain.h"
#include "providers/open_domain.h"
#include "test_support.h"

namespace fabric::testing {
namespace {

// A provider of the suite, or a local domain ("host_ipc"): two Domains of it in this process.
struct ContractCase {
  std::string name;
  bool local = false;
};

void PrintTo(const ContractCase& c, std::ostream* os) { *os << c.name << (c.local ? " (local domain)" : ""); }

std::vector<ContractCase> contract_cases() {
  std::vector<ContractCase> cases;
  for (const SuiteProvider& p : suite_providers()) cases.push_back({p.name});
  cases.push_back({"host_ipc", true});
  return cases;
}

std::string contract_name(const ::testing::TestParamInfo<ContractCase>& info) {
  if (info.param.local) return info.param.name;
  return case_name(::testing::TestParamInfo<ProviderCase>(ProviderCase{info.param.name, 1, false}, info.index));
}

class ProviderContract : public ::testing::TestWithParam<ContractCase> {
 protected:
  void SetUp() override {
    const ContractCase& c = GetParam();
    const ProviderCase pc{c.name, 1, false};
    FABRIC_SKIP_WITHOUT_DEVICE(pc);
    if (c.local) {
      cfg_ = config_for(ProviderCase{"tcp;ofi_rxm", 1, false});
      cfg_.host_ipc = true;
      a_ = open_local_domain(cfg_);
      b_ = open_local_domain(cfg_);
    } else {
      cfg_ = config_for(ProviderCase{c.name, 2, false});  // NIC 0 writes to NIC 1
      a_ = open_domain(cfg_, 0);
      b_ = open_domain(cfg_, 1);
    }
  }
  void TearDown() override {
    a_.reset();
    b_.reset();
  }

  void poll() {
    Completion c[16];
    size_t n = a_->poll(c);
    at_a_.insert(at_a_.end(), std::make_move_iterator(c), std::make_move_iterator(c + n));
    n = b_->poll(c);
    at_b_.insert(at_b_.end(), std::make_move_iterator(c), std::make_move_iterator(c + n));
  }
  // Posts until the provider takes it (the first post to a new peer may wait for its connection).
  PostResult write(const WriteOp& op, OpContext* ctx) {
    PostResult r;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while ((r = a_->post_write(op, ctx)) != PostResult::kPosted && r != PostResult::kFailed &&
           std::chrono::steady_clock::now() < deadline)
      poll();
    return r;
  }
  // Polls both domains until A completed ctx and B counted `imms` immediates `imm`.
  bool wait_for(const OpContext* ctx, uint32_t imm, size_t imms) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (std::chrono::steady_clock::now() < deadline) {
      poll();
      if (completions_of(ctx) > 0 && imms_of(imm) >= imms) return true;
    }
    return false;
  }
  size_t completions_of(const OpContext* ctx) const {
    size_t n = 0;
    for (const Completion& c : at_a_) n += c.context == ctx;
    return n;
  }
  size_t imms_of(uint32_t imm) const {
    size_t n = 0;
    for (const Completion& c : at_b_) n += c.kind == Completion::Kind::kRemoteImm && c.imm == imm;
    return n;
  }

  EngineConfig cfg_;
  std::unique_ptr<Domain> a_, b_;
  std::vector<Completion> at_a_, at_b_;
};

TEST_P(ProviderContract, CapsAreCompleteAndFixedForTheDomainsLife) {
  for (Domain* d : {a_.get(), b_.get()}) {
    const DomainCaps& c = d->caps();
    EXPECT_EQ(&d->caps(), &c) << "read once, the same object every time";
    EXPECT_FALSE(d->provider_name().empty());
    EXPECT_FALSE(d->address().empty());
    EXPECT_FALSE(c.nic_name.empty());
    EXPECT_GT(c.max_message, 0u);
    EXPECT_GT(c.max_in_flight, 0u) << "the engine would never post here";
    if (!GetParam().local) {
      EXPECT_LE(c.max_in_flight, cfg_.max_in_flight_per_nic);
    }
  }
  EXPECT_NE(a_->address(), b_->address());
}

TEST_P(ProviderContract, AWriteWithAnImmediateLandsOnceAndItsContextComesBackOnce) {
  std::vector<uint8_t> src = random_bytes(256 << 10, 7), dst(256 << 10, 0);
  DomainRegion s = a_->register_memory(src.data(), src.size(), Device::host());
  DomainRegion t = b_->register_memory(dst.data(), dst.size(), Device::host());
  EXPECT_TRUE(t.remote_access);
  const PeerId peer = a_->insert_peer(b_->address());
  EXPECT_EQ(a_->insert_peer(b_->address()), peer) << "insert_peer is cached";

  WriteOp op;
  op.src = src.data() + 100;
  op.len = 100000;
  op.desc = s.desc;
  op.peer = peer;
  op.remote_addr = t.remote.base + 5000;
  op.rkey = t.remote.rkey;
  op.has_imm = true;
  op.imm = 0xC0FFEE;
  OpContext ctx;
  ASSERT_EQ(write(op, &ctx), PostResult::kPosted) << a_->last_error();
  ASSERT_TRUE(wait_for(&ctx, op.imm, 1));
  // A little longer: nothing comes twice.
  for (int i = 0; i < 50; i++) poll();
  EXPECT_EQ(completions_of(&ctx), 1u);
  EXPECT_EQ(imms_of(op.imm), 1u);
  for (const Completion& c : at_a_) EXPECT_NE(c.kind, Completion::Kind::kError) << c.error;
  EXPECT_EQ(std::memcmp(dst.data() + 5000, src.data() + 100, op.len), 0);
  EXPECT_EQ(dst[4999], 0);
  EXPECT_EQ(dst[5000 + op.len], 0);

  // A removed peer inserted again is a working peer.
  a_->remove_peer(peer);
  a_->remove_peer(peer);  // an unknown id is ignored
  op.peer = a_->insert_peer(b_->address());
  op.imm = 0xBEEF;
  OpContext again;
  ASSERT_EQ(write(op, &again), PostResult::kPosted) << a_->last_error();
  ASSERT_TRUE(wait_for(&again, op.imm, 1));

  a_->deregister_memory(s);
  b_->deregister_memory(t);
}

// post_write_batch is for domains with caps().max_write_batch > 0; the others answer kFailed with a
// message, posting nothing.
TEST_P(ProviderContract, ADomainWithoutBatchesRefusesABatchWithAMessage) {
  if (a_->caps().max_write_batch > 0) GTEST_SKIP() << "takes batches of " << a_->caps().max_write_batch;
  std::vector<WriteOp> ops(1);
  ops[0].peer = a_->insert_peer(b_->address());
  OpContext ctx;
  EXPECT_EQ(a_->post_write_batch(ops, &ctx), PostResult::kFailed);
  EXPECT_FALSE(a_->last_error().empty());
}

INSTANTIATE_TEST_SUITE_P(Providers, ProviderContract, ::testing::ValuesIn(contract_cases()), contract_name);

}  // namespace
}  // namespace fabric::testing
