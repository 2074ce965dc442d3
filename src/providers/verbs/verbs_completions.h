// The completion side of a verbs domain: reads the send and receive CQs that every queue pair
// shares, turns work completions into Completions (a failed one names the peer and the status,
// and loses the peer's connection), and keeps the immediate SRQ filled with the zero-length
// receives that WRITE_WITH_IMM consumes.
#pragma once

#include <infiniband/verbs.h>

#include <chrono>
#include <cstdint>
#include <span>

#include "domain/domain.h"
#include "providers/verbs/verbs_posting.h"
#include "providers/verbs/verbs_queues.h"

namespace fabric::verbs {

class Connections;

class CompletionReader {
 public:
  // Immediate receives are posted again in batches of at least this many (imm_receives must hold
  // more).
  static constexpr uint32_t kImmRefill = 4 * kChain;

  // Fills the immediate SRQ. Everything passed outlives this object.
  CompletionReader(const DeviceContext& dev, const SharedQueues& queues, RequestPoster& poster,
                   Connections& connections, CompletionBacklog& backlog);
  CompletionReader(const CompletionReader&) = delete;
  CompletionReader& operator=(const CompletionReader&) = delete;

  // Up to out.size() completions: the backlog's first, then each CQ may take half of what is
  // left, then the send CQ the rest, so that a stream of local completions never leaves the
  // receive CQ (and with it the immediate receives' reposting) unread.
  size_t read(std::span<Completion> out);
  // All of the receive CQ into the backlog, before a retired queue pair is destroyed.
  void read_out_receives();

 private:
  // Reads `cq` into out[n, limit) through `on_completion` (1: it wrote a Completion); the new n.
  template <size_t (CompletionReader::*on_completion)(const ibv_wc&, Completion&)>
  size_t drain(ibv_cq* cq, std::span<Completion> out, size_t n, size_t limit);
  void warn_imm_receives_low();
  size_t on_send_completion(const ibv_wc& wc, Completion& c);
  size_t on_recv_completion(const ibv_wc& wc, Completion& c);
  void repost_imm_recvs();

  const DeviceContext& dev_;
  const SharedQueues& queues_;
  RequestPoster& poster_;
  Connections& connections_;
  CompletionBacklog& backlog_;
  uint32_t imm_reposts_ = 0;  // immediate receives consumed, not yet posted again
  std::chrono::steady_clock::time_point next_low_warning_{};
};

}  // namespace fabric::verbs
