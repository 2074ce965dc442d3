// efa-sim: wraps the fid objects of a tcp;ofi_rxm domain so that it behaves as EFA does towards
// its user (see efa_sim.h). Each wrapper is a libfabric object of its own class (its public fid
// struct first, its operation tables here) holding the tcp object it stands for; the libfabric
// domain calls it through the ordinary fi_* inline functions, unaware of the shim.
#include "providers/efa_sim/efa_sim.h"

#include <rdma/fi_cm.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>

#include <algorithm>
#include <cstring>
#include <deque>
#include <mutex>
#include <type_traits>
#include <unordered_set>

#include <unistd.h>

#include "providers/libfabric/fi_compat.h"
#include "util/log.h"

namespace fabric::efa_sim {
namespace {

// ---- process-wide counters and hooks -------------------------------------------------------

struct Global {
  std::atomic<uint64_t> domains{0}, shm_false{0}, cuda_false{0}, regions{0}, requested_keys{0};
  std::atomic<uint64_t> writes{0}, writes_with_data{0}, largest_write{0}, sends{0}, recvs{0};
  std::atomic<uint64_t> violations{0}, dmabuf_regions{0}, hmem_range_regions{0};
  std::atomic<uint64_t> fail_post_countdown{0}, fail_completion_countdown{0};
  std::atomic<bool> offer_hmem{false};
  std::mutex mu;
  std::string last_violation;
};
Global& global() {
  static Global g;
  return g;
}

// True for the call that brings a non-zero countdown to zero.
bool countdown_hits(std::atomic<uint64_t>& c) {
  uint64_t v = c.load();
  while (v != 0 && !c.compare_exchange_weak(v, v - 1)) {
  }
  return v == 1;
}

template <class... Args>
int violation(fmt::format_string<Args...> f, Args&&... args) {
  std::string m = fmt::format(f, std::forward<Args>(args)...);
  log::error("efa-sim: {}", m);
  Global& g = global();
  g.violations++;
  std::lock_guard lock(g.mu);
  g.last_violation = std::move(m);
  return -FI_EINVAL;
}

// Remote keys: tcp's key (which the shim chooses: PROV_KEY) in the top 16 bits, the region's
// virtual base address in the low 48, so that an initiator can turn a virtual remote address
// into tcp's offset without knowing the target's regions.
constexpr int kKeyShift = 48;
constexpr uint64_t kBaseMask = (1ull << kKeyShift) - 1;
// Fills the upper half of tcp's 8-byte CQ data on arrival: EFA carries 4 bytes.
constexpr uint64_t kCqDataPoison = 0xefa5'1de5ull << 32;

// A function of an operation table that says "not emulated".
template <class Fn>
struct NoSys;
template <class R, class... A>
struct NoSys<R (*)(A...)> {
  static R call(A...) { return static_cast<R>(-FI_ENOSYS); }
};
#define FABRIC_NOSYS(table, member) NoSys<decltype(table::member)>::call
// The operation tables below are filled member by member: members that newer headers add (and we
// do not name) stay null, which libfabric's FI_CHECK_OP reads as "not supported".

// ---- the wrappers ------------------------------------------------------------------------------

struct DomainState;

struct SimMr {
  fid_mr pub;  // first: the fid_mr* the user holds; mem_desc points back here
  fid_mr* real;
  DomainState* dom;
  uintptr_t base;
  size_t len;
  bool gpu;  // GPU memory (offer_hmem): registered, never moved (tcp cannot read it)
};

struct CqState {
  fid_cq* real;
  std::deque<fi_cq_err_entry> injected;  // error completions made by the test hooks
  std::unordered_set<void*> doomed;      // contexts whose completion becomes an error
};
struct SimCq {
  fid_cq pub;
  CqState* s;
};

struct DomainState {
  fid_domain* real;
  std::unordered_set<const void*> live;  // SimMr* of this domain
  uint32_t next_key = 1;
};
struct SimDomain {
  fid_domain pub;
  DomainState* s;
};

struct SimEp {
  fid_ep pub;
  fid_ep* real;
  DomainState* dom;
  CqState* cq;  // the CQ bound for transmit completions
  bool enabled;
};

static_assert(std::is_standard_layout_v<SimMr> && std::is_standard_layout_v<SimCq> &&
              std::is_standard_layout_v<SimDomain> && std::is_standard_layout_v<SimEp>);

template <class T, class F>
T* self(F* f) {
  return reinterpret_cast<T*>(f);
}

// ---- checks every post goes through ------------------------------------------------------------

// FI_MR_LOCAL: `desc` must be a live region of this domain covering [buf, buf + len).
const SimMr* local_region(DomainState* dom, const char* call, const void* buf, size_t len, void* desc) {
  if (!desc) {
    violation("{} of {} bytes without a descriptor (FI_MR_LOCAL: every operation needs one, "
              "zero-byte ones included)", call, len);
    return nullptr;
  }
  if (!dom->live.count(desc)) {
    violation("{}: {} is not the descriptor of a live region of this domain", call, desc);
    return nullptr;
  }
  auto* mr = static_cast<const SimMr*>(desc);
  if (mr->gpu) {
    violation("{}: the region is GPU memory, which efa-sim registers but cannot move", call);
    return nullptr;
  }
  auto b = reinterpret_cast<uintptr_t>(buf);
  if (b < mr->base || b - mr->base > mr->len || len > mr->len - (b - mr->base)) {
    violation("{}: buffer [{:#x}, +{}) lies outside its descriptor's region [{:#x}, +{})", call, b,
              len, mr->base, mr->len);
    return nullptr;
  }
  return mr;
}

bool size_ok(const char* call, size_t len, size_t limit, const char* what) {
  if (len <= limit) return true;
  violation("{} of {} bytes exceeds the {} ({})", call, len, what, limit);
  return false;
}

// FI_MR_VIRT_ADDR: (key, virtual address) -> (tcp key, offset into the region).
bool translate(const char* call, uint64_t key, uint64_t addr, uint64_t& tcp_key, uint64_t& offset) {
  tcp_key = key >> kKeyShift;
  uint64_t base = key & kBaseMask;
  if (tcp_key == 0) {
    violation("{}: key {:#x} was not made by efa-sim", call, key);
    return false;
  }
  if (addr < base) {
    violation("{}: remote address {:#x} lies below its region's base {:#x} (FI_MR_VIRT_ADDR: remote "
              "addresses are virtual addresses, not offsets)", call, addr, base);
    return false;
  }
  offset = addr - base;
  return true;
}

bool cq_data_ok(const char* call, uint64_t data) {
  if (data <= UINT32_MAX) return true;
  violation("{}: remote CQ data {:#x} does not fit EFA's {} bytes", call, data, kCqDataSize);
  return false;
}

void count_write(size_t len, bool data) {
  Global& g = global();
  g.writes++;
  if (data) g.writes_with_data++;
  uint64_t prev = g.largest_write.load();
  while (len > prev && !g.largest_write.compare_exchange_weak(prev, len)) {
  }
}

// The test hooks, for a WRITE that passed the checks: refuse it, or doom its completion.
bool refused_by_hook() { return countdown_hits(global().fail_post_countdown); }
void after_posted(SimEp* ep, void* context) {
  if (countdown_hits(global().fail_completion_countdown) && ep->cq) ep->cq->doomed.insert(context);
}

// ---- memory regions ----------------------------------------------------------------------------

// What an open file descriptor refers to ("anon_inode:dmabuf", "/dmabuf:..."); empty if not open.
std::string fd_target(int fd) {
  char buf[256];
  ssize_t n = readlink(fmt::format("/proc/self/fd/{}", fd).c_str(), buf, sizeof buf - 1);
  return n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string();
}

int mr_close(fid* f) {
  SimMr* mr = self<SimMr>(f);
  int rc = fi_close(&mr->real->fid);
  if (rc != 0) return rc;
  mr->dom->live.erase(mr);
  delete mr;
  return 0;
}
int mr_bind(fid* f, fid* bfid, uint64_t flags) {
  return fi_mr_bind(self<SimMr>(f)->real, bfid, flags);
}
int mr_control(fid* f, int command, void* arg) {
  fid_mr* real = self<SimMr>(f)->real;
  return real->fid.ops->control(&real->fid, command, arg);
}
fi_ops g_mr_fid_ops = [] {
  fi_ops o{};
  o.size = sizeof o;
  o.close = mr_close;
  o.bind = mr_bind;
  o.control = mr_control;
  o.ops_open = FABRIC_NOSYS(fi_ops, ops_open);
  return o;
}();

int domain_regattr(fid* f, const fi_mr_attr* attr, uint64_t flags, fid_mr** out) {
  DomainState* dom = self<SimDomain>(f)->s;
  const bool hmem = global().offer_hmem.load();
  const bool gpu = attr->iface == FI_HMEM_CUDA;
  if ((flags & ~FI_MR_DMABUF) || ((flags & FI_MR_DMABUF) && !hmem)) return -FI_EBADFLAGS;  // as EFA
  if (attr->iface != FI_HMEM_SYSTEM && !(gpu && hmem)) return -FI_EOPNOTSUPP;
  if (attr->iov_count != 1 || !attr->mr_iov) return -FI_EINVAL;
  uintptr_t base = 0;
  size_t len = 0;
  if (flags & FI_MR_DMABUF) {
    // What EFA hands to ibv_reg_dmabuf_mr: the fd, the offset into it, the length, and the
    // region's virtual address base_addr + offset (its iova under FI_MR_VIRT_ADDR).
    const fi_compat::fi_mr_dmabuf* d = fi_compat::get_dmabuf(*attr);
    if (!gpu) return violation("FI_MR_DMABUF with iface {} (fabric-lib uses dma-bufs for GPU memory)", static_cast<int>(attr->iface));
    std::string what = fd_target(d->fd);
    if (what.find("dmabuf") == std::string::npos)
      return violation("FI_MR_DMABUF: fd {} is not a dma-buf ({})", d->fd, what.empty() ? "not open" : what);
    base = reinterpret_cast<uintptr_t>(d->base_addr) + d->offset;
    len = d->len;
    global().dmabuf_regions++;
  } else {
    base = reinterpret_cast<uintptr_t>(attr->mr_iov->iov_base);
    len = attr->mr_iov->iov_len;
    if (gpu) global().hmem_range_regions++;
  }
  if (base + len > kBaseMask)
    return violation("a region at {:#x} (+{}) is above 2^48: its key cannot carry the base", base, len);
  if (attr->requested_key != 0) global().requested_keys++;  // ignored, as under FI_MR_PROV_KEY

  // tcp keys are the application's: the shim picks unused ones (EFA picks its own keys).
  // GPU memory gets a tcp registration of its address range (bookkeeping only: tcp maps keys to
  // ranges and touches memory only when data moves, which the shim refuses for GPU regions).
  fi_mr_attr tcp_attr = *attr;
  iovec range{reinterpret_cast<void*>(base), len};
  tcp_attr.mr_iov = &range;
  tcp_attr.iface = FI_HMEM_SYSTEM;
  tcp_attr.device.reserved = 0;
  fid_mr* real = nullptr;
  int rc = -FI_ENOKEY;
  for (uint32_t attempt = 0; attempt < 0xffff && rc == -FI_ENOKEY; attempt++) {
    tcp_attr.requested_key = dom->next_key;
    dom->next_key = dom->next_key == 0xffff ? 1 : dom->next_key + 1;
    rc = fi_mr_regattr(dom->real, &tcp_attr, 0, &real);
  }
  if (rc != 0) return rc;
  auto* mr = new SimMr{};
  mr->pub.fid.fclass = FI_CLASS_MR;
  mr->pub.fid.context = attr->context;
  mr->pub.fid.ops = &g_mr_fid_ops;
  mr->pub.mem_desc = mr;
  mr->pub.key = (tcp_attr.requested_key << kKeyShift) | base;
  mr->real = real;
  mr->dom = dom;
  mr->base = base;
  mr->len = len;
  mr->gpu = gpu;
  dom->live.insert(mr);
  global().regions++;
  *out = &mr->pub;
  return 0;
}
int domain_reg(fid* f, const void* buf, size_t len, uint64_t access, uint64_t offset,
               uint64_t requested_key, uint64_t flags, fid_mr** out, void* context) {
  iovec iov{const_cast<void*>(buf), len};
  fi_mr_attr attr{};
  attr.mr_iov = &iov;
  attr.iov_count = 1;
  attr.access = access;
  attr.offset = offset;
  attr.requested_key = requested_key;
  attr.context = context;
  return domain_regattr(f, &attr, flags, out);
}
fi_ops_mr g_domain_mr_ops = [] {
  fi_ops_mr o{};
  o.size = sizeof o;
  o.reg = domain_reg;
  o.regv = FABRIC_NOSYS(fi_ops_mr, regv);
  o.regattr = domain_regattr;
  return o;
}();

// ---- completion queue --------------------------------------------------------------------------

int cq_close(fid* f) {
  SimCq* cq = self<SimCq>(f);
  int rc = fi_close(&cq->s->real->fid);
  if (rc != 0) return rc;
  delete cq->s;
  delete cq;
  return 0;
}
int cq_control(fid* f, int command, void* arg) {
  fid_cq* real = self<SimCq>(f)->s->real;
  return real->fid.ops->control(&real->fid, command, arg);
}
fi_ops g_cq_fid_ops = [] {
  fi_ops o{};
  o.size = sizeof o;
  o.close = cq_close;
  o.bind = FABRIC_NOSYS(fi_ops, bind);
  o.control = cq_control;
  o.ops_open = FABRIC_NOSYS(fi_ops, ops_open);
  return o;
}();

ssize_t cq_read(fid_cq* f, void* buf, size_t count) {
  CqState* s = self<SimCq>(f)->s;
  if (!s->injected.empty()) return -FI_EAVAIL;
  ssize_t n = fi_cq_read(s->real, buf, count);
  if (n <= 0) return n;
  auto* e = static_cast<fi_cq_data_entry*>(buf);
  ssize_t kept = 0;
  for (ssize_t i = 0; i < n; i++) {
    if (e[i].flags & FI_REMOTE_CQ_DATA) e[i].data = (e[i].data & UINT32_MAX) | kCqDataPoison;
    if (!s->doomed.empty() && s->doomed.erase(e[i].op_context)) {
      fi_cq_err_entry err{};
      err.op_context = e[i].op_context;
      err.flags = e[i].flags;
      err.len = e[i].len;
      err.err = FI_EREMOTEIO;  // one failed operation (as a remote access error), not a lost peer
      err.prov_errno = FI_EREMOTEIO;
      s->injected.push_back(err);
      continue;
    }
    e[kept++] = e[i];
  }
  if (kept > 0) return kept;
  return s->injected.empty() ? -FI_EAGAIN : -FI_EAVAIL;
}
ssize_t cq_readerr(fid_cq* f, fi_cq_err_entry* buf, uint64_t flags) {
  CqState* s = self<SimCq>(f)->s;
  if (s->injected.empty()) return fi_cq_readerr(s->real, buf, flags);
  *buf = s->injected.front();
  s->injected.pop_front();
  return 1;
}
int cq_signal(fid_cq* f) { return fi_cq_signal(self<SimCq>(f)->s->real); }
const char* cq_strerror(fid_cq* f, int prov_errno, const void* err_data, char* buf, size_t len) {
  return fi_cq_strerror(self<SimCq>(f)->s->real, prov_errno, err_data, buf, len);
}
fi_ops_cq g_cq_ops = [] {
  fi_ops_cq o{};
  o.size = sizeof o;
  o.read = cq_read;
  o.readfrom = FABRIC_NOSYS(fi_ops_cq, readfrom);
  o.readerr = cq_readerr;
  o.sread = FABRIC_NOSYS(fi_ops_cq, sread);
  o.sreadfrom = FABRIC_NOSYS(fi_ops_cq, sreadfrom);
  o.signal = cq_signal;
  o.strerror = cq_strerror;
  return o;
}();

// ---- endpoint ----------------------------------------------------------------------------------

int ep_close(fid* f) {
  SimEp* ep = self<SimEp>(f);
  int rc = fi_close(&ep->real->fid);
  if (rc != 0) return rc;
  delete ep;
  return 0;
}
int ep_bind(fid* f, fid* bfid, uint64_t flags) {
  SimEp* ep = self<SimEp>(f);
  if (bfid->fclass == FI_CLASS_CQ && bfid->ops == &g_cq_fid_ops) {
    CqState* cq = self<SimCq>(bfid)->s;
    if (flags & FI_TRANSMIT) ep->cq = cq;
    return fi_ep_bind(ep->real, &cq->real->fid, flags);
  }
  return fi_ep_bind(ep->real, bfid, flags);  // the address vector is tcp's own
}
int ep_control(fid* f, int command, void* arg) {
  SimEp* ep = self<SimEp>(f);
  int rc = ep->real->fid.ops->control(&ep->real->fid, command, arg);
  if (rc == 0 && command == FI_ENABLE) ep->enabled = true;
  return rc;
}
fi_ops g_ep_fid_ops = [] {
  fi_ops o{};
  o.size = sizeof o;
  o.close = ep_close;
  o.bind = ep_bind;
  o.control = ep_control;
  o.ops_open = FABRIC_NOSYS(fi_ops, ops_open);
  return o;
}();

ssize_t ep_cancel(fid_t f, void* context) { return fi_cancel(&self<SimEp>(f)->real->fid, context); }
int ep_getopt(fid_t f, int level, int optname, void* optval, size_t* optlen) {
  return static_cast<int>(fi_getopt(&self<SimEp>(f)->real->fid, level, optname, optval, optlen));
}
int ep_setopt(fid_t f, int level, int optname, const void* optval, size_t optlen) {
  SimEp* ep = self<SimEp>(f);
  const bool shm = optname == fi_compat::kOptSharedMemoryPermitted;
  const bool cuda = optname == fi_compat::kOptCudaApiPermitted;
  if (level != FI_OPT_ENDPOINT || (!shm && !cuda))
    return static_cast<int>(fi_setopt(&ep->real->fid, level, optname, optval, optlen));
  const char* name = shm ? "FI_OPT_SHARED_MEMORY_PERMITTED" : "FI_OPT_CUDA_API_PERMITTED";
  if (optlen != sizeof(bool)) return violation("{}: optlen {} (it takes a bool)", name, optlen);
  if (ep->enabled)
    return violation("{} set after fi_enable (EFA reads it when the endpoint is enabled)", name);
  if (!*static_cast<const bool*>(optval)) (shm ? global().shm_false : global().cuda_false)++;
  return 0;  // accepted, as EFA does
}
ssize_t ep_tx_size_left(fid_ep* f) { return self<SimEp>(f)->real->ops->tx_size_left(self<SimEp>(f)->real); }
ssize_t ep_rx_size_left(fid_ep* f) { return self<SimEp>(f)->real->ops->rx_size_left(self<SimEp>(f)->real); }
fi_ops_ep g_ep_ops = [] {
  fi_ops_ep o{};
  o.size = sizeof o;
  o.cancel = ep_cancel;
  o.getopt = ep_getopt;
  o.setopt = ep_setopt;
  o.tx_ctx = FABRIC_NOSYS(fi_ops_ep, tx_ctx);
  o.rx_ctx = FABRIC_NOSYS(fi_ops_ep, rx_ctx);
  o.rx_size_left = ep_rx_size_left;
  o.tx_size_left = ep_tx_size_left;
  return o;
}();

int ep_getname(fid_t f, void* addr, size_t* addrlen) {
  return fi_getname(&self<SimEp>(f)->real->fid, addr, addrlen);
}
int ep_setname(fid_t f, void* addr, size_t addrlen) {
  return fi_setname(&self<SimEp>(f)->real->fid, addr, addrlen);
}
fi_ops_cm g_ep_cm_ops = [] {
  fi_ops_cm o{};
  o.size = sizeof o;
  o.setname = ep_setname;
  o.getname = ep_getname;
  o.getpeer = FABRIC_NOSYS(fi_ops_cm, getpeer);
  o.connect = FABRIC_NOSYS(fi_ops_cm, connect);
  o.listen = FABRIC_NOSYS(fi_ops_cm, listen);
  o.accept = FABRIC_NOSYS(fi_ops_cm, accept);
  o.reject = FABRIC_NOSYS(fi_ops_cm, reject);
  o.shutdown = FABRIC_NOSYS(fi_ops_cm, shutdown);
  o.join = FABRIC_NOSYS(fi_ops_cm, join);
  return o;
}();

ssize_t ep_recv(fid_ep* f, void* buf, size_t len, void* desc, fi_addr_t src, void* context) {
  SimEp* ep = self<SimEp>(f);
  const SimMr* mr = local_region(ep->dom, "fi_recv", buf, len, desc);
  if (!mr) return -FI_EINVAL;
  global().recvs++;
  return fi_recv(ep->real, buf, len, fi_mr_desc(mr->real), src, context);
}
ssize_t ep_send(fid_ep* f, const void* buf, size_t len, void* desc, fi_addr_t dest, void* context) {
  SimEp* ep = self<SimEp>(f);
  const SimMr* mr = local_region(ep->dom, "fi_send", buf, len, desc);
  if (!mr || !size_ok("fi_send", len, kMaxMsgSize, "max_msg_size")) return -FI_EINVAL;
  global().sends++;
  return fi_send(ep->real, buf, len, fi_mr_desc(mr->real), dest, context);
}
ssize_t ep_senddata(fid_ep* f, const void* buf, size_t len, void* desc, uint64_t data, fi_addr_t dest,
                    void* context) {
  SimEp* ep = self<SimEp>(f);
  const SimMr* mr = local_region(ep->dom, "fi_senddata", buf, len, desc);
  if (!mr || !size_ok("fi_senddata", len, kMaxMsgSize, "max_msg_size") || !cq_data_ok("fi_senddata", data))
    return -FI_EINVAL;
  global().sends++;
  return fi_senddata(ep->real, buf, len, fi_mr_desc(mr->real), data, dest, context);
}
ssize_t ep_inject(fid_ep* f, const void* buf, size_t len, fi_addr_t dest) {
  if (!size_ok("fi_inject", len, kInjectSize, "inject size")) return -FI_EINVAL;
  global().sends++;
  return fi_inject(self<SimEp>(f)->real, buf, len, dest);
}
fi_ops_msg g_ep_msg_ops = [] {
  fi_ops_msg o{};
  o.size = sizeof o;
  o.recv = ep_recv;
  o.recvv = FABRIC_NOSYS(fi_ops_msg, recvv);
  o.recvmsg = FABRIC_NOSYS(fi_ops_msg, recvmsg);
  o.send = ep_send;
  o.sendv = FABRIC_NOSYS(fi_ops_msg, sendv);
  o.sendmsg = FABRIC_NOSYS(fi_ops_msg, sendmsg);
  o.inject = ep_inject;
  o.senddata = ep_senddata;
  o.injectdata = FABRIC_NOSYS(fi_ops_msg, injectdata);
  return o;
}();

ssize_t ep_write_common(const char* call, fid_ep* f, const void* buf, size_t len, void* desc,
                        const uint64_t* data, fi_addr_t dest, uint64_t addr, uint64_t key, void* context) {
  SimEp* ep = self<SimEp>(f);
  const SimMr* mr = local_region(ep->dom, call, buf, len, desc);
  uint64_t tcp_key = 0, offset = 0;
  if (!mr || !size_ok(call, len, kMaxMsgSize, "max_msg_size") || (data && !cq_data_ok(call, *data)) ||
      !translate(call, key, addr, tcp_key, offset))
    return -FI_EINVAL;
  if (refused_by_hook()) return -FI_EIO;
  ssize_t rc = data ? fi_writedata(ep->real, buf, len, fi_mr_desc(mr->real), *data, dest, offset,
                                   tcp_key, context)
                    : fi_write(ep->real, buf, len, fi_mr_desc(mr->real), dest, offset, tcp_key, context);
  if (rc == 0) {
    count_write(len, data != nullptr);
    after_posted(ep, context);
  }
  return rc;
}
ssize_t ep_write(fid_ep* f, const void* buf, size_t len, void* desc, fi_addr_t dest, uint64_t addr,
                 uint64_t key, void* context) {
  return ep_write_common("fi_write", f, buf, len, desc, nullptr, dest, addr, key, context);
}
ssize_t ep_writedata(fid_ep* f, const void* buf, size_t len, void* desc, uint64_t data, fi_addr_t dest,
                     uint64_t addr, uint64_t key, void* context) {
  return ep_write_common("fi_writedata", f, buf, len, desc, &data, dest, addr, key, context);
}
ssize_t ep_inject_write(fid_ep* f, const void* buf, size_t len, fi_addr_t dest, uint64_t addr, uint64_t key) {
  uint64_t tcp_key = 0, offset = 0;
  if (!size_ok("fi_inject_write", len, kInjectSize, "inject size") ||
      !translate("fi_inject_write", key, addr, tcp_key, offset))
    return -FI_EINVAL;
  ssize_t rc = fi_inject_write(self<SimEp>(f)->real, buf, len, dest, offset, tcp_key);
  if (rc == 0) count_write(len, false);
  return rc;
}
ssize_t ep_inject_writedata(fid_ep* f, const void* buf, size_t len, uint64_t data, fi_addr_t dest,
                            uint64_t addr, uint64_t key) {
  uint64_t tcp_key = 0, offset = 0;
  if (!size_ok("fi_inject_writedata", len, kInjectSize, "inject size") ||
      !cq_data_ok("fi_inject_writedata", data) || !translate("fi_inject_writedata", key, addr, tcp_key, offset))
    return -FI_EINVAL;
  ssize_t rc = fi_inject_writedata(self<SimEp>(f)->real, buf, len, data, dest, offset, tcp_key);
  if (rc == 0) count_write(len, true);
  return rc;
}
fi_ops_rma g_ep_rma_ops = [] {
  fi_ops_rma o{};
  o.size = sizeof o;
  o.read = FABRIC_NOSYS(fi_ops_rma, read);
  o.readv = FABRIC_NOSYS(fi_ops_rma, readv);
  o.readmsg = FABRIC_NOSYS(fi_ops_rma, readmsg);
  o.write = ep_write;
  o.writev = FABRIC_NOSYS(fi_ops_rma, writev);
  o.writemsg = FABRIC_NOSYS(fi_ops_rma, writemsg);
  o.inject = ep_inject_write;
  o.writedata = ep_writedata;
  o.injectdata = ep_inject_writedata;
  return o;
}();

// ---- domain ------------------------------------------------------------------------------------

int domain_close(fid* f) {
  SimDomain* d = self<SimDomain>(f);
  int rc = fi_close(&d->s->real->fid);
  if (rc != 0) return rc;
  delete d->s;
  delete d;
  return 0;
}
int domain_bind(fid* f, fid* bfid, uint64_t flags) {
  return fi_domain_bind(self<SimDomain>(f)->s->real, bfid, flags);
}
int domain_control(fid* f, int command, void* arg) {
  fid_domain* real = self<SimDomain>(f)->s->real;
  return real->fid.ops->control(&real->fid, command, arg);
}
fi_ops g_domain_fid_ops = [] {
  fi_ops o{};
  o.size = sizeof o;
  o.close = domain_close;
  o.bind = domain_bind;
  o.control = domain_control;
  o.ops_open = FABRIC_NOSYS(fi_ops, ops_open);
  return o;
}();

int domain_av_open(fid_domain* f, fi_av_attr* attr, fid_av** av, void* context) {
  return fi_av_open(self<SimDomain>(f)->s->real, attr, av, context);
}
int domain_cq_open(fid_domain* f, fi_cq_attr* attr, fid_cq** out, void* context) {
  if (attr->format != FI_CQ_FORMAT_DATA) return -FI_ENOSYS;  // what fabric-lib reads
  fid_cq* real = nullptr;
  int rc = fi_cq_open(self<SimDomain>(f)->s->real, attr, &real, context);
  if (rc != 0) return rc;
  auto* cq = new SimCq{};
  cq->pub.fid.fclass = FI_CLASS_CQ;
  cq->pub.fid.context = context;
  cq->pub.fid.ops = &g_cq_fid_ops;
  cq->pub.ops = &g_cq_ops;
  cq->s = new CqState{real, {}, {}};
  *out = &cq->pub;
  return 0;
}
int domain_endpoint(fid_domain* f, fi_info* info, fid_ep** out, void* context) {
  DomainState* dom = self<SimDomain>(f)->s;
  fid_ep* real = nullptr;
  int rc = fi_endpoint(dom->real, info, &real, context);
  if (rc != 0) return rc;
  auto* ep = new SimEp{};
  ep->pub.fid.fclass = FI_CLASS_EP;
  ep->pub.fid.context = context;
  ep->pub.fid.ops = &g_ep_fid_ops;
  ep->pub.ops = &g_ep_ops;
  ep->pub.cm = &g_ep_cm_ops;
  ep->pub.msg = &g_ep_msg_ops;
  ep->pub.rma = &g_ep_rma_ops;
  ep->real = real;
  ep->dom = dom;
  *out = &ep->pub;
  return 0;
}
fi_ops_domain g_domain_ops = [] {
  fi_ops_domain o{};
  o.size = sizeof o;
  o.av_open = domain_av_open;
  o.cq_open = domain_cq_open;
  o.endpoint = domain_endpoint;
  o.scalable_ep = FABRIC_NOSYS(fi_ops_domain, scalable_ep);
  o.cntr_open = FABRIC_NOSYS(fi_ops_domain, cntr_open);
  o.poll_open = FABRIC_NOSYS(fi_ops_domain, poll_open);
  o.stx_ctx = FABRIC_NOSYS(fi_ops_domain, stx_ctx);
  o.srx_ctx = FABRIC_NOSYS(fi_ops_domain, srx_ctx);
  o.query_atomic = FABRIC_NOSYS(fi_ops_domain, query_atomic);
  o.query_collective = FABRIC_NOSYS(fi_ops_domain, query_collective);
  o.endpoint2 = FABRIC_NOSYS(fi_ops_domain, endpoint2);
  return o;
}();

}  // namespace

void present_as_efa(ProviderAttrs& a, bool hmem_wanted) {
  a.prov_name = "efa";
  a.mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY | FI_MR_HMEM;
  a.mr_key_size = 8;  // EFA's are 4; the shim's carry a base address as well
  a.cq_data_size = kCqDataSize;
  a.max_msg_size = kMaxMsgSize;
  a.inject_size = kInjectSize;
  a.data_progress = FI_PROGRESS_MANUAL;  // EFA's RDM endpoint, as tcp's: the worker drives it
  // domain_name and link_speed stay tcp's: the NIC is the loopback one, with no speed of its own.
  // tcp moves host memory only. offer_hmem: FI_HMEM is offered where the domain asks for it, as
  // EFA on a GPU host does, at API 1.20 (dma-buf registration): GPU regions are registered (and
  // checked) by the shim, never moved.
  if (global().offer_hmem && hmem_wanted) {
    a.caps |= FI_HMEM;
    a.api_version = std::max<uint32_t>(a.api_version, fi_compat::kDmabufApi);
  } else {
    a.caps &= ~FI_HMEM;
  }
}

int open_domain(fid_fabric* fabric, fi_info* info, fid_domain** out) {
  fid_domain* real = nullptr;
  int rc = fi_domain(fabric, info, &real, nullptr);
  if (rc != 0) return rc;
  auto* d = new SimDomain{};
  d->pub.fid.fclass = FI_CLASS_DOMAIN;
  d->pub.fid.ops = &g_domain_fid_ops;
  d->pub.ops = &g_domain_ops;
  d->pub.mr = &g_domain_mr_ops;
  d->s = new DomainState{real, {}, 1};
  global().domains++;
  *out = &d->pub;
  return 0;
}

Stats stats() {
  Global& g = global();
  Stats s;
  s.domains = g.domains;
  s.shared_memory_permitted_false = g.shm_false;
  s.cuda_api_permitted_false = g.cuda_false;
  s.regions = g.regions;
  s.requested_keys = g.requested_keys;
  s.writes = g.writes;
  s.writes_with_data = g.writes_with_data;
  s.largest_write = g.largest_write;
  s.sends = g.sends;
  s.recvs = g.recvs;
  s.violations = g.violations;
  s.dmabuf_regions = g.dmabuf_regions;
  s.hmem_range_regions = g.hmem_range_regions;
  return s;
}

std::string last_violation() {
  Global& g = global();
  std::lock_guard lock(g.mu);
  return g.last_violation;
}

void offer_hmem(bool on) { global().offer_hmem = on; }
void fail_write_post(uint64_t nth) { global().fail_post_countdown = nth; }
void fail_write_completion(uint64_t nth) { global().fail_completion_countdown = nth; }

const LibfabricHook& libfabric_hook() {
  static const LibfabricHook hook{kName, kUnderlying, " (efa-sim presents its own attributes)",
                                  present_as_efa, open_domain};
  return hook;
}

}  // namespace fabric::efa_sim
