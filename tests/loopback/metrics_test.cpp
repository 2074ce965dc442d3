// Engine metrics through the public API (metrics_text, the HTTP endpoint, metrics sources): known
// numbers of WRITEs, bytes, transfers, SENDs and immediates moved between two engines show as
// exactly those counts; failures show under their cause; the text is valid exposition format.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <string>

#include "fabric/fabric.h"
#include "metrics_parse.h"
#include "test_support.h"

namespace fabric::testing {
namespace {

class MetricsCounts : public ::testing::TestWithParam<ProviderCase> {};

TEST_P(MetricsCounts, EveryWriteByteTransferSendAndImmediateIsCountedOnce) {
  const size_t nics = GetParam().nics;
  TransferEngine a(config_for(GetParam())), b(config_for(GetParam()));
  std::vector<uint8_t> src = random_bytes(1 << 16, 3), dst(1 << 16, 0);
  auto [hs, ds] = a.reg_mr(src.data(), src.size());
  auto [hd, dd] = b.reg_mr(dst.data(), dst.size());
  const RemoteMr rd = a.add_remote(dd);
  std::atomic<int> received{0};
  b.submit_recvs(256, 4, [&](std::span<const std::byte>) { received++; });

  constexpr int kSingles = 5, kPaged = 3, kPages = 4, kSends = 2;
  constexpr uint64_t kSingleLen = 3000, kPageLen = 256, kSendLen = 100;
  std::atomic<uint64_t> imms_seen{0};
  b.expect_imm_count(7, kSingles + kPaged * kPages, OnDone::counter(&imms_seen));
  std::atomic<uint64_t> done{0}, failed{0};
  for (int i = 0; i < kSingles; i++)
    a.submit(SingleWrite{.len = kSingleLen, .src = {hs, 0}, .dst = {rd, uint64_t(i) * kSingleLen}, .imm = 7},
             OnDone::counter(&done, &failed));
  const std::vector<uint32_t> pages{0, 1, 2, 3};
  for (int i = 0; i < kPaged; i++)
    a.submit(PagedWrites{.page_len = kPageLen, .src = hs, .src_pages = {pages, kPageLen, 0}, .dst = rd,
                         .dst_pages = {pages, kPageLen, 32768}, .imm = 7},
             OnDone::counter(&done, &failed));
  std::vector<std::byte> msg(kSendLen, std::byte{1});
  for (int i = 0; i < kSends; i++) a.submit_send(b.main_address(), msg, OnDone::counter(&done, &failed));
  ASSERT_TRUE(wait_until([&] { return done + failed == kSingles + kPaged + kSends; }));
  ASSERT_EQ(failed.load(), 0u);
  ASSERT_TRUE(wait_until([&] { return imms_seen == 1 && received == kSends; }));

  // Single writes of 3000 bytes are one WRITE each (<= 32 KiB), whatever the NIC count.
  ASSERT_EQ(single_write_imm_count(kSingleLen, nics, false), 1u);
  const uint64_t writes = kSingles + kPaged * kPages;
  const uint64_t bytes = kSingles * kSingleLen + kPaged * kPages * kPageLen;
  const Exposition ea = parse_exposition(a.metrics_text());
  EXPECT_EQ(ea.get("fabric_writes_total"), writes);
  EXPECT_EQ(ea.get("fabric_write_bytes_total"), bytes);
  EXPECT_EQ(ea.get("fabric_sends_total"), kSends);
  EXPECT_EQ(ea.sum("fabric_nic_writes_total"), writes);
  EXPECT_EQ(ea.sum("fabric_nic_write_bytes_total"), bytes);
  EXPECT_EQ(ea.sum("fabric_nic_sends_total"), kSends);
  EXPECT_EQ(ea.sum("fabric_nic_errors_total"), 0);
  EXPECT_EQ(ea.sum("fabric_nic_in_flight"), 0);
  EXPECT_EQ(ea.get(R"(fabric_transfers_total{kind="single",worker="0"})"), kSingles);
  EXPECT_EQ(ea.get(R"(fabric_transfers_completed_total{kind="single",worker="0"})"), kSingles);
  EXPECT_EQ(ea.get(R"(fabric_transfers_total{kind="paged",worker="0"})"), kPaged);
  EXPECT_EQ(ea.get(R"(fabric_transfers_completed_total{kind="paged",worker="0"})"), kPaged);
  EXPECT_EQ(ea.get(R"(fabric_transfers_total{kind="send",worker="0"})"), kSends);
  EXPECT_FALSE(ea.has(R"(fabric_transfers_total{kind="scatter",worker="0"})")) << "no scatter was submitted";
  EXPECT_EQ(ea.sum("fabric_transfer_failures_total"), 0);
  EXPECT_EQ(ea.sum("fabric_transfers_in_flight"), 0);
  EXPECT_EQ(ea.get(R"(fabric_transfer_duration_seconds_count{kind="single",worker="0"})"), kSingles);
  EXPECT_EQ(ea.get(R"(fabric_transfer_duration_seconds_bucket{kind="single",le="+Inf",worker="0"})"), kSingles);
  EXPECT_EQ(ea.get(R"(fabric_transfer_first_post_seconds_count{kind="paged",worker="0"})"), kPaged);
  EXPECT_GT(ea.get(R"(fabric_transfer_duration_seconds_sum{kind="single",worker="0"})"), 0);
  // The peer, named as metrics_peer_label names b.
  const std::string peer = "peer=\"" + metrics_peer_label(b.main_address()) + "\"";
  EXPECT_EQ(ea.sum("fabric_peer_writes_total", {peer}), writes);
  EXPECT_EQ(ea.sum("fabric_peer_write_bytes_total", {peer}), bytes);
  EXPECT_EQ(ea.sum("fabric_peer_sends_total", {peer}), kSends);
  EXPECT_EQ(ea.sum("fabric_peer_writes_total"), writes) << "one peer only";
  EXPECT_EQ(ea.get(R"(fabric_peers{worker="0"})"), 1);
  EXPECT_EQ(ea.get(R"(fabric_worker_stalled{worker="0"})"), 0);
  EXPECT_EQ(ea.types.at("fabric_transfer_duration_seconds"), "histogram");
  EXPECT_EQ(ea.types.at("fabric_nic_in_flight"), "gauge");

  const Exposition eb = parse_exposition(b.metrics_text());
  EXPECT_EQ(eb.get("fabric_immediates_received_total"), writes);
  EXPECT_EQ(eb.sum("fabric_nic_messages_received_total"), kSends);
  EXPECT_EQ(eb.get("fabric_writes_total"), 0);
  // nic_stats() reads the same counters.
  uint64_t stats_writes = 0, stats_bytes = 0;
  for (const NicStats& s : a.nic_stats()) stats_writes += s.writes_posted, stats_bytes += s.bytes_written;
  EXPECT_EQ(stats_writes, writes);
  EXPECT_EQ(stats_bytes, bytes);
}

INSTANTIATE_TEST_SUITE_P(Loopback, MetricsCounts,
                         ::testing::Values(ProviderCase{"tcp;ofi_rxm", 1, false}, ProviderCase{"tcp;ofi_rxm", 2, false},
                                           ProviderCase{"shm", 1, false}),
                         case_name);

const ProviderCase kTcp1{"tcp;ofi_rxm", 1, false};

TEST(Metrics, RefusedSubmitsAndADeadPeerShowUnderTheirCause) {
  std::vector<uint8_t> src(1 << 12), dst(1 << 12);
  auto gone = std::make_unique<TransferEngine>(config_for(kTcp1));
  MrDesc dead = gone->reg_mr(dst.data(), dst.size()).second;
  gone.reset();  // its address no longer answers: connection refused

  // tcp;ofi_rxm may keep trying to connect to a dead address rather than fail the WRITE (peer
  // lost): then it times out, which gives the peer up just the same.
  EngineConfig cfg = config_for(kTcp1);
  cfg.transfer_timeout = std::chrono::seconds(2);
  TransferEngine a(cfg);
  auto [hs, ds] = a.reg_mr(src.data(), src.size());
  const RemoteMr rd = a.add_remote(dead);
  std::atomic<uint64_t> done{0}, failed{0};
  EXPECT_THROW(a.submit(SingleWrite{.len = 100, .src = {hs, src.size()}, .dst = {rd, 0}}, OnDone::counter(&done)),
               Error);
  EXPECT_THROW(a.submit(SingleWrite{.len = 1, .src = {MrHandle{}, 0}, .dst = {rd, 0}}, OnDone::counter(&done)),
               Error);
  EXPECT_THROW(a.submit(SingleWrite{.len = 1, .src = {hs, 0}, .dst = {rd, 0}, .nic = 3}, OnDone::counter(&done)),
               Error);
  a.submit(SingleWrite{.len = 100, .src = {hs, 0}, .dst = {rd, 0}}, OnDone::counter(&done, &failed));
  ASSERT_TRUE(wait_until([&] { return done + failed == 1; }));
  EXPECT_EQ(failed.load(), 1u);

  const Exposition e = parse_exposition(a.metrics_text());
  EXPECT_EQ(e.get(R"(fabric_submits_refused_total{code="out_of_bounds",kind="single"})"), 1);
  EXPECT_EQ(e.get(R"(fabric_submits_refused_total{code="not_found",kind="single"})"), 1);
  EXPECT_EQ(e.get(R"(fabric_submits_refused_total{code="invalid_argument",kind="single"})"), 1);
  EXPECT_EQ(e.get(R"(fabric_transfers_total{kind="single",worker="0"})"), 1) << "refused ones never reach the worker";
  EXPECT_EQ(e.get(R"(fabric_transfer_failures_total{code="peer_lost",kind="single",worker="0"})") +
                e.get(R"(fabric_transfer_failures_total{code="timeout",kind="single",worker="0"})"),
            1);
  EXPECT_EQ(e.sum("fabric_transfer_failures_total"), 1);
  EXPECT_EQ(e.get(R"(fabric_transfers_completed_total{kind="single",worker="0"})"), 0);
  EXPECT_EQ(e.get(R"(fabric_transfer_duration_seconds_count{kind="single",worker="0"})"), 0);
  EXPECT_EQ(e.get(R"(fabric_peers_lost_total{worker="0"})"), 1);
}

// GET over a plain socket: the status code and the body.
std::pair<int, std::string> http_get(uint16_t port, const std::string& path) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(port);
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa), 0) << std::strerror(errno);
  const std::string req = "GET " + path + " HTTP/1.1\r\nHost: localhost\r\n\r\n";
  EXPECT_EQ(::send(fd, req.data(), req.size(), 0), ssize_t(req.size()));
  std::string resp;
  char buf[4096];
  for (ssize_t n; (n = ::recv(fd, buf, sizeof buf, 0)) > 0;) resp.append(buf, size_t(n));
  ::close(fd);
  const size_t head_end = resp.find("\r\n\r\n");
  if (resp.size() < 12 || head_end == std::string::npos) return {0, resp};
  return {std::stoi(resp.substr(9, 3)), resp.substr(head_end + 4)};
}

// A port free a moment ago (the kernel's pick); the engine binds it next.
uint16_t free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa);
  socklen_t len = sizeof sa;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len);
  ::close(fd);
  return ntohs(sa.sin_port);
}

TEST(Metrics, TheEndpointServesTheSameTextAndRefusesOtherPaths) {
  EngineConfig cfg = config_for(kTcp1);
  std::unique_ptr<TransferEngine> a;
  for (int tries = 0; !a; tries++) {  // another process may take the port in between
    cfg.metrics_port = free_port();
    try {
      a = std::make_unique<TransferEngine>(cfg);
    } catch (const Error& e) {
      ASSERT_LT(tries, 5) << e.what();
    }
  }
  std::vector<uint8_t> src(4096), dst(4096);
  auto [hs, ds] = a->reg_mr(src.data(), src.size());
  auto [hd, dd] = a->reg_mr(dst.data(), dst.size());
  std::atomic<uint64_t> done{0};
  a->submit(SingleWrite{.len = 4096, .src = {hs, 0}, .dst = {a->add_remote(dd), 0}}, OnDone::counter(&done));
  ASSERT_TRUE(wait_until([&] { return done == 1; }));
  auto reg = a->add_metrics_source([](MetricsWriter& w) { w.counter("app_things_total", "things", 3); });

  auto [code, body] = http_get(cfg.metrics_port, "/metrics");
  EXPECT_EQ(code, 200);
  const Exposition served = parse_exposition(body);
  EXPECT_EQ(served.series, parse_exposition(a->metrics_text()).series) << "nothing moves while idle";
  EXPECT_EQ(served.get("fabric_writes_total"), 1);
  EXPECT_EQ(served.get("app_things_total"), 3);
  EXPECT_EQ(http_get(cfg.metrics_port, "/").first, 404);
  EXPECT_EQ(http_get(cfg.metrics_port, "/metricsx").first, 404);
  EXPECT_EQ(http_get(cfg.metrics_port, "/metrics?x=1").first, 200);

  // The port is taken while the engine lives: a second engine on it is refused, naming the field.
  EngineConfig again = config_for(kTcp1);
  again.metrics_port = cfg.metrics_port;
  expect_error(ErrorCode::kInvalidArgument, "metrics_port", [&] { TransferEngine b(again); });
  a.reset();  // stops the endpoint with the engine
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(cfg.metrics_port);
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_NE(::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa), 0) << "still served after close";
  ::close(fd);
}

TEST(Metrics, ARemovedSourceIsNeverCalledAgain) {
  TransferEngine a(config_for(kTcp1));
  std::atomic<int> calls{0}, self_calls{0};
  auto reg = a.add_metrics_source([&](MetricsWriter& w) {
    calls++;
    w.gauge("app_depth", "a depth", -2, {{"queue", "a\"b\\c\nd"}});
  });
  MetricsRegistration self;
  self = a.add_metrics_source([&](MetricsWriter&) {
    self_calls++;
    self.remove();  // from inside its own call
  });
  Exposition e = parse_exposition(a.metrics_text());
  EXPECT_EQ(e.get("app_depth{queue=\"a\"b\\c\nd\"}"), -2) << "escaped and read back";
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(self_calls, 1);
  reg.remove();
  EXPECT_FALSE(reg.registered());
  e = parse_exposition(a.metrics_text());
  EXPECT_FALSE(e.has("app_depth{queue=\"a\"b\\c\nd\"}"));
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(self_calls, 1);
  // Removed by destruction; a registration that outlives its engine is harmless.
  std::optional<MetricsRegistration> scoped = a.add_metrics_source([&](MetricsWriter&) { calls++; });
  a.metrics_text();
  EXPECT_EQ(calls, 2);
  scoped.reset();
  a.metrics_text();
  EXPECT_EQ(calls, 2);
  {
    auto b = std::make_unique<TransferEngine>(config_for(kTcp1));
    MetricsRegistration late = b->add_metrics_source([&](MetricsWriter&) { calls++; });
    b.reset();
  }  // `late` goes after its engine
  EXPECT_EQ(calls, 2);
}

}  // namespace
}  // namespace fabric::testing
