// nanobind module `fabric_lib._fabric_lib`: the C++ API for Python. Submissions release the GIL;
// callbacks take it on the engine's callback thread. The worker thread never needs the GIL: what it
// holds and drops (DoneFlag/DoneCounter state) is C++-owned, and Python objects captured by the
// engine (callables) are released on the callback thread, under the GIL it holds to call them, or
// by the thread that closes the engine (PyRef). Once Python exits, engine threads no longer enter
// it (py_exit.h).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/string_view.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <thread>

#include "arg_check.h"
#include "engine_defaults.h"
#include "fabric/fabric.h"
#include "fabric/topology.h"
#include "py_support.h"

namespace nb = nanobind;
using namespace nb::literals;
using namespace fabric;
using namespace fabric::py;

namespace {

// Pages as Python holds them: the object owns its indices (fabric::Pages is a view, read during
// submit only), and lends a fabric::Pages over them at submit time.
struct PyPages {
  std::vector<uint32_t> indices;
  uint64_t stride = 0;
  uint64_t offset = 0;
  Pages view() const { return Pages{indices, stride, offset}; }
};

// A scatter slice as Python builds it: `dst` is the Python object given (a RemoteMr, or an MrDesc
// that submit interns with add_remote).
struct PyScatterSlice {
  uint64_t len = 0;
  uint64_t src_offset = 0;
  nb::object dst;
  uint64_t dst_offset = 0;
};

// A destination as given: an interned RemoteMr, or an MrDesc to intern (add_remote, idempotent)
// once the GIL is released. `desc` points into a Python object the caller keeps referenced.
struct DstRef {
  RemoteMr mr;
  const MrDesc* desc = nullptr;
};

DstRef dst_ref(nb::handle h, const char* what) {
  if (nb::isinstance<RemoteMr>(h)) return {nb::cast<RemoteMr>(h), nullptr};
  if (nb::isinstance<MrDesc>(h)) return {RemoteMr{}, &nb::cast<const MrDesc&>(h)};
  throw nb::type_error((std::string(what) + " must be a RemoteMr or an MrDesc, got " +
                        nb::type_name(h.type()).c_str())
                           .c_str());
}

// Without the GIL: an MrDesc is interned (the same descriptor gives the same RemoteMr).
RemoteMr resolve(TransferEngine& eng, const DstRef& d) {
  return d.desc ? eng.add_remote(*d.desc) : d.mr;
}

// Destinations of a sequence (barrier dsts, group members). `keep` holds every item whose C++
// object a DstRef points into, so another thread changing the sequence while the GIL is released
// cannot free it.
std::vector<DstRef> dst_refs(nb::handle seq, const char* what, std::vector<nb::object>& keep) {
  std::vector<DstRef> out;
  for (nb::handle item : seq) {
    out.push_back(dst_ref(item, what));
    if (out.back().desc) keep.push_back(nb::borrow(item));
  }
  return out;
}

std::vector<RemoteMr> resolve_all(TransferEngine& eng, const std::vector<DstRef>& refs) {
  std::vector<RemoteMr> out;
  out.reserve(refs.size());
  for (const DstRef& d : refs) out.push_back(resolve(eng, d));
  return out;
}

uint64_t to_u64(nb::handle h) { return nb::cast<uint64_t>(h); }
nb::handle tuple_item(nb::handle t, Py_ssize_t i) {
  return PyTuple_GET_ITEM(t.ptr(), i);
}  // borrowed

// A ScatterSlice, or a tuple (len, src_offset, dst[, dst_offset]).
std::pair<ScatterSlice, DstRef> scatter_slice(nb::handle item, std::vector<nb::object>& keep) {
  ScatterSlice s;
  nb::handle dst;  // borrowed from `item`, which the caller's iteration holds
  if (nb::isinstance<PyScatterSlice>(item)) {
    const PyScatterSlice& p = nb::cast<const PyScatterSlice&>(item);
    s.len = p.len;
    s.src_offset = p.src_offset;
    s.dst.offset = p.dst_offset;
    dst = p.dst;
  } else if (PyTuple_Check(item.ptr()) && (nb::len(item) == 3 || nb::len(item) == 4)) {
    s.len = to_u64(tuple_item(item, 0));
    s.src_offset = to_u64(tuple_item(item, 1));
    dst = tuple_item(item, 2);
    s.dst.offset = nb::len(item) == 4 ? to_u64(tuple_item(item, 3)) : 0;
  } else {
    throw nb::type_error(
        "slices must hold ScatterSlice objects or (len, src_offset, dst[, dst_offset]) tuples");
  }
  DstRef d = dst_ref(dst, "ScatterSlice.dst");
  if (d.desc) keep.push_back(nb::borrow(dst));
  return {s, d};
}

// A GroupSlice, or a tuple (len, src_offset, dst_offset).
GroupSlice group_slice(nb::handle item) {
  if (nb::isinstance<GroupSlice>(item)) return nb::cast<GroupSlice>(item);
  if (PyTuple_Check(item.ptr()) && nb::len(item) == 3)
    return GroupSlice{to_u64(tuple_item(item, 0)), to_u64(tuple_item(item, 1)),
                      to_u64(tuple_item(item, 2))};
  throw nb::type_error(
      "slices must hold GroupSlice objects or (len, src_offset, dst_offset) tuples");
}

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

// The device a barrier goes out from: that GPU's worker, else the first.
Device gpu_or_host(std::optional<int> cuda_device) {
  return cuda_device ? Device::cuda(*cuda_device) : Device::host();
}

// Type checks and their descriptions, for the messages of checked bindings (arg_check.h).
bool is_mr_handle(nb::handle h) { return nb::isinstance<MrHandle>(h); }
bool is_remote_mr(nb::handle h) { return nb::isinstance<RemoteMr>(h); }
bool is_mr_desc(nb::handle h) { return nb::isinstance<MrDesc>(h); }
bool is_dst(nb::handle h) { return is_remote_mr(h) || is_mr_desc(h); }
bool is_pages(nb::handle h) { return nb::isinstance<PyPages>(h); }
bool is_group(nb::handle h) { return nb::isinstance<PeerGroupHandle>(h); }
bool is_net_addr(nb::handle h) { return nb::isinstance<NetAddr>(h); }
bool is_bytes(nb::handle h) { return PyBytes_Check(h.ptr()); }
bool is_reservation(nb::handle h) { return nb::isinstance<PyImmReservation>(h); }
constexpr const char* kMrHandleText = "an MrHandle (from this engine's reg_mr or register_tensor)";
constexpr const char* kDstText =
    "a RemoteMr (from add_remote) or an MrDesc (the peer's descriptor)";
constexpr const char* kPagesText = "a Pages (fabric_lib.Pages(indices, stride, offset))";
constexpr const char* kGroupText = "a PeerGroupHandle (from add_peer_group)";

// Parameter types as the generated stubs show them (nb::sig), where the binding takes a handle.
#define FABRIC_DST "RemoteMr | MrDesc"
#define FABRIC_ON_DONE \
  "DoneFlag | DoneCounter | collections.abc.Callable[[Status], object] | None = None"

}  // namespace

NB_MODULE(_fabric_lib, m) {
  m.doc() = "fabric-lib: RDMA point-to-point transfers (one-sided WRITEs with immediates)";

  // FabricError carries `.code` (the ErrorCode as Status.code names it: "timeout", "not found",
  // ...); a timeout is a FabricTimeoutError, which is also a TimeoutError, wherever it is raised.
  nb::exception<Error> fabric_error(m, "FabricError", PyExc_RuntimeError);
  PyObject_SetAttrString(fabric_error.ptr(), "code", Py_None);  // raised from Python without one
  nb::object timeout_bases = nb::make_tuple(fabric_error, nb::handle(PyExc_TimeoutError));
  PyObject* timeout_error = PyErr_NewExceptionWithDoc(
      "fabric_lib._fabric_lib.FabricTimeoutError",
      "A FabricError with code 'timeout'; also a TimeoutError.", timeout_bases.ptr(), nullptr);
  if (!timeout_error) throw nb::python_error();
  m.attr("FabricTimeoutError") = nb::steal(timeout_error);
  PyObject_SetAttrString(timeout_error, "code", nb::str("timeout").ptr());
  // Tried before nanobind's own translator (the latest registered goes first): the message is
  // decoded with backslashreplace, so an error is always a FabricError, never a UnicodeDecodeError.
  nb::register_exception_translator(
      [](const std::exception_ptr& p, void* type) {
        try {
          std::rethrow_exception(p);
        } catch (const Error& e) {
          set_fabric_error(static_cast<PyObject*>(type), e.code(), e.what());
        }
      },
      fabric_error.ptr());
  set_error_types(fabric_error.ptr(), timeout_error);
  m.def(
      "_error_of", [](const Status& s) { return error_of(s); },
      "The exception (FabricError or FabricTimeoutError, with .code) for a failed Status.");

  nb::class_<Status>(m, "Status")
      .def_prop_ro("ok", &Status::ok)
      .def_prop_ro("code", [](const Status& s) { return std::string(to_string(s.code())); })
      .def_prop_ro("message", [](const Status& s) { return to_py_str(s.message()); })
      .def("__bool__", &Status::ok)
      .def("__repr__", [](const Status& s) { return to_py_str("Status(" + status_text(s) + ")"); });

  nb::class_<DoneFlag>(
      m, "DoneFlag",
      "Set by the engine itself when the one operation it was given to ends. One-shot: giving a "
      "fired flag (or one still in flight) to another operation raises; reset() re-arms it.")
      .def(nb::init<>())
      .def_prop_ro("done", [](const DoneFlag& f) { return f.state->value.load() != kDonePending; })
      .def_prop_ro("ok", [](const DoneFlag& f) { return f.state->value.load() == kDoneSucceeded; })
      .def_prop_ro(
          "status", [](const DoneFlag& f) { return flag_status(f); },
          "None while pending; then the Status it ended with (its code and message on failure).")
      .def(
          "wait",
          [](DoneFlag& f, std::optional<double> timeout) {
            auto state = f.state;
            return wait_released([&] { return state->value.load() != kDonePending; }, timeout);
          },
          "timeout"_a = nb::none(), "Blocks (GIL released) until done; False on timeout.")
      .def(
          "reset",
          [](DoneFlag& f) {
            if (f.in_flight())
              throw Error(ErrorCode::kInvalidArgument,
                          "DoneFlag.reset(): the operation it was given to has not ended; wait() "
                          "for it first");
            f.state->status.clear();
            f.state->value.store(kDonePending);
          },
          "Re-arms a flag whose operation ended (or was refused), for the next operation.")
      .def("__repr__", [](const DoneFlag& f) {
        const int v = f.state->value.load();
        if (v == kDonePending)
          return to_py_str(f.in_flight() ? "DoneFlag(pending)" : "DoneFlag(unused)");
        return to_py_str("DoneFlag(" + status_text(*flag_status(f)) + ")");
      });

  nb::class_<DoneCounter>(m, "DoneCounter", "Counts operations that ended, by outcome.")
      .def(nb::init<>())
      .def_prop_ro("done", [](const DoneCounter& c) { return c.counts->done.load(); })
      .def_prop_ro("failed", [](const DoneCounter& c) { return c.counts->failed.load(); })
      .def(
          "wait",
          [](DoneCounter& c, uint64_t n, std::optional<double> timeout) {
            auto counts = c.counts;
            return wait_released([&] { return counts->done.load() + counts->failed.load() >= n; },
                                 timeout);
          },
          "n"_a, "timeout"_a = nb::none(), "Blocks until done + failed >= n; False on timeout.")
      .def_prop_ro(
          "error", [](const DoneCounter& c) { return c.counts->status.first_failure(); },
          "None, or the Status of the first operation that failed (its code and message).")
      .def("__repr__", [](const DoneCounter& c) {
        return "DoneCounter(done=" + std::to_string(c.counts->done.load()) +
               ", failed=" + std::to_string(c.counts->failed.load()) + ")";
      });

  nb::class_<NetAddr>(m, "NetAddr")
      .def_static("from_bytes", [](nb::bytes b) { return NetAddr::from_bytes(as_span(b)); })
      .def_static("from_hex", &NetAddr::from_hex)
      .def("to_bytes", [](const NetAddr& a) { return to_py_bytes(a.to_bytes()); })
      .def("to_hex", &NetAddr::to_hex)
      .def_prop_ro("provider", [](const NetAddr& a) { return to_py_str(a.provider()); })
      .def_prop_ro("nic_count", &NetAddr::nic_count)
      .def_prop_ro("max_message", &NetAddr::max_message,
                   "the longest message (bytes) the engine accepts: its max_message_size; a longer "
                   "submit_send to it is refused")
      .def("__eq__", [](const NetAddr& a, const NetAddr& b) { return a == b; })
      .def("__hash__", [](const NetAddr& a) { return std::hash<std::string>()(a.to_hex()); })
      .def("__getstate__", [](const NetAddr& a) { return to_py_bytes(a.to_bytes()); })
      .def("__setstate__",
           [](NetAddr& a, nb::bytes b) { new (&a) NetAddr(NetAddr::from_bytes(as_span(b))); })
      .def("__repr__", [](const NetAddr& a) {
        return to_py_str("NetAddr(" + a.provider() + ", " + std::to_string(a.nic_count()) +
                         " NICs)");
      });

  nb::class_<MrDesc>(m, "MrDesc")
      .def_static("from_bytes", [](nb::bytes b) { return MrDesc::from_bytes(as_span(b)); })
      .def_static("from_hex", &MrDesc::from_hex)
      .def("to_bytes", [](const MrDesc& d) { return to_py_bytes(d.to_bytes()); })
      .def("to_hex", &MrDesc::to_hex)
      .def_prop_ro("owner", &MrDesc::owner)
      .def_prop_ro("len", &MrDesc::len)
      .def_prop_ro("addr", &MrDesc::addr)
      .def_prop_ro(
          "imm_base", [](const MrDesc& d) { return d.imms().base; },
          "its immediate range's first value")
      .def_prop_ro(
          "imm_bits", [](const MrDesc& d) { return d.imms().bits; },
          "its immediate range's width (32: unreserved)")
      .def("__eq__", [](const MrDesc& a, const MrDesc& b) { return a == b; })
      .def("__hash__", [](const MrDesc& d) { return std::hash<std::string>()(d.to_hex()); })
      .def("__getstate__", [](const MrDesc& d) { return to_py_bytes(d.to_bytes()); })
      .def("__setstate__",
           [](MrDesc& d, nb::bytes b) { new (&d) MrDesc(MrDesc::from_bytes(as_span(b))); })
      .def("__repr__",
           [](const MrDesc& d) { return "MrDesc(" + std::to_string(d.len()) + " bytes)"; });

  nb::class_<MrHandle>(m, "MrHandle",
                       "A region registered by reg_mr / register_tensor (of that engine only).")
      .def_ro("slot", &MrHandle::slot)
      .def_ro("generation", &MrHandle::generation)
      .def_ro("engine", &MrHandle::engine, "the engine it belongs to")
      .def("__eq__", [](const MrHandle& a, const MrHandle& b) { return a == b; })
      .def("__hash__",
           [](const MrHandle& h) { return handle_hash(h.slot, h.generation, h.engine); })
      .def("__repr__", [](const MrHandle& h) {
        return "MrHandle(slot=" + std::to_string(h.slot) +
               ", generation=" + std::to_string(h.generation) +
               ", engine=" + std::to_string(h.engine) + ")";
      });

  nb::class_<RemoteMr>(
      m, "RemoteMr",
      "A remote region interned by add_remote of one engine (valid there until remove_remote).")
      .def_ro("slot", &RemoteMr::slot)
      .def_ro("generation", &RemoteMr::generation)
      .def_ro("engine", &RemoteMr::engine, "the engine that interned it")
      .def("__eq__", [](const RemoteMr& a, const RemoteMr& b) { return a == b; })
      .def("__hash__",
           [](const RemoteMr& r) { return handle_hash(r.slot, r.generation, r.engine); })
      .def("__repr__", [](const RemoteMr& r) {
        return "RemoteMr(slot=" + std::to_string(r.slot) +
               ", generation=" + std::to_string(r.generation) +
               ", engine=" + std::to_string(r.engine) + ")";
      });

  nb::class_<PyPages>(m, "Pages",
                      "Page i lives at offset + stride * indices[i] (the indices are copied).")
      .def(
          "__init__",
          [](PyPages* p,
             nb::ndarray<const uint32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> indices,
             uint64_t stride, uint64_t offset) {
            new (p)
                PyPages{std::vector<uint32_t>(indices.data(), indices.data() + indices.shape(0)),
                        stride, offset};
          },
          "indices"_a, "stride"_a, "offset"_a = 0)
      .def(
          "__init__",
          [](PyPages* p, nb::args args, nb::kwargs kwargs) {
            // Any other call: a list or an int array of another dtype is taken, each index checked.
            auto v = check_args(
                "Pages",
                {iterable_arg("indices", "page indices (ints in [0, 2**32))"),
                 uint_arg("stride", UINT64_MAX, true), uint_arg("offset", UINT64_MAX, false)},
                3, args, kwargs);
            std::vector<uint32_t> indices;
            size_t i = 0;
            for (nb::handle item : v[0]) {
              const std::string name = "indices[" + std::to_string(i++) + "]";
              Problem bad = check_value(uint_arg(name.c_str(), UINT32_MAX, true), item);
              if (!bad.text.empty()) fail("Pages(): " + bad.text, bad.value_error);
              indices.push_back(static_cast<uint32_t>(uint_value(item)));
            }
            new (p) PyPages{std::move(indices), uint_value(v[1]), uint_value(v[2])};
          },
          "Any other call: indices may be any iterable of ints in [0, 2**32); a wrong argument is "
          "named.")
      .def_ro("stride", &PyPages::stride)
      .def_ro("offset", &PyPages::offset)
      .def("__len__", [](const PyPages& p) { return p.indices.size(); })
      .def("__repr__",
           [](const PyPages& p) {
             std::string first;
             for (size_t i = 0; i < p.indices.size() && i < 4; i++)
               first += (i ? ", " : "") + std::to_string(p.indices[i]);
             if (p.indices.size() > 4) first += ", ...";
             return "Pages(" + std::to_string(p.indices.size()) + " pages [" + first +
                    "], stride=" + std::to_string(p.stride) +
                    ", offset=" + std::to_string(p.offset) + ")";
           })
      .def_prop_ro("indices", [](const PyPages& p) { return p.indices; });

  nb::class_<PyScatterSlice>(
      m, "ScatterSlice",
      "len bytes from src_offset in the source region to dst (a RemoteMr or an MrDesc) at "
      "dst_offset.")
      .def(
          "__init__",
          [](PyScatterSlice* p, uint64_t len, uint64_t src_offset, nb::object dst,
             uint64_t dst_offset) {
            dst_ref(dst, "ScatterSlice.dst");  // type check now, not at submit
            new (p) PyScatterSlice{len, src_offset, std::move(dst), dst_offset};
          },
          nb::sig("def __init__(self, len: int, src_offset: int, dst: " FABRIC_DST
                  ", dst_offset: int = 0) -> None"),
          "len"_a, "src_offset"_a, "dst"_a.none(), "dst_offset"_a = 0)
      .def(
          "__init__",
          [](PyScatterSlice* p, nb::args args, nb::kwargs kwargs) {
            auto v = check_args(
                "ScatterSlice",
                {uint_arg("len", UINT64_MAX, true), uint_arg("src_offset", UINT64_MAX, true),
                 object_arg("dst", kDstText, is_dst, true),
                 uint_arg("dst_offset", UINT64_MAX, false)},
                4, args, kwargs);
            new (p) PyScatterSlice{uint_value(v[0]), uint_value(v[1]), nb::borrow(v[2]),
                                   uint_value(v[3])};
          },
          "Any other call: raises TypeError or ValueError naming the argument that is wrong.")
      .def_ro("len", &PyScatterSlice::len)
      .def_ro("src_offset", &PyScatterSlice::src_offset)
      .def_prop_ro(
          "dst", [](const PyScatterSlice& p) { return p.dst; },
          nb::for_getter(nb::sig("def dst(self, /) -> " FABRIC_DST)))
      .def_ro("dst_offset", &PyScatterSlice::dst_offset)
      .def("__repr__", [](const PyScatterSlice& p) {
        return "ScatterSlice(len=" + std::to_string(p.len) +
               ", src_offset=" + std::to_string(p.src_offset) +
               ", dst=" + nb::cast<std::string>(nb::repr(p.dst)) +
               ", dst_offset=" + std::to_string(p.dst_offset) + ")";
      });

  nb::class_<GroupSlice>(m, "GroupSlice",
                         "Slice i of a group scatter goes to member i of the group.")
      .def(nb::init<uint64_t, uint64_t, uint64_t>(), "len"_a, "src_offset"_a, "dst_offset"_a)
      .def(
          "__init__",
          [](GroupSlice* g, nb::args args, nb::kwargs kwargs) {
            auto v = check_args(
                "GroupSlice",
                {uint_arg("len", UINT64_MAX, true), uint_arg("src_offset", UINT64_MAX, true),
                 uint_arg("dst_offset", UINT64_MAX, true)},
                3, args, kwargs);
            new (g) GroupSlice{uint_value(v[0]), uint_value(v[1]), uint_value(v[2])};
          },
          "Any other call: raises TypeError or ValueError naming the argument that is wrong.")
      .def_ro("len", &GroupSlice::len)
      .def_ro("src_offset", &GroupSlice::src_offset)
      .def_ro("dst_offset", &GroupSlice::dst_offset)
      .def("__repr__", [](const GroupSlice& g) {
        return "GroupSlice(len=" + std::to_string(g.len) +
               ", src_offset=" + std::to_string(g.src_offset) +
               ", dst_offset=" + std::to_string(g.dst_offset) + ")";
      });

  nb::class_<PeerGroupHandle>(m, "PeerGroupHandle", "A peer group made by Engine.add_peer_group.")
      .def_ro("id", &PeerGroupHandle::id)
      .def_ro("size", &PeerGroupHandle::size)
      .def_ro("engine", &PeerGroupHandle::engine, "the engine that made it")
      .def("__len__", [](const PeerGroupHandle& g) { return g.size; })
      .def("__repr__", [](const PeerGroupHandle& g) {
        return "PeerGroupHandle(id=" + std::to_string(g.id) + ", size=" + std::to_string(g.size) +
               ", engine=" + std::to_string(g.engine) + ")";
      });

  nb::class_<NicStats>(m, "NicStats")
      .def_ro("writes_posted", &NicStats::writes_posted)
      .def_ro("bytes_written", &NicStats::bytes_written)
      .def_ro("sends_posted", &NicStats::sends_posted)
      .def_ro("imms_received", &NicStats::imms_received)
      .def_ro("messages_received", &NicStats::messages_received)
      .def_ro("errors", &NicStats::errors)
      .def_ro("faults_injected", &NicStats::faults_injected)
      .def_ro("imms_duplicated", &NicStats::imms_duplicated)
      .def_ro("imms_dropped", &NicStats::imms_dropped)
      .def_ro("messages_dropped", &NicStats::messages_dropped,
              "messages that arrived and could not be delivered (longer than the receive buffers)")
      .def_prop_ro(
          "nic", [](const NicStats& n) { return to_py_str(n.nic); }, "the NIC's name")
      .def_ro("worker", &NicStats::worker, "the worker (GPU) it belongs to")
      .def_ro("link_gbps", &NicStats::link_gbps,
              "link speed in Gbit/s, 0 where the provider does not say")
      .def("__repr__", [](const NicStats& n) {
        return to_py_str("NicStats(" + n.nic + ", worker=" + std::to_string(n.worker) +
                         ", writes_posted=" + std::to_string(n.writes_posted) +
                         ", bytes_written=" + std::to_string(n.bytes_written) +
                         ", imms_received=" + std::to_string(n.imms_received) +
                         ", messages_received=" + std::to_string(n.messages_received) +
                         ", errors=" + std::to_string(n.errors) + ")");
      });

  nb::class_<ImmExpectation>(m, "ImmExpectation", "A pending expect_imm_count, to cancel it.")
      .def_ro("imm", &ImmExpectation::imm)
      .def_ro("id", &ImmExpectation::id)
      .def_ro("engine", &ImmExpectation::engine, "the engine that counts it")
      .def("__repr__", [](const ImmExpectation& x) {
        return "ImmExpectation(imm=" + std::to_string(x.imm) + ", id=" + std::to_string(x.id) +
               ", engine=" + std::to_string(x.engine) + ")";
      });

  m.def(
      "single_write_imm_count",
      [](uint64_t len, size_t nic_count, bool pinned, std::optional<uint32_t> num_shards) {
        SingleWrite w;
        w.len = len;
        w.num_shards = num_shards;
        if (pinned) w.nic = 0;  // only "pinned or not" matters to the count
        return single_write_imm_count(w, nic_count);
      },
      "len"_a, "nic_count"_a, "pinned_to_one_nic"_a = false, nb::kw_only(),
      "num_shards"_a = nb::none(),
      "How many immediates a single write delivers (see docs/api.md): num_shards if given.");

  // The host's topology (include/fabric/topology.h): read-only values.
  nb::enum_<NicAffinity>(m, "NicAffinity",
                         "How close a GPU's NICs are (as NCCL names PCIe distances).")
      .value("SWITCH", NicAffinity::kSwitch, "behind the same PCIe switch as the GPU")
      .value("NUMA", NicAffinity::kNuma,
             "on the GPU's NUMA node, under another switch or root port")
      .value("SYSTEM", NicAffinity::kSystem, "on another NUMA node")
      .value("NONE", NicAffinity::kNone, "no RDMA NIC on the host");

  nb::class_<TopoNic>(m, "TopoNic", "An RDMA NIC listed under class/infiniband.")
      .def_ro("name", &TopoNic::name)
      .def_ro("pci", &TopoNic::pci)
      .def_ro("driver", &TopoNic::driver)
      .def_ro("provider", &TopoNic::provider, "what EngineConfig's provider must say to use it")
      .def_ro("domain", &TopoNic::domain,
              "the NIC entry's domain: libfabric's domain, verbs' device")
      .def_ro("numa_node", &TopoNic::numa_node)
      .def_ro("link_gbps", &TopoNic::link_gbps)
      .def_ro("active", &TopoNic::active)
      .def("__repr__", [](const TopoNic& n) {
        char gbps[32];
        std::snprintf(gbps, sizeof gbps, "%g", n.link_gbps);
        return "TopoNic(" + n.name + ", pci=" + n.pci + ", provider=" + n.provider +
               ", numa_node=" + std::to_string(n.numa_node) + ", link_gbps=" + gbps + ")";
      });

  nb::class_<TopoGpu>(m, "TopoGpu", "A GPU and the NICs and cores assigned to it.")
      .def_ro("cuda_index", &TopoGpu::cuda_index)
      .def_ro("pci", &TopoGpu::pci)
      .def_ro("numa_node", &TopoGpu::numa_node)
      .def_prop_ro(
          "nics", [](const TopoGpu& g) { return g.nics; },
          "indices into Topology.nics, in rail order")
      .def_ro("affinity", &TopoGpu::affinity)
      .def_ro("worker_cpu", &TopoGpu::worker_cpu, "-1: none known")
      .def_ro("watcher_cpu", &TopoGpu::watcher_cpu, "-1: none known")
      .def("__repr__", [](const TopoGpu& g) {
        std::string nics;
        for (size_t i : g.nics) nics += (nics.empty() ? "" : ", ") + std::to_string(i);
        return "TopoGpu(" + std::to_string(g.cuda_index) + ", pci=" + g.pci +
               ", numa_node=" + std::to_string(g.numa_node) + ", nics=[" + nics +
               "], worker_cpu=" + std::to_string(g.worker_cpu) +
               ", watcher_cpu=" + std::to_string(g.watcher_cpu) + ")";
      });

  nb::class_<TopoNumaNode>(m, "TopoNumaNode")
      .def_ro("id", &TopoNumaNode::id)
      .def_prop_ro(
          "cpus", [](const TopoNumaNode& n) { return n.cpus; }, "every logical CPU of the node")
      .def("__repr__", [](const TopoNumaNode& n) {
        return "TopoNumaNode(" + std::to_string(n.id) + ", " + std::to_string(n.cpus.size()) +
               " CPUs)";
      });

  nb::class_<Topology>(m, "Topology",
                       "GPUs, RDMA NICs and NUMA nodes of a host, as detect_topology assigns them.")
      .def_prop_ro(
          "gpus", [](const Topology& t) { return t.gpus; }, "by CUDA index (PCI order)")
      .def_prop_ro(
          "nics", [](const Topology& t) { return t.nics; }, "active RDMA NICs, by PCI address")
      .def_prop_ro("numa_nodes", [](const Topology& t) { return t.numa_nodes; })
      .def_ro("provider", &Topology::provider,
              "what every NIC speaks: 'efa', 'verbs', or '' (none)")
      .def("to_table", &Topology::to_table, "a readable table (what `fabric-bench topo` prints)")
      .def("__repr__", [](const Topology& t) {
        return "Topology(" + std::to_string(t.gpus.size()) + " GPUs, " +
               std::to_string(t.nics.size()) + " NICs, provider='" + t.provider + "')";
      });

  m.def("_begin_exit", &begin_python_exit,
        "From now on engine threads drop Python callbacks instead of taking the GIL; returns once "
        "the calls already under way have ended (fabric_lib's atexit hook, before it closes the "
        "live engines).");

  m.def(
      "remove_shm_endpoints_of", &remove_shm_endpoints_of, "pid"_a,
      "Removes the /dev/shm files that a killed process's shm endpoints left "
      "(fabric/shm_cleanup.h): only fabric-lib's, only of a pid that no longer exists in this PID "
      "namespace. Returns how many it removed. A supervisor calls it after reaping a dead worker.");

  m.def(
      "detect_topology",
      [](const std::string& sysfs_root) {
        nb::gil_scoped_release release;
        return detect_topology({.sysfs_root = sysfs_root});
      },
      "sysfs_root"_a = "/sys",
      "Reads the host's GPUs, RDMA NICs and NUMA nodes from sysfs and assigns each GPU its NICs "
      "and cores (include/fabric/topology.h). Raises FabricError when sysfs_root is not a sysfs "
      "tree.");

  nb::class_<PyEngine> engine(m, "Engine");
  engine
      .def(
          "__init__",
          [](PyEngine* self, std::optional<std::string> provider,
             std::optional<std::vector<std::string>> nics, std::optional<std::string> poll,
             std::optional<std::string> callback_poll, double transfer_timeout_s,
             size_t max_in_flight_per_nic, size_t max_message_size, std::optional<int> worker_cpu,
             bool reorder, uint64_t reorder_seed, std::optional<int> cuda_device,
             std::optional<bool> cuda_ipc, std::optional<bool> host_ipc, const Topology* topology,
             std::optional<std::vector<int>> gpus, uint16_t metrics_port, std::string metrics_address) {
            // What is left out comes from the FABRIC_* environment as in C++
            // (EngineConfig::from_env), else from the provider's defaults (engine_defaults.h).
            EngineConfig c = python_engine_config(provider, nics, cuda_device);
            // Python's engines poll adaptively unless told (FABRIC_POLL or poll=): C++'s default,
            // busy polling, would take a core per engine from every notebook and test run.
            const bool env_poll = std::getenv("FABRIC_POLL") != nullptr;
            c.worker_poll = poll       ? poll_mode(*poll)
                            : env_poll ? c.worker_poll
                                       : PollMode::kAdaptive;
            c.callback_poll = callback_poll ? poll_mode(*callback_poll)
                              : env_poll    ? c.callback_poll
                                            : PollMode::kAdaptive;
            if (!(transfer_timeout_s > 0))
              throw Error(
                  ErrorCode::kInvalidArgument,
                  "TransferEngine(transfer_timeout_s=...) must be a positive number of seconds");
            c.transfer_timeout =
                std::chrono::milliseconds(static_cast<int64_t>(transfer_timeout_s * 1000));
            c.max_in_flight_per_nic = max_in_flight_per_nic;
            c.max_message_size = max_message_size;
            c.worker_cpu = worker_cpu;
            c.reorder.enabled = reorder;
            c.reorder.seed = reorder_seed;
            if (cuda_ipc) c.cuda_ipc = *cuda_ipc;
            if (host_ipc) c.host_ipc = *host_ipc;
            c.metrics_port = metrics_port;
            c.metrics_address = std::move(metrics_address);
            // With a topology: one worker per GPU (all, or `gpus`), their NICs and cores from it;
            // the arguments above are the rest of the configuration (and the NICs where the host
            // has no RDMA NIC).
            if (topology)
              c = engine_config_for(*topology, c,
                                    gpus ? std::span<const int>(*gpus) : std::span<const int>{});
            else if (gpus)
              throw Error(ErrorCode::kInvalidArgument,
                          "Engine(gpus=...) needs topology=detect_topology()");
            new (self) PyEngine(std::move(c));
          },
          "provider"_a = nb::none(), "nics"_a = nb::none(), "poll"_a = nb::none(),
          "callback_poll"_a = nb::none(), "transfer_timeout_s"_a = 30.0,
          "max_in_flight_per_nic"_a = 64, "max_message_size"_a = 16384, "worker_cpu"_a = nb::none(),
          "reorder"_a = false, "reorder_seed"_a = 1, "cuda_device"_a = nb::none(),
          "cuda_ipc"_a = nb::none(), "host_ipc"_a = nb::none(), "topology"_a = nb::none(),
          "gpus"_a = nb::none(), "metrics_port"_a = 0, "metrics_address"_a = "127.0.0.1")
      .def("close", &PyEngine::close,
           "Ends pending work with errors and joins the engine's threads.")
      .def_prop_ro("closed", &PyEngine::closed,
                   "True after close(): every call then raises FabricError (shutdown)")
      .def(
          "main_address", [](PyEngine& e) { return e.get().main_address(); },
          "This engine's NetAddr (every worker's NICs): give it (to_bytes()) to the peers out of "
          "band.")
      .def_prop_ro(
          "nic_count", [](PyEngine& e) { return e.get().nic_count(); },
          "NICs per worker (the rail width)")
      .def_prop_ro(
          "worker_count", [](PyEngine& e) { return e.get().worker_count(); },
          "workers (GPUs served): 1 unless built from a topology")
      .def_prop_ro(
          "peer_count", nogil<PyEngine>(&TransferEngine::peer_count),
          "peers this engine holds NIC resources for (diagnostics; a round trip to each worker)")
      .def(
          "nic_stats", [](PyEngine& e) { return e.get().nic_stats(); },
          "A NicStats per NIC, every worker's in order (cuda_ipc / host_ipc entries last).")
      .def("metrics_text", nogil<PyEngine>(&TransferEngine::metrics_text),
           "The engine's metrics and its metrics sources' in the Prometheus text format 0.0.4 "
           "(docs/api.md, Metrics reference); metrics_port=N also serves them at "
           "http://metrics_address:N/metrics.");
  def_checked(
      engine, "submit_recvs",
      {uint_arg("length", UINT64_MAX, true), uint_arg("count", UINT64_MAX, true),
       callable_arg("on_recv")},
      3,
      [](PyEngine& e, size_t len, size_t count, nb::callable on_recv) {
        TransferEngine& eng = e.get();
        auto ref = std::make_shared<PyRef>(nb::borrow(on_recv));
        nb::gil_scoped_release release;  // registers on the worker and waits for it
        eng.submit_recvs(len, count, [ref](std::span<const std::byte> msg) {
          with_python([&] {
            try {
              ref->obj(nb::bytes(reinterpret_cast<const char*>(msg.data()), msg.size()));
            } catch (nb::python_error& err) {
              err.discard_as_unraisable("in a fabric_lib receive callback");
            }
          });
        });
      },
      "length"_a, "count"_a, "on_recv"_a,
      "Posts count receive buffers of length bytes (raised to max_message_size, so every message a "
      "peer may send fits), re-posted after each message; on_recv(data: bytes) runs on the "
      "callback thread with the GIL.");
  def_checked(engine, "cancel_imm_expectation",
              {object_arg("expectation", "an ImmExpectation (from expect_imm_count)",
                          is_expectation, true)},
              1, nogil<PyEngine>(&TransferEngine::cancel_imm_expectation), "expectation"_a,
              "Ends a pending expectation with a 'cancelled' error; False if it had ended.");
  def_checked(
      engine, "remove_peer",
      {object_arg("peer", "a NetAddr (the peer's main_address())", is_net_addr, true)}, 1,
      nogil<PyEngine>(&TransferEngine::remove_peer), "peer"_a,
      "Forgets a peer that left: its pending transfers end cancelled, its NIC resources go.");
  def_checked(
      engine, "reg_mr",
      {uint_arg("ptr", UINTPTR_MAX, true), uint_arg("length", UINT64_MAX, true),
       uint_arg("cuda_device", INT32_MAX, false, true),
       object_arg("imms", "an ImmReservation", is_reservation, false, true)},
      4,
      [](PyEngine& e, uintptr_t ptr, size_t len, std::optional<int> cuda_device,
         PyImmReservation* imms) {
        TransferEngine& eng = e.get();
        ImmReservation* r = imms ? &imms->get() : nullptr;
        const Device device = cuda_device ? Device::cuda(*cuda_device) : Device::host();
        nb::gil_scoped_release release;
        return r ? eng.reg_mr(reinterpret_cast<void*>(ptr), len, device, *r)
                 : eng.reg_mr(reinterpret_cast<void*>(ptr), len, device);
      },
      "ptr"_a, "length"_a, "cuda_device"_a = nb::none(), "imms"_a = nb::none(),
      "Registers raw memory (host, or CUDA device memory of cuda_device); returns (MrHandle, "
      "MrDesc). imms: the ImmReservation whose range WRITEs into it carry their immediates in.");
  engine.def(
      "reg_mrs",
      [](PyEngine& e, nb::iterable regions, PyImmReservation* imms, bool prefault) {
        TransferEngine& eng = e.get();
        const ImmReservation* r = imms ? &imms->get() : nullptr;
        std::vector<MrRequest> requests;
        for (nb::handle item : regions) {
          const size_t i = requests.size();
          nb::object t = nb::steal(PySequence_Check(item.ptr()) ? PySequence_Tuple(item.ptr()) : nullptr);
          if (!t.is_valid() || (nb::len(t) != 2 && nb::len(t) != 3)) {
            PyErr_Clear();
            throw nb::type_error(("reg_mrs: region " + std::to_string(i) +
                                  " must be a tuple (ptr, length) or (ptr, length, cuda_device)")
                                     .c_str());
          }
          nb::tuple tt = nb::borrow<nb::tuple>(t);
          std::optional<int> cuda = nb::len(tt) == 3 ? nb::cast<std::optional<int>>(tt[2]) : std::nullopt;
          requests.push_back({.ptr = reinterpret_cast<void*>(nb::cast<uintptr_t>(tt[0])),
                              .len = nb::cast<size_t>(tt[1]),
                              .device = cuda ? Device::cuda(*cuda) : Device::host(),
                              .imms = r,
                              .prefault = prefault});
        }
        nb::gil_scoped_release release;
        return eng.reg_mrs(requests);
      },
      "regions"_a, "imms"_a = nb::none(), "prefault"_a = false,
      "Registers many regions, each (ptr, length) or (ptr, length, cuda_device), in one call (one "
      "round trip per worker); returns [(MrHandle, MrDesc)] in order. All or none: a bad entry or a "
      "failure part-way registers nothing, and the error names the entry. imms: the "
      "ImmReservation of every region; prefault: populate host pages before registering.");
  def_checked(engine, "dereg_mr", {object_arg("handle", kMrHandleText, is_mr_handle, true)}, 1,
              nogil<PyEngine>(&TransferEngine::dereg_mr), "handle"_a,
              "Ends local and remote access to a region; transfers still reading it fail ('not "
              "found'), and it returns once WRITEs already with a NIC completed, so the memory may "
              "be freed then.");
  def_checked(
      engine, "submit_send",
      {object_arg("dst", "a NetAddr (the peer's main_address())", is_net_addr, true),
       object_arg("data", "bytes", is_bytes, true), on_done_arg(is_done_object)},
      3,
      [](PyEngine& e, const NetAddr& dst, nb::bytes data, nb::handle on_done) {
        TransferEngine& eng = e.get();
        OnDone d = make_on_done(on_done);
        auto bytes = std::as_bytes(std::span(data.c_str(), data.size()));
        nb::gil_scoped_release release;  // `data` stays referenced by the caller's frame
        eng.submit_send(dst, bytes, std::move(d));
      },
      "dst"_a, "data"_a, "on_done"_a = nb::none(),
      "A two-sided message (bytes, copied before return) to the engine at dst, on NIC 0; on_done "
      "at local completion. Raises FabricError (invalid argument) for a message over this engine's "
      "max_message_size or longer than dst accepts (dst.max_message).");
  def_checked(
      engine, "expect_imm_count",
      {uint_arg("imm", UINT32_MAX, true), uint_arg("count", UINT64_MAX, true),
       on_done_arg(is_done_object), timeout_arg(), uint_arg("cuda_device", INT32_MAX, false, true)},
      3,
      [](PyEngine& e, uint32_t imm, uint64_t count, nb::handle on_done,
         std::optional<double> timeout_s, std::optional<int> cuda_device) {
        TransferEngine& eng = e.get();
        OnDone d = make_on_done(on_done);
        const ExpectOptions opts = expect_options(timeout_s, cuda_device);
        nb::gil_scoped_release release;
        return eng.expect_imm_count(imm, count, std::move(d), opts);
      },
      "imm"_a, "count"_a, "on_done"_a = nb::none(), nb::kw_only(), "timeout_s"_a = nb::none(),
      "cuda_device"_a = nb::none(),
      "Calls on_done once `imm` arrived `count` times; with timeout_s it ends with a timeout error "
      "if not met by then. cuda_device: the GPU whose regions the WRITEs land in (a multi-GPU "
      "engine counts immediates per GPU). Returns an ImmExpectation for cancel_imm_expectation.");
  def_checked(
      engine, "imm_count", {uint_arg("imm", UINT32_MAX, true)}, 1,
      nogil<PyEngine>(&TransferEngine::imm_count), "imm"_a,
      "Arrivals of imm counted and not yet consumed by an expectation (diagnostics, tests).");
  def_checked(
      engine, "add_remote",
      {object_arg("desc", "an MrDesc (the peer's descriptor)", is_mr_desc, true),
       bool_arg("connect")},
      1,
      [](PyEngine& e, const MrDesc& desc, bool connect) {
        TransferEngine& eng = e.get();
        nb::gil_scoped_release release;
        RemoteMr r = eng.add_remote(desc);
        if (connect) eng.connect(r);
        return r;
      },
      "desc"_a, nb::kw_only(), "connect"_a = false,
      "Interns a remote region; the same descriptor gives the same RemoteMr until remove_remote. "
      "connect=True: also connect(), so the first transfer pays no connection set-up.");
  def_checked(
      engine, "connect", {object_arg("dst", kDstText, is_dst, true)}, 1,
      [](PyEngine& e, nb::handle dst) {
        TransferEngine& eng = e.get();
        DstRef d = dst_ref(dst, "dst");  // `dst` stays referenced by the caller's frame
        nb::gil_scoped_release release;
        eng.connect(resolve(eng, d));
      },
      nb::sig("def connect(self, dst: " FABRIC_DST ") -> None"), "dst"_a,
      "Connects to the owner of dst (a RemoteMr, or an MrDesc it interns) through every NIC now: "
      "one zero-byte WRITE without an immediate each (nothing written, nothing counted), waited "
      "for with the GIL released. The first transfer then costs what the tenth does. Raises "
      "FabricError (a gone peer) or FabricTimeoutError (after transfer_timeout_s).");
  def_checked(engine, "remove_remote",
              {object_arg("remote", "a RemoteMr (from add_remote)", is_remote_mr, true)}, 1,
              nogil<PyEngine>(&TransferEngine::remove_remote), "remote"_a,
              "Forgets an interned region: later requests naming it fail with 'not found'.");
  def_checked(
      engine, "submit_single_write",
      {uint_arg("len", UINT64_MAX, true), object_arg("src", kMrHandleText, is_mr_handle, true),
       object_arg("dst", kDstText, is_dst, true), uint_arg("src_offset", UINT64_MAX, false),
       uint_arg("dst_offset", UINT64_MAX, false), on_done_arg(is_done_object),
       uint_arg("imm", UINT32_MAX, false, true), uint_arg("nic", UINT8_MAX, false, true),
       uint_arg("num_shards", UINT32_MAX, false, true)},
      0,
      [](PyEngine& e, uint64_t len, const MrHandle& src, nb::handle dst, uint64_t src_offset,
         uint64_t dst_offset, nb::handle on_done, std::optional<uint32_t> imm,
         std::optional<uint8_t> nic, std::optional<uint32_t> num_shards) {
        TransferEngine& eng = e.get();
        DstRef d = dst_ref(dst, "dst");  // `dst` stays referenced by the caller's frame
        OnDone done = make_on_done(on_done);
        nb::gil_scoped_release release;
        SingleWrite w{.len = len,
                      .src = {src, src_offset},
                      .dst = {resolve(eng, d), dst_offset},
                      .imm = imm,
                      .nic = nic,
                      .num_shards = num_shards};
        eng.submit(w, std::move(done));
      },
      nb::sig("def submit_single_write(self, *, len: int, src: MrHandle, dst: " FABRIC_DST
              ", src_offset: int = 0, dst_offset: int = 0, on_done: " FABRIC_ON_DONE
              ", imm: int | None = None, nic: int | None = None, num_shards: int | None = None) -> "
              "None"),
      nb::kw_only(), "len"_a, "src"_a, "dst"_a.none(), "src_offset"_a = 0, "dst_offset"_a = 0,
      "on_done"_a = nb::none(), "imm"_a = nb::none(), "nic"_a = nb::none(),
      "num_shards"_a = nb::none(),
      "len bytes from src at src_offset to dst (a RemoteMr or an MrDesc) at dst_offset.");
  def_checked(
      engine, "submit_paged_writes",
      {uint_arg("page_len", UINT64_MAX, true), object_arg("src", kMrHandleText, is_mr_handle, true),
       object_arg("src_pages", kPagesText, is_pages, true),
       object_arg("dst", kDstText, is_dst, true),
       object_arg("dst_pages", kPagesText, is_pages, true), on_done_arg(is_done_object),
       uint_arg("imm", UINT32_MAX, false, true), uint_arg("nic", UINT8_MAX, false, true)},
      0,
      [](PyEngine& e, uint64_t page_len, const MrHandle& src, const PyPages& src_pages,
         nb::handle dst, const PyPages& dst_pages, nb::handle on_done, std::optional<uint32_t> imm,
         std::optional<uint8_t> nic) {
        TransferEngine& eng = e.get();
        DstRef d = dst_ref(dst, "dst");
        OnDone done = make_on_done(on_done);
        nb::gil_scoped_release release;  // the Pages stay referenced by the caller's frame
        PagedWrites w{.page_len = page_len,
                      .src = src,
                      .src_pages = src_pages.view(),
                      .dst = resolve(eng, d),
                      .dst_pages = dst_pages.view(),
                      .imm = imm,
                      .nic = nic};
        eng.submit(w, std::move(done));
      },
      nb::sig("def submit_paged_writes(self, *, page_len: int, src: MrHandle, src_pages: Pages, "
              "dst: " FABRIC_DST ", dst_pages: Pages, on_done: " FABRIC_ON_DONE
              ", imm: int | None = None, nic: int | None = None) -> None"),
      nb::kw_only(), "page_len"_a, "src"_a, "src_pages"_a, "dst"_a.none(), "dst_pages"_a,
      "on_done"_a = nb::none(), "imm"_a = nb::none(), "nic"_a = nb::none(),
      "One WRITE of page_len bytes per page: source page i to destination page i.");
  def_checked(
      engine, "submit_scatter",
      {object_arg("src", kMrHandleText, is_mr_handle, true),
       iterable_arg("slices", "ScatterSlice or (len, src_offset, dst[, dst_offset])"),
       on_done_arg(is_done_object), uint_arg("imm", UINT32_MAX, false, true),
       uint_arg("nic", UINT8_MAX, false, true)},
      0,
      [](PyEngine& e, const MrHandle& src, nb::iterable slices, nb::handle on_done,
         std::optional<uint32_t> imm, std::optional<uint8_t> nic) {
        TransferEngine& eng = e.get();
        std::vector<nb::object> keep;  // released after the GIL is taken back
        std::vector<ScatterSlice> ss;
        std::vector<DstRef> dsts;
        for (nb::handle item : slices) {
          auto [s, d] = scatter_slice(item, keep);
          ss.push_back(s);
          dsts.push_back(d);
        }
        OnDone done = make_on_done(on_done);
        nb::gil_scoped_release release;
        for (size_t i = 0; i < ss.size(); i++) ss[i].dst.mr = resolve(eng, dsts[i]);
        eng.submit(Scatter{.src = src, .slices = ss, .imm = imm, .nic = nic}, std::move(done));
      },
      nb::sig(
          "def submit_scatter(self, *, src: MrHandle, slices: collections.abc.Iterable[ScatterSlice"
          " | tuple[int, int, " FABRIC_DST "] | tuple[int, int, " FABRIC_DST
          ", int]], on_done: " FABRIC_ON_DONE
          ", imm: int | None = None, nic: int | None = None) -> None"),
      nb::kw_only(), "src"_a, "slices"_a, "on_done"_a = nb::none(), "imm"_a = nb::none(),
      "nic"_a = nb::none(),
      "One WRITE per ScatterSlice (or (len, src_offset, dst[, dst_offset]) tuple).");
  def_checked(
      engine, "add_peer_group", {iterable_arg("members", kDstText)}, 1,
      [](PyEngine& e, nb::iterable members) {
        TransferEngine& eng = e.get();
        std::vector<nb::object> keep;
        std::vector<DstRef> refs = dst_refs(members, "members", keep);
        nb::gil_scoped_release release;
        std::vector<RemoteMr> mrs = resolve_all(eng, refs);
        return eng.add_peer_group(mrs);
      },
      nb::sig("def add_peer_group(self, members: collections.abc.Iterable[" FABRIC_DST
              "]) -> PeerGroupHandle"),
      "members"_a,
      "Prebuilds the WRITEs to each member (RemoteMr or MrDesc) for group scatters and barriers.");
  def_checked(
      engine, "submit_group_scatter",
      {object_arg("group", kGroupText, is_group, true),
       object_arg("src", kMrHandleText, is_mr_handle, true),
       iterable_arg("slices", "GroupSlice or (len, src_offset, dst_offset)"),
       on_done_arg(is_done_object), uint_arg("imm", UINT32_MAX, false, true),
       uint_arg("nic", UINT8_MAX, false, true)},
      0,
      [](PyEngine& e, const PeerGroupHandle& group, const MrHandle& src, nb::iterable slices,
         nb::handle on_done, std::optional<uint32_t> imm, std::optional<uint8_t> nic) {
        TransferEngine& eng = e.get();
        std::vector<GroupSlice> gs;
        for (nb::handle item : slices) gs.push_back(group_slice(item));
        OnDone done = make_on_done(on_done);
        nb::gil_scoped_release release;
        eng.submit(GroupScatter{.group = group, .src = src, .slices = gs, .imm = imm, .nic = nic},
                   std::move(done));
      },
      nb::sig(
          "def submit_group_scatter(self, *, group: PeerGroupHandle, src: MrHandle, slices: "
          "collections.abc.Iterable[GroupSlice | tuple[int, int, int]], on_done: " FABRIC_ON_DONE
          ", imm: int | None = None, nic: int | None = None) -> None"),
      nb::kw_only(), "group"_a, "src"_a, "slices"_a, "on_done"_a = nb::none(), "imm"_a = nb::none(),
      "nic"_a = nb::none(),
      "One WRITE per member: slice i (a GroupSlice or (len, src_offset, dst_offset)) to member i.");
  def_checked(
      engine, "submit_barrier",
      {iterable_arg("dsts", kDstText), uint_arg("imm", UINT32_MAX, true),
       on_done_arg(is_done_object), uint_arg("nic", UINT8_MAX, false, true),
       uint_arg("cuda_device", INT32_MAX, false, true)},
      0,
      [](PyEngine& e, nb::iterable dsts, uint32_t imm, nb::handle on_done,
         std::optional<uint8_t> nic, std::optional<int> cuda_device) {
        TransferEngine& eng = e.get();
        std::vector<nb::object> keep;
        std::vector<DstRef> refs = dst_refs(dsts, "dsts", keep);
        OnDone done = make_on_done(on_done);
        nb::gil_scoped_release release;
        std::vector<RemoteMr> mrs = resolve_all(eng, refs);
        eng.submit(Barrier{.dsts = mrs, .imm = imm, .nic = nic, .device = gpu_or_host(cuda_device)},
                   std::move(done));
      },
      nb::sig("def submit_barrier(self, *, dsts: collections.abc.Iterable[" FABRIC_DST
              "], imm: int, on_done: " FABRIC_ON_DONE
              ", nic: int | None = None, cuda_device: int | None = None) -> None"),
      nb::kw_only(), "dsts"_a, "imm"_a, "on_done"_a = nb::none(), "nic"_a = nb::none(),
      "cuda_device"_a = nb::none(),
      "One zero-byte WRITE carrying imm to each destination (RemoteMr or MrDesc).");
  def_checked(
      engine, "submit_group_barrier",
      {object_arg("group", kGroupText, is_group, true), uint_arg("imm", UINT32_MAX, true),
       on_done_arg(is_done_object), uint_arg("nic", UINT8_MAX, false, true),
       uint_arg("cuda_device", INT32_MAX, false, true)},
      0,
      [](PyEngine& e, const PeerGroupHandle& group, uint32_t imm, nb::handle on_done,
         std::optional<uint8_t> nic, std::optional<int> cuda_device) {
        TransferEngine& eng = e.get();
        OnDone done = make_on_done(on_done);
        nb::gil_scoped_release release;
        eng.submit(
            GroupBarrier{
                .group = group, .imm = imm, .nic = nic, .device = gpu_or_host(cuda_device)},
            std::move(done));
      },
      nb::sig("def submit_group_barrier(self, *, group: PeerGroupHandle, imm: int, "
              "on_done: " FABRIC_ON_DONE
              ", nic: int | None = None, cuda_device: int | None = None) -> None"),
      nb::kw_only(), "group"_a, "imm"_a, "on_done"_a = nb::none(), "nic"_a = nb::none(),
      "cuda_device"_a = nb::none(),
      "One zero-byte WRITE carrying imm to every member of the group.");
  def_checked(engine, "discard_imm_count", {uint_arg("imm", UINT32_MAX, true)}, 1,
              nogil<PyEngine>(&TransferEngine::discard_imm_count), "imm"_a,
              "Drops the arrivals of imm counted and not consumed; returns how many.");

  bind_gpu_signals(m);
  bind_imms(m);
  bind_kv(m);
  bind_weights(m);
  bind_moe(m);
}
