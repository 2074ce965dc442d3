// Poster (poster.h): building and posting a transfer's WRITEs, batches and SENDs.
#include "worker/poster.h"

#include <algorithm>
#include <cstring>
#include <optional>

namespace fabric {

void Poster::open(DomainGroup& domains) {
  send_buffer_.resize(send_slots_ * max_message_size_);
  send_region_ = domains.register_on(DomainGroup::kMessageDomain, send_buffer_.data(),
                                     send_buffer_.size(), Device::host());
}

void Poster::close(DomainGroup& domains) {
  domains.deregister_on(DomainGroup::kMessageDomain, send_region_);
}

// Builds and posts WRITE (or SEND, or batch of WRITEs) number t.next_op. Returns false on
// back-pressure.
bool Poster::post_next(Transfer& t, DomainGroup& domains, PeerTable& peers) {
  const TransferRequest& q = t.req;
  const uint32_t i = t.next_op;
  ResolvedTarget* target = t.group                   ? &t.group->members[i].target
                           : per_destination(q.kind) ? &t.targets[i]
                                                     : &t.targets[0];
  if (!peers.live(target->record) && !peers.usable(t, *target, i))
    return true;  // failed: pump stops
  if (t.src && t.src->generation.load(std::memory_order_relaxed) != q.src.generation) {
    t.fail(Status(ErrorCode::kNotFound,
                  "the source region was deregistered while this transfer "
                  "was being posted"));
    return true;
  }
  const size_t nic = domains.domain_for(q, *target, i);
  // The NIC pushed back or is full: wait for its completions.
  if (!domains.may_post(nic, target->peer[nic])) return false;
  OpContext* ctx = contexts_.acquire();
  ctx->owner = &t;
  ctx->nic = static_cast<uint32_t>(nic);
  ctx->peer = target->record;

  PostResult result;
  if (q.kind == TransferKind::kSend) {
    if (t.send_slot == UINT32_MAX) {
      std::optional<uint32_t> slot = free_send_slots_.take();
      if (!slot) {
        contexts_.release(ctx);
        return false;
      }
      t.send_slot = *slot;
      std::memcpy(&send_buffer_[t.send_slot * max_message_size_], q.buf->payload.data(),
                  q.buf->payload.size());
    }
    ctx->kind = kOpSend;
    result =
        domains.post_send(nic, target->peer[nic], &send_buffer_[t.send_slot * max_message_size_],
                          q.buf->payload.size(), send_region_.desc, ctx);
  } else {
    // The template: where this destination is reached through this NIC.
    WriteOp op;
    op.has_imm = q.has_imm;
    op.imm = target->imm_base + q.imm;  // fits: checked against the range at submit
    op.peer = target->peer[nic];
    op.rkey = target->key[nic].rkey;
    const uint64_t base = target->key[nic].base;
    const RequestBuffer* b = q.buf;
    uint64_t src_off = 0, dst_off = 0;
    switch (q.kind) {
      case TransferKind::kSingle: {
        Shard s = DomainGroup::shard(q.len, t.total_ops, i);
        src_off = q.src_offset + s.offset;
        dst_off = q.dst_offset + s.offset;
        op.len = s.len;
        break;
      }
      case TransferKind::kPaged:
        src_off = q.src_offset + q.src_stride * b->src_pages[i];
        dst_off = q.dst_offset + q.dst_stride * b->dst_pages[i];
        op.len = q.len;
        break;
      case TransferKind::kScatter:
        src_off = b->slices[i].src_offset;
        dst_off = b->slices[i].dst.offset;
        op.len = b->slices[i].len;
        break;
      case TransferKind::kGroupScatter:
        src_off = b->group_slices[i].src_offset;
        dst_off = b->group_slices[i].dst_offset;
        op.len = b->group_slices[i].len;
        break;
      default:  // barriers: immediate only
        break;
    }
    if (!reads_source(q.kind)) {
      op.src = domains.scratch_buffer(nic);
      op.desc = domains.scratch_desc(nic);  // EFA wants a valid descriptor even on zero-byte writes
    } else {
      op.src = t.src->ptr + src_off;
      op.desc = t.src->per_nic[nic].desc;
    }
    op.remote_addr = base + dst_off;
    ctx->kind = kOpWrite;
    if (t.batch > 0) {  // pages [i * batch, ...) in one post
      const uint64_t first = uint64_t{i} * t.batch;
      const uint64_t n = std::min<uint64_t>(t.batch, q.count - first);
      batch_ops_.clear();
      for (uint64_t p = first; p < first + n; p++) {
        op.src = t.src->ptr + q.src_offset + q.src_stride * b->src_pages[p];
        op.remote_addr = base + q.dst_offset + q.dst_stride * b->dst_pages[p];
        batch_ops_.push_back(op);
      }
      ctx->aux = n * q.len;
      ctx->writes = static_cast<uint32_t>(n);
      result = domains.post_write_batch(nic, batch_ops_, ctx);
    } else {
      ctx->aux = op.len;
      result = domains.post_write(nic, op, ctx);
    }
  }

  // The domain group booked the result (back-off, in-flight count, errors); the transfer and
  // the peer record count what was posted.
  if (result == PostResult::kRetry || result == PostResult::kRetryPeer) {
    contexts_.release(ctx);
    return false;
  }
  if (result == PostResult::kFailed) {
    contexts_.release(ctx);
    t.fail(Status(ErrorCode::kProvider, domains.last_error(nic)));
    return true;
  }
  // Counted per posted operation and taken off again by complete() (poster.h): the transfer's
  // operations in flight (its end waits for them), the same per domain (given back at its
  // timeout), the peer record's (its release waits for them), the source region's (dereg_mr
  // waits for them); the domain group counted its own in flight when it booked kPosted.
  t.next_op++;
  t.outstanding++;
  t.outstanding_on[nic]++;
  peers.posted(target->record);
  if (t.src) t.src->writes_in_flight++;
  if (t.next_op == 1) first_posted(t);
  if (record_post_timings_) record_post_timing(t);
  return true;
}

// The submit time is the deadline minus the timeout (the submitting thread read the clock once,
// for the deadline); now is the worker's round clock (util::RoundClock).
void Poster::first_posted(const Transfer& t) {
  const auto since_submit = clock_.now() - (t.req.deadline - transfer_timeout_);
  const int64_t ns = std::chrono::nanoseconds(since_submit).count();
  metrics_.first_post[WorkerMetrics::kind(t.req.kind)].observe(ns > 0 ? static_cast<uint64_t>(ns) : 0);
}

// The submit time is the deadline minus the timeout: no clock read on the submit path.
void Poster::record_post_timing(Transfer& t) {
  if (t.next_op != 1 && t.next_op != t.total_ops) return;
  auto since_submit = Clock::now() - (t.req.deadline - transfer_timeout_);
  auto ns = static_cast<uint64_t>(std::chrono::nanoseconds(since_submit).count());
  if (t.next_op == 1) t.first_post_ns = ns;
  if (t.next_op != t.total_ops) return;
  if (post_timings_.size() >= 65536) post_timings_.erase(post_timings_.begin());
  post_timings_.push_back({t.first_post_ns, ns, t.total_ops});
}

}  // namespace fabric
