// Shared-core mode of the simulator (simulator.h): when a host's devices can outnumber its CPU cores,
// nodes running at the same time slow each other down, so durations depend on what overlaps. This
// event-driven version of Algorithm 1 keeps per-device queues in dispatch order and recomputes the
// rates at every start and end; it equals simulate() whenever no host is oversubscribed.
#include <algorithm>
#include <functional>
#include <limits>

#include "simulator.h"

namespace rl {

void Evaluator::simulate_shared(const int32_t* plan, std::vector<NodeRecord>* records) {
    place_atoms_if_stale(plan);
    const int per = static_cast<int>(p_.iter_nodes.size());
    const int total = p_.n_nodes();
    const int n_atoms = n_atoms_;
    const double cores = p_.cores_per_node;
    for (int a = 0; a < n_atoms; ++a) {
        fifo_[a].clear();
        fifo_head_[a] = 0;
    }
    std::fill(ready_.begin(), ready_.end(), 0.0);
    std::fill(iter_end_.begin(), iter_end_.end(), 0.0);
    std::copy(p_.n_parents.begin(), p_.n_parents.end(), remaining_.begin());
    open_gates(plan);
    for (int32_t v : open_gates_) remaining_[v] = 0;  // ready at 0, their parents ignored (stale.h)
    if (records) records->assign(total, NodeRecord{});
    waiting_.clear();
    running_.clear();
    heap_.clear();
    auto later = std::greater<std::pair<double, int32_t>>();
    for (int v = 0; v < total; ++v)
        if (remaining_[v] == 0) heap_.emplace_back(0.0, rank(v));
    std::make_heap(heap_.begin(), heap_.end(), later);

    // The atoms of template node j: r1, then the part of r2 outside r1.
    auto for_atoms = [&](int j, auto&& fn) {
        for (int a = slot_[j].a1; a < slot_[j].b1; ++a) fn(a);
        for (int a = slot_[j].a2; a < slot_[j].b2; ++a)
            if (a < slot_[j].a1 || a >= slot_[j].b1) fn(a);
    };
    // A fused pair's call nodes run as one node (fused_node.h): the first to leave the queue waits, without
    // devices, for the other, which runs the fused node and, as it ends, ends the waiting one first.
    const bool fused = n_fused_on_ > 0;
    if (fused) std::fill(arrived_.begin(), arrived_.end(), 0);
    auto partner = [&](int v) { return joint_[v % per] < 0 ? -1 : v / per * per + joint_[v % per]; };
    auto finish_one = [&](int v, double end) {
        const int t = v / per;
        iter_end_[t] = std::max(iter_end_[t], end);
        if (records) record(plan, records, v, start_[v], end);
        release_children(v, end);
    };
    auto finish = [&](int v, double end) {
        const int q = fused ? partner(v) : -1;
        if (q >= 0 && arrived_[q]) {
            arrived_[q] = 0;
            start_[q] = start_[v];
            finish_one(q, end);
        }
        finish_one(v, end);
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
    auto dequeue = [&](int v) { for_atoms(v % per, [&](int a) { ++fifo_head_[a]; }); };
    auto first_in_line = [&](int v) {
        bool first = true;
        for_atoms(v % per, [&](int a) { first = first && fifo_[a][fifo_head_[a]] == v; });
        return first;
    };
    // Start node v now; a node of no duration also ends now (returns true).
    auto begin = [&](int v, double now) {
        start_[v] = now;
        if (slot_[v % per].cost == 0.0) {
            dequeue(v);
            finish(v, now);
            return true;
        }
        finish_[v] = now + slot_[v % per].cost;
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
            if (slot_[v % per].pass) {  // a free transfer: no request, no device
                start_[v] = ready;
                finish(v, ready);
                continue;
            }
            if (fused && partner(v) >= 0 && !arrived_[partner(v)]) {
                arrived_[v] = 1;  // runs with the other call, once that is ready too
                continue;
            }
            for_atoms(v % per, [&](int a) { fifo_[a].push_back(v); });
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

}  // namespace rl
