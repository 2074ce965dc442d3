// Python bindings of immediate namespaces (fabric/imm_range.h, TransferEngine::reserve_imms): the
// ImmReservation a user of a shared engine counts its immediates in.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <cstdio>

#include "arg_check.h"
#include "py_support.h"

namespace fabric::py {

using namespace nb::literals;

void bind_imms(nb::module_& m) {
  nb::class_<PyImmReservation> reservation(
      m, "ImmReservation",
      "A range of an engine's immediate space held by one user: regions registered under it "
      "(reg_mr(..., imms=)) count their WRITEs' immediates here, as local values 0 .. 2**bits - 1. "
      "Released by release() or when its engine closes.");
  reservation
      .def(
          "__init__",
          [](PyImmReservation* self, PyEngine& engine, std::string holder, uint8_t bits,
             std::optional<uint32_t> base) {
            new (self) PyImmReservation();
            TransferEngine& eng = engine.get();
            self->h->obj = std::make_unique<ImmReservation>(
                eng.reserve_imms({.holder = std::move(holder), .bits = bits, .base = base}));
            engine.add_dependent(self->h);
          },
          "engine"_a, "holder"_a, "bits"_a = 28, "base"_a = nb::none(), nb::keep_alive<1, 2>(),
          "Reserves 2**bits immediates (the highest free block, or at base); raises for an "
          "overlap, naming its holder.")
      .def_prop_ro("base", [](PyImmReservation& r) { return r.get().range().base; })
      .def_prop_ro("bits", [](PyImmReservation& r) { return r.get().range().bits; })
      .def_prop_ro("holder", [](PyImmReservation& r) { return r.get().holder(); })
      .def(
          "imm", [](PyImmReservation& r, uint64_t local) { return r.get().imm(local); }, "local"_a,
          "The value on the wire of a local immediate.");
  def_checked(
      reservation, "expect",
      {uint_arg("local", UINT64_MAX, true), uint_arg("count", UINT64_MAX, true),
       on_done_arg(is_done_object), timeout_arg(), uint_arg("cuda_device", INT32_MAX, false, true)},
      3,
      [](PyImmReservation& r, uint64_t local, uint64_t count, nb::handle on_done,
         std::optional<double> timeout_s, std::optional<int> cuda_device) {
        ImmReservation& imms = r.get();
        OnDone d = make_on_done(on_done);
        const ExpectOptions opts = expect_options(timeout_s, cuda_device);
        nb::gil_scoped_release release;
        return imms.expect(local, count, std::move(d), opts);
      },
      "local"_a, "count"_a, "on_done"_a = nb::none(), nb::kw_only(), "timeout_s"_a = nb::none(),
      "cuda_device"_a = nb::none(),
      "TransferEngine.expect_imm_count of a local immediate of this range.");
  def_checked(reservation, "count", {uint_arg("local", UINT64_MAX, true)}, 1,
              nogil<PyImmReservation>(&ImmReservation::count), "local"_a,
              "Arrivals of a local immediate counted and not consumed.");
  def_checked(
      reservation, "discard", {uint_arg("local", UINT64_MAX, true)}, 1,
      nogil<PyImmReservation>(&ImmReservation::discard), "local"_a,
      "Drops the arrivals of a local immediate counted and not consumed; returns how many.");
  def_checked(reservation, "cancel",
              {object_arg("expectation", "an ImmExpectation (from this reservation's expect)",
                          is_expectation, true)},
              1, nogil<PyImmReservation>(&ImmReservation::cancel), "expectation"_a);
  reservation
      // The object stays (endpoints built on it hold its address); it only stops being held.
      .def(
          "release", [](PyImmReservation& r) { r.get().release(); },
          "Gives the range back: later calls raise, regions registered under it keep their range.")
      .def_prop_ro("held", [](PyImmReservation& r) { return r.h->obj && r.h->obj->held(); })
      .def("__repr__", [](PyImmReservation& r) {
        if (!r.h->obj || !r.h->obj->held()) return std::string("ImmReservation(released)");
        const ImmReservation& x = *r.h->obj;
        char base[32];
        std::snprintf(base, sizeof base, "%#x", static_cast<unsigned>(x.range().base));
        return "ImmReservation(holder='" + x.holder() + "', base=" + base +
               ", bits=" + std::to_string(x.range().bits) + ")";
      });
}

}  // namespace fabric::py
