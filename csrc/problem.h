// The search problem as plain arrays: candidate placements per call, the dataflow graph, and
// the transfer costs between layouts. Python (realloc/search/problem.py) fills it; the
// simulator and the MCMC only read it. No I/O here.
#pragma once

#include <array>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "stale.h"
#include "tail.h"

namespace rl {

// Every placement (mesh, strategy, n_mbs) one call may take, column by column.
// A mesh is a contiguous interval [dev_lo, dev_hi) of global device ids (cluster.py: meshes are
// aligned blocks inside a node or runs of whole nodes). Pipeline stage k holds devices
// [dev_lo + k * stage_width, dev_lo + (k + 1) * stage_width) (rank order tp, dp, pp).
struct Candidates {
    std::vector<int32_t> dev_lo, dev_hi;
    std::vector<int32_t> stage_width;  // devices per pipeline stage = dp * tp
    std::vector<int32_t> layout;       // (mesh, strategy) id inside the call's model; indexes pair costs
    std::vector<int32_t> mesh_id;      // cluster mesh id (groups for "same mesh" moves)
    std::vector<int32_t> shape_class;  // (mesh shape, strategy, n_mbs, recompute) id (groups for "move the mesh")
    // The same placement with the other activation-recomputation choice (a training call's second
    // dimension besides n_mbs), or -1; twin[twin[i]] == i. Only the MCMC's moves read it.
    std::vector<int32_t> twin;
    // 1: every device of the mesh holds the whole model (tp 1, pp 1), so a reallocation from it into a mesh
    // inside it copies in place (Problem::in_place). Empty: none does.
    std::vector<int32_t> whole;
    std::vector<double> time;          // seconds, the call alone
    // Bytes per device of each pipeline stage: candidate i's stages are entries
    // [mem_offset[i], mem_offset[i + 1]) of the pools (one per stage, pp of them).
    std::vector<int64_t> mem_offset;
    std::vector<int64_t> mem_static;   // counted once per model, from its home call's candidate
    std::vector<int64_t> mem_dynamic;  // while the call runs: activations, KV cache
    std::vector<int64_t> mem_param;    // the model's parameters in this layout (a reallocated copy)
    // Derived by Problem::finalize(): candidate i's stages grouped into runs of consecutive stages with
    // the same bytes (the middle stages of a pipeline usually are), entries [run_offset[i],
    // run_offset[i + 1]): the run's first device and the pool index of its first stage. The memory
    // check sweeps runs instead of stages.
    std::vector<int32_t> run_offset, run_device;
    std::vector<int64_t> run_stage;

    int size() const { return static_cast<int>(time.size()); }
    bool holds_whole(int i) const { return !whole.empty() && whole[i]; }
};

// Seconds to move something from layout `a` to layout `b`. Costs are priced lazily by the
// estimator; a pair not priced yet reads as `provisional` and makes an evaluation inexact.
// Reads are thread-safe; writes happen only between search runs.
class PairCosts {
public:
    int rows = 0, cols = 0;
    double provisional = 0.0;

    void set(int a, int b, double seconds);
    // The cost of (a, b), or `provisional` if unknown; `known` tells which.
    double get(int a, int b, bool& known) const {
        if (keys_.empty()) {
            known = false;
            return provisional;
        }
        const uint64_t key = pack(a, b);
        for (size_t i = mix(key) & mask_;; i = (i + 1) & mask_) {
            if (keys_[i] == key) {
                known = true;
                return values_[i];
            }
            if (keys_[i] == kEmpty) {
                known = false;
                return provisional;
            }
        }
    }
    size_t n_known() const { return n_; }

private:
    static constexpr uint64_t kEmpty = ~0ull;
    static uint64_t pack(int a, int b) { return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b); }
    static uint64_t mix(uint64_t x) {
        x ^= x >> 33;
        x *= 0xff51afd7ed558ccdull;
        x ^= x >> 33;
        return x;
    }
    void grow();
    std::vector<uint64_t> keys_;
    std::vector<double> values_;
    size_t mask_ = 0, n_ = 0;
};

struct DataEdge {
    int src = 0, dst = 0;
    PairCosts cost;  // src model layouts x dst model layouts
};

// kTail, kPartData, kPart: long-tail migration (tail.h): a migrating call's tail, a split consumer's part-1
// transfer and part 1.
enum class NodeKind : uint8_t { kCall = 0, kRealloc = 1, kData = 2, kTail = 3, kPartData = 4, kPart = 5, kGate = 6 };

// One node of the augmented graph of one iteration (realhf.txt §4, Figure 6).
struct NodeTemplate {
    NodeKind kind;
    int call;   // the call this node runs or feeds
    int other;  // realloc: the model's previous call (source layout); data: the producing call
    int table;  // pair-cost table id (realloc: model; data: n_models + edge); -1 for calls
};

// A pair cost an evaluation needed but that is not priced yet.
struct MissingPair {
    int table, a, b;
    bool operator<(const MissingPair& o) const {
        return table != o.table ? table < o.table : a != o.a ? a < o.a : b < o.b;
    }
    bool operator==(const MissingPair& o) const { return table == o.table && a == o.a && b == o.b; }
};

// A pair of train calls the plan may fuse (fused_node.h): one plan entry after the calls' says whether it does.
struct FusedPair {
    int a = 0, b = 0;                    // the calls (a's stage order; b's stages reversed on the same mesh)
    PairCosts saving;                    // (a's candidate, b's) -> seconds per iteration fusion saves
    PairCosts extra;                     // (a's candidate, b's) -> activation bytes fusion adds per device
    std::vector<double> bound_a, bound_b;  // per candidate: at most what fusion can save (unpriced pairs)
};

struct Problem {
    int n_devices = 0;
    int n_iterations = 4;
    // The priced window (docs/search.md, "The price of a plan"): a plan costs (T_last - T_first) / (last - first)
    // seconds per iteration, T_t being the end of iteration t's last node, first = warmup and last =
    // n_iterations - 1 - lookahead (0-based). The warm-up iterations are the start-up transient (generation running
    // ahead at staleness > 0); the lookahead iterations are simulated only so that the last priced iteration's calls
    // queue behind the next iteration's, as in a long run (a plan that overlaps iterations is priced low without).
    // 0 and 0: (T_K - T_1) / (K - 1) over the whole unrolled graph.
    int warmup = 0;
    int lookahead = 0;
    int64_t device_memory = 0;
    double oom_alpha = 100.0;
    // Seconds from the end of a call or reallocation on its devices until the runtime's master has
    // dispatched the requests that waited for it (reply, scheduling, request message): a delay on
    // every edge out of a call or reallocation node. A call queued behind a data transfer on its
    // workers follows it without a round trip through the master, so edges out of transfer nodes
    // have none. 0 models an ideal dispatcher.
    double dispatch_latency = 0.0;
    // Hosts ("nodes") of devices_per_node consecutive devices share cores_per_node CPU cores; a
    // device that runs something needs one (CPU devices run one thread each). 0 = enough cores.
    int devices_per_node = 0;
    double cores_per_node = 0.0;
    std::vector<int32_t> call_model;  // model of each call; calls are numbered in topological order
    std::vector<int32_t> model_home;  // the call whose layout holds the model's static memory
    std::vector<Candidates> cands;
    std::vector<std::array<int, 2>> order_edges;  // (u, v) inside one iteration, no transfer
    std::vector<std::array<int, 2>> carry_edges;  // (u at t, v at t+1): parameter versions
    std::vector<DataEdge> data_edges;             // (u, v) inside one iteration, with a transfer node
    std::vector<PairCosts> realloc;               // per model: home layout -> call layout
    // Bounded staleness (asynchronous RL, issue 25): with staleness eta > 0 the calls marked in `stale`
    // (generation of a trained model) leave their model's chain of reallocations. Before each call c of them a
    // snapshot node copies the parameters from the model's last non-stale call (its train step, home) to c's
    // layout, as the runtime orders it (stale.h): after that train step of iteration t - 1 - eta and the stale
    // calls of t - 1 that read the same copy, before c of iteration t and the model's first non-stale node of
    // iteration t - eta; none when c reads home in place. Empty or eta = 0: the synchronous graph.
    int staleness = 0;
    std::vector<uint8_t> stale;
    std::vector<StaleGate> stale_gates;  // derived by finalize(): the plan-dependent order (stale.h)
    // Heterogeneous clusters (docs/heterogeneous.md): pool i holds devices [pool_start[i], pool_start[i + 1])
    // (the last to n_devices) with pool_memory[i] usable bytes each; a plan fits when every device's peak fits
    // its pool. Empty: one pool, device_memory each. device_memory stays the scale of the OOM penalty.
    std::vector<int32_t> pool_start;
    std::vector<int64_t> pool_memory;
    // A home that keeps its parameters across a narrowing trip (home_keep.cpp): pool_narrows[a * n_pools + b]
    // when a trip from pool a's dtype into pool b's rounds; train_call[c] when call c is a train step. Empty: the
    // runtime moves every reallocation (one dtype).
    std::vector<uint8_t> pool_narrows;
    std::vector<uint8_t> train_call;
    // Fused train pairs (fused_node.h). A plan has n_calls() + fused.size() entries: a candidate per call, then
    // 0/1 per pair. Pair p's tables are pair-cost tables n_tables() + 2p (saving) and n_tables() + 2p + 1 (extra).
    std::vector<FusedPair> fused;
    // Long-tail migration (tail.h): per migrating call its candidates' migrations; the consumers that may run
    // in two parts. Derived by finalize(): per call its index in each (-1: none).
    std::vector<TailColumns> tail_cols;
    std::vector<TailSplit> tail_splits;
    std::vector<int32_t> tail_of_call, split_of_call;
    // Bumped whenever a pair cost or a provisional cost changes (bump_pair_costs), so that evaluators
    // drop the pair costs they cached from earlier evaluations.
    uint64_t pair_version = 0;
    void bump_pair_costs() { ++pair_version; }

    // Derived by finalize(): the augmented graph unrolled over n_iterations.
    std::vector<NodeTemplate> iter_nodes;         // nodes of one iteration, topologically ordered
    std::vector<int32_t> child_start, children;   // CSR over all n_iterations * iter_nodes.size()
    std::vector<int32_t> n_parents;
    std::vector<std::vector<int32_t>> model_calls;  // calls of each model, in execution order
    // Whether every node of an iteration has a path to a node of the next one (as in a PPO graph,
    // where every call feeds or precedes a train step): then no node ends after the last iteration's
    // end, which makes the simulator's early-stop bound stronger (Evaluator::evaluate_bounded).
    bool iterations_chain = false;
    bool finalized = false;

    int n_calls() const { return static_cast<int>(call_model.size()); }
    int n_models() const { return static_cast<int>(model_home.size()); }
    int n_nodes() const { return static_cast<int>(iter_nodes.size()) * n_iterations; }
    int first_priced() const { return warmup; }
    int last_priced() const { return n_iterations - 1 - lookahead; }
    int n_tables() const { return n_models() + static_cast<int>(data_edges.size()); }
    int plan_size() const { return n_calls() + static_cast<int>(fused.size()); }
    int host_size() const { return devices_per_node > 0 ? devices_per_node : n_devices; }
    // True when the devices of a host can be busy in greater number than it has cores.
    bool shares_cores() const { return cores_per_node > 0.0 && cores_per_node < host_size(); }
    // A reallocation from `src`'s candidate `i` into `dst`'s candidate `k` that copies every destination shard
    // from the device's own source shard: the source holds the whole model on every device and the destination
    // mesh lies inside it. Only the destination's devices take part; the runtime does not wait for the others
    // (runtime/control/master_schedule._wait_realloc). search/reference.py's `_in_place` is the same.
    bool in_place(int src, int i, int dst, int k) const {
        const Candidates& a = cands[src];
        const Candidates& b = cands[dst];
        return a.holds_whole(i) && a.dev_lo[i] <= b.dev_lo[k] && b.dev_hi[k] <= a.dev_hi[i];
    }
    PairCosts& table(int id);
    const PairCosts& table(int id) const;

    // Checks every array and builds the unrolled augmented graph; throws std::invalid_argument.
    void finalize();
    // Checks that `plan` names one valid candidate per call; throws std::invalid_argument.
    void check_plan(const std::vector<int32_t>& plan) const;
};

// Checks the fused pairs against the calls (fused_node.cpp); throws std::invalid_argument.
void check_fused_pairs(const Problem& p);
// home_keep.cpp: whether the runtime skips `call`'s incoming chain reallocation under `plan` (its home kept the
// parameters), the template nodes that depend on every call of their model, and the arrays' check.
bool home_skips_return(const Problem& p, int call, const int32_t* plan);
void add_home_keep_nodes(const Problem& p, std::vector<std::vector<int32_t>>& nodes_of);
void check_home_keep(const Problem& p);

}  // namespace rl
