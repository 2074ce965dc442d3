// RL weight updates for Python (include/fabric/weights/plan.h, update.h). fabric_lib/weights.py
// builds manifests from tensors and a store; here the manifest types, the planner and the two
// executors. update() and wait() release the GIL; a Python unit hook runs under it on the thread
// that called update().
#include <nanobind/stl/optional.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "fabric/weights/update.h"
#include "py_support.h"

namespace fabric::py {

using namespace nb::literals;
using namespace fabric::weights;

namespace {

inline constexpr char kWeightsEndpoint[] = "weight-update endpoint";
template <class T>
using PyWeights = EngineBound<T, kWeightsEndpoint>;

std::chrono::milliseconds ms(double s) {
  return std::chrono::milliseconds(static_cast<int64_t>(s * 1000));
}

// A Python callable(UnitWork) as the sender's hook: the GIL is taken for the call; a Python error
// becomes a fabric::Error that fails the update.
UnitHook python_hook(nb::handle fn) {
  if (fn.is_none()) return {};
  if (!PyCallable_Check(fn.ptr()))
    throw nb::type_error("hook must be None or a callable(UnitWork)");
  auto ref = std::make_shared<PyRef>(nb::borrow(fn));
  return [ref](const UnitWork& w) {
    bool ran = with_python([&] {
      try {
        ref->obj(w);
      } catch (nb::python_error& e) {
        throw Error(ErrorCode::kInvalidArgument, std::string("the unit hook raised: ") + e.what());
      }
    });
    if (!ran) throw Error(ErrorCode::kShutdown, "Python is exiting: the unit hook was not run");
  };
}

}  // namespace

void bind_weights(nb::module_& m) {
  m.attr("UPDATE_IMM_BITS") = kUpdateImmBits;  // the immediate range a rank of an update needs
  nb::class_<TensorSpec>(m, "TensorSpec", "A tensor as a matrix: rows (dim 0) x cols (the rest).")
      .def(nb::init<>())
      .def(
          "__init__",
          [](TensorSpec* t, std::string name, uint64_t rows, uint64_t cols, uint32_t elem_bytes,
             bool fp8_blocks) {
            new (t) TensorSpec{std::move(name), rows, cols, elem_bytes, fp8_blocks};
          },
          "name"_a, "rows"_a, "cols"_a, "elem_bytes"_a = 2, "fp8_blocks"_a = false)
      .def_rw("name", &TensorSpec::name)
      .def_rw("rows", &TensorSpec::rows)
      .def_rw("cols", &TensorSpec::cols)
      .def_rw("elem_bytes", &TensorSpec::elem_bytes)
      .def_rw("fp8_blocks", &TensorSpec::fp8_blocks);
  nb::class_<Box>(m, "Box", "Rows [r0, r1) x columns [c0, c1).")
      .def(
          "__init__",
          [](Box* b, uint64_t r0, uint64_t r1, uint64_t c0, uint64_t c1) {
            new (b) Box{r0, r1, c0, c1};
          },
          "r0"_a, "r1"_a, "c0"_a, "c1"_a)
      .def_rw("r0", &Box::r0)
      .def_rw("r1", &Box::r1)
      .def_rw("c0", &Box::c0)
      .def_rw("c1", &Box::c1)
      .def("__eq__", [](const Box& a, const Box& b) { return a == b; })
      .def("__repr__", [](const Box& b) {
        return "Box(" + std::to_string(b.r0) + ", " + std::to_string(b.r1) + ", " +
               std::to_string(b.c0) + ", " + std::to_string(b.c1) + ")";
      });
  nb::class_<Placement>(m, "Placement", "Where a box of a tensor lives in one rank's arena.")
      .def(
          "__init__",
          [](Placement* p, uint32_t tensor, uint32_t rank, const Box& box, uint64_t offset,
             uint64_t row_stride) {
            new (p) Placement{tensor, rank, box, offset, row_stride};
          },
          "tensor"_a, "rank"_a, "box"_a, "offset"_a, "row_stride"_a = 0)
      .def_rw("tensor", &Placement::tensor)
      .def_rw("rank", &Placement::rank)
      .def_rw("box", &Placement::box)
      .def_rw("offset", &Placement::offset)
      .def_rw("row_stride", &Placement::row_stride);
  nb::class_<Manifest>(m, "Manifest",
                       "Both sides of a weight update (include/fabric/weights/plan.h).")
      .def(nb::init<>())
      .def_rw("tensors", &Manifest::tensors)
      .def_rw("src_ranks", &Manifest::src_ranks)
      .def_rw("dst_ranks", &Manifest::dst_ranks)
      .def_rw("sources", &Manifest::sources)
      .def_rw("dests", &Manifest::dests)
      .def_rw("dest_scales", &Manifest::dest_scales);

  nb::class_<UpdatePlan>(m, "UpdatePlan", "plan_update's result: gather, quantize and send.")
      .def_ro("staging_base", &UpdatePlan::staging_base)
      .def_ro("owner_rows", &UpdatePlan::owner_rows)
      .def_prop_ro("units", [](const UpdatePlan& p) { return p.quantize.size(); })
      .def_prop_ro(
          "send_bytes", [](const UpdatePlan& p) { return p.send.src_bytes; },
          "bytes per training rank")
      .def_prop_ro("gather_bytes", [](const UpdatePlan& p) { return p.gather.src_bytes; })
      .def_prop_ro("send_max_over_mean",
                   [](const UpdatePlan& p) { return p.send.src_max_over_mean(); })
      .def(
          "staging_bytes_for",
          [](const UpdatePlan& p, uint32_t window) { return staging_bytes_for(p, window); },
          "window"_a, "Staging bytes per training rank for `window` slots.");
  m.def(
      "weights_plan_update",
      [](const Manifest& manifest, uint64_t owner_rows) {
        nb::gil_scoped_release release;
        return std::make_shared<const UpdatePlan>(
            plan_update(manifest, {.owner_rows = owner_rows}));
      },
      "manifest"_a, "owner_rows"_a = 0,
      "The update plan (throws FabricError for a manifest it cannot cover).");
  m.def(
      "weights_predict_update",
      [](std::shared_ptr<const UpdatePlan> plan, double link_gbs, double quantize_gbs,
         double post_us, double unit_us, double write_rtt_us, bool one_device, uint32_t window,
         size_t nics) {
        UpdatePrediction p;
        {
          nb::gil_scoped_release release;
          p = predict_update(std::move(plan), {.link_gbs = link_gbs,
                                               .quantize_gbs = quantize_gbs,
                                               .post_us = post_us,
                                               .unit_us = unit_us,
                                               .write_rtt_us = write_rtt_us,
                                               .one_device = one_device,
                                               .window = window,
                                               .nics = nics});
        }
        nb::dict d;
        d["predicted_ms"] = p.predicted_ms;
        d["lower_bound_ms"] = p.lower_bound_ms;
        d["link_ms"] = p.link_ms;
        d["quantize_ms"] = p.quantize_ms;
        d["post_ms"] = p.post_ms;
        d["fill_ms"] = p.fill_ms;
        d["chain_ms"] = p.chain_ms;
        d["busiest_bytes"] = p.busiest_bytes;
        d["requests_max"] = p.requests_max;
        return d;
      },
      "plan"_a, nb::kw_only(), "link_gbs"_a, "quantize_gbs"_a = 0.0, "post_us"_a = 0.0,
      "unit_us"_a = 0.0, "write_rtt_us"_a = 0.0, "one_device"_a = false, "window"_a = 2,
      "nics"_a = 1, "The executor's cost model (include/fabric/weights/update.h, predict_update).");
  m.def("weights_check_update", nogil(&check_update), "manifest"_a, "plan"_a,
        "\"\" or what is wrong with the plan.");

  nb::class_<Copy>(m, "WeightsCopy",
                   "rows of row_bytes from src_offset to dst_offset at their strides.")
      .def_ro("rows", &Copy::rows)
      .def_ro("row_bytes", &Copy::row_bytes)
      .def_ro("src_offset", &Copy::src_offset)
      .def_ro("src_stride", &Copy::src_stride)
      .def_ro("dst_offset", &Copy::dst_offset)
      .def_ro("dst_stride", &Copy::dst_stride);
  nb::class_<UnitWork>(m, "UnitWork",
                       "One unit a training rank copies and quantizes (offsets into its arena).")
      .def_prop_ro("tensor", [](const UnitWork& w) { return w.task.tensor; })
      .def_prop_ro("r0", [](const UnitWork& w) { return w.task.r0; })
      .def_prop_ro("r1", [](const UnitWork& w) { return w.task.r1; })
      .def_ro("cols", &UnitWork::cols)
      .def_prop_ro("in_offset", [](const UnitWork& w) { return w.task.in_offset; })
      .def_prop_ro(
          "in_stride", [](const UnitWork& w) { return w.task.in_stride; }, "bytes")
      .def_prop_ro("out_offset", [](const UnitWork& w) { return w.task.out_offset; })
      .def_prop_ro("scale_offset", [](const UnitWork& w) { return w.task.scale_offset; })
      .def_ro("local_copies", &UnitWork::local_copies);

  nb::class_<PyWeights<WeightSender>>(
      m, "WeightSender", "A training rank's executor (include/fabric/weights/update.h).")
      .def(
          "__init__",
          [](PyWeights<WeightSender>* self, PyEngine& engine,
             std::shared_ptr<const UpdatePlan> plan, uint32_t rank, MrHandle arena,
             uintptr_t arena_ptr, std::vector<MrDesc> train_arenas,
             std::vector<std::vector<MrDesc>> dest_arenas, PyImmReservation& imms, uint32_t window,
             double timeout_s, nb::handle hook, bool cuda_hook, bool trace) {
            new (self) PyWeights<WeightSender>();
            TransferEngine& eng = engine.get();
            auto* base = reinterpret_cast<std::byte*>(arena_ptr);
            if (cuda_hook && !hook.is_none())
              throw nb::value_error("give a hook or cuda_hook=True, not both");
            WeightSenderConfig cfg{.plan = std::move(plan),
                                   .rank = rank,
                                   .arena = arena,
                                   .arena_ptr = cuda_hook ? nullptr : base,
                                   .train_arenas = std::move(train_arenas),
                                   .dest_arenas = std::move(dest_arenas),
                                   .window = window,
                                   .timeout = ms(timeout_s),
                                   .hook = cuda_hook ? cuda_unit_hook(base) : python_hook(hook),
                                   .trace = trace,
                                   .imms = &imms.get()};
            {
              nb::gil_scoped_release release;
              self->h->obj = std::make_unique<WeightSender>(eng, std::move(cfg));
            }
            engine.add_dependent(self->h);
          },
          "engine"_a, "plan"_a, nb::kw_only(), "rank"_a, "arena"_a, "arena_ptr"_a, "train_arenas"_a,
          "dest_arenas"_a, "imms"_a, "window"_a = 2, "timeout_s"_a = 60.0, "hook"_a = nb::none(),
          "cuda_hook"_a = false, "trace"_a = false, nb::keep_alive<1, 2>(), nb::keep_alive<1, 9>(),
          "imms: the ImmReservation the arena was registered under; arena_ptr: the arena's address "
          "(a device pointer with cuda_hook=True: the library's CUDA unit hook); hook: a Python "
          "callable(UnitWork) instead; trace: update() also returns a timeline per unit.")
      .def(
          "update",
          [](PyWeights<WeightSender>& s, uint64_t step) {
            WeightSender& tx = s.get();
            UpdateTimes t;
            {
              nb::gil_scoped_release release;
              t = tx.update(step);
            }
            nb::dict d;
            d["total_ms"] = t.total_ms;
            d["gather_wait_ms"] = t.gather_wait_ms;
            d["quantize_ms"] = t.quantize_ms;
            d["ready_wait_ms"] = t.ready_wait_ms;
            d["drain_ms"] = t.drain_ms;
            d["post_ms"] = t.post_ms;
            d["writes"] = t.writes;
            d["requests"] = t.requests;
            d["units_quantized"] = t.units_quantized;
            d["bytes"] = t.bytes;
            if (!t.units.empty()) {
              nb::list units;
              for (const UnitTrace& u : t.units)
                units.append(
                    nb::make_tuple(u.unit, u.input_ms, u.start_ms, u.quantized_ms, u.posted_ms));
              d["units"] = units;  // (unit, input_ms, start_ms, quantized_ms, posted_ms)
            }
            return d;
          },
          "step"_a,
          "Runs one step; returns where its time went. Raises FabricError (a timeout names what it "
          "waited for).")
      .def("close", [](PyWeights<WeightSender>& s) { s.h->close(); });

  nb::class_<PyWeights<WeightReceiver>>(
      m, "WeightReceiver", "An inference rank's side (include/fabric/weights/update.h).")
      .def(
          "__init__",
          [](PyWeights<WeightReceiver>* self, PyEngine& engine,
             std::shared_ptr<const UpdatePlan> plan, uint32_t rank,
             std::vector<MrDesc> train_arenas, uint32_t sets, PyImmReservation& imms) {
            new (self) PyWeights<WeightReceiver>();
            TransferEngine& eng = engine.get();
            WeightReceiverConfig cfg{.plan = std::move(plan),
                                     .rank = rank,
                                     .train_arenas = std::move(train_arenas),
                                     .sets = sets,
                                     .imms = &imms.get()};
            {
              nb::gil_scoped_release release;
              self->h->obj = std::make_unique<WeightReceiver>(eng, std::move(cfg));
            }
            engine.add_dependent(self->h);
          },
          "engine"_a, "plan"_a, nb::kw_only(), "rank"_a, "train_arenas"_a, "sets"_a = 1, "imms"_a,
          nb::keep_alive<1, 2>(), nb::keep_alive<1, 7>(),
          "imms: the ImmReservation this rank's weight arenas were registered under.")
      .def("ready", nogil<PyWeights<WeightReceiver>>(&WeightReceiver::ready), "step"_a,
           "Buffer set step % sets may be written.")
      .def(
          "wait_update",
          [](PyWeights<WeightReceiver>& r, uint64_t step, double timeout_s) {
            WeightReceiver& rx = r.get();
            nb::gil_scoped_release release;
            rx.wait_update(step, ms(timeout_s));
          },
          "step"_a, "timeout_s"_a = 60.0,
          "Returns when the step has landed; a timeout names the missing training ranks.")
      .def("set_sources", nogil<PyWeights<WeightReceiver>>(&WeightReceiver::set_sources),
           "train_arenas"_a)
      .def_prop_ro("expected_writes",
                   [](PyWeights<WeightReceiver>& r) { return r.get().expected_writes(); })
      .def("close", [](PyWeights<WeightReceiver>& r) { r.h->close(); });
}

}  // namespace fabric::py
