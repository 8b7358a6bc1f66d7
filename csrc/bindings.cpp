// pybind11 entry point of realloc._C: the plan simulator and the MCMC search.
// std::invalid_argument surfaces in Python as ValueError.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <optional>

#include "mcmc.h"
#include "problem.h"
#include "simulator.h"

namespace py = pybind11;

void bind_fused(py::module_& m);  // fused_bindings.cpp
void bind_chunks(py::module_& m);  // chunk_bindings.cpp

namespace {

template <typename T>
using Array = py::array_t<T, py::array::c_style | py::array::forcecast>;

template <typename T>
std::vector<T> to_vector(const Array<T>& a, const char* name, py::ssize_t expect = -1) {
    if (a.ndim() != 1) throw std::invalid_argument(std::string(name) + " must be one-dimensional");
    if (expect >= 0 && a.shape(0) != expect)
        throw std::invalid_argument(std::string(name) + " has " + std::to_string(a.shape(0)) + " entries, expected " +
                                    std::to_string(expect));
    return std::vector<T>(a.data(), a.data() + a.shape(0));
}

std::vector<std::array<int, 2>> pairs(const Array<int32_t>& a, const char* name) {
    if (a.size() == 0) return {};
    if (a.ndim() != 2 || a.shape(1) != 2) throw std::invalid_argument(std::string(name) + " must have shape (n, 2)");
    std::vector<std::array<int, 2>> out(a.shape(0));
    for (py::ssize_t i = 0; i < a.shape(0); ++i) out[i] = {a.at(i, 0), a.at(i, 1)};
    return out;
}

// A plan of n_calls entries fuses nothing: its fused-pair entries (csrc/fused_node.h) read as 0.
void pad_fused(const rl::Problem& p, std::vector<int32_t>& v) {
    if (static_cast<int>(v.size()) == p.n_calls()) v.resize(p.plan_size(), 0);
}

std::vector<int32_t> plan_of(const rl::Problem& p, const Array<int32_t>& plan) {
    auto v = to_vector(plan, "plan");
    pad_fused(p, v);
    p.check_plan(v);
    return v;
}

py::dict eval_dict(const rl::Evaluation& e) {
    py::dict d;
    d["time"] = e.time;
    d["makespan"] = e.makespan;
    d["cost"] = e.cost;
    d["peak_memory"] = e.peak_memory;
    d["overflow"] = e.overflow;
    d["peak_device"] = e.peak_device;
    d["peak_call"] = e.peak_call;
    d["feasible"] = e.feasible;
    d["exact"] = e.exact;
    return d;
}

py::array_t<int32_t> missing_array(const std::vector<rl::MissingPair>& v) {
    py::array_t<int32_t> out({static_cast<py::ssize_t>(v.size()), static_cast<py::ssize_t>(3)});
    auto m = out.mutable_unchecked<2>();
    for (size_t i = 0; i < v.size(); ++i) {
        m(i, 0) = v[i].table;
        m(i, 1) = v[i].a;
        m(i, 2) = v[i].b;
    }
    return out;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
    m.doc() = "realloc C++ core: plan simulator and MCMC search";
    m.attr("NODE_CALL") = static_cast<int>(rl::NodeKind::kCall);
    m.attr("NODE_REALLOC") = static_cast<int>(rl::NodeKind::kRealloc);
    m.attr("NODE_DATA") = static_cast<int>(rl::NodeKind::kData);
    m.def("build_info", []() {
        return std::string("realloc._C C++") + std::to_string(__cplusplus) + " " + __VERSION__;
    });

    py::class_<rl::Problem>(m, "Problem", "Search problem as arrays; see csrc/problem.h")
        .def(py::init([](int n_devices, int n_iterations, int64_t device_memory, double oom_alpha,
                         const Array<int32_t>& call_model, const Array<int32_t>& model_home, double dispatch_latency,
                         int devices_per_node, double cores_per_node) {
                 auto p = std::make_unique<rl::Problem>();
                 p->n_devices = n_devices;
                 p->n_iterations = n_iterations;
                 p->device_memory = device_memory;
                 p->oom_alpha = oom_alpha;
                 p->dispatch_latency = dispatch_latency;
                 p->devices_per_node = devices_per_node;
                 p->cores_per_node = cores_per_node;
                 p->call_model = to_vector(call_model, "call_model");
                 p->model_home = to_vector(model_home, "model_home");
                 p->cands.resize(p->call_model.size());
                 p->realloc.resize(p->model_home.size());
                 return p;
             }),
             py::arg("n_devices"), py::arg("n_iterations"), py::arg("device_memory"), py::arg("oom_alpha"),
             py::arg("call_model"), py::arg("model_home"), py::arg("dispatch_latency") = 0.0,
             py::arg("devices_per_node") = 0, py::arg("cores_per_node") = 0.0)
        .def(
            "set_candidates",
            [](rl::Problem& p, int call, const Array<int32_t>& dev_lo, const Array<int32_t>& dev_hi,
               const Array<int32_t>& stage_width, const Array<int32_t>& layout, const Array<int32_t>& mesh_id,
               const Array<int32_t>& shape_class, const Array<double>& time, const Array<int64_t>& mem_offset,
               const Array<int64_t>& mem_static, const Array<int64_t>& mem_dynamic, const Array<int64_t>& mem_param,
               const std::optional<Array<int32_t>>& twin, const std::optional<Array<int32_t>>& whole) {
                if (call < 0 || call >= p.n_calls()) throw std::invalid_argument("call index out of range");
                rl::Candidates k;
                k.time = to_vector(time, "time");
                const py::ssize_t n = static_cast<py::ssize_t>(k.time.size());
                k.twin = twin ? to_vector(*twin, "twin", n) : std::vector<int32_t>(n, -1);
                if (whole) k.whole = to_vector(*whole, "whole", n);
                k.dev_lo = to_vector(dev_lo, "dev_lo", n);
                k.dev_hi = to_vector(dev_hi, "dev_hi", n);
                k.stage_width = to_vector(stage_width, "stage_width", n);
                k.layout = to_vector(layout, "layout", n);
                k.mesh_id = to_vector(mesh_id, "mesh_id", n);
                k.shape_class = to_vector(shape_class, "shape_class", n);
                k.mem_offset = to_vector(mem_offset, "mem_offset", n + 1);
                k.mem_static = to_vector(mem_static, "mem_static");
                k.mem_dynamic = to_vector(mem_dynamic, "mem_dynamic");
                k.mem_param = to_vector(mem_param, "mem_param");
                p.cands[call] = std::move(k);
                p.finalized = false;
            },
            py::arg("call"), py::arg("dev_lo"), py::arg("dev_hi"), py::arg("stage_width"), py::arg("layout"),
            py::arg("mesh_id"), py::arg("shape_class"), py::arg("time"), py::arg("mem_offset"),
            py::arg("mem_static"), py::arg("mem_dynamic"), py::arg("mem_param"), py::arg("twin") = py::none(),
            py::arg("whole") = py::none())
        .def(
            "set_realloc_layouts",
            [](rl::Problem& p, int model, int n_layouts) {
                if (model < 0 || model >= p.n_models()) throw std::invalid_argument("model index out of range");
                p.realloc[model].rows = p.realloc[model].cols = n_layouts;
                p.finalized = false;
            },
            py::arg("model"), py::arg("n_layouts"))
        .def(
            "add_data_edge",
            [](rl::Problem& p, int src, int dst, int n_src_layouts, int n_dst_layouts) {
                rl::DataEdge e;
                e.src = src;
                e.dst = dst;
                e.cost.rows = n_src_layouts;
                e.cost.cols = n_dst_layouts;
                p.data_edges.push_back(std::move(e));
                p.finalized = false;
                return p.n_models() + static_cast<int>(p.data_edges.size()) - 1;
            },
            py::arg("src"), py::arg("dst"), py::arg("n_src_layouts"), py::arg("n_dst_layouts"),
            "Adds a data edge; returns its pair-cost table id.")
        .def(
            "set_pair_costs",
            [](rl::Problem& p, int table, const Array<int32_t>& a, const Array<int32_t>& b,
               const Array<double>& seconds) {
                rl::PairCosts& t = p.table(table);
                auto va = to_vector(a, "a");
                auto vb = to_vector(b, "b", static_cast<py::ssize_t>(va.size()));
                auto vs = to_vector(seconds, "seconds", static_cast<py::ssize_t>(va.size()));
                for (size_t i = 0; i < va.size(); ++i) t.set(va[i], vb[i], vs[i]);
                p.bump_pair_costs();
            },
            py::arg("table"), py::arg("a"), py::arg("b"), py::arg("seconds"),
            "Prices pairs of a table (model index for reallocation, n_models + edge for data). Not while a "
            "search runs.")
        .def(
            "set_provisional",
            [](rl::Problem& p, int table, double seconds) {
                if (!(seconds >= 0.0)) throw std::invalid_argument("provisional cost must be >= 0");
                p.table(table).provisional = seconds;
                p.bump_pair_costs();
            },
            py::arg("table"), py::arg("seconds"))
        .def("n_known", [](const rl::Problem& p, int table) { return p.table(table).n_known(); }, py::arg("table"))
        .def(
            "set_edges",
            [](rl::Problem& p, const Array<int32_t>& order, const Array<int32_t>& carry) {
                p.order_edges = pairs(order, "order_edges");
                p.carry_edges = pairs(carry, "carry_edges");
                p.finalized = false;
            },
            py::arg("order"), py::arg("carry"))
        .def(
            "set_tail_call",  // long-tail migration (csrc/tail.h)
            [](rl::Problem& p, int call, const Array<int32_t>& grid, const Array<int32_t>& width,
               const Array<double>& time) {
                rl::TailColumns t;
                t.call = call;
                t.grid = to_vector(grid, "grid");
                t.width = to_vector(width, "width", static_cast<py::ssize_t>(t.grid.size()));
                t.time = to_vector(time, "time", static_cast<py::ssize_t>(t.grid.size()));
                p.tail_cols.push_back(std::move(t));
                p.finalized = false;
            },
            py::arg("call"), py::arg("grid"), py::arg("width"), py::arg("time"))
        .def(
            "add_tail_split",
            [](rl::Problem& p, int edge, const py::array_t<double, py::array::c_style | py::array::forcecast>& part1,
               const py::array_t<double, py::array::c_style | py::array::forcecast>& part2,
               const Array<double>& share1, const Array<double>& share2) {
                if (part1.ndim() != 2 || part2.ndim() != 2) throw std::invalid_argument("part times must be 2-D");
                rl::TailSplit s;
                s.edge = edge;
                s.n_grid = static_cast<int>(part1.shape(1));
                s.part1.assign(part1.data(), part1.data() + part1.size());
                s.part2.assign(part2.data(), part2.data() + part2.size());
                s.share1 = to_vector(share1, "share1");
                s.share2 = to_vector(share2, "share2");
                p.tail_splits.push_back(std::move(s));
                p.finalized = false;
            },
            py::arg("edge"), py::arg("part1"), py::arg("part2"), py::arg("share1"), py::arg("share2"))
        .def(
            "set_window",
            [](rl::Problem& p, int warmup, int lookahead) {
                p.warmup = warmup;
                p.lookahead = lookahead;
                p.finalized = false;
            },
            py::arg("warmup"), py::arg("lookahead"), "the priced window: csrc/problem.h")
        .def(
            "set_staleness",
            [](rl::Problem& p, int staleness, const Array<int32_t>& stale_calls) {
                p.staleness = staleness;
                p.stale.assign(p.n_calls(), 0);
                for (int32_t c : to_vector(stale_calls, "stale_calls")) {
                    if (c < 0 || c >= p.n_calls()) throw std::invalid_argument("stale call index out of range");
                    p.stale[c] = 1;
                }
                p.finalized = false;
            },
            py::arg("staleness"), py::arg("stale_calls"))
        .def(
            "set_pools",
            [](rl::Problem& p, const Array<int32_t>& pool_start, const Array<int64_t>& pool_memory) {
                p.pool_start = to_vector(pool_start, "pool_start");
                p.pool_memory = to_vector(pool_memory, "pool_memory");
                p.finalized = false;
            },
            py::arg("pool_start"), py::arg("pool_memory"))
        .def(
            "set_home_keep",  // csrc/home_keep.cpp
            [](rl::Problem& p, const Array<uint8_t>& pool_narrows, const Array<int32_t>& train_calls) {
                p.pool_narrows = to_vector(pool_narrows, "pool_narrows");
                p.train_call.assign(p.n_calls(), 0);
                for (int32_t c : to_vector(train_calls, "train_calls")) {
                    if (c < 0 || c >= p.n_calls()) throw std::invalid_argument("train call index out of range");
                    p.train_call[c] = 1;
                }
                p.finalized = false;
            },
            py::arg("pool_narrows"), py::arg("train_calls"))
        .def(
            "add_fused_pair",
            [](rl::Problem& p, int a, int b, const Array<double>& bound_a, const Array<double>& bound_b) {
                rl::FusedPair f;
                f.a = a;
                f.b = b;
                f.bound_a = to_vector(bound_a, "bound_a");
                f.bound_b = to_vector(bound_b, "bound_b");
                f.saving.rows = f.extra.rows = static_cast<int>(f.bound_a.size());
                f.saving.cols = f.extra.cols = static_cast<int>(f.bound_b.size());
                p.fused.push_back(std::move(f));
                p.finalized = false;
                return p.n_tables() + 2 * static_cast<int>(p.fused.size()) - 2;
            },
            py::arg("a"), py::arg("b"), py::arg("bound_a"), py::arg("bound_b"),
            "Adds a fused pair (csrc/fused_node.h); returns its saving table id (its extra-bytes table is the next).")
        .def("finalize", &rl::Problem::finalize)
        .def_property_readonly("n_calls", &rl::Problem::n_calls)
        .def_property_readonly("n_nodes", &rl::Problem::n_nodes)
        .def_property_readonly("iterations_chain", [](const rl::Problem& p) { return p.iterations_chain; })
        .def(
            "evaluate_bounded",
            [](const rl::Problem& p, const Array<int32_t>& plan, double limit, double best_cost, bool best_feasible) {
                auto v = plan_of(p, plan);
                rl::Evaluator ev(p);
                rl::Evaluation best;
                best.cost = best_cost;
                best.feasible = best_feasible;
                const rl::Evaluation e = ev.evaluate_bounded(v.data(), limit, best);
                py::dict d = eval_dict(e);
                d["complete"] = e.complete;
                d["simulated"] = e.simulated;
                return d;
            },
            py::arg("plan"), py::arg("limit"), py::arg("best_cost"), py::arg("best_feasible"),
            "evaluate() that may stop once the plan is proven to cost more than limit and no better than the best "
            "(complete=False; simulated=False if proven before simulating); the MCMC's early rejection.")
        .def_property_readonly("n_iterations", [](const rl::Problem& p) { return p.n_iterations; })
        .def_property_readonly("warmup", [](const rl::Problem& p) { return p.warmup; })
        .def_property_readonly("lookahead", [](const rl::Problem& p) { return p.lookahead; })
        .def(
            "evaluate",
            [](const rl::Problem& p, const Array<int32_t>& plan) {
                auto v = plan_of(p, plan);
                rl::Evaluator ev(p);
                return eval_dict(ev.evaluate(v.data()));
            },
            py::arg("plan"), "Time, memory and cost of one plan (candidate index per call).")
        .def(
            "missing",
            [](const rl::Problem& p, const Array<int32_t>& plan) {
                auto v = plan_of(p, plan);
                rl::Evaluator ev(p);
                std::vector<rl::MissingPair> out;
                ev.evaluate(v.data(), &out);
                std::sort(out.begin(), out.end());
                out.erase(std::unique(out.begin(), out.end()), out.end());
                return missing_array(out);
            },
            py::arg("plan"), "Unpriced pair costs the plan needs, as rows (table, a, b).")
        .def(
            "evaluate_batch",
            [](const rl::Problem& p, Array<int32_t> plans) {
                if (plans.ndim() != 2 || (plans.shape(1) != p.plan_size() && plans.shape(1) != p.n_calls()))
                    throw std::invalid_argument("plans must have shape (n_plans, n_calls [+ n_fused_pairs])");
                if (plans.shape(1) != p.plan_size()) {  // fusing nothing (pad_fused)
                    py::array_t<int32_t> padded({plans.shape(0), static_cast<py::ssize_t>(p.plan_size())});
                    auto m = padded.mutable_unchecked<2>();
                    for (py::ssize_t i = 0; i < plans.shape(0); ++i)
                        for (py::ssize_t c = 0; c < p.plan_size(); ++c) m(i, c) = c < p.n_calls() ? plans.at(i, c) : 0;
                    plans = padded;
                }
                const py::ssize_t n = plans.shape(0);
                for (py::ssize_t i = 0; i < n; ++i)
                    p.check_plan(std::vector<int32_t>(plans.data(i, 0), plans.data(i, 0) + p.plan_size()));
                Array<double> time(n), cost(n);
                Array<int64_t> peak(n);
                Array<bool> feasible(n);
                {
                    py::gil_scoped_release nogil;
                    rl::Evaluator ev(p);
                    for (py::ssize_t i = 0; i < n; ++i) {
                        const rl::Evaluation e = ev.evaluate(plans.data(i, 0));
                        time.mutable_at(i) = e.time;
                        cost.mutable_at(i) = e.cost;
                        peak.mutable_at(i) = e.peak_memory;
                        feasible.mutable_at(i) = e.feasible;
                    }
                }
                py::dict d;
                d["time"] = time;
                d["cost"] = cost;
                d["peak_memory"] = peak;
                d["feasible"] = feasible;
                return d;
            },
            py::arg("plans"))
        .def(
            "schedule",
            [](const rl::Problem& p, const Array<int32_t>& plan) {
                auto v = plan_of(p, plan);
                rl::Evaluator ev(p);
                py::list out;
                for (const auto& r : ev.schedule(v.data()))
                    out.append(py::make_tuple(r.kind, r.call, r.other, r.iteration, r.start, r.end, r.lo1, r.hi1,
                                              r.lo2, r.hi2));
                return out;
            },
            py::arg("plan"),
            "Every node of the unrolled augmented graph in scheduling order: (kind, call, other, iteration, start, "
            "end, lo1, hi1, lo2, hi2); kind 0 call, 1 reallocation, 2 data transfer.")
        .def(
            "memory",
            [](const rl::Problem& p, const Array<int32_t>& plan) {
                auto v = plan_of(p, plan);
                rl::Evaluator ev(p);
                const rl::MemoryReport r = ev.memory(v.data());
                py::dict d;
                d["device_static"] = r.device_static;
                d["device_peak"] = r.device_peak;
                d["call_peak"] = r.call_peak;
                return d;
            },
            py::arg("plan"));

    py::class_<rl::SearchOptions>(m, "SearchOptions")
        .def(py::init<>())
        .def_readwrite("n_chains", &rl::SearchOptions::n_chains)
        .def_readwrite("n_threads", &rl::SearchOptions::n_threads)
        .def_readwrite("n_temps", &rl::SearchOptions::n_temps)
        .def_readwrite("ladder", &rl::SearchOptions::ladder)
        .def_readwrite("seed", &rl::SearchOptions::seed)
        .def_readwrite("accept_1pct", &rl::SearchOptions::accept_1pct)
        .def_readwrite("restart_margin", &rl::SearchOptions::restart_margin)
        .def_readwrite("p_any", &rl::SearchOptions::p_any)
        .def_readwrite("p_mbs", &rl::SearchOptions::p_mbs)
        .def_readwrite("p_strategy", &rl::SearchOptions::p_strategy)
        .def_readwrite("p_position", &rl::SearchOptions::p_position)
        .def_readwrite("p_colocate", &rl::SearchOptions::p_colocate)
        .def_readwrite("p_swap", &rl::SearchOptions::p_swap)
        .def_readwrite("p_recompute", &rl::SearchOptions::p_recompute)
        .def_readwrite("p_heat", &rl::SearchOptions::p_heat)
        .def_readwrite("heat_one", &rl::SearchOptions::heat_one)
        .def_readwrite("heat_two", &rl::SearchOptions::heat_two)
        .def_readwrite("early_reject", &rl::SearchOptions::early_reject)
        .def_readwrite("p_fuse", &rl::SearchOptions::p_fuse);

    py::class_<rl::Search>(m, "Search", "Metropolis-Hastings chains over plans; see csrc/mcmc.h")
        .def(py::init([](const rl::Problem& p, const rl::SearchOptions& o, const Array<int32_t>& starts) {
                 if (starts.ndim() != 2 || (starts.shape(1) != p.plan_size() && starts.shape(1) != p.n_calls()))
                     throw std::invalid_argument("starts must have shape (n_starts, n_calls [+ n_fused_pairs])");
                 std::vector<std::vector<int32_t>> v;
                 for (py::ssize_t i = 0; i < starts.shape(0); ++i) {
                     v.emplace_back(starts.data(i, 0), starts.data(i, 0) + starts.shape(1));
                     pad_fused(p, v.back());
                 }
                 return std::make_unique<rl::Search>(p, o, v);
             }),
             py::arg("problem"), py::arg("options"), py::arg("starts"), py::keep_alive<1, 2>())
        .def("run", &rl::Search::run, py::arg("evals_per_replica"), py::arg("seconds") = 0.0,
             py::call_guard<py::gil_scoped_release>(),
             "Advance every chain; the GIL is released. Returns True if the time limit stopped it.")
        .def(
            "missing_pairs",
            [](const rl::Search& s, int limit) { return missing_array(s.missing_pairs(limit)); },
            py::arg("limit") = 16, "Unpriced pairs of the pending provisional plans, as rows (table, a, b).")
        .def("resolve", &rl::Search::resolve, "Re-evaluate the chains after new pair costs were set.")
        .def_property_readonly("best_plan", &rl::Search::best_plan)
        .def_property_readonly("best", [](const rl::Search& s) { return eval_dict(s.best_eval()); })
        .def_property_readonly("swap_rate", &rl::Search::swap_rate)
        .def_property_readonly("evals", &rl::Search::evals)
        .def_property_readonly("simulations", &rl::Search::simulations)
        .def_property_readonly("unsimulated", &rl::Search::unsimulated)
        .def_property_readonly("elapsed", &rl::Search::elapsed)
        .def_property_readonly("temperature", &rl::Search::temperature)
        .def_property_readonly("history", [](const rl::Search& s) {
            py::list out;
            for (const auto& h : s.history())
                out.append(py::make_tuple(h.seconds, h.evals, h.cost, h.time, h.feasible));
            return out;
        });
    bind_fused(m);
    bind_chunks(m);
}
