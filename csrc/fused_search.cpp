// Simulated annealing over fused pipeline schedules (rlhfuse.txt §5.2, Algorithms 1 and 2).
//
// A neighbour swaps two adjacent passes of one device. Swaps that would break a model's micro-batch
// order or put a backward before its forward are never proposed; swaps that deadlock or exceed the
// memory cap are undone. The first annealing lowers the makespan (plus a small share of the devices'
// mean end, so that moves which shorten some device's tail are told apart from neutral ones); the
// second lowers the peak memory (plus a small share of the devices' mean peak) and accepts only
// moves that keep the makespan of the first. Temperatures fall geometrically from t_start to t_end
// times the start energy over the given number of steps.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <stdexcept>
#include <string>

#include "fused_schedule.h"

namespace rl::fused {

namespace {

struct Rng {  // splitmix64: results depend on the seed alone
    uint64_t s;
    uint64_t next() {
        uint64_t z = (s += 0x9E3779B97F4A7C15ULL);
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
        return z ^ (z >> 31);
    }
    double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }
    size_t below(size_t n) { return static_cast<size_t>(next() % n); }
};


double mean(const std::vector<double>& v) { return std::accumulate(v.begin(), v.end(), 0.0) / v.size(); }
double latency_energy(const Eval& e, double share) { return e.makespan + share * mean(e.device_end); }

// Whether two adjacent passes may trade places: not two passes of one model and direction (that
// would reorder micro-batches), nor a micro-batch's forward and backward.
bool swappable(int32_t a, int32_t b) {
    if (task_model(a) != task_model(b)) return true;
    return task_backward(a) != task_backward(b) && task_mb(a) != task_mb(b);
}

double device_peak(const Problem& p, int d, const std::vector<int32_t>& seq) {
    double cur = 0.0, peak = 0.0;
    for (int32_t t : seq) {
        cur += task_backward(t) ? -p.act(d, t) : p.act(d, t);
        peak = std::max(peak, cur);
    }
    return peak;
}

bool better(const Eval& a, const Eval& b) {  // lower makespan, then lower peak
    const double tol = 1e-12 * std::max(1.0, b.makespan);
    if (a.makespan < b.makespan - tol) return true;
    return a.makespan <= b.makespan + tol && a.peak < b.peak - 1e-12 * std::max(1.0, b.peak);
}

// A move: the pass at `from` on device d travels `steps` places in direction dir (+1 later, -1
// earlier), by swaps of adjacent passes that may trade places (rlhfuse.txt Algorithm 2 is reach 1).
struct Move {
    int d = 0;
    size_t from = 0;
    int dir = 1, steps = 0;
};

void apply(Order& o, Move& m, int reach, Rng& rng) {
    auto& seq = o[m.d];
    const int want = 1 + static_cast<int>(rng.below(reach));
    size_t pos = m.from;
    m.steps = 0;
    while (m.steps < want) {
        if ((m.dir < 0 && pos == 0) || (m.dir > 0 && pos + 1 >= seq.size())) break;
        const size_t nb = m.dir > 0 ? pos + 1 : pos - 1;
        if (!swappable(seq[std::min(pos, nb)], seq[std::max(pos, nb)])) break;
        std::swap(seq[pos], seq[nb]);
        pos = nb;
        ++m.steps;
    }
}

void undo(Order& o, const Move& m) {
    auto& seq = o[m.d];
    size_t pos = m.dir > 0 ? m.from + m.steps : m.from - m.steps;
    for (int i = 0; i < m.steps; ++i) {
        const size_t nb = m.dir > 0 ? pos - 1 : pos + 1;
        std::swap(seq[pos], seq[nb]);
        pos = nb;
    }
}

// Draws and applies a move that changes the order (a few tries); false if none was found.
bool propose(Order& o, Rng& rng, int reach, Move& m) {
    for (int tries = 0; tries < 64; ++tries) {
        m.d = static_cast<int>(rng.below(o.size()));
        if (o[m.d].size() < 2) continue;
        m.from = rng.below(o[m.d].size());
        m.dir = rng.below(2) ? 1 : -1;
        apply(o, m, reach, rng);
        if (m.steps > 0) return true;
    }
    return false;
}

double cooling(double t_start, double t_end, int64_t steps) {
    return steps > 0 ? std::pow(t_end / t_start, 1.0 / static_cast<double>(steps)) : 1.0;
}

// Makespan annealing from `order` (valid, within the cap); returns the best order seen.
void anneal_latency(const Problem& p, const SearchOptions& opt, Rng& rng, Order& order, Eval& ev, int64_t& evals,
                    double lb) {
    Order cur = order;
    Eval cur_ev = ev;
    double e_cur = latency_energy(cur_ev, opt.tie_share);
    double temp = opt.t_start * cur_ev.makespan;
    const double alpha = cooling(opt.t_start, opt.t_end, opt.iterations);
    const bool capped = std::isfinite(opt.memory_cap);
    for (int64_t it = 0; it < opt.iterations; ++it, temp *= alpha) {
        Move mv;
        if (!propose(cur, rng, opt.reach, mv)) return;
        if (capped && device_peak(p, mv.d, cur[mv.d]) > opt.memory_cap * (1 + 1e-12)) {
            undo(cur, mv);
            continue;
        }
        Eval nb = p.evaluate(cur);
        ++evals;
        if (!nb.valid) {
            undo(cur, mv);
            continue;
        }
        const double e_nb = latency_energy(nb, opt.tie_share);
        if (better(nb, ev)) {
            order = cur;
            ev = nb;
            if (ev.makespan <= lb * (1 + 1e-12)) return;  // cannot do better
        }
        if (e_nb <= e_cur || std::exp((e_cur - e_nb) / temp) > rng.uniform()) {
            e_cur = e_nb;
            cur_ev = std::move(nb);
        } else {
            undo(cur, mv);
        }
    }
}

// Memory annealing (§5.2, "Optimizing memory usage"): energy = peak + share of the mean peak,
// moves that raise the makespan above `ev.makespan` are refused.
void anneal_memory(const Problem& p, const SearchOptions& opt, Rng& rng, Order& order, Eval& ev, int64_t& evals) {
    Order cur = order;
    std::vector<double> peaks = ev.device_peak;
    auto energy = [&](const std::vector<double>& pk) {
        return *std::max_element(pk.begin(), pk.end()) + opt.tie_share * mean(pk);
    };
    double e_cur = energy(peaks);
    const double span = ev.makespan * (1 + 1e-12);
    double temp = opt.t_start * std::max(ev.peak, 1e-30);
    const double alpha = cooling(opt.t_start, opt.t_end, opt.memory_iterations);
    for (int64_t it = 0; it < opt.memory_iterations; ++it, temp *= alpha) {
        Move mv;
        if (!propose(cur, rng, opt.reach, mv)) return;
        const int d = mv.d;
        const double old_peak = peaks[d];
        peaks[d] = device_peak(p, d, cur[d]);
        const double e_nb = energy(peaks);
        bool keep = peaks[d] <= opt.memory_cap * (1 + 1e-12) &&
                    (e_nb <= e_cur || std::exp((e_cur - e_nb) / temp) > rng.uniform());
        Eval nb;
        if (keep) {
            nb = p.evaluate(cur);
            ++evals;
            keep = nb.valid && nb.makespan <= span;
        }
        if (!keep) {
            undo(cur, mv);
            peaks[d] = old_peak;
            continue;
        }
        e_cur = e_nb;
        if (nb.peak < ev.peak - 1e-12 * ev.peak || (nb.peak <= ev.peak && nb.makespan < ev.makespan)) {
            order = cur;
            ev = std::move(nb);
        }
    }
}

}  // namespace

SearchResult search(const Problem& p, const SearchOptions& opt) {
    if (opt.iterations < 0 || opt.memory_iterations < 0 || opt.restarts < 1)
        throw std::invalid_argument("fused search: iterations must be >= 0 and restarts >= 1");
    if (!(opt.t_start > 0) || !(opt.t_end > 0) || opt.t_end > opt.t_start)
        throw std::invalid_argument("fused search: need 0 < t_end <= t_start");
    if (opt.reach < 1) throw std::invalid_argument("fused search: reach must be >= 1");
    if (!(opt.memory_cap > 0)) throw std::invalid_argument("fused search: memory_cap must be > 0");
    SearchResult r;
    r.lower_bound = p.lower_bound();
    const Eval a = p.alone_1f1b(0), b = p.alone_1f1b(1);
    r.serial.valid = true;
    r.serial.makespan = a.makespan + b.makespan;
    r.serial.device_end.assign(p.n_devices(), r.serial.makespan);
    r.serial.device_peak.resize(p.n_devices());
    for (int d = 0; d < p.n_devices(); ++d) {
        r.serial.device_peak[d] = std::max(a.device_peak[d], b.device_peak[d]);
        r.serial.peak = std::max(r.serial.peak, r.serial.device_peak[d]);
    }
    // Starts: the greedy list schedules (eager, with 1F1B's in-flight limit, and either model keeping
    // its 1F1B order while the other backfills, both keeping theirs) and the serial order.
    std::vector<Order> starts = {p.greedy(false, opt.memory_cap), p.greedy(true, opt.memory_cap), p.serial_1f1b()};
    for (int primary = 0; primary < 2; ++primary)
        for (double slack : {0.0, 0.5, 1.0, 2.0})
            for (bool limit : {false, true}) starts.push_back(p.greedy(limit, opt.memory_cap, primary, slack));
    for (int extra : {0, 1, 2, 4, 8}) starts.push_back(p.greedy(false, opt.memory_cap, 2, 0.0, extra));
    std::vector<std::pair<Eval, Order>> ranked;
    for (Order& o : starts) {
        if (o.empty()) continue;
        Eval e = p.evaluate(o);
        ++r.evaluations;
        if (e.valid && e.peak <= opt.memory_cap * (1 + 1e-12)) ranked.emplace_back(std::move(e), std::move(o));
    }
    std::stable_sort(ranked.begin(), ranked.end(), [](const auto& x, const auto& y) { return better(x.first, y.first); });
    if (!ranked.empty()) r.order = ranked[0].second, r.eval = ranked[0].first;
    if (r.order.empty())
        throw std::invalid_argument("fused search: memory_cap " + std::to_string(opt.memory_cap) +
                                    " is below what running the two models one after the other needs (" +
                                    std::to_string(r.serial.peak) + ")");
    r.greedy = r.eval;
    // Restart k anneals from the (k mod n)-th best start; the best schedule of all runs is kept.
    for (int k = 0; k < opt.restarts && r.eval.makespan > r.lower_bound * (1 + 1e-12); ++k) {
        Rng rng{opt.seed * 0x100000001B3ULL + static_cast<uint64_t>(k)};
        auto [ev, order] = ranked[k % ranked.size()];
        anneal_latency(p, opt, rng, order, ev, r.evaluations, r.lower_bound);
        if (better(ev, r.eval)) r.order = std::move(order), r.eval = std::move(ev);
    }
    Rng rng{opt.seed ^ 0xA5A5A5A5ULL};
    anneal_memory(p, opt, rng, r.order, r.eval, r.evaluations);
    return r;
}

}  // namespace rl::fused
