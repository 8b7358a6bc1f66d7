// The search problem as plain arrays: candidate placements per call, the dataflow graph, and
// the transfer-cost tables between layouts. Python (realloc/search/problem.py) fills it; the
// simulator and the MCMC only read it. No I/O here.
#pragma once

#include <array>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace rl {

// Per-device memory of a candidate is given for three device groups of its mesh: the first
// pipeline stage (embedding), the middle stages, and the last stage (output head).
// With pp == 1 only part 0 is used; with pp == 2 parts 0 and 2.
constexpr int kParts = 3;

// Every placement (mesh, strategy, n_mbs) one call may take, column by column.
// A mesh is a contiguous interval [dev_lo, dev_hi) of global device ids (cluster.py: meshes are
// aligned blocks inside a node or runs of whole nodes).
struct Candidates {
    std::vector<int32_t> dev_lo, dev_hi;
    std::vector<int32_t> stage_width;  // devices per pipeline stage = dp * tp
    std::vector<int32_t> layout;       // (mesh, strategy) id inside the call's model; indexes pair tables
    std::vector<int32_t> mesh_id;      // cluster mesh id (groups for "same mesh" moves)
    std::vector<int32_t> shape_class;  // (mesh shape, strategy, n_mbs) id (groups for "move the mesh")
    std::vector<double> time;          // seconds, the call alone
    // bytes per device, size() * kParts, row-major (candidate, part)
    std::vector<int64_t> mem_static;   // counted once per model, from its home call's candidate
    std::vector<int64_t> mem_dynamic;  // while the call runs: activations, KV cache
    std::vector<int64_t> mem_param;    // the model's parameters in this layout (a reallocated copy)

    int size() const { return static_cast<int>(time.size()); }
};

// Cost (seconds) of moving something from layout `a` (rows) to layout `b` (columns).
struct PairTable {
    int rows = 0, cols = 0;
    std::vector<double> values;
    double at(int a, int b) const { return values[static_cast<size_t>(a) * cols + b]; }
};

struct DataEdge {
    int src = 0, dst = 0;
    PairTable cost;  // src model layouts x dst model layouts
};

enum class NodeKind : uint8_t { kCall = 0, kRealloc = 1, kData = 2 };

// One node of the augmented graph of one iteration (realhf.txt §4, Figure 6).
struct NodeTemplate {
    NodeKind kind;
    int call;   // the call this node runs or feeds
    int other;  // realloc: the model's home call (source layout); data: the producing call
    int edge;   // data: index into data_edges
};

struct Problem {
    int n_devices = 0;
    int n_iterations = 4;
    int64_t device_memory = 0;
    double oom_alpha = 100.0;
    std::vector<int32_t> call_model;  // model of each call; calls are numbered in topological order
    std::vector<int32_t> model_home;  // the call whose layout holds the model's static memory
    std::vector<Candidates> cands;
    std::vector<std::array<int, 2>> order_edges;  // (u, v) inside one iteration, no transfer
    std::vector<std::array<int, 2>> carry_edges;  // (u at t, v at t+1): parameter versions
    std::vector<DataEdge> data_edges;             // (u, v) inside one iteration, with a transfer node
    std::vector<PairTable> realloc;               // per model: home layout -> call layout

    // Derived by finalize(): the augmented graph unrolled over n_iterations.
    std::vector<NodeTemplate> iter_nodes;         // nodes of one iteration, topologically ordered
    std::vector<int32_t> child_start, children;   // CSR over all n_iterations * iter_nodes.size()
    std::vector<int32_t> n_parents;
    std::vector<std::vector<int32_t>> model_calls;  // calls of each model, in execution order
    bool finalized = false;

    int n_calls() const { return static_cast<int>(call_model.size()); }
    int n_models() const { return static_cast<int>(model_home.size()); }
    int n_nodes() const { return static_cast<int>(iter_nodes.size()) * n_iterations; }

    // Checks every array and builds the unrolled augmented graph; throws std::invalid_argument.
    void finalize();
    // Checks that `plan` names one valid candidate per call; throws std::invalid_argument.
    void check_plan(const std::vector<int32_t>& plan) const;
};

}  // namespace rl
