// MoE dispatch/combine steps for the loopback tests: ranks as threads of this process, an
// all-gather among them, skewed random routing, and each rank's dispatch and combine outputs
// checked against the CPU reference (include/fabric/moe/reference.h).
#pragma once

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <barrier>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "fabric/moe/all_to_all.h"
#include "fabric/moe/reference.h"
#include "fabric/weights/fp8.h"
#include "loopback/test_support.h"
#include "moe/layout.h"

namespace fabric::testing {

using moe::AllToAll;
using moe::AllToAllConfig;
using moe::ReferenceInput;

// An all-gather among the threads of one test.
class ThreadGather {
 public:
  explicit ThreadGather(uint32_t ranks) : ranks_(ranks), slots_(ranks) {}
  moe::AllGather for_rank(uint32_t rank) {
    return [this, rank](const std::vector<std::byte>& mine) { return gather(rank, mine); };
  }

 private:
  std::vector<std::vector<std::byte>> gather(uint32_t rank, const std::vector<std::byte>& mine) {
    std::unique_lock lock(mu_);
    const uint64_t round = round_;
    slots_[rank] = mine;
    if (++arrived_ == ranks_) {
      result_ = slots_;
      arrived_ = 0;
      ++round_;
      cv_.notify_all();
    } else {
      cv_.wait(lock, [&] { return round_ != round; });
    }
    return result_;
  }
  uint32_t ranks_;
  std::mutex mu_;
  std::condition_variable cv_;
  uint32_t arrived_ = 0;
  uint64_t round_ = 0;
  std::vector<std::vector<std::byte>> slots_, result_;
};

struct MoeCase {
  ProviderCase provider;
  uint32_t ranks, node_size, experts, topk, hidden, max_tokens, private_rows;
  moe::Dtype dtype;
};
inline void PrintTo(const MoeCase& c, std::ostream* os) {
  PrintTo(c.provider, os);
  *os << ", " << c.ranks << " ranks in nodes of " << c.node_size << ", hidden " << c.hidden
      << ", private " << c.private_rows << (c.dtype == moe::Dtype::kFp8 ? ", fp8" : ", bf16");
}

inline AllToAllConfig config_of(const MoeCase& c, uint32_t rank, const std::string& job) {
  AllToAllConfig cfg;
  cfg.rank = rank, cfg.ranks = c.ranks, cfg.node_size = c.node_size, cfg.experts = c.experts,
  cfg.topk = c.topk;
  cfg.hidden = c.hidden, cfg.max_tokens = c.max_tokens, cfg.private_rows = c.private_rows,
  cfg.dispatch_dtype = c.dtype;
  cfg.timeout = std::chrono::seconds(60);
  cfg.job = job;
  return cfg;
}

// One engine per rank.
inline std::vector<std::unique_ptr<TransferEngine>> engines_for(const MoeCase& mc) {
  std::vector<std::unique_ptr<TransferEngine>> engines;
  for (uint32_t r = 0; r < mc.ranks; ++r)
    engines.push_back(std::make_unique<TransferEngine>(config_for(mc.provider)));
  return engines;
}

// Step `step`'s input of `rank`: token counts that differ per rank (rank 1 sends none on odd
// steps), routing where a third of the picks go to two hot experts, ~1 in 8 slots masked.
inline ReferenceInput make_input(const AllToAllConfig& c, uint32_t rank, uint32_t step) {
  std::mt19937_64 rng(rank * 1000003ull + step * 7919ull + 17);
  ReferenceInput in;
  in.num_tokens =
      (rank == 1 && step % 2 == 1) ? 0 : static_cast<uint32_t>(rng() % (c.max_tokens + 1));
  if (rank == 0) in.num_tokens = c.max_tokens;
  const bool fp8 = c.dispatch_dtype == moe::Dtype::kFp8;
  const uint64_t payload = fp8 ? c.hidden : 2ull * c.hidden;
  in.x.resize(in.num_tokens * payload);
  for (auto& b : in.x) b = std::byte(rng());
  if (fp8) {
    in.x_scales.resize(uint64_t{in.num_tokens} * c.hidden / 128);
    for (auto& s : in.x_scales) s = static_cast<float>(rng() % 1000) / 64.0f;
  }
  in.topk_idx.assign(uint64_t{in.num_tokens} * c.topk, -1);
  in.topk_weights.resize(in.topk_idx.size());
  for (uint32_t t = 0; t < in.num_tokens; ++t)
    for (uint32_t k = 0; k < c.topk; ++k) {
      in.topk_weights[t * c.topk + k] = static_cast<float>(rng() % 4096) / 4096.0f;
      if (rng() % 8 == 0) continue;  // masked
      for (;;) {
        const int64_t e = rng() % 3 == 0 ? static_cast<int64_t>(rng() % 2)
                                         : static_cast<int64_t>(rng() % c.experts);
        bool taken = false;
        for (uint32_t k2 = 0; k2 < k; ++k2) taken |= in.topk_idx[t * c.topk + k2] == e;
        if (taken) continue;
        in.topk_idx[t * c.topk + k] = e;
        break;
      }
    }
  return in;
}

// The "expert": a BF16 row that depends on the row's source token, the expert and the column,
// so a row combined from the wrong place shows.
inline std::vector<uint16_t> expert_output(const AllToAllConfig& c, uint32_t rank,
                                           const moe::DispatchOutput& out) {
  const uint64_t M = out.rows_per_expert;
  std::vector<uint16_t> y(uint64_t{out.local_experts} * M * c.hidden, 0);
  for (uint32_t el = 0; el < out.local_experts; ++el)
    for (int32_t m = 0; m < out.counts[el]; ++m) {
      const int64_t src = out.src[el * M + m];
      for (uint32_t h = 0; h < c.hidden; ++h) {
        const float v =
            static_cast<float>((src * 31 + (rank * out.local_experts + el) * 7 + h) % 97) * 0.125f -
            6.0f;
        y[(el * M + m) * c.hidden + h] = moe::detail::float_to_bf16(v);
      }
    }
  return y;
}

// BF16 tokens for a quantizing dispatch, [num_tokens][hidden]: per 128-value block a magnitude
// m = 2^-14 .. 2^10 (values from subnormal e4m3 to saturation after scaling), 1 block in 16 all
// zeros, 1 value in 32 zero; 1 block in 8 has amax 1.75 m (amax / 448 exactly a power of two, the
// edge of a power-of-two scale's ceiling) and 1 in 8 the next BF16 above it.
inline std::vector<uint16_t> make_bf16_tokens(const AllToAllConfig& c, uint32_t num_tokens, uint32_t seed) {
  std::mt19937_64 rng(seed * 2654435761ull + 99);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  std::vector<uint16_t> x(uint64_t{num_tokens} * c.hidden, 0);
  for (uint64_t b = 0; b < x.size() / 128; ++b) {
    if (rng() % 16 == 0) continue;
    const float magnitude = std::ldexp(1.0f, static_cast<int>(rng() % 25) - 14);
    for (uint64_t i = 0; i < 128; ++i)
      if (rng() % 32 != 0) x[b * 128 + i] = moe::detail::float_to_bf16(unit(rng) * magnitude);
    const uint64_t kind = rng() % 8, at = b * 128 + rng() % 128;
    const float sign = rng() % 2 ? -1.0f : 1.0f;
    if (kind == 0) x[at] = moe::detail::float_to_bf16(sign * 1.75f * magnitude);
    if (kind == 1) x[at] = moe::detail::float_to_bf16(sign * (1.75f + 0x1p-7f) * magnitude);
  }
  return x;
}

// What a quantizing dispatch must send for BF16 tokens x, computed apart from the library's
// kernels: block quantization of each token (fp8::quantize_blocks, one row at a time) for kAmax;
// for kPow2 the scale from a double log2 (exact for the float quotient) and fp8::to_e4m3.
inline void quantize_tokens(const AllToAllConfig& c, moe::Quantize q, const std::vector<uint16_t>& x,
                            ReferenceInput& in) {
  const uint64_t H = c.hidden, G = H / 128;
  in.x.assign(uint64_t{in.num_tokens} * H, std::byte{0});
  in.x_scales.assign(uint64_t{in.num_tokens} * G, 0.0f);
  for (uint64_t t = 0; t < in.num_tokens; ++t) {
    if (q == moe::Quantize::kAmax) {
      fp8::quantize_blocks({.in = std::span(x).subspan(t * H, H), .rows = 1, .cols = H,
                            .out = std::span(reinterpret_cast<uint8_t*>(in.x.data()) + t * H, H),
                            .scales = std::span(in.x_scales).subspan(t * G, G)});
      continue;
    }
    for (uint64_t g = 0; g < G; ++g) {
      float amax = 0.0f;
      for (uint64_t i = 0; i < 128; ++i) amax = std::max(amax, std::fabs(fp8::from_bf16(x[t * H + g * 128 + i])));
      const float v = std::max(amax, 1e-4f) / 448.0f;
      const float scale = static_cast<float>(std::exp2(std::ceil(std::log2(static_cast<double>(v)))));
      in.x_scales[t * G + g] = scale;
      for (uint64_t i = 0; i < 128; ++i)
        in.x[t * H + g * 128 + i] = std::byte{fp8::to_e4m3(fp8::from_bf16(x[t * H + g * 128 + i]) / scale)};
    }
  }
}

// How run_steps runs: shared, rank r's engine (empty: an engine each); seed, another input for
// every step (two instances that share engines route differently); overlap, two dispatches in
// flight (send A, send B, receive A, receive B, then combine A and B, received in the opposite
// order), else one at a time with every other step's halves as separate calls; quantize, FP8
// dispatches of BF16 tokens that the send half quantizes (checked against quantize_tokens);
// recombine, every dispatch combined a second time with the expert outputs negated (as DeepEP's
// test combines each dispatch twice; a row of the first combine read by the second shows).
struct StepRun {
  std::vector<TransferEngine*> shared{};
  uint32_t seed = 0;
  bool overlap = false;
  moe::Quantize quantize = moe::Quantize::kNone;
  bool recombine = false;
};

// Runs rank_main(r) -> failure ("" when none) on a thread per rank and returns each rank's;
// on_failure() runs on a rank's thread when it failed or threw (e.g. to leave a barrier, so the
// others do not wait for it).
template <typename RankMain, typename OnFailure>
std::vector<std::string> on_rank_threads(uint32_t ranks, RankMain&& rank_main, OnFailure&& on_failure) {
  std::vector<std::string> failures(ranks);
  std::vector<std::thread> threads;
  for (uint32_t r = 0; r < ranks; ++r)
    threads.emplace_back([&, r] {
      try {
        failures[r] = rank_main(r);
      } catch (const std::exception& e) {
        failures[r] = e.what();
      }
      if (!failures[r].empty()) on_failure();
    });
  for (auto& t : threads) t.join();
  return failures;
}

// The expert outputs with every value's sign flipped (exact in BF16).
inline std::vector<uint16_t> negated(std::vector<uint16_t> y) {
  for (uint16_t& v : y) v ^= 0x8000;
  return y;
}

// Runs `steps` steps on every rank (a thread each) and checks each rank's dispatch output and
// combine output against the reference. Returns per rank the first failure ("" when none).
inline std::vector<std::string> run_steps(const MoeCase& mc, uint32_t steps, const std::string& job,
                                          const StepRun& run = {}) {
  ThreadGather gather(mc.ranks);
  const std::vector<std::unique_ptr<TransferEngine>> owned =
      run.shared.empty() ? engines_for(mc) : decltype(engines_for(mc)){};
  std::vector<TransferEngine*> engines = run.shared;
  for (const auto& e : owned) engines.push_back(e.get());
  const uint32_t batch = run.overlap ? 2 : 1;
  // [batch][rank]: this step's expert outputs, for combine's reference.
  std::vector<std::vector<std::vector<uint16_t>>> expert_outs(
      batch, std::vector<std::vector<uint16_t>>(mc.ranks));
  std::barrier sync(static_cast<std::ptrdiff_t>(mc.ranks));
  std::atomic<bool> any_failed{false};

  auto check_dispatch = [&](const AllToAllConfig& cfg, uint32_t r, uint32_t step,
                            const std::vector<ReferenceInput>& inputs,
                            const moe::DispatchOutput& out) -> std::string {
    const moe::ReferenceDispatch want = moe::reference_dispatch(cfg, inputs)[r];
    const uint64_t M = out.rows_per_expert,
                   payload = mc.dtype == moe::Dtype::kFp8 ? mc.hidden : 2ull * mc.hidden;
    const uint64_t sc = mc.dtype == moe::Dtype::kFp8 ? mc.hidden / 128 : 0;
    for (uint32_t el = 0; el < out.local_experts; ++el) {
      const uint32_t e = r * out.local_experts + el;
      if (out.counts[el] != want.counts[el])
        return fmt::format("step {} expert {}: {} rows, the reference {}", step, e, out.counts[el],
                           want.counts[el]);
      const uint64_t rows = static_cast<uint64_t>(want.counts[el]);
      if (std::memcmp(static_cast<const std::byte*>(out.x) + el * M * payload,
                      want.x.data() + el * M * payload, rows * payload) != 0)
        return fmt::format("step {} expert {}: received rows differ from their source tokens", step,
                           e);
      if (std::memcmp(out.src + el * M, want.src.data() + el * M, rows * 4) != 0)
        return fmt::format("step {} expert {}: rows name other source tokens", step, e);
      if (sc && std::memcmp(out.scales + el * M * sc, want.scales.data() + el * M * sc,
                            rows * sc * 4) != 0)
        return fmt::format("step {} expert {}: scales differ", step, e);
      // Each source's run of the expert's rows (sources in rank order), from the reference's, read
      // as DeepEP's own test reads layout_range (tests/legacy/test_low_latency.py: begin = v >> 32,
      // count = v & 0xffffffff).
      uint64_t first = 0;
      for (uint32_t s = 0; s < mc.ranks; ++s) {
        uint64_t n = 0;
        for (uint64_t m = 0; m < rows; ++m) n += want.src[el * M + m] / mc.max_tokens == s;
        const auto got = static_cast<uint64_t>(out.runs[el * mc.ranks + s]);
        const uint64_t got_begin = got >> 32, got_count = got & 0xffffffffu;
        if (got_count != n || (n > 0 && got_begin != first))
          return fmt::format("step {} expert {}: the run of source {} is (begin {}, count {}), not "
                             "(begin {}, count {})",
                             step, e, s, got_begin, got_count, first, n);
        first += n;
      }
    }
    return "";
  };

  auto rank_main = [&](uint32_t r) -> std::string {
    const AllToAllConfig cfg = config_of(mc, r, job);
    AllToAll a2a(*engines[r], cfg, gather.for_rank(r));
    if (run.quantize != moe::Quantize::kNone) {
      // Scales with a quantizing dispatch are refused before anything is written (the steps
      // below then run exactly).
      const float scale = 1.0f;
      try {
        a2a.dispatch_send({.x_scales = &scale, .quantize = run.quantize});
        return "a quantizing dispatch took x_scales";
      } catch (const Error& e) {
        if (e.code() != ErrorCode::kInvalidArgument ||
            std::string(e.what()).find("x_scales is given with quantize") == std::string::npos)
          return fmt::format("x_scales with quantize: {}", e.what());
      }
    }
    for (uint32_t first = 1; first + batch - 1 <= steps; first += batch) {
      std::vector<std::vector<ReferenceInput>> inputs(batch);
      std::vector<std::vector<uint16_t>> bf16(batch);  // this rank's tokens before quantization
      std::vector<moe::Handle> handles(batch);
      for (uint32_t b = 0; b < batch; ++b)
        for (uint32_t s = 0; s < mc.ranks; ++s) {
          const uint32_t seed = first + b + 1000 * run.seed;
          inputs[b].push_back(make_input(cfg, s, seed));
          if (run.quantize == moe::Quantize::kNone) continue;
          const std::vector<uint16_t> x = make_bf16_tokens(cfg, inputs[b][s].num_tokens, seed * 131 + s);
          quantize_tokens(cfg, run.quantize, x, inputs[b][s]);
          if (s == r) bf16[b] = x;
        }
      auto args_of = [&](uint32_t b) {
        const ReferenceInput& in = inputs[b][r];
        if (run.quantize != moe::Quantize::kNone)
          return moe::DispatchArgs{.num_tokens = in.num_tokens,
                                   .x = bf16[b].data(),
                                   .topk_idx = in.topk_idx.data(),
                                   .quantize = run.quantize};
        return moe::DispatchArgs{.num_tokens = in.num_tokens,
                                 .x = in.x.data(),
                                 .x_scales = in.x_scales.data(),
                                 .topk_idx = in.topk_idx.data()};
      };
      if (run.overlap) {
        for (uint32_t b = 0; b < batch; ++b) handles[b] = a2a.dispatch_send(args_of(b));
        for (uint32_t b = 0; b < batch; ++b) a2a.dispatch_recv(handles[b]);
      } else if (first % 2 == 0) {
        handles[0] = a2a.dispatch_send(args_of(0));
        a2a.dispatch_recv(handles[0]);
      } else {
        handles[0] = a2a.dispatch(args_of(0));
      }
      std::vector<std::vector<uint16_t>> ys(batch);
      for (uint32_t b = 0; b < batch; ++b) {
        if (handles[b].step != first + b || handles[b].num_tokens != inputs[b][r].num_tokens)
          return fmt::format("step {}: the handle names dispatch {} of {} tokens", first + b,
                             handles[b].step, handles[b].num_tokens);
        const moe::DispatchOutput out = a2a.output(handles[b]);
        if (std::string f = check_dispatch(cfg, r, first + b, inputs[b], out); !f.empty()) return f;
        ys[b] = expert_output(cfg, r, out);
        expert_outs[b][r] = ys[b];
      }
      sync.arrive_and_wait();            // every rank's expert outputs are in expert_outs
      if (any_failed.load()) return "";  // another rank failed: its failure is the one to report
      std::vector<std::vector<uint16_t>> want(batch), want_again(batch), combined(batch);
      for (uint32_t b = 0; b < batch; ++b) {
        want[b] = moe::reference_combine(cfg, inputs[b], r, expert_outs[b]);
        if (run.recombine) {
          std::vector<std::vector<uint16_t>> flipped;
          for (const auto& y : expert_outs[b]) flipped.push_back(negated(y));
          want_again[b] = moe::reference_combine(cfg, inputs[b], r, flipped);
        }
      }
      sync.arrive_and_wait();  // nobody overwrites expert_outs before every rank took its reference
      auto cargs_of = [&](uint32_t b) {
        return moe::CombineArgs{.expert_out = ys[b].data(),
                                .topk_weights = inputs[b][r].topk_weights.data(),
                                .out = combined[b].data()};
      };
      for (uint32_t round = 0; round < (run.recombine ? 2u : 1u); ++round) {
        for (uint32_t b = 0; b < batch; ++b) {
          combined[b].assign(uint64_t{inputs[b][r].num_tokens} * mc.hidden, 0xFFFF);
          if (round == 1) ys[b] = negated(ys[b]);
        }
        if (run.overlap) {
          for (uint32_t b = 0; b < batch; ++b) a2a.combine_send(handles[b], cargs_of(b));
          for (uint32_t b = batch; b-- > 0;) a2a.combine_recv(handles[b], cargs_of(b));
        } else if ((first + round) % 2 == 0) {
          a2a.combine_send(handles[0], cargs_of(0));
          a2a.combine_recv(handles[0], cargs_of(0));
        } else {
          a2a.combine(handles[0], cargs_of(0));
        }
        for (uint32_t b = 0; b < batch; ++b)
          if (combined[b] != (round == 0 ? want[b] : want_again[b]))
            return fmt::format("step {}: {} combine differs from the reference", first + b,
                               round == 0 ? "the" : "the second");
      }
    }
    a2a.check();
    return "";
  };
  return on_rank_threads(mc.ranks, rank_main, [&] {
    any_failed.store(true);
    sync.arrive_and_drop();  // the others must not wait for this rank
  });
}

}  // namespace fabric::testing
