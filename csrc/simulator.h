// Plan simulator: time (realhf.txt §5.1, Algorithm 1) and memory (§5.1, Table 2) of one plan.
//
// Devices are handled as "atoms": the call meshes of a plan cut the device line [0, n_devices)
// into at most 2 * n_calls + 1 intervals whose devices always do the same thing, so the
// scheduler tracks one free-time per atom instead of one per device. This is exact because every
// node's device set is one call mesh or the union of two.
//
// Time. Algorithm 1 (realhf-appendix.txt) takes the ready node with the smallest ready time (ties:
// data transfers first, then the lowest node index) and starts it once all its devices are free.
// That is the runtime's behaviour: the master dispatches a node when its dependencies are done
// (plus the dispatch latency, Problem::dispatch_latency), a finished call's outputs before
// anything else its end unblocks, and every worker runs its requests in arrival order.
//
// Shared cores. When a host's devices can outnumber its CPU cores (Problem::shares_cores), nodes
// running at the same time slow each other down: a host with b busy devices and c < b cores runs
// each at rate c / b (processor sharing), and a node spanning hosts runs at its slowest host's
// rate. Durations then depend on what overlaps, so that case runs an event-driven version of the
// same schedule (per-device queues in dispatch order; rates recomputed at every start and end),
// which equals Algorithm 1 whenever no host is oversubscribed.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "problem.h"

namespace rl {

struct Evaluation {
    double time = 0.0;       // steady-state seconds per iteration: (T_K - T_1) / (K - 1)
    double makespan = 0.0;   // end of the last node of iteration K
    double cost = 0.0;       // time, or the OOM-penalized time (realhf.txt §5.2)
    int64_t peak_memory = 0; // bytes on the most loaded device
    int64_t overflow = 0;    // peak_memory - device_memory if positive
    int peak_device = -1;    // lowest device id holding peak_memory
    int peak_call = -1;      // call whose dynamic memory makes that peak (-1: static only)
    bool feasible = false;
    bool exact = true;       // every transfer cost it used was priced (none provisional)
};

struct NodeRecord {
    int kind;       // NodeKind
    int call;       // the call this node runs or feeds
    int other;      // realloc: home call; data: producing call; call: -1
    int iteration;
    double start, end;
    int lo1, hi1, lo2, hi2;  // device intervals; lo2 == hi2 when there is one
};

struct MemoryReport {
    std::vector<int64_t> device_static;  // per device
    std::vector<int64_t> device_peak;    // per device: static + the largest dynamic
    std::vector<int64_t> call_peak;      // per call: the largest static + own dynamic over its mesh
};

// Reusable evaluation workspace. Not thread-safe: use one per thread.
class Evaluator {
public:
    explicit Evaluator(const Problem& problem);

    // `missing`, if given, receives the unpriced pair costs the evaluation used.
    Evaluation evaluate(const int32_t* plan, std::vector<MissingPair>* missing = nullptr);
    std::vector<NodeRecord> schedule(const int32_t* plan);
    MemoryReport memory(const int32_t* plan);

    const Problem& problem() const { return p_; }

private:
    bool prepare(const int32_t* plan, std::vector<MissingPair>* missing);
    void simulate(const int32_t* plan, std::vector<NodeRecord>* records);
    void simulate_shared(const int32_t* plan, std::vector<NodeRecord>* records);
    void record(const int32_t* plan, std::vector<NodeRecord>* records, int v, double start, double end) const;
    void release_children(int v, double end);
    // Dispatch order among nodes ready at the same time: data transfers first (the master sends a
    // call's outputs on as soon as it finishes, before what its end unblocks), then node order.
    int rank(int v) const {
        const int per = static_cast<int>(p_.iter_nodes.size());
        return p_.iter_nodes[v % per].kind == NodeKind::kData ? v : v + p_.n_nodes();
    }
    int node_of(int r) const { return r < p_.n_nodes() ? r : r - p_.n_nodes(); }
    void check_memory(const int32_t* plan, Evaluation& ev);

    const Problem& p_;
    // time atoms
    std::vector<int32_t> bp_, atom_lo_, atom_hi_;
    std::vector<double> free_;
    // per-iteration node costs and atom ranges
    std::vector<double> node_cost_;
    std::vector<int32_t> r1a_, r1b_, r2a_, r2b_;
    std::vector<uint8_t> pass_;
    std::vector<double> out_latency_;  // per template node: delay on its edges to its children
    // per template node: (host, busy devices) it adds while it runs (shared-core mode only)
    std::vector<int32_t> host_start_;
    std::vector<std::pair<int32_t, int32_t>> host_load_;
    // scheduling state
    std::vector<double> ready_, iter_end_;
    std::vector<int32_t> remaining_;
    std::vector<std::pair<double, int32_t>> heap_;
    // shared-core mode: per-atom FIFO queues of node ids, dispatched-but-waiting and running nodes
    std::vector<std::vector<int32_t>> queue_;
    std::vector<size_t> queue_head_;
    std::vector<int32_t> waiting_, running_, done_;
    std::vector<double> finish_, rate_, start_, host_busy_;
    // memory atoms
    std::vector<int32_t> mbp_;
};

}  // namespace rl
