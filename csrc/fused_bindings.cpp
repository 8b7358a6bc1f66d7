// realloc._C bindings of the fused pipeline schedule (fused_schedule.h). A schedule crosses as one
// list per device of (model, backward, micro-batch) tuples; model 0 is A, 1 is B.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <tuple>

#include "fused_schedule.h"

namespace py = pybind11;
using rl::fused::Order;

namespace {

using PyOrder = std::vector<std::vector<std::tuple<int, int, int>>>;

Order to_order(const PyOrder& o) {
    Order out(o.size());
    for (size_t d = 0; d < o.size(); ++d)
        for (const auto& [model, bw, mb] : o[d]) {
            if (model < 0 || model > 1 || bw < 0 || bw > 1 || mb < 0)
                throw std::invalid_argument("fused order: device " + std::to_string(d) +
                                            " has a pass that is not (model 0/1, backward 0/1, micro-batch >= 0)");
            out[d].push_back(rl::fused::encode(model, bw, mb));
        }
    return out;
}

PyOrder from_order(const Order& o) {
    PyOrder out(o.size());
    for (size_t d = 0; d < o.size(); ++d)
        for (int32_t t : o[d])
            out[d].emplace_back(rl::fused::task_model(t), rl::fused::task_backward(t), rl::fused::task_mb(t));
    return out;
}

py::dict eval_dict(const rl::fused::Eval& e) {
    py::dict d;
    d["valid"] = e.valid;
    d["makespan"] = e.makespan;
    d["peak"] = e.peak;
    d["device_peak"] = e.device_peak;
    d["device_end"] = e.device_end;
    return d;
}

rl::fused::Model model_of(int pp, int n_micro, std::vector<double> fwd, std::vector<double> bwd,
                          std::vector<double> act) {
    rl::fused::Model m;
    m.pp = pp;
    m.n_micro = n_micro;
    m.fwd = std::move(fwd);
    m.bwd = std::move(bwd);
    m.act = std::move(act);
    return m;
}

}  // namespace

void bind_fused(py::module_& m) {
    using rl::fused::Problem;
    py::class_<Problem>(m, "FusedProblem",
                        "Two models' pipelines on one set of devices, B in reverse stage order; see "
                        "csrc/fused_schedule.h")
        .def(py::init([](int n_devices, int pp_a, int n_micro_a, std::vector<double> fwd_a, std::vector<double> bwd_a,
                         std::vector<double> act_a, int pp_b, int n_micro_b, std::vector<double> fwd_b,
                         std::vector<double> bwd_b, std::vector<double> act_b, double p2p) {
                 return std::make_unique<Problem>(n_devices, model_of(pp_a, n_micro_a, fwd_a, bwd_a, act_a),
                                                  model_of(pp_b, n_micro_b, fwd_b, bwd_b, act_b), p2p);
             }),
             py::arg("n_devices"), py::arg("pp_a"), py::arg("n_micro_a"), py::arg("fwd_a"), py::arg("bwd_a"),
             py::arg("act_a"), py::arg("pp_b"), py::arg("n_micro_b"), py::arg("fwd_b"), py::arg("bwd_b"),
             py::arg("act_b"), py::arg("p2p") = 0.0)
        .def("stage", &Problem::stage, py::arg("model"), py::arg("device"))
        .def("pipe", &Problem::pipe, py::arg("model"), py::arg("device"))
        .def(
            "evaluate",
            [](const Problem& p, const PyOrder& o) {
                const Order order = to_order(o);
                p.check_order(order);
                return eval_dict(p.evaluate(order));
            },
            py::arg("order"))
        .def("alone_1f1b", [](const Problem& p, int model) { return eval_dict(p.alone_1f1b(model)); },
             py::arg("model"))
        .def("serial_1f1b", [](const Problem& p) { return from_order(p.serial_1f1b()); })
        .def(
            "greedy",
            [](const Problem& p, bool inflight_1f1b, double memory_cap, int primary, double slack, int extra_warmup) {
                if (primary < -1 || primary > 2) throw std::invalid_argument("greedy: primary must be -1, 0, 1 or 2");
                if (extra_warmup < 0) throw std::invalid_argument("greedy: extra_warmup must be >= 0");
                return from_order(p.greedy(inflight_1f1b, memory_cap, primary, slack, extra_warmup));
            },
            py::arg("inflight_1f1b") = false, py::arg("memory_cap") = std::numeric_limits<double>::infinity(),
            py::arg("primary") = -1, py::arg("slack") = 0.0, py::arg("extra_warmup") = 0)
        .def("lower_bound", &Problem::lower_bound)
        .def(
            "search",
            [](const Problem& p, int64_t iterations, int64_t memory_iterations, int restarts, uint64_t seed,
               double memory_cap, double t_start, double t_end, double tie_share, int reach) {
                rl::fused::SearchOptions opt;
                opt.iterations = iterations;
                opt.memory_iterations = memory_iterations;
                opt.restarts = restarts;
                opt.seed = seed;
                opt.memory_cap = memory_cap;
                opt.t_start = t_start;
                opt.t_end = t_end;
                opt.tie_share = tie_share;
                opt.reach = reach;
                rl::fused::SearchResult r;
                {
                    py::gil_scoped_release release;
                    r = rl::fused::search(p, opt);
                }
                py::dict d;
                d["order"] = from_order(r.order);
                d["eval"] = eval_dict(r.eval);
                d["start"] = eval_dict(r.greedy);
                d["serial"] = eval_dict(r.serial);
                d["lower_bound"] = r.lower_bound;
                d["evaluations"] = r.evaluations;
                return d;
            },
            py::arg("iterations") = 20000, py::arg("memory_iterations") = 20000, py::arg("restarts") = 2,
            py::arg("seed") = 0, py::arg("memory_cap") = std::numeric_limits<double>::infinity(),
            py::arg("t_start") = 2e-4, py::arg("t_end") = 1e-6, py::arg("tie_share") = 0.01, py::arg("reach") = 64);
}
