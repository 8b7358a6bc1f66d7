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
#include <cstring>
#include <limits>
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
    // False if evaluate_bounded stopped early: memory is exact, time and cost are lower bounds.
    bool complete = true;
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
    // evaluate(), except that it may stop as soon as the plan is proven to cost more than `limit` and to
    // be no better than `best` (mcmc.h's better()); it then returns complete = false. Memory is checked
    // first; once the first iteration's nodes are all done (T_1 is known), T_K is bounded below by
    // max(next ready time, atom free) + the work left on that atom, for the atom with the most work:
    // nodes leave the queue in order of ready time, none starts before it is ready or before its
    // atoms are free, and the work left on one atom runs one node after another. The work left counts
    // every iteration when every node precedes the last iteration's end (Problem::iterations_chain),
    // else the last iteration's.
    Evaluation evaluate_bounded(const int32_t* plan, double limit, const Evaluation& best);
    std::vector<NodeRecord> schedule(const int32_t* plan);
    MemoryReport memory(const int32_t* plan);

    const Problem& problem() const { return p_; }

private:
    bool prepare(const int32_t* plan, std::vector<MissingPair>* missing);
    // Returns false if it stopped because the steady-state time was proven above `stop_time`.
    bool simulate(const int32_t* plan, std::vector<NodeRecord>* records,
                  double stop_time = std::numeric_limits<double>::infinity());
    void finish(Evaluation& ev) const;
    void simulate_shared(const int32_t* plan, std::vector<NodeRecord>* records);
    void record(const int32_t* plan, std::vector<NodeRecord>* records, int v, double start, double end) const;
    void release_children(int v, double end);
    void release_to_queue(int v, double end, const int32_t* plan, std::vector<NodeRecord>* records);
    // Dispatch order among nodes ready at the same time: data transfers first (the master sends a
    // call's outputs on as soon as it finishes, before what its end unblocks), then node order.
    int rank(int v) const { return rank_[v]; }
    int node_of(int r) const { return r < p_.n_nodes() ? r : r - p_.n_nodes(); }
    // The ready list of simulate(): unordered, each node as one 128-bit key that orders like (ready time,
    // rank) (a non-negative double's bits order like the double), so that taking the next node is a
    // branch-free minimum over the few nodes ready at a time.
    using ReadyKey = unsigned __int128;
    static ReadyKey ready_key(double ready, int32_t rank) {
        uint64_t bits;
        std::memcpy(&bits, &ready, sizeof bits);
        return (static_cast<ReadyKey>(bits) << 32) | static_cast<uint32_t>(rank);
    }
    static double key_time(ReadyKey key) {
        const uint64_t bits = static_cast<uint64_t>(key >> 32);
        double t;
        std::memcpy(&t, &bits, sizeof t);
        return t;
    }
    void enqueue(double ready, int32_t rank) { ready_list_.push_back(ready_key(ready, rank)); }
    size_t next_ready() const {
        size_t m = 0;
        for (size_t i = 1; i < ready_list_.size(); ++i) m = ready_list_[i] < ready_list_[m] ? i : m;
        return m;
    }
    void check_memory(const int32_t* plan, Evaluation& ev);

    const Problem& p_;
    // per node of the unrolled graph: its template node, its iteration and its dispatch rank
    std::vector<int32_t> tmpl_, iter_, rank_;
    // time atoms
    std::vector<int32_t> bp_, atom_lo_, atom_hi_;
    std::vector<double> free_;
    std::vector<double> work_;  // per atom: busy seconds per iteration (bounded runs)
    // per-iteration node costs and atom ranges
    std::vector<double> node_cost_;
    std::vector<int32_t> r1a_, r1b_, r2a_, r2b_;
    std::vector<uint8_t> pass_;
    std::vector<double> out_latency_;  // per template node: delay on its edges to its children
    // what prepare() last computed from: the plan, and per template node whether its pair cost is
    // priced and which pair it is (valid while the problem's pair_version is cache_version_)
    std::vector<int32_t> last_plan_;
    std::vector<uint8_t> changed_, known_;
    std::vector<int32_t> pair_a_, pair_b_;
    uint64_t cache_version_ = ~0ull;
    // per template node: (host, busy devices) it adds while it runs (shared-core mode only)
    std::vector<int32_t> host_start_;
    std::vector<std::pair<int32_t, int32_t>> host_load_;
    // scheduling state
    std::vector<double> ready_, iter_end_;
    std::vector<int32_t> remaining_, iter_left_;  // per iteration: nodes not finished yet
    std::vector<std::pair<double, int32_t>> heap_;  // simulate_shared's dispatch queue
    std::vector<ReadyKey> ready_list_;
    // shared-core mode: per-atom FIFO queues of node ids, dispatched-but-waiting and running nodes
    std::vector<std::vector<int32_t>> queue_;
    std::vector<size_t> queue_head_;
    std::vector<int32_t> waiting_, running_, done_;
    std::vector<double> finish_, rate_, start_, host_busy_;
    // per call while sweeping the device line for memory: its stage, next boundary, whether it runs on a copy
    std::vector<int64_t> mem_stage_;
    std::vector<int32_t> mem_next_;
    std::vector<uint8_t> mem_copy_;
};

}  // namespace rl
