// Fused pipeline schedule: evaluation, greedy start, lower bound, annealing (see fused_schedule.h).
#include "fused_schedule.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <stdexcept>

namespace rl::fused {

namespace {

void check_model(const Model& m, const char* name, int n) {
    const std::string who = std::string("fused model ") + name;
    if (m.pp < 1 || n % m.pp != 0)
        throw std::invalid_argument(who + ": pp " + std::to_string(m.pp) + " must divide the " + std::to_string(n) +
                                    " devices");
    if (m.n_micro < 1) throw std::invalid_argument(who + ": n_micro must be at least 1");
    for (const auto* v : {&m.fwd, &m.bwd, &m.act}) {
        if (static_cast<int>(v->size()) != m.pp)
            throw std::invalid_argument(who + ": fwd, bwd and act need one entry per stage (" + std::to_string(m.pp) +
                                        ")");
        for (double x : *v)
            if (!(x >= 0.0) || !std::isfinite(x))
                throw std::invalid_argument(who + ": times and activations must be finite and >= 0");
    }
}

// 1F1B on one stage: min(pp - stage - 1 + extra, M) warm-up forwards, then forward/backward pairs,
// then the remaining backwards; min(pp - stage + extra, M) micro-batches in flight at most.
void append_1f1b(std::vector<int32_t>& seq, int model, int pp, int stage, int m, int extra = 0) {
    const int warm = std::min(pp - stage - 1 + extra, m);
    int f = 0, b = 0;
    for (; f < warm; ++f) seq.push_back(encode(model, 0, f));
    for (; f < m; ++f) {
        seq.push_back(encode(model, 0, f));
        seq.push_back(encode(model, 1, b++));
    }
    for (; b < m; ++b) seq.push_back(encode(model, 1, b));
}

}  // namespace

Problem::Problem(int n_devices, Model a, Model b, double p2p) : n_(n_devices), m_{std::move(a), std::move(b)}, p2p_(p2p) {
    if (n_ < 1) throw std::invalid_argument("fused schedule: n_devices must be at least 1");
    if (!(p2p_ >= 0.0) || !std::isfinite(p2p_)) throw std::invalid_argument("fused schedule: p2p must be finite and >= 0");
    check_model(m_[0], "A", n_);
    check_model(m_[1], "B", n_);
    mmax_ = std::max(m_[0].n_micro, m_[1].n_micro);
}

int Problem::stage(int model, int device) const {
    const int r = model == 0 ? device : n_ - 1 - device;
    return r % m_[model].pp;
}
int Problem::pipe(int model, int device) const {
    const int r = model == 0 ? device : n_ - 1 - device;
    return r / m_[model].pp;
}
int Problem::device(int model, int pipe, int stage) const {
    const int r = pipe * m_[model].pp + stage;
    return model == 0 ? r : n_ - 1 - r;
}
double Problem::duration(int device, int32_t t) const {
    const Model& m = m_[task_model(t)];
    const int s = stage(task_model(t), device);
    return task_backward(t) ? m.bwd[s] : m.fwd[s];
}
double Problem::act(int device, int32_t t) const {
    const int model = task_model(t);
    return m_[model].act[stage(model, device)];
}

void Problem::check_order(const Order& order) const {
    if (static_cast<int>(order.size()) != n_)
        throw std::invalid_argument("fused order: has " + std::to_string(order.size()) + " devices, expected " +
                                    std::to_string(n_));
    for (int d = 0; d < n_; ++d) {
        const std::string at = "fused order: device " + std::to_string(d);
        const size_t want = 2 * static_cast<size_t>(m_[0].n_micro + m_[1].n_micro);
        if (order[d].size() != want)
            throw std::invalid_argument(at + " has " + std::to_string(order[d].size()) + " passes, expected " +
                                        std::to_string(want));
        int next[2][2] = {{0, 0}, {0, 0}};
        for (int32_t t : order[d]) {
            if (t < 0) throw std::invalid_argument(at + ": negative pass code");
            const int model = task_model(t), bw = task_backward(t), mb = task_mb(t);
            if (mb >= m_[model].n_micro)
                throw std::invalid_argument(at + ": micro-batch " + std::to_string(mb) + " out of range");
            if (mb != next[model][bw])
                throw std::invalid_argument(at + ": model " + std::to_string(model) +
                                            " passes must keep micro-batch order (got " + std::to_string(mb) +
                                            ", expected " + std::to_string(next[model][bw]) + ")");
            if (bw && next[model][0] <= mb)
                throw std::invalid_argument(at + ": backward of micro-batch " + std::to_string(mb) +
                                            " before its forward");
            ++next[model][bw];
        }
    }
}

Eval Problem::evaluate(const Order& order, std::vector<double>* start) const {
    Eval e;
    e.device_peak.assign(n_, 0.0);
    e.device_end.assign(n_, 0.0);
    // fin[((model * 2 + backward) * n + device) * mmax + mb]: when the pass ended, < 0 while pending.
    std::vector<double> fin(static_cast<size_t>(4) * n_ * mmax_, -1.0);
    if (start) start->assign(fin.size(), -1.0);
    std::vector<size_t> ptr(n_, 0);
    std::vector<char> queued(n_, 1);
    std::vector<int> stack(n_);
    for (int d = 0; d < n_; ++d) stack[d] = n_ - 1 - d;
    size_t done = 0, total = 0;
    for (const auto& s : order) total += s.size();
    while (!stack.empty()) {
        const int d = stack.back();
        stack.pop_back();
        queued[d] = 0;
        const auto& seq = order[d];
        double t = e.device_end[d];
        while (ptr[d] < seq.size()) {
            const int32_t task = seq[ptr[d]];
            const int model = task_model(task), bw = task_backward(task), mb = task_mb(task);
            const Model& m = m_[model];
            const int s = stage(model, d), k = pipe(model, d);
            // The one input of this pass, and the device that waits for this pass (if another).
            int dep_dev = -1, dep_bw = 0, next_dev = -1;
            if (!bw) {
                if (s > 0) dep_dev = device(model, k, s - 1);
                if (s + 1 < m.pp) next_dev = device(model, k, s + 1);
            } else {
                if (s + 1 < m.pp) dep_dev = device(model, k, s + 1), dep_bw = 1;
                else dep_dev = d;  // the last stage's backward follows its own forward
                if (s > 0) next_dev = device(model, k, s - 1);
            }
            double ready = 0.0;
            if (dep_dev >= 0) {
                const double f = fin[slot(model, dep_bw, dep_dev, mb)];
                if (f < 0) break;
                ready = f + (dep_dev != d ? p2p_ : 0.0);
            }
            t = std::max(t, ready);
            if (start) (*start)[slot(model, bw, d, mb)] = t;
            t += bw ? m.bwd[s] : m.fwd[s];
            fin[slot(model, bw, d, mb)] = t;
            ++ptr[d];
            ++done;
            if (next_dev >= 0 && !queued[next_dev]) {
                queued[next_dev] = 1;
                stack.push_back(next_dev);
            }
        }
        e.device_end[d] = t;
    }
    if (done != total) return e;  // deadlock
    e.valid = true;
    e.makespan = *std::max_element(e.device_end.begin(), e.device_end.end());
    for (int d = 0; d < n_; ++d) {
        double cur = 0.0, peak = 0.0;
        for (int32_t task : order[d]) {
            cur += task_backward(task) ? -act(d, task) : act(d, task);
            peak = std::max(peak, cur);
        }
        e.device_peak[d] = peak;
        e.peak = std::max(e.peak, peak);
    }
    return e;
}

Eval Problem::alone_1f1b(int model) const {
    Order o(n_);
    for (int d = 0; d < n_; ++d) append_1f1b(o[d], model, m_[model].pp, stage(model, d), m_[model].n_micro);
    return evaluate(o);
}

Order Problem::serial_1f1b() const {
    Order o(n_);
    for (int d = 0; d < n_; ++d)
        for (int model = 0; model < 2; ++model)
            append_1f1b(o[d], model, m_[model].pp, stage(model, d), m_[model].n_micro);
    return o;
}

Order Problem::greedy(bool inflight_1f1b, double memory_cap, int primary, double slack, int extra_warmup) const {
    Order o(n_);
    std::vector<double> fin(static_cast<size_t>(4) * n_ * mmax_, -1.0);
    // The fixed models' 1F1B orders per device; for one primary, when each of its passes starts when
    // it runs alone.
    Order prim[2] = {Order(n_), Order(n_)};
    const bool fixed[2] = {primary == 0 || primary == 2, primary == 1 || primary == 2};
    std::vector<double> planned;
    std::vector<std::array<size_t, 2>> prim_next(n_, {0, 0});
    for (int model = 0; model < 2; ++model)
        if (fixed[model])
            for (int d = 0; d < n_; ++d)
                append_1f1b(prim[model][d], model, m_[model].pp, stage(model, d), m_[model].n_micro, extra_warmup);
    if (primary == 0 || primary == 1) evaluate(prim[primary], &planned);
    std::vector<double> free_at(n_, 0.0), mem(n_, 0.0);
    std::vector<std::array<std::array<int, 2>, 2>> next(n_, {{{0, 0}, {0, 0}}});
    const size_t total = 2 * static_cast<size_t>(n_) * (m_[0].n_micro + m_[1].n_micro);
    for (size_t placed = 0; placed < total; ++placed) {
        // Among every device's candidates (each model's next forward and next backward), the one that
        // can start first; ties: backward, then the longer pass, then the lower device.
        double best_start = std::numeric_limits<double>::infinity(), best_len = 0;
        int best_dev = -1, best_model = 0, best_bw = 0;
        for (int d = 0; d < n_; ++d) {
            for (int model = 0; model < 2; ++model) {
                const Model& m = m_[model];
                const int s = stage(model, d), k = pipe(model, d);
                for (int bw = 1; bw >= 0; --bw) {
                    const int mb = next[d][model][bw];
                    if (mb >= m.n_micro) continue;
                    if (fixed[model] && (prim_next[d][model] >= prim[model][d].size() ||
                                         prim[model][d][prim_next[d][model]] != encode(model, bw, mb)))
                        continue;  // a fixed model keeps its 1F1B order
                    if (!bw) {
                        const int in_flight = mb - next[d][model][1];
                        if (inflight_1f1b && in_flight >= std::min(m.pp - s, m.n_micro)) continue;
                        if (mem[d] + m.act[s] > memory_cap * (1 + 1e-12)) continue;
                    } else if (next[d][model][0] <= mb) {
                        continue;  // its forward has not run here yet
                    }
                    int dep_dev = -1, dep_bw = 0;
                    if (!bw) {
                        if (s > 0) dep_dev = device(model, k, s - 1);
                    } else {
                        if (s + 1 < m.pp) dep_dev = device(model, k, s + 1), dep_bw = 1;
                        else dep_dev = d;
                    }
                    double ready = 0.0;
                    if (dep_dev >= 0) {
                        const double f = fin[slot(model, dep_bw, dep_dev, mb)];
                        if (f < 0) continue;
                        ready = f + (dep_dev != d ? p2p_ : 0.0);
                    }
                    const double start = std::max(free_at[d], ready);
                    const double len = bw ? m.bwd[s] : m.fwd[s];
                    if ((primary == 0 || primary == 1) && model != primary &&
                        prim_next[d][primary] < prim[primary][d].size()) {
                        const int32_t pt = prim[primary][d][prim_next[d][primary]];
                        const double due = planned[slot(primary, task_backward(pt), d, task_mb(pt))];
                        if (start + len > due + slack * len + 1e-12 * (1 + due)) continue;
                    }
                    const bool better = start < best_start ||
                                        (start == best_start && (bw > best_bw || (bw == best_bw && len > best_len)));
                    if (better) {
                        best_start = start, best_len = len, best_dev = d, best_model = model, best_bw = bw;
                    }
                }
            }
        }
        if (best_dev < 0) return {};  // the memory cap (or the in-flight limit) left nothing to run
        const int d = best_dev, mb = next[d][best_model][best_bw];
        const double t = best_start + best_len;
        fin[slot(best_model, best_bw, d, mb)] = t;
        free_at[d] = t;
        const double a = m_[best_model].act[stage(best_model, d)];
        mem[d] += best_bw ? -a : a;
        ++next[d][best_model][best_bw];
        if (fixed[best_model]) ++prim_next[d][best_model];
        o[d].push_back(encode(best_model, best_bw, mb));
    }
    return o;
}

double Problem::lower_bound() const {
    double lb = 0.0;
    for (int d = 0; d < n_; ++d) {
        double arr[2], tail[2], work[2];
        for (int model = 0; model < 2; ++model) {
            const Model& m = m_[model];
            const int s = stage(model, d);
            arr[model] = tail[model] = 0.0;
            for (int i = 0; i < s; ++i) arr[model] += m.fwd[i] + p2p_, tail[model] += m.bwd[i] + p2p_;
            work[model] = m.n_micro * (m.fwd[s] + m.bwd[s]);
            lb = std::max(lb, arr[model] + work[model] + tail[model]);
        }
        lb = std::max(lb, std::min(arr[0], arr[1]) + work[0] + work[1] + std::min(tail[0], tail[1]));
    }
    return lb;
}

}  // namespace rl::fused
