// nanobind module `fabric_lib._fabric_lib`: the C++ API for Python. Submissions release the GIL;
// callbacks take it on the engine's callback thread. The worker thread never needs the GIL: what it
// holds and drops (DoneFlag/DoneCounter state) is C++-owned, and Python objects captured by the
// engine (callables) are released on the callback thread, under the GIL it holds to call them, or
// by the thread that closes the engine (PyRef).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/string_view.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <thread>

#include "fabric/fabric.h"

namespace nb = nanobind;
using namespace nb::literals;
using namespace fabric;

namespace {

// A Python object captured by the engine. Its reference is dropped with the GIL held: by the
// callback that used it (OnDone callables fire once), or here, taking the GIL, by whoever destroys
// the capture (a rejected submit's caller; the closing thread for receive callbacks). Never by the
// worker: it only moves callables to the callback thread and never destroys a non-empty one.
struct PyRef {
  nb::object obj;
  explicit PyRef(nb::object o) : obj(std::move(o)) {}
  ~PyRef() {
    if (!obj.is_valid() || !Py_IsInitialized()) return;
    nb::gil_scoped_acquire gil;
    obj = nb::object();
  }
};

// Completion state set by the worker itself. The atomics live in C++-allocated storage shared with
// the engine through OnDone::keep_alive, so the worker's drop of its reference is a plain C++
// release. (Keeping the Python object alive instead, through nanobind's shared_ptr caster, makes
// the worker take the GIL to drop it: every completion would wait for whichever Python thread
// holds the GIL, stalling every NIC.)
struct DoneFlag {
  std::shared_ptr<std::atomic<int>> state = std::make_shared<std::atomic<int>>(kDonePending);
};
struct DoneCounter {
  struct Counts {
    std::atomic<uint64_t> done{0}, failed{0};
  };
  std::shared_ptr<Counts> counts = std::make_shared<Counts>();
};

// A str for text that may not be UTF-8 (provider messages): undecodable bytes become \xNN escapes,
// so reading a message never raises UnicodeDecodeError.
nb::str to_py_str(std::string_view s) {
  PyObject* o = PyUnicode_DecodeUTF8(s.data(), static_cast<Py_ssize_t>(s.size()), "backslashreplace");
  if (!o) throw nb::python_error();
  return nb::steal<nb::str>(o);
}

// Waits with the GIL released; returns false on timeout (None: wait forever).
template <class Pred>
bool wait_released(Pred done, std::optional<double> timeout_s) {
  nb::gil_scoped_release release;
  auto deadline = std::chrono::steady_clock::now() +
                  std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                      std::chrono::duration<double>(timeout_s.value_or(1e9)));
  while (!done()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
  return true;
}

// None, a DoneFlag, a DoneCounter, or a callable taking a Status.
OnDone make_on_done(nb::handle on_done) {
  if (on_done.is_none()) return OnDone::none();
  if (nb::isinstance<DoneFlag>(on_done)) {
    std::shared_ptr<std::atomic<int>> state = nb::cast<DoneFlag&>(on_done).state;
    OnDone d = OnDone::flag(state.get());
    return std::move(d).keep_alive(std::move(state));
  }
  if (nb::isinstance<DoneCounter>(on_done)) {
    std::shared_ptr<DoneCounter::Counts> c = nb::cast<DoneCounter&>(on_done).counts;
    OnDone d = OnDone::counter(&c->done, &c->failed);
    return std::move(d).keep_alive(std::move(c));
  }
  if (!PyCallable_Check(on_done.ptr()))
    throw nb::type_error("on_done must be None, a DoneFlag, a DoneCounter or a callable(status)");
  auto ref = std::make_shared<PyRef>(nb::borrow(on_done));
  return OnDone::callback([ref](const Status& status) {
    nb::gil_scoped_acquire gil;
    try {
      ref->obj(status);
    } catch (nb::python_error& e) {
      e.discard_as_unraisable("in a fabric_lib completion callback");
    }
    ref->obj = nb::object();  // it fires once: release the callable now, under this GIL
  });
}

WriteOptions options(std::optional<uint32_t> imm, std::optional<uint8_t> nic) { return {imm, nic}; }

PollMode poll_mode(const std::string& s) {
  if (s == "busy") return PollMode::kBusy;
  if (s == "adaptive") return PollMode::kAdaptive;
  throw nb::value_error("poll must be 'busy' or 'adaptive'");
}

nb::bytes to_py_bytes(const std::vector<uint8_t>& b) {
  return nb::bytes(reinterpret_cast<const char*>(b.data()), b.size());
}
std::span<const uint8_t> as_span(const nb::bytes& b) {
  return {reinterpret_cast<const uint8_t*>(b.c_str()), b.size()};
}

// The engine as Python sees it: closable, and never destroyed while holding the GIL (its threads
// may need the GIL to finish running callbacks).
class PyEngine {
 public:
  explicit PyEngine(EngineConfig config) {
    nb::gil_scoped_release release;
    engine_ = std::make_unique<TransferEngine>(std::move(config));
  }
  ~PyEngine() { close(); }

  void close() {
    if (!engine_) return;
    if (PyGILState_Check()) {
      nb::gil_scoped_release release;
      engine_.reset();
    } else {
      engine_.reset();
    }
  }
  TransferEngine& get() {
    if (!engine_) throw Error(ErrorCode::kShutdown, "the engine is closed");
    return *engine_;
  }
  bool closed() const { return !engine_; }

 private:
  std::unique_ptr<TransferEngine> engine_;
};

}  // namespace

NB_MODULE(_fabric_lib, m) {
  m.doc() = "fabric-lib: RDMA point-to-point transfers (one-sided WRITEs with immediates)";

  nb::exception<Error> fabric_error(m, "FabricError", PyExc_RuntimeError);
  // Tried before nanobind's own translator (the latest registered goes first): the message is
  // decoded with backslashreplace, so an error is always a FabricError, never a UnicodeDecodeError.
  nb::register_exception_translator(
      [](const std::exception_ptr& p, void* type) {
        try {
          std::rethrow_exception(p);
        } catch (const Error& e) {
          PyObject* msg = PyUnicode_DecodeUTF8(e.what(), static_cast<Py_ssize_t>(std::strlen(e.what())),
                                               "backslashreplace");
          if (msg) {
            PyErr_SetObject(static_cast<PyObject*>(type), msg);
            Py_DECREF(msg);
          }
        }
      },
      fabric_error.ptr());

  nb::class_<Status>(m, "Status")
      .def_prop_ro("ok", &Status::ok)
      .def_prop_ro("code", [](const Status& s) { return std::string(to_string(s.code())); })
      .def_prop_ro("message", [](const Status& s) { return to_py_str(s.message()); })
      .def("__bool__", &Status::ok)
      .def("__repr__", [](const Status& s) {
        return to_py_str(s.ok() ? std::string("Status(ok)") : "Status(" + s.message() + ")");
      });

  nb::class_<DoneFlag>(m, "DoneFlag", "Set by the engine itself when the operation ends.")
      .def(nb::init<>())
      .def_prop_ro("done", [](const DoneFlag& f) { return f.state->load() != kDonePending; })
      .def_prop_ro("ok", [](const DoneFlag& f) { return f.state->load() == kDoneSucceeded; })
      .def("wait",
           [](DoneFlag& f, std::optional<double> timeout) {
             auto state = f.state;
             return wait_released([&] { return state->load() != kDonePending; }, timeout);
           },
           "timeout"_a = nb::none(), "Blocks (GIL released) until done; False on timeout.");

  nb::class_<DoneCounter>(m, "DoneCounter", "Counts operations that ended, by outcome.")
      .def(nb::init<>())
      .def_prop_ro("done", [](const DoneCounter& c) { return c.counts->done.load(); })
      .def_prop_ro("failed", [](const DoneCounter& c) { return c.counts->failed.load(); })
      .def("wait",
           [](DoneCounter& c, uint64_t n, std::optional<double> timeout) {
             auto counts = c.counts;
             return wait_released([&] { return counts->done.load() + counts->failed.load() >= n; },
                                  timeout);
           },
           "n"_a, "timeout"_a = nb::none(), "Blocks until done + failed >= n; False on timeout.");

  nb::class_<NetAddr>(m, "NetAddr")
      .def_static("from_bytes", [](nb::bytes b) { return NetAddr::from_bytes(as_span(b)); })
      .def_static("from_hex", &NetAddr::from_hex)
      .def("to_bytes", [](const NetAddr& a) { return to_py_bytes(a.to_bytes()); })
      .def("to_hex", &NetAddr::to_hex)
      .def_prop_ro("provider", [](const NetAddr& a) { return to_py_str(a.provider()); })
      .def_prop_ro("nic_count", &NetAddr::nic_count)
      .def("__eq__", [](const NetAddr& a, const NetAddr& b) { return a == b; })
      .def("__hash__", [](const NetAddr& a) { return std::hash<std::string>()(a.to_hex()); })
      .def("__getstate__", [](const NetAddr& a) { return to_py_bytes(a.to_bytes()); })
      .def("__setstate__",
           [](NetAddr& a, nb::bytes b) { new (&a) NetAddr(NetAddr::from_bytes(as_span(b))); })
      .def("__repr__", [](const NetAddr& a) {
        return to_py_str("NetAddr(" + a.provider() + ", " + std::to_string(a.nic_count()) + " NICs)");
      });

  nb::class_<MrDesc>(m, "MrDesc")
      .def_static("from_bytes", [](nb::bytes b) { return MrDesc::from_bytes(as_span(b)); })
      .def_static("from_hex", &MrDesc::from_hex)
      .def("to_bytes", [](const MrDesc& d) { return to_py_bytes(d.to_bytes()); })
      .def("to_hex", &MrDesc::to_hex)
      .def_prop_ro("owner", &MrDesc::owner)
      .def_prop_ro("len", &MrDesc::len)
      .def_prop_ro("addr", &MrDesc::addr)
      .def("__eq__", [](const MrDesc& a, const MrDesc& b) { return a == b; })
      .def("__getstate__", [](const MrDesc& d) { return to_py_bytes(d.to_bytes()); })
      .def("__setstate__",
           [](MrDesc& d, nb::bytes b) { new (&d) MrDesc(MrDesc::from_bytes(as_span(b))); })
      .def("__repr__", [](const MrDesc& d) { return "MrDesc(" + std::to_string(d.len()) + " bytes)"; });

  nb::class_<MrHandle>(m, "MrHandle")
      .def_ro("slot", &MrHandle::slot)
      .def_ro("generation", &MrHandle::generation)
      .def("__eq__", [](const MrHandle& a, const MrHandle& b) { return a == b; })
      .def("__hash__", [](const MrHandle& h) { return (uint64_t{h.slot} << 32) | h.generation; });

  nb::class_<Pages>(m, "Pages")
      .def("__init__",
           [](Pages* p, nb::ndarray<const uint32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> indices,
              uint64_t stride, uint64_t offset) {
             new (p) Pages{std::vector<uint32_t>(indices.data(), indices.data() + indices.shape(0)),
                           stride, offset};
           },
           "indices"_a, "stride"_a, "offset"_a = 0)
      .def_ro("stride", &Pages::stride)
      .def_ro("offset", &Pages::offset)
      .def("__len__", [](const Pages& p) { return p.indices.size(); })
      .def_prop_ro("indices", [](const Pages& p) { return p.indices; });

  nb::class_<ScatterDst>(m, "ScatterDst")
      .def(nb::init<uint64_t, uint64_t, MrDesc, uint64_t>(), "len"_a, "src_offset"_a, "dst"_a,
           "dst_offset"_a)
      .def_ro("len", &ScatterDst::len)
      .def_ro("src_offset", &ScatterDst::src_offset)
      .def_ro("dst", &ScatterDst::dst)
      .def_ro("dst_offset", &ScatterDst::dst_offset);

  nb::class_<PeerGroupHandle>(m, "PeerGroupHandle").def_ro("id", &PeerGroupHandle::id);

  nb::class_<NicStats>(m, "NicStats")
      .def_ro("writes_posted", &NicStats::writes_posted)
      .def_ro("bytes_written", &NicStats::bytes_written)
      .def_ro("sends_posted", &NicStats::sends_posted)
      .def_ro("imms_received", &NicStats::imms_received)
      .def_ro("messages_received", &NicStats::messages_received)
      .def_ro("errors", &NicStats::errors)
      .def_ro("faults_injected", &NicStats::faults_injected)
      .def_ro("imms_duplicated", &NicStats::imms_duplicated)
      .def_ro("imms_dropped", &NicStats::imms_dropped);

  nb::class_<ImmExpectation>(m, "ImmExpectation", "A pending expect_imm_count, to cancel it.")
      .def_ro("imm", &ImmExpectation::imm)
      .def_ro("id", &ImmExpectation::id);

  m.def("single_write_imm_count", &single_write_imm_count, "len"_a, "nic_count"_a,
        "pinned_to_one_nic"_a = false,
        "How many immediates a single write delivers (see docs/api.md).");

  nb::class_<PyEngine>(m, "Engine")
      .def("__init__",
           [](PyEngine* self, const std::string& provider, std::vector<std::string> nics,
              const std::string& poll, const std::string& callback_poll,
              double transfer_timeout_s, size_t max_in_flight_per_nic, size_t max_message_size,
              std::optional<int> worker_cpu, bool reorder, uint64_t reorder_seed,
              std::optional<int> cuda_device, bool cuda_ipc) {
             // An explicit empty list is an error, as in C++ (docs/api.md); leaving `nics` out
             // gives one NIC.
             if (nics.empty() || nics.size() > kMaxNics)
               throw Error(ErrorCode::kInvalidArgument,
                           "TransferEngine(nics=...) must list 1 to " + std::to_string(kMaxNics) +
                               " NICs, it lists " + std::to_string(nics.size()) +
                               " (leave it out for one NIC on 127.0.0.1; [\"\"] picks the "
                               "provider's default domain)");
             EngineConfig c;
             c.provider = provider;
             c.nics.clear();
             // "node" or "domain@node" per NIC; "" picks the provider's default.
             for (auto& n : nics) {
               auto at = n.find('@');
               c.nics.push_back(at == std::string::npos ? NicConfig{"", n}
                                                        : NicConfig{n.substr(0, at), n.substr(at + 1)});
             }
             c.worker_poll = poll_mode(poll);
             c.callback_poll = poll_mode(callback_poll);
             c.transfer_timeout = std::chrono::milliseconds(static_cast<int64_t>(transfer_timeout_s * 1000));
             c.max_in_flight_per_nic = max_in_flight_per_nic;
             c.max_message_size = max_message_size;
             c.worker_cpu = worker_cpu;
             c.reorder.enabled = reorder;
             c.reorder.seed = reorder_seed;
             c.cuda_device = cuda_device;
             c.cuda_ipc = cuda_ipc;
             new (self) PyEngine(std::move(c));
           },
           "provider"_a = "tcp;ofi_rxm", "nics"_a = std::vector<std::string>{"127.0.0.1"},
           "poll"_a = "adaptive", "callback_poll"_a = "adaptive", "transfer_timeout_s"_a = 30.0,
           "max_in_flight_per_nic"_a = 64, "max_message_size"_a = 16384,
           "worker_cpu"_a = nb::none(), "reorder"_a = false, "reorder_seed"_a = 1,
           "cuda_device"_a = nb::none(), "cuda_ipc"_a = false)
      .def("close", &PyEngine::close, "Ends pending work with errors and joins the engine's threads.")
      .def_prop_ro("closed", &PyEngine::closed)
      .def("main_address", [](PyEngine& e) { return e.get().main_address(); })
      .def_prop_ro("nic_count", [](PyEngine& e) { return e.get().nic_count(); })
      .def("reg_mr",
           [](PyEngine& e, uintptr_t ptr, size_t len, std::optional<int> cuda_device) {
             TransferEngine& eng = e.get();
             nb::gil_scoped_release release;
             return eng.reg_mr(reinterpret_cast<void*>(ptr), len,
                               cuda_device ? Device::cuda(*cuda_device) : Device::host());
           },
           "ptr"_a, "length"_a, "cuda_device"_a = nb::none(),
           "Registers raw memory (host, or CUDA device memory of cuda_device); returns (MrHandle, MrDesc).")
      .def("dereg_mr",
           [](PyEngine& e, MrHandle h) {
             TransferEngine& eng = e.get();
             nb::gil_scoped_release release;
             eng.dereg_mr(h);
           },
           "handle"_a)
      .def("submit_send",
           [](PyEngine& e, const NetAddr& dst, nb::bytes data, nb::handle on_done) {
             TransferEngine& eng = e.get();
             OnDone d = make_on_done(on_done);
             auto bytes = std::as_bytes(std::span(data.c_str(), data.size()));
             nb::gil_scoped_release release;  // `data` stays referenced by the caller's frame
             eng.submit_send(dst, bytes, std::move(d));
           },
           "dst"_a, "data"_a, "on_done"_a = nb::none())
      .def("submit_recvs",
           [](PyEngine& e, size_t len, size_t count, nb::callable on_recv) {
             TransferEngine& eng = e.get();
             auto ref = std::make_shared<PyRef>(nb::borrow(on_recv));
             nb::gil_scoped_release release;  // registers on the worker and waits for it
             eng.submit_recvs(len, count, [ref](std::span<const std::byte> msg) {
               nb::gil_scoped_acquire gil;
               try {
                 ref->obj(nb::bytes(reinterpret_cast<const char*>(msg.data()), msg.size()));
               } catch (nb::python_error& err) {
                 err.discard_as_unraisable("in a fabric_lib receive callback");
               }
             });
           },
           "length"_a, "count"_a, "on_recv"_a)
      .def("expect_imm_count",
           [](PyEngine& e, uint32_t imm, uint64_t count, nb::handle on_done,
              std::optional<double> timeout_s) {
             TransferEngine& eng = e.get();
             OnDone d = make_on_done(on_done);
             ExpectOptions opts;
             if (timeout_s) opts.timeout = std::chrono::milliseconds(static_cast<int64_t>(*timeout_s * 1000));
             nb::gil_scoped_release release;
             return eng.expect_imm_count(imm, count, std::move(d), opts);
           },
           "imm"_a, "count"_a, "on_done"_a, nb::kw_only(), "timeout_s"_a = nb::none(),
           "Calls on_done once `imm` arrived `count` times; with timeout_s it ends with a timeout "
           "error if not met by then. Returns an ImmExpectation for cancel_imm_expectation.")
      .def("cancel_imm_expectation",
           [](PyEngine& e, const ImmExpectation& x) {
             TransferEngine& eng = e.get();
             nb::gil_scoped_release release;
             return eng.cancel_imm_expectation(x);
           },
           "expectation"_a, "Ends a pending expectation with a 'cancelled' error; False if it had ended.")
      .def("remove_peer",
           [](PyEngine& e, const NetAddr& peer) {
             TransferEngine& eng = e.get();
             nb::gil_scoped_release release;
             eng.remove_peer(peer);
           },
           "peer"_a, "Forgets a peer that left: its pending transfers end cancelled, its NIC resources go.")
      .def_prop_ro("peer_count",
                   [](PyEngine& e) {
                     TransferEngine& eng = e.get();
                     nb::gil_scoped_release release;
                     return eng.peer_count();
                   })
      .def("imm_count",
           [](PyEngine& e, uint32_t imm) {
             TransferEngine& eng = e.get();
             nb::gil_scoped_release release;
             return eng.imm_count(imm);
           },
           "imm"_a)
      .def("submit_single_write",
           [](PyEngine& e, uint64_t len, const MrHandle& src, uint64_t src_offset, const MrDesc& dst,
              uint64_t dst_offset, nb::handle on_done, std::optional<uint32_t> imm,
              std::optional<uint8_t> nic) {
             TransferEngine& eng = e.get();
             OnDone d = make_on_done(on_done);
             nb::gil_scoped_release release;
             eng.submit_single_write(len, src, src_offset, dst, dst_offset, std::move(d),
                                     options(imm, nic));
           },
           "length"_a, "src"_a, "src_offset"_a, "dst"_a, "dst_offset"_a, "on_done"_a = nb::none(),
           nb::kw_only(), "imm"_a = nb::none(), "nic"_a = nb::none())
      .def("submit_paged_writes",
           [](PyEngine& e, uint64_t page_len, const MrHandle& src, const Pages& src_pages,
              const MrDesc& dst, const Pages& dst_pages, nb::handle on_done,
              std::optional<uint32_t> imm, std::optional<uint8_t> nic) {
             TransferEngine& eng = e.get();
             OnDone d = make_on_done(on_done);
             nb::gil_scoped_release release;
             eng.submit_paged_writes(page_len, src, src_pages, dst, dst_pages, std::move(d),
                                     options(imm, nic));
           },
           "page_len"_a, "src"_a, "src_pages"_a, "dst"_a, "dst_pages"_a, "on_done"_a = nb::none(),
           nb::kw_only(), "imm"_a = nb::none(), "nic"_a = nb::none())
      .def("add_peer_group",
           [](PyEngine& e, const std::vector<NetAddr>& peers) {
             TransferEngine& eng = e.get();
             nb::gil_scoped_release release;
             return eng.add_peer_group(peers);
           },
           "peers"_a)
      .def("submit_scatter",
           [](PyEngine& e, const MrHandle& src, const std::vector<ScatterDst>& dsts,
              nb::handle on_done, std::optional<uint32_t> imm, std::optional<uint8_t> nic,
              std::optional<PeerGroupHandle> group) {
             TransferEngine& eng = e.get();
             OnDone d = make_on_done(on_done);
             nb::gil_scoped_release release;
             eng.submit_scatter(group, src, dsts, std::move(d), options(imm, nic));
           },
           "src"_a, "dsts"_a, "on_done"_a = nb::none(), nb::kw_only(), "imm"_a = nb::none(),
           "nic"_a = nb::none(), "group"_a = nb::none())
      .def("submit_barrier",
           [](PyEngine& e, uint32_t imm, const std::vector<MrDesc>& dsts, nb::handle on_done,
              std::optional<uint8_t> nic, std::optional<PeerGroupHandle> group) {
             TransferEngine& eng = e.get();
             OnDone d = make_on_done(on_done);
             nb::gil_scoped_release release;
             eng.submit_barrier(group, imm, dsts, std::move(d), nic);
           },
           "imm"_a, "dsts"_a, "on_done"_a = nb::none(), nb::kw_only(), "nic"_a = nb::none(),
           "group"_a = nb::none())
      .def("nic_stats", [](PyEngine& e) { return e.get().nic_stats(); });
}
