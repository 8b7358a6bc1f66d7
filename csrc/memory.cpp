// Memory side of the simulator (simulator.h): every device's peak under a plan, with the estimator's
// rules (realloc/estimator/memory.py; realhf.txt Table 2).
#include <algorithm>
#include <climits>

#include "fused_node.h"
#include "simulator.h"

namespace rl {

void Evaluator::check_memory(const int32_t* plan, Evaluation& ev) {
    if (!p_.fused.empty() && check_fused_memory(plan, ev)) return;  // a fused pair on (fused_node.cpp)
    const int n = p_.n_calls();
    // Sweep the device line over the boundaries of every call's memory runs (Candidates::run_device, merged
    // on the fly): between two boundaries each call's stage bytes are constant. Per call: its next boundary
    // (INT32_MAX after its mesh), its next run, and the static and dynamic bytes it puts on the devices
    // there; `stat` is the sum of the static bytes, kept as calls enter and leave runs rather than summed
    // again at every boundary. A boundary where nothing changes would split a segment into two with the
    // same bytes, so the peak and the first device holding it are those of a sweep over every stage.
    int32_t* next_of = mem_next_.data();
    int64_t* run = mem_run_.data();
    int64_t* stat_of = mem_stat_.data();
    int64_t* dyn_of = mem_dyn_.data();
    for (int c = 0; c < n; ++c) {
        const Candidates& k = p_.cands[c];
        const int i = plan[c];
        const int home = p_.model_home[p_.call_model[c]];
        mem_copy_[c] = c != home && k.layout[i] != p_.cands[home].layout[plan[home]];
        // A stale call's copy (bounded staleness) stays between its calls: generation runs ahead on it.
        mem_keep_[c] = mem_copy_[c] && p_.staleness > 0 && !p_.stale.empty() && p_.stale[c];
        next_of[c] = k.dev_lo[i];
        run[c] = k.run_offset[i];
        stat_of[c] = dyn_of[c] = 0;
    }
    // Peak = static memory of every model resident on the device + the largest dynamic memory
    // of any call running there (memory.py rules 2-4: calls on one device never overlap in time).
    int64_t peak = -1, stat = 0;
    // With pools, the largest excess of a device's bytes over its pool's memory (segments end at pool starts).
    const int n_pools = static_cast<int>(p_.pool_start.size());
    int64_t excess = INT64_MIN;
    int pool = 0;
    int x = 0;
    while (x < p_.n_devices) {
        int64_t dyn = 0;
        int dyn_call = -1, next = p_.n_devices;
        for (int c = 0; c < n; ++c) {
            if (x == next_of[c]) {  // c enters its mesh, its next run, or leaves its mesh here
                const Candidates& k = p_.cands[c];
                const int i = plan[c];
                stat -= stat_of[c];
                if (x == k.dev_hi[i]) {
                    next_of[c] = INT32_MAX;
                    stat_of[c] = dyn_of[c] = 0;
                } else {
                    const int64_t r = run[c]++;
                    const int64_t s = k.run_stage[r];
                    next_of[c] = r + 1 < k.run_offset[i + 1] ? k.run_device[r + 1] : k.dev_hi[i];
                    stat_of[c] = mem_home_[c] ? k.mem_static[s] : mem_keep_[c] ? k.mem_param[s] : 0;
                    dyn_of[c] = k.mem_dynamic[s] + (mem_copy_[c] && !mem_keep_[c] ? k.mem_param[s] : 0);
                }
                stat += stat_of[c];
            }
            next = std::min(next, next_of[c]);
            if (dyn_of[c] > dyn) {
                dyn = dyn_of[c];
                dyn_call = c;
            }
        }
        if (stat + dyn > peak) {
            peak = stat + dyn;
            ev.peak_device = x;
            ev.peak_call = dyn_call;
        }
        if (n_pools) {
            while (pool + 1 < n_pools && p_.pool_start[pool + 1] <= x) ++pool;
            if (pool + 1 < n_pools) next = std::min(next, p_.pool_start[pool + 1]);
            excess = std::max(excess, stat + dyn - p_.pool_memory[pool]);
        }
        x = next;
    }
    ev.peak_memory = peak;
    ev.overflow = std::max<int64_t>(0, n_pools ? excess : peak - p_.device_memory);
    ev.feasible = n_pools ? excess <= 0 : peak <= p_.device_memory;
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
            const int64_t s = k.mem_offset[i] + stage_at(p_, plan, c, x);  // fused_node.cpp: reversed stages
            int64_t d = k.mem_dynamic[s];
            const bool keep = p_.staleness > 0 && !p_.stale.empty() && p_.stale[c];
            if (c == home)
                r.device_static[x] += k.mem_static[s];
            else if (k.layout[i] != p_.cands[home].layout[plan[home]])
                (keep ? r.device_static[x] : d) += k.mem_param[s];
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
    if (!p_.fused.empty()) fused_memory_report(plan, r);  // fused_node.cpp
    return r;
}

}  // namespace rl
