// A weight update's training and inference ranks for the loopback tests: each rank with its
// engine (its own, or one of a few shared ones), its immediate range and its registered arena(s),
// the senders and receivers, and one step run on every rank at once.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstring>
#include <future>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "fabric/fabric.h"
#include "fabric/weights/update.h"
#include "test_support.h"
#include "weights_model.h"

namespace fabric::weights {

using fabric::testing::config_for;
using fabric::testing::ProviderCase;
using testing::Model;
using testing::random_bf16;

// Training and inference ranks of one model, each with its engine and registered arena(s).
struct Cluster {
  Model model;
  std::shared_ptr<const UpdatePlan> plan;
  std::vector<std::unique_ptr<TransferEngine>> owned;
  std::vector<TransferEngine*> train_engines, infer_engines;
  std::vector<ImmReservation> train_imms, infer_imms;  // each rank's immediate range; before the senders go
  std::vector<std::vector<std::byte>> train_arena;
  std::vector<std::vector<std::vector<std::byte>>> infer_arena;  // [set][rank]
  std::vector<MrHandle> train_mr;
  std::vector<MrDesc> train_desc;
  std::vector<std::vector<MrDesc>> infer_desc;  // [set][rank]
  std::vector<std::unique_ptr<WeightSender>> senders;
  std::vector<std::unique_ptr<WeightReceiver>> receivers;

  // shared: engines to put the ranks on (training rank r on shared[r % size], inference rank r on
  // shared[(ns + r) % size]) instead of an engine each; they must outlive the cluster.
  Cluster(Model m, const ProviderCase& pc, uint32_t window, uint32_t sets, uint64_t owner_rows,
          std::chrono::milliseconds timeout = std::chrono::seconds(60), std::vector<TransferEngine*> shared = {})
      : model(std::move(m)) {
    plan = std::make_shared<const UpdatePlan>(plan_update(model.m, {.owner_rows = owner_rows}));
    const uint32_t ns = model.m.src_ranks, nd = model.m.dst_ranks;
    const std::vector<uint64_t> staging = staging_bytes_for(*plan, window);
    auto engine_for = [&](uint32_t i) {
      if (!shared.empty()) return shared[i % shared.size()];
      owned.push_back(std::make_unique<TransferEngine>(config_for(pc)));
      return owned.back().get();
    };
    for (uint32_t r = 0; r < ns; r++) {
      train_engines.push_back(engine_for(r));
      train_arena.emplace_back(plan->staging_base[r] + staging[r]);
      train_imms.push_back(train_engines[r]->reserve_imms({.holder = "weights trainer", .bits = kUpdateImmBits}));
      auto [h, d] = train_engines[r]->reg_mr(train_arena[r].data(), train_arena[r].size(), Device::host(), train_imms[r]);
      train_mr.push_back(h);
      train_desc.push_back(d);
    }
    for (uint32_t r = 0; r < nd; r++) {
      infer_engines.push_back(engine_for(ns + r));
      infer_imms.push_back(infer_engines[r]->reserve_imms({.holder = "weights inference", .bits = kUpdateImmBits}));
    }
    infer_arena.resize(sets);
    infer_desc.resize(sets);
    for (uint32_t k = 0; k < sets; k++)
      for (uint32_t r = 0; r < nd; r++) {
        infer_arena[k].emplace_back(model.dst_size[r] + 1);  // + 1: never a zero-length region
        infer_desc[k].push_back(
            infer_engines[r]->reg_mr(infer_arena[k][r].data(), infer_arena[k][r].size(), Device::host(), infer_imms[r]).second);
      }
    new_senders(window, timeout);
    for (uint32_t r = 0; r < nd; r++)
      receivers.push_back(std::make_unique<WeightReceiver>(
          *infer_engines[r],
          WeightReceiverConfig{.plan = plan, .rank = r, .train_arenas = train_desc, .sets = sets, .imms = &infer_imms[r]}));
  }

  // Every training rank's sender made anew (as a restarted job would have), with this window and
  // per-update timeout.
  void new_senders(uint32_t window, std::chrono::milliseconds timeout) {
    senders.resize(train_engines.size());
    for (uint32_t r = 0; r < senders.size(); r++)
      senders[r] = std::make_unique<WeightSender>(
          *train_engines[r], WeightSenderConfig{.plan = plan, .rank = r, .arena = train_mr[r],
                                                .arena_ptr = train_arena[r].data(), .train_arenas = train_desc,
                                                .dest_arenas = infer_desc, .window = window, .timeout = timeout,
                                                .imms = &train_imms[r]});
  }

  // New weights for a step: every tensor redrawn, every shard rewritten from them.
  void new_weights(uint32_t seed) {
    std::mt19937 rng(seed);
    for (auto& t : model.full)
      for (auto& v : t) v = random_bf16(rng);
    for (const Placement& s : model.m.sources) {
      const TensorSpec& t = model.m.tensors[s.tensor];
      const uint64_t stride = s.row_stride ? s.row_stride : s.box.cols() * 2;
      for (uint64_t i = 0; i < s.box.rows(); i++)
        std::memcpy(&train_arena[s.rank][s.offset + i * stride], &model.full[s.tensor][(s.box.r0 + i) * t.cols + s.box.c0],
                    s.box.cols() * 2);
    }
  }

  std::vector<std::vector<uint8_t>> set_bytes(uint32_t set) const {
    std::vector<std::vector<uint8_t>> out;
    for (const auto& a : infer_arena[set]) {
      const auto* p = reinterpret_cast<const uint8_t*>(a.data());
      out.emplace_back(p, p + a.size() - 1);
    }
    return out;
  }

  // One step on every rank (those in `skip` stay out); returns each sender's error ("" if none).
  std::vector<std::string> step(uint64_t step, const std::vector<uint32_t>& skip = {},
                                std::chrono::milliseconds wait_timeout = std::chrono::seconds(60)) {
    std::vector<std::future<std::string>> runs;
    for (uint32_t r = 0; r < senders.size(); r++) {
      if (std::find(skip.begin(), skip.end(), r) != skip.end()) continue;
      runs.push_back(std::async(std::launch::async, [this, r, step]() -> std::string {
        try {
          senders[r]->update(step);
          return "";
        } catch (const Error& e) {
          return e.what();
        }
      }));
    }
    std::vector<std::future<std::string>> waits;
    for (auto& rx : receivers) {
      WeightReceiver* w = rx.get();
      waits.push_back(std::async(std::launch::async, [w, step, wait_timeout]() -> std::string {
        try {
          w->ready(step);
          w->wait_update(step, wait_timeout);
          return "";
        } catch (const Error& e) {
          return e.what();
        }
      }));
    }
    std::vector<std::string> errors;
    for (auto& f : runs) errors.push_back(f.get());
    for (auto& f : waits) errors.push_back(f.get());
    return errors;
  }
};

}  // namespace fabric::weights
