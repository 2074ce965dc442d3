// The benchmark's control channel: short text messages over the engine's own SEND/RECV (so the
// tool needs nothing but the peer's NetAddr), plus the data pattern both sides agree on.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "fabric/fabric.h"

namespace fabric::bench {

inline uint8_t pattern(uint64_t i) { return static_cast<uint8_t>(i * 131 + (i >> 12) + 7); }

class Control {
 public:
  explicit Control(TransferEngine& engine) : engine_(engine) {
    engine_.submit_recvs(65536, 16, [this](std::span<const std::byte> m) {
      std::lock_guard lock(mu_);
      inbox_.emplace_back(reinterpret_cast<const char*>(m.data()), m.size());
      cv_.notify_one();
    });
  }
  void set_peer(const NetAddr& peer) { peer_ = peer; }
  void set_reply_timeout(std::chrono::milliseconds t) { reply_timeout_ = t; }

  void send(const std::string& msg) {
    std::atomic<int> done{kDonePending};
    engine_.submit_send(peer_, std::as_bytes(std::span(msg)), OnDone::flag(&done));
    done.wait(kDonePending);
    if (done.load() != kDoneSucceeded) throw Error(ErrorCode::kProvider, "control message lost");
  }

  std::string recv() { return recv(reply_timeout_); }
  std::string recv(std::chrono::milliseconds timeout) {
    std::unique_lock lock(mu_);
    if (!cv_.wait_for(lock, timeout, [&] { return !inbox_.empty(); }))
      throw Error(ErrorCode::kTimeout, "no control message from the peer within " +
                                           std::to_string(timeout.count()) + " ms (is it running?)");
    std::string m = std::move(inbox_.front());
    inbox_.pop_front();
    return m;
  }

  // Sends and expects a reply starting with `want`.
  std::string call(const std::string& msg, const std::string& want) {
    send(msg);
    std::string r = recv();
    if (r.rfind(want, 0) != 0)
      throw Error(ErrorCode::kProvider, "control: sent '" + msg + "', got '" + r + "'");
    return r;
  }

 private:
  TransferEngine& engine_;
  NetAddr peer_;
  std::chrono::milliseconds reply_timeout_ = std::chrono::seconds(300);
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::string> inbox_;
};

inline std::vector<std::string> split(const std::string& s) {
  std::istringstream in(s);
  std::vector<std::string> out;
  for (std::string w; in >> w;) out.push_back(w);
  return out;
}

// Random page order shared by both sides: a permutation of [0, n).
std::vector<uint32_t> page_order(uint32_t n, uint32_t seed);

}  // namespace fabric::bench
