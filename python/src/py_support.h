// What the binding files share: Python objects captured by the engine, completion objects, and the
// engine as Python holds it.
#pragma once

#include <nanobind/nanobind.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <optional>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "fabric/fabric.h"
#include "py_exit.h"
#include "py_wait.h"

namespace fabric::py {

namespace nb = nanobind;

// Runs f without the GIL: released if this thread holds it (destructors that join engine threads,
// which may need the GIL to finish a callback), as is otherwise.
template <class F>
void without_gil(F&& f) {
  if (PyGILState_Check()) {
    nb::gil_scoped_release release;
    f();
  } else {
    f();
  }
}

// Something built on an engine that must be released before the engine closes.
struct Closable {
  virtual ~Closable() = default;
  virtual void close() = 0;
};

// A Python object captured by the engine. Its reference is dropped with the GIL held: by the
// callback that used it (OnDone callables fire once), or here, taking the GIL, by whoever destroys
// the capture (a rejected submit's caller; the closing thread for receive callbacks). Never by the
// worker: it only moves callables to the callback thread and never destroys a non-empty one.
// Once Python is exiting the reference is leaked on purpose: the GIL may not be taken then (see
// with_python), and the process is about to free everything anyway.
struct PyRef {
  nb::object obj;
  explicit PyRef(nb::object o) : obj(std::move(o)) {}
  ~PyRef() {
    if (!obj.is_valid()) return;
    if (python_exiting()) {
      obj.release();
      return;
    }
    nb::gil_scoped_acquire gil;
    obj = nb::object();
  }
};

// Completion state set by the worker itself. The atomics live in C++-allocated storage shared with
// the engine through OnDone::keep_alive, so the worker's drop of its reference is a plain C++
// release. (Keeping the Python object alive instead, through nanobind's shared_ptr caster, makes
// the worker take the GIL to drop it: every completion would wait for whichever Python thread
// holds the GIL, stalling every NIC.)
// A flag is one-shot: handed to one operation at a time, and refused once it has fired until
// reset(). `armed` is true while an operation's OnDone holds the flag (an Arm, its keep-alive): it
// turns false when the OnDone lets go, fired or not (a submit that was refused), so a flag still
// in flight is told from one nobody holds.
struct DoneFlag {
  struct State {
    std::atomic<int> value{kDonePending};
    std::atomic<bool> armed{false};
    DoneStatus status;  // how it failed
  };
  struct Arm {
    std::shared_ptr<State> state;
    Arm() = default;
    Arm(const Arm&) = delete;
    Arm& operator=(const Arm&) = delete;
    ~Arm() {
      if (state) state->armed.store(false);
    }
  };
  std::shared_ptr<State> state = std::make_shared<State>();
  bool in_flight() const { return state->armed.load() && state->value.load() == kDonePending; }
};
// None while pending; the Status it ended with (the failure's code and message) after.
inline std::optional<Status> flag_status(const DoneFlag& f) {
  const int v = f.state->value.load(std::memory_order_acquire);
  if (v == kDonePending) return std::nullopt;
  if (v == kDoneSucceeded) return Status::ok_status();
  if (auto failed = f.state->status.first_failure()) return failed;
  return Status(ErrorCode::kProvider, "failed (no message recorded)");
}

struct DoneCounter {
  struct Counts {
    std::atomic<uint64_t> done{0}, failed{0};
    DoneStatus status;  // the first failure
  };
  std::shared_ptr<Counts> counts = std::make_shared<Counts>();
};

// A str for text that may not be UTF-8 (provider messages): undecodable bytes become \xNN escapes,
// so reading a message never raises UnicodeDecodeError.
inline nb::str to_py_str(std::string_view s) {
  PyObject* o =
      PyUnicode_DecodeUTF8(s.data(), static_cast<Py_ssize_t>(s.size()), "backslashreplace");
  if (!o) throw nb::python_error();
  return nb::steal<nb::str>(o);
}

// The exception types for fabric::Error, set once by the module (bindings.cpp): FabricError, and
// FabricTimeoutError for code kTimeout (a subclass of FabricError and of TimeoutError).
inline PyObject*& fabric_error_type() {
  static PyObject* t = nullptr;
  return t;
}
inline PyObject*& fabric_timeout_type() {
  static PyObject* t = nullptr;
  return t;
}
inline void set_error_types(PyObject* error, PyObject* timeout) {
  fabric_error_type() = error;
  fabric_timeout_type() = timeout;
}

// The exception object for an error: its message (undecodable bytes escaped) and `.code`.
inline PyObject* make_fabric_error(ErrorCode code, std::string_view message) {
  PyObject* type = code == ErrorCode::kTimeout && fabric_timeout_type() ? fabric_timeout_type()
                                                                        : fabric_error_type();
  PyObject* msg = PyUnicode_DecodeUTF8(message.data(), static_cast<Py_ssize_t>(message.size()),
                                       "backslashreplace");
  if (!msg) return nullptr;
  PyObject* exc = PyObject_CallOneArg(type, msg);
  Py_DECREF(msg);
  if (!exc) return nullptr;
  const std::string_view name = to_string(code);
  PyObject* code_str =
      PyUnicode_FromStringAndSize(name.data(), static_cast<Py_ssize_t>(name.size()));
  if (!code_str || PyObject_SetAttrString(exc, "code", code_str) != 0) {
    Py_XDECREF(code_str);
    Py_DECREF(exc);
    return nullptr;
  }
  Py_DECREF(code_str);
  return exc;
}

// Raises it (the exception translator's half; `fallback` is the type nanobind registered).
inline void set_fabric_error(PyObject* fallback, ErrorCode code, std::string_view message) {
  if (!fabric_error_type()) fabric_error_type() = fallback;
  PyObject* exc = make_fabric_error(code, message);
  if (!exc) return;  // a Python error is set already
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc)), exc);
  Py_DECREF(exc);
}

// The exception a failed Status stands for (for awaitables and waits that raise it later).
inline nb::object error_of(const Status& s) {
  PyObject* exc = make_fabric_error(s.code(), s.message());
  if (!exc) throw nb::python_error();
  return nb::steal(exc);
}

// "ok", or "<code>: <message>" (the message of a thrown Error already starts with its code).
inline std::string status_text(const Status& s) {
  if (s.ok()) return "ok";
  const std::string code(to_string(s.code()));
  return s.message().rfind(code, 0) == 0 ? s.message() : code + ": " + s.message();
}

// Handles hash by all their fields: the same slot of two engines are different handles.
inline uint64_t handle_hash(uint32_t slot, uint32_t generation, uint32_t engine) {
  return ((uint64_t{slot} << 32) | generation) ^ (uint64_t{engine} * 0x9E3779B97F4A7C15ull);
}

// The objects make_on_done takes besides None and callables, and an expectation's handle: the
// type checks of checked bindings (arg_check.h).
inline bool is_done_object(nb::handle h) {
  return nb::isinstance<DoneFlag>(h) || nb::isinstance<DoneCounter>(h) ||
         nb::isinstance<GpuCounter>(h);
}
inline bool is_expectation(nb::handle h) { return nb::isinstance<ImmExpectation>(h); }

// None, a DoneFlag, a DoneCounter, a GpuCounter (counts successes), or a callable taking a Status.
inline OnDone make_on_done(nb::handle on_done) {
  if (on_done.is_none()) return OnDone::none();
  if (nb::isinstance<DoneFlag>(on_done)) {
    DoneFlag& flag = nb::cast<DoneFlag&>(on_done);
    if (flag.in_flight())
      throw Error(ErrorCode::kInvalidArgument,
                  "on_done: this DoneFlag is still waiting for the operation it was given to; a "
                  "flag serves one operation at a time (use a DoneCounter to count several)");
    if (flag.state->value.load() != kDonePending)
      throw Error(ErrorCode::kInvalidArgument,
                  "on_done: this DoneFlag already fired (a flag is one-shot): call flag.reset() "
                  "before giving it to another operation, or use a new DoneFlag");
    auto arm = std::make_shared<DoneFlag::Arm>();  // built in place: a temporary Arm would disarm
    arm->state = flag.state;
    flag.state->armed.store(true);
    OnDone d = OnDone::flag(&flag.state->value, &flag.state->status);
    return std::move(d).keep_alive(std::move(arm));
  }
  if (nb::isinstance<DoneCounter>(on_done)) {
    std::shared_ptr<DoneCounter::Counts> c = nb::cast<DoneCounter&>(on_done).counts;
    OnDone d = OnDone::counter(&c->done, &c->failed, &c->status);
    return std::move(d).keep_alive(std::move(c));
  }
  if (nb::isinstance<GpuCounter>(on_done))
    return OnDone::counter(nb::cast<const GpuCounter&>(on_done).host);
  if (!PyCallable_Check(on_done.ptr()))
    throw nb::type_error(
        "on_done must be None, a DoneFlag, a DoneCounter, a GpuCounter or a callable(status)");
  auto ref = std::make_shared<PyRef>(nb::borrow(on_done));
  return OnDone::callback([ref](const Status& status) {
    with_python([&] {
      try {
        ref->obj(status);
      } catch (nb::python_error& e) {
        e.discard_as_unraisable("in a fabric_lib completion callback");
      }
      ref->obj = nb::object();  // it fires once: release the callable now, under this GIL
    });
  });
}

// The options of expect_imm_count and ImmReservation.expect from their keyword arguments.
inline ExpectOptions expect_options(std::optional<double> timeout_s,
                                    std::optional<int> cuda_device) {
  ExpectOptions opts;
  if (timeout_s) opts.timeout = std::chrono::milliseconds(static_cast<int64_t>(*timeout_s * 1000));
  if (cuda_device) opts.device = Device::cuda(*cuda_device);
  return opts;
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

  // Objects built on the engine (KV endpoints) that must go before it: closed first, in reverse.
  void add_dependent(std::weak_ptr<Closable> d) { dependents_.push_back(std::move(d)); }

  // Held by a wait on one of the engine's words (wait_watcher, wait_counter), which runs without
  // the GIL: the words live in the engine's memory, so close() first ends such waits (stopping()
  // turns true) and waits for them to leave. Taken, then `closing_` read, both seq_cst against
  // close()'s store then read: a wait that starts as the engine closes sees one or the other.
  class Wait {
   public:
    explicit Wait(PyEngine& e) : e_(e) {
      e_.waits_.fetch_add(1, std::memory_order_seq_cst);
      if (e_.closing_.load(std::memory_order_seq_cst) || !e_.engine_) {
        e_.waits_.fetch_sub(1, std::memory_order_seq_cst);
        throw Error(ErrorCode::kShutdown, "the engine is closed");
      }
    }
    ~Wait() { e_.waits_.fetch_sub(1, std::memory_order_seq_cst); }
    Wait(const Wait&) = delete;
    Wait& operator=(const Wait&) = delete;
    bool stopping() const { return e_.closing_.load(std::memory_order_relaxed); }

   private:
    PyEngine& e_;
  };

  void close() {
    if (!engine_) return;
    closing_.store(true, std::memory_order_seq_cst);
    // The waits see `closing_` within one check and return (they need the GIL to raise).
    without_gil([&] {
      while (waits_.load(std::memory_order_seq_cst) != 0)
        std::this_thread::sleep_for(std::chrono::microseconds(50));
    });
    for (auto it = dependents_.rbegin(); it != dependents_.rend(); ++it)
      if (auto d = it->lock()) d->close();
    dependents_.clear();
    without_gil([&] { engine_.reset(); });
  }
  TransferEngine& get() {
    if (!engine_) throw Error(ErrorCode::kShutdown, "the engine is closed");
    return *engine_;
  }
  bool closed() const { return !engine_; }

 private:
  std::unique_ptr<TransferEngine> engine_;
  std::vector<std::weak_ptr<Closable>> dependents_;
  std::atomic<int> waits_{0};
  std::atomic<bool> closing_{false};
};

// An object built on an engine (KV and weight-update endpoints), closed with it: it deregisters
// its memory before the engine goes. `what` names it in the error a call after close raises.
template <class T, const char* what>
struct EngineBound {
  struct Holder : Closable {
    std::unique_ptr<T> obj;
    void close() override {
      without_gil([&] { obj.reset(); });
    }
  };
  std::shared_ptr<Holder> h = std::make_shared<Holder>();
  T& get() {
    if (!h->obj)
      throw Error(ErrorCode::kShutdown, std::string("the engine of this ") + what + " is closed");
    return *h->obj;
  }
};

// The binding of a call that only looks up its object, releases the GIL and forwards:
// nogil<Self>(&C::method) for a method of the C that Self holds (PyEngine, an EngineBound), whose
// get() runs first with the GIL (a closed one raises FabricError); nogil(&function) for a free
// function. nanobind converts the arguments to the function's own parameter types before the call
// and the result after it, both under the GIL, so nothing Python is touched while it is released
// (as with nb::call_guard<nb::gil_scoped_release>, which cannot reach through get()). The Python
// signature is the function's parameter types with the .def's argument names.
template <class Self, class C, class R, class... Args, class Method>
auto nogil_method(Method method) {
  return [method](Self& self, Args... args) -> R {
    C& obj = self.get();
    nb::gil_scoped_release release;
    return (obj.*method)(std::forward<Args>(args)...);
  };
}
template <class Self, class R, class C, class... Args>
auto nogil(R (C::*method)(Args...)) {
  return nogil_method<Self, C, R, Args...>(method);
}
template <class Self, class R, class C, class... Args>
auto nogil(R (C::*method)(Args...) const) {
  return nogil_method<Self, C, R, Args...>(method);
}
template <class R, class... Args>
auto nogil(R (*function)(Args...)) {
  return [function](Args... args) -> R {
    nb::gil_scoped_release release;
    return function(std::forward<Args>(args)...);
  };
}

inline constexpr char kImmReservationName[] = "immediate reservation";
using PyImmReservation = EngineBound<ImmReservation, kImmReservationName>;

void bind_imms(nb::module_& m);         // imm_bindings.cpp
void bind_kv(nb::module_& m);           // kv_bindings.cpp
void bind_weights(nb::module_& m);      // weights_bindings.cpp
void bind_gpu_signals(nb::module_& m);  // gpu_signal_bindings.cpp
void bind_moe(nb::module_& m);          // moe_bindings.cpp

}  // namespace fabric::py
