// WeightSender (include/fabric/weights/update.h): one training rank's side of a step, as a
// non-blocking loop over four kinds of work that become possible as immediates arrive: gather
// WRITEs whose slot was released, BF16 WRITEs to inference ranks that are ready, the next unit to
// quantize, and that unit's FP8 WRITEs.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstring>
#include <thread>

#include "fabric/error.h"
#include "fabric/weights/fp8.h"
#include "fabric/weights/update.h"
#include "schedule.h"
#include "weights_stats.h"

namespace fabric::weights {

namespace {

using Clock = std::chrono::steady_clock;

// More than 4 hardware threads: an idle executor may poll instead of sleeping (sender.cpp's loop).
const bool kSpareCores = std::thread::hardware_concurrency() > 4;

double ms_since(Clock::time_point t) { return std::chrono::duration<double, std::milli>(Clock::now() - t).count(); }

void host_hook(std::byte* arena, const UnitWork& w) {
  for (const Copy& c : w.local_copies)
    for (uint64_t i = 0; i < c.rows; i++)
      std::memcpy(arena + c.dst_offset + i * c.dst_stride, arena + c.src_offset + i * c.src_stride, c.row_bytes);
  const QuantizeTask& q = w.task;
  const uint64_t rows = q.r1 - q.r0;
  const uint64_t in_len = (rows - 1) * (q.in_stride / 2) + w.cols;
  fp8::quantize_blocks({.in = {reinterpret_cast<const uint16_t*>(arena + q.in_offset), in_len},
                        .rows = rows,
                        .cols = w.cols,
                        .in_stride = q.in_stride / 2,
                        .out = {reinterpret_cast<uint8_t*>(arena + q.out_offset), rows * w.cols},
                        .out_stride = 0,
                        .scales = {reinterpret_cast<float*>(arena + q.scale_offset),
                                   fp8::scale_rows(rows) * fp8::scale_cols(w.cols)}});
}

// What one update's completions report into; every OnDone keeps it alive, so late completions
// of a failed update land in it, not in freed memory.
struct Progress {
  std::vector<std::atomic<int>> ready;          // per inference rank
  std::vector<std::atomic<int>> gathered;       // per own unit
  std::vector<std::atomic<uint64_t>> credits;   // per training rank (credits it gave us)
  std::vector<std::atomic<uint64_t>> slot_done;  // per slot: completed sends of its units
  std::atomic<uint64_t> done{0}, failed{0};     // gathers, BF16 sends and barriers
  std::atomic<uint64_t> slot_failed{0};
  Progress(size_t dsts, size_t units, size_t srcs, size_t slots)
      : ready(dsts), gathered(units), credits(srcs), slot_done(slots) {}
};

}  // namespace

std::vector<uint64_t> staging_bytes_for(const UpdatePlan& plan, uint32_t window) {
  auto shared = std::shared_ptr<const UpdatePlan>(&plan, [](const UpdatePlan*) {});  // not owned
  const detail::Schedule s = detail::schedule_update(shared, window);
  std::vector<uint64_t> out;
  for (const detail::RankSchedule& r : s.ranks) out.push_back(std::min<uint64_t>(window, r.units.size()) * r.slot_bytes);
  return out;
}

struct WeightSender::State {
  TransferEngine& engine;
  WeightSenderConfig cfg;
  ImmReservation& imms;  // this rank's: gathers, credits and ready notices are counted there
  detail::Schedule sched;
  const detail::RankSchedule& me;
  std::vector<RemoteMr> train;                 // per training rank
  std::vector<std::vector<RemoteMr>> dest;     // [set][inference rank]
  std::vector<uint32_t> my_dsts;               // inference ranks this rank writes to
  detail::RankRuns runs;  // what this rank submits (gathers per quantizer and unit, sends), as runs
  std::vector<std::vector<RemoteMr>> unit_contributors;  // per own unit
  std::vector<std::vector<uint32_t>> unit_dsts;          // per own unit: inference ranks its sends reach
  std::vector<uint32_t> iota;  // 0, 1, ...: the page indices of every run
  detail::SenderStats stats;
  MetricsRegistration metrics;  // last: removed before what its source reads

  State(TransferEngine& e, WeightSenderConfig c)
      : engine(e), cfg(std::move(c)), imms(*cfg.imms), sched(detail::schedule_update(cfg.plan, cfg.window)), me(sched.ranks.at(cfg.rank)) {}

  size_t imm_count_of(uint64_t len) const { return single_write_imm_count(len, engine.nic_count(), false); }

  // One run as one request: a SingleWrite, or a PagedWrites of its `count` pages.
  void post(const detail::WriteRun& r, RemoteMr dst, uint32_t imm, OnDone done) {
    if (r.count == 1) {
      engine.submit(SingleWrite{.len = r.len, .src = {cfg.arena, r.src_offset}, .dst = {dst, r.dst_offset}, .imm = imm},
                    std::move(done));
      return;
    }
    const std::span<const uint32_t> pages(iota.data(), r.count);
    engine.submit(PagedWrites{.page_len = r.len,
                              .src = cfg.arena,
                              .src_pages = {.indices = pages, .stride = r.src_stride, .offset = r.src_offset},
                              .dst = dst,
                              .dst_pages = {.indices = pages, .stride = r.dst_stride, .offset = r.dst_offset},
                              .imm = imm},
                  std::move(done));
  }
};

WeightSender::WeightSender(TransferEngine& engine, WeightSenderConfig config) {
  if (!config.plan) throw Error(ErrorCode::kInvalidArgument, "WeightSender: no plan");
  const uint32_t ranks = config.plan->gather_manifest.src_ranks, dsts = config.plan->send_manifest.dst_ranks;
  if (config.rank >= ranks)
    throw Error(ErrorCode::kInvalidArgument, fmt::format("WeightSender: rank {} of {} training ranks", config.rank, ranks));
  if (ranks > kMaxUpdateRanks || dsts > kMaxUpdateRanks)
    throw Error(ErrorCode::kInvalidArgument, "WeightSender: more ranks than the immediates can name");
  if (config.train_arenas.size() != ranks)
    throw Error(ErrorCode::kInvalidArgument, fmt::format("WeightSender: {} training arenas for {} ranks",
                                                         config.train_arenas.size(), ranks));
  if (config.dest_arenas.empty() || config.dest_arenas.size() > 2)
    throw Error(ErrorCode::kInvalidArgument, "WeightSender: one or two buffer sets of inference arenas");
  for (const auto& set : config.dest_arenas)
    if (set.size() != dsts)
      throw Error(ErrorCode::kInvalidArgument,
                  fmt::format("WeightSender: a buffer set of {} arenas for {} inference ranks", set.size(), dsts));
  if (!config.hook && !config.arena_ptr)
    throw Error(ErrorCode::kInvalidArgument, "WeightSender: no hook and no host pointer to the arena");
  if (detail::checked_imms(config.imms, "WeightSender").range() != config.train_arenas[config.rank].imms())
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("WeightSender: training rank {}'s arena was not registered under its immediate "
                            "reservation (reg_mr with imms)",
                            config.rank));
  s_ = std::make_unique<State>(engine, std::move(config));
  State& s = *s_;
  for (const MrDesc& d : s.cfg.train_arenas) s.train.push_back(engine.add_remote(d));
  for (const auto& set : s.cfg.dest_arenas) {
    s.dest.emplace_back();
    for (const MrDesc& d : set) s.dest.back().push_back(engine.add_remote(d));
  }
  s.runs = detail::rank_runs(s.sched, s.cfg.rank, engine.nic_count());
  std::vector<bool> writes_to(dsts, false);
  for (uint32_t d = 0; d < dsts; d++) writes_to[d] = !s.runs.bf16_to[d].empty();
  for (const detail::ScheduledUnit& u : s.me.units) {
    s.unit_contributors.emplace_back();
    for (uint32_t g : u.contributors) s.unit_contributors.back().push_back(s.train[g]);
    s.unit_dsts.emplace_back();
    for (uint32_t i : u.send_writes) {
      const uint32_t d = s.sched.send[i].dst_rank;
      writes_to[d] = true;
      if (std::find(s.unit_dsts.back().begin(), s.unit_dsts.back().end(), d) == s.unit_dsts.back().end())
        s.unit_dsts.back().push_back(d);
    }
  }
  for (uint32_t d = 0; d < dsts; d++)
    if (writes_to[d]) s.my_dsts.push_back(d);
  s.iota.resize(s.runs.longest);
  for (uint32_t i = 0; i < s.runs.longest; i++) s.iota[i] = i;
  s.metrics = engine.add_metrics_source([st = &s](MetricsWriter& w) { write_metrics(w, st->stats, st->cfg.rank); });
}

WeightSender::~WeightSender() = default;

// One update of one training rank: what it armed, posted and still waits for.
class WeightSender::Step {
 public:
  Step(State& s, uint64_t step)
      : s_(s),
        step_(step),
        me_(s.cfg.rank),
        window_(s.sched.window),
        units_(s.me.units.size()),
        ranks_(s.train.size()),
        dest_(s.dest[step % s.dest.size()]),
        progress_(std::make_shared<Progress>(s.dest.front().size(), units_, ranks_, std::min<size_t>(window_, units_))),
        pr_(*progress_),
        slot_posted_(pr_.slot_done.size(), 0),
        next_credit_unit_(ranks_, 0),
        bf16_posted_(s.runs.bf16_to.size(), false) {}

  UpdateTimes run() {
    t0_ = Clock::now();
    last_move_ = t0_;
    deadline_ = t0_ + s_.cfg.timeout;
    try {
      arm();
      for (;;) {
        check_failures();
        bool moved = post_released_gathers();
        moved |= post_bf16();
        moved |= run_next_unit();
        if (all_posted()) break;
        if (Clock::now() > deadline_)
          throw Error(ErrorCode::kTimeout, fmt::format("weight update step {} on training rank {}: not done after {} ms: {}",
                                                       step_, me_, s_.cfg.timeout.count(), awaited()));
        // Idle: where cores are to spare, poll again at once for a while (the next immediate is
        // usually microseconds away: each 20 us sleep would add to every credit -> gather round
        // trip), then sleep; on a machine of few cores (CI's 2) the polling would take the CPU
        // from the engines' own threads, so sleep at once.
        const auto now = Clock::now();
        if (moved) last_move_ = now;
        else if (!kSpareCores || now - last_move_ > std::chrono::microseconds(200))
          std::this_thread::sleep_for(std::chrono::microseconds(20));
        else std::this_thread::yield();
      }
      drain();
    } catch (...) {
      for (const ImmExpectation& e : armed_) s_.engine.cancel_imm_expectation(e);
      throw;
    }
    times_.total_ms = ms_since(t0_);
    times_.units_quantized = next_unit_;
    return times_;
  }

 private:
  OnDone keep(OnDone d) { return std::move(d).keep_alive(progress_); }
  OnDone count_done() { return keep(OnDone::counter(&pr_.done, &pr_.failed)); }
  bool ready(uint32_t d) const { return pr_.ready[d].load(std::memory_order_acquire) == kDoneSucceeded; }

  void expect(uint32_t imm, uint64_t count, OnDone done) {
    armed_.push_back(s_.imms.expect(imm, count, keep(std::move(done))));
  }

  // Tells a unit's contributors its slot is free.
  void credit(uint32_t unit) {
    if (unit >= units_ || s_.unit_contributors[unit].empty()) return;
    s_.engine.submit(Barrier{.dsts = s_.unit_contributors[unit], .imm = update_imm(ImmKind::kCredit, step_, me_)},
                     count_done());
    posted_++;
  }

  void post(const detail::WriteRun& r, RemoteMr dst, uint32_t imm, OnDone done) {
    const auto t = Clock::now();
    s_.post(r, dst, imm, std::move(done));
    times_.post_ms += ms_since(t);
    times_.requests++;
    times_.writes += r.count;
    times_.bytes += r.count * r.len;
  }

  // Readiness of our inference ranks, each own unit's gather, the credits of the quantizers we
  // fill; then the first `window` slots released.
  void arm() {
    for (uint32_t d : s_.my_dsts) expect(update_imm(ImmKind::kReady, step_, d), 1, OnDone::flag(&pr_.ready[d]));
    for (uint32_t u = 0; u < units_; u++) {
      uint64_t count = 0;
      for (uint32_t i : s_.me.units[u].gather_writes) count += s_.imm_count_of(s_.sched.gather[i].len);
      if (count == 0) pr_.gathered[u].store(kDoneSucceeded);
      else expect(update_imm(ImmKind::kGather, step_, u), count, OnDone::flag(&pr_.gathered[u]));
    }
    for (uint32_t r = 0; r < ranks_; r++)
      for (size_t k = 0; k < s_.runs.gather_to[r].size(); k++)
        expect(update_imm(ImmKind::kCredit, step_, r), 1, OnDone::counter(&pr_.credits[r]));
    for (uint32_t u = 0; u < std::min<size_t>(window_, units_); u++) credit(u);
  }

  void check_failures() const {
    if (pr_.failed.load() || pr_.slot_failed.load())
      throw Error(ErrorCode::kProvider, fmt::format("weight update step {}: a WRITE of training rank {} failed "
                                                    "(the log has its error)", step_, me_));
  }

  // Gather WRITEs into the slots the quantizers released: c credits from a quantizer release
  // the first c of its units we fill (it releases them in order).
  bool post_released_gathers() {
    bool moved = false;
    for (uint32_t r = 0; r < ranks_; r++) {
      const uint64_t released = pr_.credits[r].load(std::memory_order_acquire);
      while (next_credit_unit_[r] < released && next_credit_unit_[r] < s_.runs.gather_to[r].size()) {
        const detail::UnitRuns& u = s_.runs.gather_to[r][next_credit_unit_[r]++];
        for (const detail::WriteRun& run : u.runs) {
          post(run, s_.train[r], update_imm(ImmKind::kGather, step_, u.unit), count_done());
          posted_++;
        }
        moved = true;
      }
    }
    return moved;
  }

  // BF16 pieces straight from the shards, to every inference rank that is ready.
  bool post_bf16() {
    bool moved = false;
    for (uint32_t d = 0; d < s_.runs.bf16_to.size(); d++) {
      if (bf16_posted_[d] || s_.runs.bf16_to[d].empty() || !ready(d)) continue;
      for (const detail::WriteRun& run : s_.runs.bf16_to[d]) {
        post(run, dest_[d], update_imm(ImmKind::kData, step_, me_), count_done());
        posted_++;
      }
      bf16_posted_[d] = true;
      moved = true;
    }
    return moved;
  }

  // The next unit, once its input is complete, its slot's earlier sends are done and its
  // inference ranks are ready: copy, quantize, release its input area, send.
  bool run_next_unit() {
    if (next_unit_ >= units_) return false;
    const uint32_t u = static_cast<uint32_t>(next_unit_);
    const size_t slot = u % window_;
    if (pr_.gathered[u].load() == kDoneFailed)
      throw Error(ErrorCode::kProvider, fmt::format("weight update step {}: gathering unit {} failed", step_, u));
    const bool in = pr_.gathered[u].load(std::memory_order_acquire) == kDoneSucceeded;
    const bool free = pr_.slot_done[slot].load(std::memory_order_acquire) == slot_posted_[slot];
    const bool dsts_ready = std::all_of(s_.unit_dsts[u].begin(), s_.unit_dsts[u].end(), [&](uint32_t d) { return ready(d); });
    if (s_.cfg.trace && in && input_seen_ <= u) {  // the first time this loop sees it gathered
      input_seen_ = u + 1;
      input_ms_ = ms_since(t0_);
    }
    if (!(in && free && dsts_ready)) {
      if (waiting_ == kIdle) {
        waiting_ = !in ? kGather : !dsts_ready ? kReady : kSlot;
        waiting_since_ = Clock::now();
      }
      return false;
    }
    account_wait();
    const detail::ScheduledUnit& su = s_.me.units[u];
    const UnitWork work{su.task, s_.cfg.plan->gather_manifest.tensors[su.task.tensor].cols, su.local_copies};
    const auto tq = Clock::now();
    if (s_.cfg.hook) s_.cfg.hook(work);
    else host_hook(s_.cfg.arena_ptr, work);
    times_.quantize_ms += ms_since(tq);
    if (s_.cfg.trace)
      times_.units.push_back({.unit = u,
                              .input_ms = input_seen_ > u ? input_ms_ : ms_since(t0_),
                              .start_ms = std::chrono::duration<double, std::milli>(tq - t0_).count(),
                              .quantized_ms = ms_since(t0_)});
    credit(u + window_);  // its input area may be refilled
    for (const detail::WriteRun& run : s_.runs.unit_sends[u]) {
      post(run, dest_[run.dst_rank], update_imm(ImmKind::kData, step_, me_),
           keep(OnDone::counter(&pr_.slot_done[slot], &pr_.slot_failed)));
      slot_posted_[slot]++;
    }
    if (s_.cfg.trace) times_.units.back().posted_ms = ms_since(t0_);
    next_unit_++;
    return true;
  }

  void account_wait() {
    const double w = ms_since(waiting_since_);
    if (waiting_ == kGather) times_.gather_wait_ms += w;
    if (waiting_ == kReady) times_.ready_wait_ms += w;
    waiting_ = kIdle;
  }

  bool all_posted() const {
    bool all = next_unit_ == units_;
    for (uint32_t r = 0; r < ranks_; r++) all &= next_credit_unit_[r] == s_.runs.gather_to[r].size();
    for (uint32_t d = 0; d < s_.runs.bf16_to.size(); d++) all &= bf16_posted_[d] || s_.runs.bf16_to[d].empty();
    return all;
  }

  // What the step still waits for, for the timeout's message.
  std::string awaited() const {
    if (next_unit_ < units_) {
      const detail::ScheduledUnit& su = s_.me.units[next_unit_];
      const TensorSpec& t = s_.cfg.plan->gather_manifest.tensors[su.task.tensor];
      std::string what = fmt::format("unit {} ({} rows [{}, {})) waits for ", next_unit_, t.name, su.task.r0, su.task.r1);
      if (pr_.gathered[next_unit_].load() != kDoneSucceeded)
        return what + fmt::format("gather WRITEs from training ranks {}", fmt::join(su.contributors, ", "));
      std::vector<uint32_t> missing;
      for (uint32_t d : s_.unit_dsts[next_unit_])
        if (!ready(d)) missing.push_back(d);
      return what + (missing.empty() ? std::string("its slot's earlier WRITEs")
                                     : fmt::format("inference ranks {} to be ready", fmt::join(missing, ", ")));
    }
    std::vector<uint32_t> r_missing, d_missing;
    for (uint32_t r = 0; r < ranks_; r++)
      if (next_credit_unit_[r] < s_.runs.gather_to[r].size()) r_missing.push_back(r);
    for (uint32_t d = 0; d < s_.runs.bf16_to.size(); d++)
      if (!bf16_posted_[d] && !s_.runs.bf16_to[d].empty()) d_missing.push_back(d);
    std::string what;
    if (!r_missing.empty()) what = fmt::format("slot credits from training ranks {}", fmt::join(r_missing, ", "));
    if (!d_missing.empty())
      what += fmt::format("{}inference ranks {} to be ready", what.empty() ? "" : "; ", fmt::join(d_missing, ", "));
    return what;
  }

  // Every WRITE and barrier completed.
  void drain() {
    const auto td = Clock::now();
    auto outstanding = [&] {
      uint64_t sends_left = 0;
      for (size_t k = 0; k < slot_posted_.size(); k++) sends_left += slot_posted_[k] - pr_.slot_done[k].load();
      return pr_.done.load() < posted_ || sends_left > 0;
    };
    while (outstanding()) {
      check_failures();
      if (Clock::now() > deadline_)
        throw Error(ErrorCode::kTimeout, fmt::format("weight update step {} on training rank {}: WRITEs not completed "
                                                     "after {} ms", step_, me_, s_.cfg.timeout.count()));
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
    times_.drain_ms = ms_since(td);
  }

  State& s_;
  const uint64_t step_;
  const uint32_t me_, window_;
  const size_t units_, ranks_;
  const std::vector<RemoteMr>& dest_;
  std::shared_ptr<Progress> progress_;
  Progress& pr_;
  Clock::time_point t0_{}, deadline_{}, last_move_{};
  std::vector<ImmExpectation> armed_;
  UpdateTimes times_;
  uint64_t posted_ = 0;                // gathers, BF16 sends and barriers
  std::vector<uint64_t> slot_posted_;  // per slot: sends posted from it
  std::vector<size_t> next_credit_unit_;  // per quantizer: its units we have filled (runs.gather_to)
  std::vector<bool> bf16_posted_;
  size_t next_unit_ = 0;
  size_t input_seen_ = 0;  // trace: units up to this one were seen gathered, the last at input_ms_
  double input_ms_ = 0;
  enum { kIdle, kGather, kReady, kSlot } waiting_ = kIdle;
  Clock::time_point waiting_since_{};
};

UpdateTimes WeightSender::update(uint64_t step) {
  detail::SenderStats& m = s_->stats;
  UpdateTimes t;
  try {
    t = Step(*s_, step).run();
  } catch (...) {
    m.failed.add();
    throw;
  }
  m.updates.add();
  m.bytes.add(t.bytes);
  m.seconds.observe(std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::duration<double, std::milli>(t.total_ms)));
  m.last_bytes.set(static_cast<double>(t.bytes));
  m.last_bytes_per_second.set(t.total_ms > 0 ? static_cast<double>(t.bytes) / (t.total_ms * 1e-3) : 0);
  return t;
}

}  // namespace fabric::weights
