#include "simulator.h"

#include <algorithm>
#include <cassert>
#include <climits>
#include <functional>
#include <limits>

namespace rl {

namespace {

using HeapItem = std::pair<double, int32_t>;
constexpr int kBoundEvery = 2;  // simulate(): nodes between two checks of the early-stop bound

inline int atom_index(const std::vector<int32_t>& bp, int x) {
    return static_cast<int>(std::lower_bound(bp.begin(), bp.end(), x) - bp.begin());
}

}  // namespace

Evaluator::Evaluator(const Problem& problem) : p_(problem) {
    if (!p_.finalized) throw std::invalid_argument("problem is not finalized");
    const int n = p_.n_calls();
    const size_t per = p_.iter_nodes.size();
    bp_.reserve(2 * n);
    atom_lo_.resize(n);
    atom_hi_.resize(n);
    free_.resize(2 * n + 1);
    work_.resize(2 * n + 1);
    node_cost_.resize(per);
    r1a_.resize(per);
    r1b_.resize(per);
    r2a_.resize(per);
    r2b_.resize(per);
    pass_.resize(per);
    out_latency_.resize(per);
    tmpl_.resize(p_.n_nodes());
    iter_.resize(p_.n_nodes());
    rank_.resize(p_.n_nodes());
    for (int v = 0; v < p_.n_nodes(); ++v) {
        tmpl_[v] = v % static_cast<int>(per);
        iter_[v] = v / static_cast<int>(per);
        rank_[v] = p_.iter_nodes[tmpl_[v]].kind == NodeKind::kData ? v : v + p_.n_nodes();
    }
    last_plan_.assign(n, -1);
    changed_.resize(n);
    known_.assign(per, 1);
    pair_a_.assign(per, 0);
    pair_b_.assign(per, 0);
    mem_stage_.resize(n);
    mem_next_.resize(n);
    mem_copy_.resize(n);
    ready_.resize(p_.n_nodes());
    remaining_.resize(p_.n_nodes());
    iter_end_.resize(p_.n_iterations);
    iter_left_.resize(p_.n_iterations);
    heap_.reserve(p_.n_nodes());
    ready_list_.reserve(p_.n_nodes());
    if (p_.shares_cores()) {
        host_start_.resize(per + 1);
        queue_.resize(2 * n + 1);
        queue_head_.resize(2 * n + 1);
        finish_.resize(p_.n_nodes());
        rate_.resize(p_.n_nodes());
        start_.resize(p_.n_nodes());
        host_busy_.resize(p_.n_devices / p_.host_size());
    }
}

bool Evaluator::prepare(const int32_t* plan, std::vector<MissingPair>* missing) {
    // Consecutive plans of a chain differ in one or two calls: template nodes that involve neither keep
    // what the last plan gave them, unless the atoms moved (a mesh changed) or pair costs changed.
    const int n = p_.n_calls();
    const size_t per = p_.iter_nodes.size();
    if (cache_version_ != p_.pair_version) {
        std::fill(last_plan_.begin(), last_plan_.end(), -1);
        cache_version_ = p_.pair_version;
    }
    bool meshes_moved = false;
    for (int c = 0; c < n; ++c) {
        changed_[c] = plan[c] != last_plan_[c];
        if (changed_[c] && (last_plan_[c] < 0 || p_.cands[c].dev_lo[plan[c]] != p_.cands[c].dev_lo[last_plan_[c]] ||
                            p_.cands[c].dev_hi[plan[c]] != p_.cands[c].dev_hi[last_plan_[c]]))
            meshes_moved = true;
        last_plan_[c] = plan[c];
    }
    if (meshes_moved) {
        bp_.clear();
        for (int c = 0; c < n; ++c) {
            bp_.push_back(p_.cands[c].dev_lo[plan[c]]);
            bp_.push_back(p_.cands[c].dev_hi[plan[c]]);
        }
        std::sort(bp_.begin(), bp_.end());
        bp_.erase(std::unique(bp_.begin(), bp_.end()), bp_.end());
        for (int c = 0; c < n; ++c) {
            atom_lo_[c] = atom_index(bp_, p_.cands[c].dev_lo[plan[c]]);
            atom_hi_[c] = atom_index(bp_, p_.cands[c].dev_hi[plan[c]]);
        }
    }
    for (size_t j = 0; j < per; ++j) {
        const NodeTemplate& nt = p_.iter_nodes[j];
        const int c = nt.call;
        if (!meshes_moved && !changed_[c] && (nt.other < 0 || !changed_[nt.other])) continue;
        r1a_[j] = atom_lo_[c];
        r1b_[j] = atom_hi_[c];
        if (nt.kind == NodeKind::kCall) {
            node_cost_[j] = p_.cands[c].time[plan[c]];
            r2a_[j] = r2b_[j] = 0;
            pass_[j] = 0;
            known_[j] = 1;
            out_latency_[j] = p_.dispatch_latency;
            continue;
        }
        const int o = nt.other;
        const int la = p_.cands[o].layout[plan[o]], lb = p_.cands[c].layout[plan[c]];
        double cost = 0.0;
        bool known = true;
        // Parameters already in the call's layout need no move: reallocation is free.
        if (nt.kind == NodeKind::kData || la != lb) cost = p_.table(nt.table).get(la, lb, known);
        node_cost_[j] = cost;
        known_[j] = known;
        pair_a_[j] = la;
        pair_b_[j] = lb;
        r2a_[j] = atom_lo_[o];
        r2b_[j] = atom_hi_[o];
        if (r2a_[j] <= r1b_[j] && r1a_[j] <= r2b_[j]) {  // overlapping or touching: one range of atoms
            r1a_[j] = std::min(r1a_[j], r2a_[j]);
            r1b_[j] = std::max(r1b_[j], r2b_[j]);
            r2a_[j] = r2b_[j] = 0;
        }
        // A free transfer occupies no device and is no request: its consumer waits only for the producer.
        pass_[j] = cost == 0.0;
        out_latency_[j] = nt.kind == NodeKind::kRealloc && !pass_[j] ? p_.dispatch_latency : 0.0;
    }
    bool exact = true;
    for (size_t j = 0; j < per; ++j) {
        if (known_[j]) continue;
        exact = false;
        if (missing) missing->push_back({p_.iter_nodes[j].table, pair_a_[j], pair_b_[j]});
    }
    if (p_.shares_cores()) {
        // Busy devices each node adds per host: the union of its (at most two) device intervals.
        const int h = p_.host_size();
        host_load_.clear();
        for (size_t j = 0; j < per; ++j) {
            host_start_[j] = static_cast<int32_t>(host_load_.size());
            if (pass_[j]) continue;
            const NodeTemplate& nt = p_.iter_nodes[j];
            int lo1 = p_.cands[nt.call].dev_lo[plan[nt.call]], hi1 = p_.cands[nt.call].dev_hi[plan[nt.call]];
            int lo2 = lo1, hi2 = lo1;
            if (nt.other >= 0) {
                lo2 = p_.cands[nt.other].dev_lo[plan[nt.other]];
                hi2 = p_.cands[nt.other].dev_hi[plan[nt.other]];
            }
            if (lo2 < hi2 && lo2 <= hi1 && lo1 <= hi2) {  // overlapping or touching: one interval
                lo1 = std::min(lo1, lo2);
                hi1 = std::max(hi1, hi2);
                lo2 = hi2 = 0;
            }
            for (const auto& [lo, hi] : {std::pair<int, int>{lo1, hi1}, std::pair<int, int>{lo2, hi2}})
                for (int x = lo; x < hi; x = (x / h + 1) * h) {
                    const int32_t host = x / h;
                    const int32_t count = std::min(hi, (host + 1) * h) - x;
                    if (host_load_.size() > static_cast<size_t>(host_start_[j]) && host_load_.back().first == host)
                        host_load_.back().second += count;
                    else
                        host_load_.emplace_back(host, count);
                }
        }
        host_start_[per] = static_cast<int32_t>(host_load_.size());
    }
    return exact;
}

void Evaluator::record(const int32_t* plan, std::vector<NodeRecord>* records, int v, double start,
                       double end) const {
    const int per = static_cast<int>(p_.iter_nodes.size());
    const NodeTemplate& nt = p_.iter_nodes[v % per];
    NodeRecord r{static_cast<int>(nt.kind), nt.call, nt.other, v / per, start, end,
                 p_.cands[nt.call].dev_lo[plan[nt.call]], p_.cands[nt.call].dev_hi[plan[nt.call]], 0, 0};
    if (nt.other >= 0) {
        r.lo2 = p_.cands[nt.other].dev_lo[plan[nt.other]];
        r.hi2 = p_.cands[nt.other].dev_hi[plan[nt.other]];
    }
    (*records)[v] = r;
}

void Evaluator::release_children(int v, double end) {
    const double ready = end + out_latency_[tmpl_[v]];
    for (int i = p_.child_start[v]; i < p_.child_start[v + 1]; ++i) {
        const int u = p_.children[i];
        ready_[u] = std::max(ready_[u], ready);
        if (--remaining_[u] == 0) {
            heap_.emplace_back(ready_[u], rank_[u]);
            std::push_heap(heap_.begin(), heap_.end(), std::greater<HeapItem>());
        }
    }
}

// Like release_children, but a free transfer whose parents are all done completes at once instead of
// waiting in the queue: it occupies no device and its children rank after it, so it would leave the
// queue before any of them could anyway (the schedule is the same; only the queue does less work).
inline void Evaluator::release_to_queue(int v, double end, const int32_t* plan, std::vector<NodeRecord>* records) {
    const double ready = end + out_latency_[tmpl_[v]];
    for (int i = p_.child_start[v]; i < p_.child_start[v + 1]; ++i) {
        const int u = p_.children[i];
        if (ready_[u] < ready) ready_[u] = ready;
        if (--remaining_[u] != 0) continue;
        if (!pass_[tmpl_[u]]) {
            enqueue(ready_[u], rank_[u]);
            continue;
        }
        // A free transfer completes at once; its children are calls (finalize builds no transfer
        // after a transfer), so one more level of release.
        const double t = ready_[u];
        iter_end_[iter_[u]] = std::max(iter_end_[iter_[u]], t);
        --iter_left_[iter_[u]];
        if (records) record(plan, records, u, t, t);
        for (int k = p_.child_start[u]; k < p_.child_start[u + 1]; ++k) {
            const int w = p_.children[k];
            assert(!pass_[tmpl_[w]] && p_.iter_nodes[tmpl_[w]].kind == NodeKind::kCall);
            if (ready_[w] < t) ready_[w] = t;
            if (--remaining_[w] == 0) enqueue(ready_[w], rank_[w]);
        }
    }
}

bool Evaluator::simulate(const int32_t* plan, std::vector<NodeRecord>* records, double stop_time) {
    const int total = p_.n_nodes();
    const int K = p_.n_iterations;
    const int n_atoms = static_cast<int>(bp_.size()) - 1;
    const size_t per = p_.iter_nodes.size();
    std::fill(free_.begin(), free_.begin() + n_atoms, 0.0);
    std::fill(ready_.begin(), ready_.end(), 0.0);
    std::fill(iter_end_.begin(), iter_end_.end(), 0.0);
    std::fill(iter_left_.begin(), iter_left_.end(), static_cast<int32_t>(per));
    std::copy(p_.n_parents.begin(), p_.n_parents.end(), remaining_.begin());
    if (records) records->assign(total, NodeRecord{});
    ready_list_.clear();
    for (int v = 0; v < total; ++v)
        if (remaining_[v] == 0) enqueue(0.0, rank_[v]);
    const bool bounded = stop_time < std::numeric_limits<double>::infinity();
    // the work left that the bound counts: iterations from `counted` on (evaluate_bounded)
    const int counted = p_.iterations_chain ? 0 : K - 1;
    // The bound follows the atom with the most work per iteration (usually the one that paces the plan).
    int busy = 0;
    double left = 0.0;
    if (bounded) {
        std::fill(work_.begin(), work_.begin() + n_atoms, 0.0);
        for (size_t j = 0; j < per; ++j) {
            if (pass_[j]) continue;
            for (int a = r1a_[j]; a < r1b_[j]; ++a) work_[a] += node_cost_[j];
            for (int a = r2a_[j]; a < r2b_[j]; ++a) work_[a] += node_cost_[j];
        }
        busy = static_cast<int>(std::max_element(work_.begin(), work_.begin() + n_atoms) - work_.begin());
        left = (K - counted) * work_[busy];
    }
    int since_check = 0;
    // rounding in the work sums must never stop a run that would come out just under the limit
    const double stop_span = stop_time * (K - 1) * (1.0 + 1e-9);

    // Algorithm 1: take the ready node with the smallest ready time (ties: the lowest node index);
    // it starts when its mesh's devices are all free.
    while (!ready_list_.empty()) {
        const size_t m = next_ready();
        const ReadyKey key = ready_list_[m];
        ready_list_[m] = ready_list_.back();
        ready_list_.pop_back();
        const double ready = key_time(key);
        const int v = node_of(static_cast<int32_t>(static_cast<uint32_t>(key)));
        const int j = tmpl_[v];
        double start = ready, end = ready;
        if (!pass_[j]) {
            const int a1 = r1a_[j], b1 = r1b_[j], a2 = r2a_[j], b2 = r2b_[j];
            for (int a = a1; a < b1; ++a) start = std::max(start, free_[a]);
            for (int a = a2; a < b2; ++a) start = std::max(start, free_[a]);
            end = start + node_cost_[j];
            for (int a = a1; a < b1; ++a) free_[a] = end;
            for (int a = a2; a < b2; ++a) free_[a] = end;
            if (bounded && iter_[v] >= counted && ((a1 <= busy && busy < b1) || (a2 <= busy && busy < b2)))
                left -= node_cost_[j];
        }
        iter_end_[iter_[v]] = std::max(iter_end_[iter_[v]], end);
        --iter_left_[iter_[v]];
        if (records) record(plan, records, v, start, end);
        release_to_queue(v, end, plan, records);
        if (bounded && iter_left_[0] == 0 && (++since_check & (kBoundEvery - 1)) == 0 && !ready_list_.empty()) {
            const double next = key_time(ready_list_[next_ready()]);
            double t_k = iter_end_[K - 1];
            if (iter_left_[K - 1]) t_k = std::max(t_k, std::max(next, free_[busy]) + left);
            if (t_k - iter_end_[0] > stop_span) return false;
        }
    }
    return true;
}

void Evaluator::simulate_shared(const int32_t* plan, std::vector<NodeRecord>* records) {
    const int per = static_cast<int>(p_.iter_nodes.size());
    const int total = p_.n_nodes();
    const int n_atoms = static_cast<int>(bp_.size()) - 1;
    const double cores = p_.cores_per_node;
    for (int a = 0; a < n_atoms; ++a) {
        queue_[a].clear();
        queue_head_[a] = 0;
    }
    std::fill(ready_.begin(), ready_.end(), 0.0);
    std::fill(iter_end_.begin(), iter_end_.end(), 0.0);
    std::copy(p_.n_parents.begin(), p_.n_parents.end(), remaining_.begin());
    if (records) records->assign(total, NodeRecord{});
    waiting_.clear();
    running_.clear();
    heap_.clear();
    auto later = std::greater<HeapItem>();
    for (int v = 0; v < total; ++v)
        if (remaining_[v] == 0) heap_.emplace_back(0.0, rank(v));
    std::make_heap(heap_.begin(), heap_.end(), later);

    // The atoms of template node j: r1, then the part of r2 outside r1.
    auto for_atoms = [&](int j, auto&& fn) {
        for (int a = r1a_[j]; a < r1b_[j]; ++a) fn(a);
        for (int a = r2a_[j]; a < r2b_[j]; ++a)
            if (a < r1a_[j] || a >= r1b_[j]) fn(a);
    };
    auto finish = [&](int v, double end) {
        const int t = v / per;
        iter_end_[t] = std::max(iter_end_[t], end);
        if (records) record(plan, records, v, start_[v], end);
        release_children(v, end);
    };
    // Processor sharing: a host with more busy devices than cores runs them at cores / busy; a
    // node whose rate changes keeps its remaining work, now done at the new rate.
    auto update_rates = [&](double now) {
        std::fill(host_busy_.begin(), host_busy_.end(), 0.0);
        for (int v : running_)
            for (int k = host_start_[v % per]; k < host_start_[v % per + 1]; ++k)
                host_busy_[host_load_[k].first] += host_load_[k].second;
        for (int v : running_) {
            double rate = 1.0;
            for (int k = host_start_[v % per]; k < host_start_[v % per + 1]; ++k)
                rate = std::min(rate, cores / host_busy_[host_load_[k].first]);
            if (rate != rate_[v]) {
                finish_[v] = now + (finish_[v] - now) * rate_[v] / rate;
                rate_[v] = rate;
            }
        }
    };
    auto dequeue = [&](int v) { for_atoms(v % per, [&](int a) { ++queue_head_[a]; }); };
    auto first_in_line = [&](int v) {
        bool first = true;
        for_atoms(v % per, [&](int a) { first = first && queue_[a][queue_head_[a]] == v; });
        return first;
    };
    // Start node v now; a node of no duration also ends now (returns true).
    auto begin = [&](int v, double now) {
        start_[v] = now;
        if (node_cost_[v % per] == 0.0) {
            dequeue(v);
            finish(v, now);
            return true;
        }
        finish_[v] = now + node_cost_[v % per];
        rate_[v] = 1.0;
        running_.push_back(v);
        return false;
    };
    double now = 0.0;
    while (true) {
        // 1. What ends now leaves its queues, in node order.
        done_.clear();
        for (size_t i = 0; i < running_.size();) {
            if (finish_[running_[i]] <= now) {
                done_.push_back(running_[i]);
                running_.erase(running_.begin() + static_cast<std::ptrdiff_t>(i));
            } else {
                ++i;
            }
        }
        std::sort(done_.begin(), done_.end());
        for (int v : done_) {
            dequeue(v);
            finish(v, now);
        }
        // 2. Nodes already dispatched start when first in line on all their devices (one of no
        //    duration ends at once and may let the next ones start).
        for (bool scan = true; scan;) {
            scan = false;
            for (size_t i = 0; i < waiting_.size();) {
                const int v = waiting_[i];
                if (!first_in_line(v)) {
                    ++i;
                    continue;
                }
                waiting_.erase(waiting_.begin() + static_cast<std::ptrdiff_t>(i));
                if (begin(v, now)) {
                    scan = true;
                    break;
                }
            }
        }
        // 3. Dispatch, one node at a time in Algorithm 1's order, everything ready by now.
        while (!heap_.empty() && heap_.front().first <= now) {
            std::pop_heap(heap_.begin(), heap_.end(), later);
            const auto [ready, r] = heap_.back();
        const int v = node_of(r);
            heap_.pop_back();
            if (pass_[v % per]) {  // a free transfer: no request, no device
                start_[v] = ready;
                finish(v, ready);
                continue;
            }
            for_atoms(v % per, [&](int a) { queue_[a].push_back(v); });
            if (first_in_line(v))
                begin(v, now);
            else
                waiting_.push_back(v);
        }
        update_rates(now);
        double next = std::numeric_limits<double>::infinity();
        for (int v : running_) next = std::min(next, finish_[v]);
        if (!heap_.empty()) next = std::min(next, heap_.front().first);
        if (next == std::numeric_limits<double>::infinity()) break;
        now = next;
    }
}

void Evaluator::check_memory(const int32_t* plan, Evaluation& ev) {
    const int n = p_.n_calls();
    // Sweep the device line over the pipeline-stage boundaries of every call (merged on the fly):
    // between two boundaries each call's stage, hence its memory, is constant. mem_next_[c] is c's
    // next boundary (INT32_MAX after its mesh), mem_stage_[c] its current stage (-1 before its mesh).
    for (int c = 0; c < n; ++c) {
        const Candidates& k = p_.cands[c];
        const int i = plan[c];
        const int home = p_.model_home[p_.call_model[c]];
        mem_copy_[c] = c != home && k.layout[i] != p_.cands[home].layout[plan[home]];
        mem_next_[c] = k.dev_lo[i];
        mem_stage_[c] = -1;
    }
    // Peak = static memory of every model resident on the device + the largest dynamic memory
    // of any call running there (memory.py rules 2-4: calls on one device never overlap in time).
    int64_t peak = -1;
    int x = 0;
    while (x < p_.n_devices) {
        int64_t stat = 0, dyn = 0;
        int dyn_call = -1, next = p_.n_devices;
        for (int c = 0; c < n; ++c) {
            const Candidates& k = p_.cands[c];
            const int i = plan[c];
            if (x == mem_next_[c]) {  // c enters its mesh or its next stage here
                if (x == k.dev_hi[i]) {
                    mem_next_[c] = INT32_MAX;
                    mem_stage_[c] = -1;
                } else {
                    mem_stage_[c] = mem_stage_[c] < 0 ? k.mem_offset[i] : mem_stage_[c] + 1;
                    mem_next_[c] = x + k.stage_width[i];
                }
            }
            next = std::min(next, mem_next_[c]);
            const int64_t s = mem_stage_[c];
            if (s < 0) continue;
            int64_t d = k.mem_dynamic[s];
            if (c == p_.model_home[p_.call_model[c]])
                stat += k.mem_static[s];
            else if (mem_copy_[c])
                d += k.mem_param[s];
            if (d > dyn) {
                dyn = d;
                dyn_call = c;
            }
        }
        if (stat + dyn > peak) {
            peak = stat + dyn;
            ev.peak_device = x;
            ev.peak_call = dyn_call;
        }
        x = next;
    }
    ev.peak_memory = peak;
    ev.overflow = std::max<int64_t>(0, peak - p_.device_memory);
    ev.feasible = peak <= p_.device_memory;
}

void Evaluator::finish(Evaluation& ev) const {
    const int K = p_.n_iterations;
    ev.makespan = iter_end_[K - 1];
    ev.time = (iter_end_[K - 1] - iter_end_[0]) / (K - 1);
    // realhf.txt §5.2 multiplies an OOM plan's time by a large alpha. We scale alpha by
    // (1 + overflow fraction) so that among OOM plans the chain still moves toward ones that fit.
    ev.cost = ev.feasible ? ev.time
                          : ev.time * p_.oom_alpha *
                                (1.0 + static_cast<double>(ev.overflow) / static_cast<double>(p_.device_memory));
}

Evaluation Evaluator::evaluate(const int32_t* plan, std::vector<MissingPair>* missing) {
    Evaluation ev;
    ev.exact = prepare(plan, missing);
    if (p_.shares_cores())
        simulate_shared(plan, nullptr);
    else
        simulate(plan, nullptr);
    check_memory(plan, ev);
    finish(ev);
    return ev;
}

Evaluation Evaluator::evaluate_bounded(const int32_t* plan, double limit, const Evaluation& best) {
    Evaluation ev;
    ev.exact = prepare(plan, nullptr);
    check_memory(plan, ev);
    // A plan that could become the best must be evaluated whole (mcmc.h better(): fitting first).
    if (ev.feasible == best.feasible)
        limit = std::max(limit, best.cost);
    else if (ev.feasible)
        limit = std::numeric_limits<double>::infinity();
    const double factor = ev.feasible ? 1.0 : p_.oom_alpha * (1.0 + static_cast<double>(ev.overflow) /
                                                                        static_cast<double>(p_.device_memory));
    if (p_.shares_cores())
        simulate_shared(plan, nullptr);
    else if (!simulate(plan, nullptr, limit / factor)) {
        ev.complete = false;
        ev.time = ev.cost = limit;  // lower bounds: the plan costs more
        return ev;
    }
    finish(ev);
    return ev;
}

std::vector<NodeRecord> Evaluator::schedule(const int32_t* plan) {
    std::vector<NodeRecord> out;
    out.reserve(p_.n_nodes());
    prepare(plan, nullptr);
    if (p_.shares_cores())
        simulate_shared(plan, &out);
    else
        simulate(plan, &out);
    return out;  // in node order: iteration, then the iteration's node order
}

MemoryReport Evaluator::memory(const int32_t* plan) {
    const int n = p_.n_calls();
    MemoryReport r;
    r.device_static.assign(p_.n_devices, 0);
    r.device_peak.assign(p_.n_devices, 0);
    r.call_peak.assign(n, 0);
    std::vector<int64_t> dyn(p_.n_devices, 0);
    std::vector<std::vector<int64_t>> own(n);
    for (int c = 0; c < n; ++c) {
        const Candidates& k = p_.cands[c];
        const int i = plan[c], lo = k.dev_lo[i], hi = k.dev_hi[i];
        const int home = p_.model_home[p_.call_model[c]];
        own[c].assign(p_.n_devices, 0);
        for (int x = lo; x < hi; ++x) {
            const int64_t s = k.mem_offset[i] + (x - lo) / k.stage_width[i];
            int64_t d = k.mem_dynamic[s];
            if (c == home)
                r.device_static[x] += k.mem_static[s];
            else if (k.layout[i] != p_.cands[home].layout[plan[home]])
                d += k.mem_param[s];
            own[c][x] = d;
            dyn[x] = std::max(dyn[x], d);
        }
    }
    for (int x = 0; x < p_.n_devices; ++x) r.device_peak[x] = r.device_static[x] + dyn[x];
    for (int c = 0; c < n; ++c) {
        const int i = plan[c];
        for (int x = p_.cands[c].dev_lo[i]; x < p_.cands[c].dev_hi[i]; ++x)
            r.call_peak[c] = std::max(r.call_peak[c], r.device_static[x] + own[c][x]);
    }
    return r;
}

}  // namespace rl
