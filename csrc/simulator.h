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
    double time = 0.0;       // steady-state seconds per iteration over the priced window (problem.h)
    double makespan = 0.0;   // end of the last node of the window's last iteration
    double cost = 0.0;       // time, or the OOM-penalized time (realhf.txt §5.2)
    int64_t peak_memory = 0; // bytes on the most loaded device
    int64_t overflow = 0;    // peak_memory - device_memory if positive
    int peak_device = -1;    // lowest device id holding peak_memory
    int peak_call = -1;      // call whose dynamic memory makes that peak (-1: static only)
    bool feasible = false;
    bool exact = true;       // every transfer cost it used was priced (none provisional)
    // False if evaluate_bounded stopped early: memory is exact, time and cost are lower bounds.
    bool complete = true;
    // False if evaluate_bounded proved the plan rejected before simulating it (the path bound).
    bool simulated = true;
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
//
// The MCMC evaluates millions of plans that differ from the previous one in a few calls, so the
// workspace keeps what a plan determines per template node (cost, atoms, latency) and recomputes only
// the nodes of the calls that changed; the simulation loop itself allocates nothing and reads flat
// arrays (simulator.cpp). Restarting the simulation from the first event a change touches (keeping
// the schedule's prefix) was measured and not done: a move changes a node that runs within the first
// few of the 84 events of a PPO graph (the first iteration's reallocations from the train layouts).
class Evaluator {
public:
    explicit Evaluator(const Problem& problem);

    // `missing`, if given, receives the unpriced pair costs the evaluation used.
    Evaluation evaluate(const int32_t* plan, std::vector<MissingPair>* missing = nullptr);
    // evaluate(), except that it may stop as soon as the plan is proven to cost more than `limit` and to
    // be no better than `best` (mcmc.h's better()); it then returns complete = false. Memory is checked
    // first; once the priced window's first iteration is done (T_first is known; problem.h), T_last is bounded below by
    // max(next ready time, atom free) + the work left on that atom, for the atom with the most work:
    // nodes leave the queue in order of ready time, none starts before it is ready or before its
    // atoms are free, and the work left on one atom runs one node after another (this part only when
    // every node precedes the last iteration's end, Problem::iterations_chain). Before simulating, the
    // path bound (paths_exceed) may already prove it.
    Evaluation evaluate_bounded(const int32_t* plan, double limit, const Evaluation& best);
    std::vector<NodeRecord> schedule(const int32_t* plan);
    MemoryReport memory(const int32_t* plan);

    const Problem& problem() const { return p_; }

private:
    // What one template node (a node of one iteration) costs under the current plan; the loop reads
    // one of these per node, so they sit together.
    struct Slot {
        double cost = 0.0;
        double latency = 0.0;           // delay on its edges to its children
        int32_t a1 = 0, b1 = 0;         // atoms [a1, b1) and [a2, b2) it occupies
        int32_t a2 = 0, b2 = 0;
        int32_t pass = 0;               // a free transfer: no device, no request
        int32_t known = 1;              // its pair cost is priced
        double busy_cost = 0.0;         // bounded runs: the work it takes off the busiest atom (simulator.cpp)
        int32_t joined = 0;             // call node of a fused pair: 1 the first call's, 2 the second's (fused_node.h)
        // a migrating generation's phase 1 (tail.cpp): atoms [a1, mid) stay busy `hold` seconds longer
        double hold = 0.0;
        int32_t mid = 0;
    };
    // A node of the unrolled graph, numbered by dispatch rank (see rank()): template, iteration and its
    // children (ranks, in children_).
    struct Link {
        int32_t tmpl, iter, child_begin, child_end;
    };

    bool prepare(const int32_t* plan, std::vector<MissingPair>* missing);
    void place_atoms_if_stale(const int32_t* plan);
    void price(int j, const int32_t* plan);
    // Returns false if it stopped because the steady-state time was proven above `stop_time`.
    bool simulate(const int32_t* plan, std::vector<NodeRecord>* records,
                  double stop_time = std::numeric_limits<double>::infinity());
    template <bool kBounded, bool kRecords, bool kFused>
    bool run(const int32_t* plan, std::vector<NodeRecord>* records, double stop_time);
    void finish(Evaluation& ev) const;
    void simulate_shared(const int32_t* plan, std::vector<NodeRecord>* records);  // shared_cores.cpp
    void record(const int32_t* plan, std::vector<NodeRecord>* records, int v, double start, double end) const;
    void release_children(int v, double end);
    void check_memory(const int32_t* plan, Evaluation& ev);  // memory.cpp
    // Fused pairs (fused_node.cpp): which are on under `plan`, their nodes' price, their memory.
    void setup_fused();
    bool price_fused(const int32_t* plan, std::vector<MissingPair>* missing);
    bool check_fused_memory(const int32_t* plan, Evaluation& ev);
    void fused_memory_report(const int32_t* plan, MemoryReport& r);
    void find_paths();
    // bounded staleness (stale.cpp): the gates `plan` opens (their nodes with parents) into open_gates_
    void open_gates(const int32_t* plan);
    std::vector<int32_t> open_gates_;
    // long-tail migration (tail.cpp)
    void init_tail(std::vector<std::vector<int32_t>>& nodes_of);
    int tail_split_device(int i, const int32_t* plan) const;
    int split_grid(int s, const int32_t* plan) const;
    void price_tail(int j, const int32_t* plan);
    // A transfer template node's price from layouts (la, lb): its slot, and the pair it was priced for.
    void set_transfer(int j, Slot& s, int la, int lb, double cost, bool known);
    void place_tail_atoms();
    std::vector<uint8_t> tail_tmpl_;  // per template node: priced by price_tail
    std::vector<int32_t> tmpl_split_, atom_split_;
    // True if the steady-state time is proven above `stop_time` without simulating: see find_paths().
    bool paths_exceed(double stop_time);
    // Dispatch order among nodes ready at the same time: data transfers first (the master sends a
    // call's outputs on as soon as it finishes, before what its end unblocks), then node order.
    // simulate() numbers nodes by this rank, so that its ready keys carry the node itself.
    int rank(int v) const { return pos_[v]; }
    int node_of(int r) const { return order_[r]; }
    // simulate()'s ready queue holds each node as one 128-bit key that orders like (ready time, rank) (a
    // non-negative double's bits order like the double), sorted: the next node is the first.
    using ReadyKey = unsigned __int128;
    static ReadyKey ready_key(double ready, int32_t rank) {
        uint64_t bits;
        std::memcpy(&bits, &ready, sizeof bits);
        // built from two 64-bit halves: GCC otherwise goes through the stack
        const uint64_t low = bits << 32 | static_cast<uint32_t>(rank);
        return static_cast<ReadyKey>(bits >> 32) << 64 | low;
    }
    static double key_time(ReadyKey key) {
        const uint64_t bits = static_cast<uint64_t>(key >> 32);
        double t;
        std::memcpy(&t, &bits, sizeof t);
        return t;
    }

    const Problem& p_;
    int per_ = 0;  // template nodes per iteration
    // the unrolled graph by rank: order_[rank] = node, pos_[node] = rank; links, children, parent counts
    // and the nodes without parents (ascending) in rank numbering
    std::vector<int32_t> order_, pos_;
    std::vector<Link> link_;
    std::vector<int32_t> children_, n_parents_, roots_;
    std::vector<uint8_t> fast_;  // per rank: its children all rank after it (run()'s release of free nodes)
    // per call: the template nodes whose cost or atoms depend on its candidate (it runs or it feeds them)
    std::vector<int32_t> call_nodes_start_, call_nodes_;
    // per template node: its call, the source call of a transfer (-1 for a call) and its pair-cost table
    std::vector<int32_t> tmpl_call_, tmpl_other_;
    std::vector<const PairCosts*> tmpl_table_;
    // the path bound (find_paths): for each pair (x, y) of the n_last_ template nodes that may end an
    // iteration, whether x in one iteration leads to y in the next, and a path as (predecessor, node)
    // template pairs after x; chain_ is its workspace
    int n_last_ = 0;
    std::vector<uint8_t> path_exists_;
    std::vector<int32_t> path_start_, path_pred_, path_node_;
    std::vector<double> chain_;
    // time atoms: every call's mesh ends as (device << 32 | 2 * call + (1 for the upper end)), sorted, and
    // each call's atom range
    std::vector<uint64_t> ends_;
    std::vector<int32_t> atom_lo_, atom_hi_;
    int n_atoms_ = 0;
    bool atoms_stale_ = true;  // a mesh moved since the atoms were cut
    std::vector<Slot> slot_;
    std::vector<uint8_t> pass_;  // per template node: Slot::pass, where the release loop looks it up
    std::vector<int32_t> pair_a_, pair_b_;  // per template node: the pair it prices (transfers only)
    std::vector<uint8_t> in_place_;  // per template node: a reallocation on the destination's devices only
    int n_unknown_ = 0;                     // template nodes whose pair cost is not priced
    // what prepare() last computed from (valid while the problem's pair_version is cache_version_)
    std::vector<int32_t> last_plan_, changed_calls_, seen_;
    int32_t stamp_ = 0;
    uint64_t cache_version_ = ~0ull;
    // per template node: (host, busy devices) it adds while it runs (shared-core mode only)
    std::vector<int32_t> host_start_;
    std::vector<std::pair<int32_t, int32_t>> host_load_;
    // scheduling state of simulate(): per node by rank, when it is ready and how many parents it waits
    // for; per iteration, its end so far and its nodes not done yet; the ready queue
    struct NodeState {
        double ready;
        int32_t remaining;
    };
    struct IterState {
        double end;
        int32_t left;
    };
    std::vector<NodeState> state_, start_state_;  // start_state_: ready at 0, waiting for every parent
    std::vector<IterState> iter_;
    std::vector<ReadyKey> queue_;
    std::vector<double> free_, left_;  // per atom: free from (both simulations); scratch of bounded runs
    // simulate_shared's, by node
    std::vector<double> ready_, iter_end_;
    std::vector<int32_t> remaining_;
    // shared-core mode: dispatch heap, per-atom FIFO queues of node ids, waiting and running nodes
    std::vector<std::pair<double, int32_t>> heap_;
    std::vector<std::vector<int32_t>> fifo_;
    std::vector<size_t> fifo_head_;
    std::vector<int32_t> waiting_, running_, done_;
    std::vector<double> finish_, rate_, start_, host_busy_;
    // per call while sweeping the device line for memory: next boundary, next run, static and dynamic bytes
    std::vector<int32_t> mem_next_;
    std::vector<int64_t> mem_run_, mem_stat_, mem_dyn_;
    std::vector<uint8_t> mem_copy_, mem_keep_, mem_home_;
    // fused pairs: per call its call node's template, per template node its partner's while its pair is on (else
    // -1), per pair whether it is on, how many are; per rank whether a fused node's first call waits (run())
    std::vector<int32_t> call_tmpl_, joint_;
    std::vector<uint8_t> fused_on_, arrived_;
    int n_fused_on_ = 0;
};

}  // namespace rl
