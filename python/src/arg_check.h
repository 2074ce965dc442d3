// When a call's arguments do not fit its binding, nanobind raises "incompatible function
// arguments" with the whole signature. A checked binding adds a second overload that takes
// anything (tried only after the real one failed) and says which argument is wrong and what it
// must be; arguments that are all acceptable after Python's own conversions (numpy integers,
// __index__) are forwarded to the real binding, kept under a private name, so nothing that worked
// stops working.
#pragma once

#include <nanobind/nanobind.h>

#include <cstdint>
#include <deque>
#include <vector>
#include <string>
#include <tuple>
#include <type_traits>

namespace fabric::py {

namespace nb = nanobind;

// What an argument must be.
enum class ArgKind {
  kUInt,      // an int in [0, max]
  kObject,    // an instance of one of `types` (Python names, for the message), checked by `is`
  kOnDone,    // None, DoneFlag, DoneCounter, GpuCounter or a callable
  kIterable,  // any iterable
  kNumber,    // a float or int >= 0 (seconds)
  kBool,      // True or False
  kCallable,  // anything callable
};

struct ArgSpec {
  const char* name;
  ArgKind kind;
  bool required = false;
  bool none_ok = false;         // None accepted (an optional argument)
  uint64_t max = UINT64_MAX;    // kUInt: the largest value
  const char* what = "";        // kObject: "an MrHandle (from reg_mr or register_tensor)"
  bool (*is)(nb::handle) = nullptr;  // kObject: the type check
};

inline ArgSpec uint_arg(const char* name, uint64_t max, bool required, bool none_ok = false) {
  return {name, ArgKind::kUInt, required, none_ok, max, "", nullptr};
}
inline ArgSpec object_arg(const char* name, const char* what, bool (*is)(nb::handle), bool required,
                          bool none_ok = false) {
  return {name, ArgKind::kObject, required, none_ok, UINT64_MAX, what, is};
}
inline ArgSpec on_done_arg(bool (*is)(nb::handle) = nullptr) {
  return {"on_done", ArgKind::kOnDone, false, true, 0, "", is};
}
inline ArgSpec callable_arg(const char* name) { return {name, ArgKind::kCallable, true, false, 0, "", nullptr}; }
inline ArgSpec bool_arg(const char* name) { return {name, ArgKind::kBool, false, false, 0, "", nullptr}; }
inline ArgSpec timeout_arg() { return {"timeout_s", ArgKind::kNumber, false, true, 0, "", nullptr}; }
inline ArgSpec iterable_arg(const char* name, const char* what) {
  return {name, ArgKind::kIterable, true, false, 0, what, nullptr};
}

// "[0, 2**32)" for the common maxima, else "[0, max]".
inline std::string range_text(uint64_t max) {
  if (max == UINT64_MAX) return "[0, 2**64)";
  if (max == UINT32_MAX) return "[0, 2**32)";
  if (max == UINT8_MAX) return "[0, 255]";
  return "[0, " + std::to_string(max) + "]";
}

inline std::string type_of(nb::handle h) { return nb::type_name(h.type()).c_str(); }

// What is wrong with one value ("" when nothing), and whether it is a wrong value of the right
// type (ValueError) rather than a wrong type (TypeError).
struct Problem {
  std::string text;
  bool value_error = false;
};

inline std::string int_text(nb::handle i) { return nb::cast<std::string>(nb::str(i)); }

inline Problem check_value(const ArgSpec& a, nb::handle v) {
  const std::string name = a.name;
  if (v.is_none()) return {a.none_ok ? "" : name + " must not be None", false};
  switch (a.kind) {
    case ArgKind::kUInt: {
      if (PyBool_Check(v.ptr()) || PyFloat_Check(v.ptr()) || !PyIndex_Check(v.ptr()))
        return {name + " must be an int in " + range_text(a.max) + ", got " + type_of(v), false};
      nb::object i = nb::steal(PyNumber_Index(v.ptr()));
      if (!i.is_valid()) {
        PyErr_Clear();
        return {name + " must be an int", false};
      }
      int overflow = 0;
      const long long signed_value = PyLong_AsLongLongAndOverflow(i.ptr(), &overflow);
      bool fits = overflow == 0 ? signed_value >= 0 && static_cast<uint64_t>(signed_value) <= a.max : overflow > 0;
      if (fits && overflow > 0) {
        const unsigned long long u = PyLong_AsUnsignedLongLong(i.ptr());
        fits = !PyErr_Occurred() && u <= a.max;
        PyErr_Clear();
      }
      if (fits) return {};
      return {name + " must be in " + range_text(a.max) + ", got " + int_text(i), true};
    }
    case ArgKind::kNumber: {
      if (PyBool_Check(v.ptr()) || !PyNumber_Check(v.ptr()))
        return {name + " must be a number of seconds (or None), got " + type_of(v), false};
      const double d = PyFloat_AsDouble(v.ptr());
      if (PyErr_Occurred()) {
        PyErr_Clear();
        return {name + " must be a number of seconds", false};
      }
      if (!(d >= 0)) return {name + " must be >= 0 seconds, got " + std::to_string(d), true};
      return {};
    }
    case ArgKind::kObject:
      return {a.is(v) ? "" : name + " must be " + a.what + ", got " + type_of(v), false};
    case ArgKind::kCallable:
      return {PyCallable_Check(v.ptr()) ? "" : name + " must be callable, got " + type_of(v), false};
    case ArgKind::kBool:
      return {PyBool_Check(v.ptr()) ? "" : name + " must be True or False, got " + type_of(v), false};
    case ArgKind::kOnDone:
      if (PyCallable_Check(v.ptr()) || a.is == nullptr || a.is(v)) return {};
      return {name + " must be None, a DoneFlag, a DoneCounter, a GpuCounter or a callable(status), got " +
                  type_of(v),
              false};
    case ArgKind::kIterable: {
      nb::object it = nb::steal(PyObject_GetIter(v.ptr()));
      if (it.is_valid()) return {};
      PyErr_Clear();
      return {name + " must be an iterable of " + a.what + ", got " + type_of(v), false};
    }
  }
  return {};
}

[[noreturn]] inline void fail(const std::string& msg, bool value_error) {
  if (value_error) throw nb::value_error(msg.c_str());
  throw nb::type_error(msg.c_str());
}

// Raises TypeError or ValueError naming the first wrong argument of `fn(args, kwargs)`; returns
// when every argument is acceptable, with the values by spec position (an invalid handle where an
// optional argument was not given). `positional`: how many leading arguments may be positional
// (the rest are keyword-only).
inline std::vector<nb::handle> check_args(const char* fn, const std::vector<ArgSpec>& spec, size_t positional,
                                          const nb::args& args, const nb::kwargs& kwargs) {
  std::vector<nb::handle> values(spec.size());
  const std::string f = std::string(fn) + "()";
  std::string names;
  for (const ArgSpec& a : spec) names += (names.empty() ? "" : ", ") + std::string(a.name);
  if (args.size() > positional)
    fail(f + " takes " +
             (positional ? "at most " + std::to_string(positional) + " positional arguments"
                         : std::string("keyword arguments only")) +
             ", got " + std::to_string(args.size()) + " positional: name them (" + names + ")",
         false);
  for (auto [k, v] : kwargs) {
    const std::string key = nb::cast<std::string>(nb::str(k));
    bool known = false;
    for (const ArgSpec& a : spec) known |= key == a.name;
    if (!known) fail(f + " got an unknown argument '" + key + "' (it takes " + names + ")", false);
  }
  for (size_t i = 0; i < spec.size(); i++) {
    const ArgSpec& a = spec[i];
    nb::handle v;
    if (i < args.size()) v = args[i];
    if (kwargs.contains(a.name)) {
      if (v.is_valid()) fail(f + " got " + a.name + " twice (by position and by name)", false);
      v = kwargs[a.name];
    }
    if (!v.is_valid()) {
      if (a.required) fail(f + " is missing the argument " + a.name + " (it takes " + names + ")", false);
      continue;
    }
    Problem p = check_value(a, v);
    if (!p.text.empty()) fail(f + ": " + p.text, p.value_error);
    values[i] = v;
  }
  return values;
}

// An argument check_args accepted as kUInt, converted (numpy integers, __index__); `otherwise`
// where it was not given or is None.
inline uint64_t uint_value(nb::handle v, uint64_t otherwise = 0) {
  if (!v.is_valid() || v.is_none()) return otherwise;
  nb::object i = nb::steal(PyNumber_Index(v.ptr()));
  if (!i.is_valid()) throw nb::python_error();
  return nb::cast<uint64_t>(i);
}

// "_name": where a checked binding keeps the real one, for the catch-all overload to forward to.
inline const char* private_name_of(const char* name) {
  static std::deque<std::string> names;  // nanobind keeps the name pointers
  return names.emplace_back(std::string("_") + name).c_str();
}

// Binds `impl` as `name` (and as `_name`, for the forward below), then the overload that
// diagnoses a call the first did not take.
template <class Class, class Impl, class... Extra>
void def_checked(Class& cls, const char* name, std::vector<ArgSpec> spec, size_t positional, Impl&& impl,
                 const Extra&... extra) {
  const char* private_name = private_name_of(name);
  // Without its nb::sig, whose name would make it another overload of the public one.
  auto kept = std::tuple_cat([&]() {
    if constexpr (std::is_same_v<Extra, nb::sig>) return std::tuple<>();
    else return std::tuple<const Extra&>(extra);
  }()...);
  std::apply([&](const auto&... e) { cls.def(private_name, impl, e...); }, kept);
  cls.def(name, std::forward<Impl>(impl), extra...);
  cls.def(name, [name, private_name, spec = std::move(spec), positional](nb::handle self, nb::args args,
                                                                        nb::kwargs kwargs) -> nb::object {
    check_args(name, spec, positional, args, kwargs);
    // Every argument is acceptable once converted (numpy integers and the like): the real binding,
    // which tries conversions on its own.
    return self.attr(private_name)(*args, **kwargs);
  }, "Any other call: raises TypeError or ValueError naming the argument that is wrong and what it must be.");
}

// def_checked for a module-level function: `impl` is bound as `name` and `_name`, then the
// overload that diagnoses a call the first did not take.
template <class Impl, class... Extra>
void def_checked_fn(nb::module_& m, const char* name, std::vector<ArgSpec> spec, size_t positional, Impl&& impl,
                    const Extra&... extra) {
  const char* private_name = private_name_of(name);
  m.def(private_name, impl, extra...);
  m.def(name, std::forward<Impl>(impl), extra...);
  m.def(name, [m, private_name, name, spec = std::move(spec), positional](nb::args args, nb::kwargs kwargs) {
    check_args(name, spec, positional, args, kwargs);
    return m.attr(private_name)(*args, **kwargs);
  }, "Any other call: raises TypeError or ValueError naming the argument that is wrong and what it must be.");
}

}  // namespace fabric::py
