// Fused pipeline schedule of two train calls on one set of devices (rlhfuse.txt §5.2).
//
// Model A runs K_a pipelines of pp_a stages over the n devices (device = pipe * pp_a + stage); model B
// runs K_b pipelines of pp_b stages in the reverse direction (device = n - 1 - (pipe * pp_b + stage)),
// so every device holds exactly one stage of each model. Each device executes, one at a time, the
// forward and backward pass of every micro-batch of its two stages; a schedule is the order of those
// 2 (M_a + M_b) passes on every device. A pass starts when the device is free and its one input is
// ready: the forward of the same micro-batch one stage up, the backward one stage down (the last
// stage's backward waits for its own forward), each plus `p2p` seconds when it comes from another
// device. An order whose waits form a cycle deadlocks and is invalid.
//
// Each model keeps its own micro-batch order on every device (forwards 0, 1, ..., backwards 0, 1, ...),
// so gradients accumulate in the order of the unfused run and the result is the same.
//
// Memory: a micro-batch's activations on a stage live from its forward to its backward; a device's
// peak is the largest sum of `act` over the passes in flight, a function of the order alone.
//
// The search (§5.2): greedy list schedules as starts, simulated annealing over moves of one pass of one
// device by up to `reach` places, i.e. chains of adjacent swaps (Algorithms 1, 2; reach 1 is the paper's
// neighbourhood), to lower the makespan under a memory cap, then a second annealing that lowers the peak
// memory without raising the makespan. The lower bound is the
// one of §7.3: per device, earliest first arrival + all its work + the shortest tail after its last pass.
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

namespace rl::fused {

// One model's pipelines. fwd, bwd, act have pp entries (per stage); the same for every pipeline.
struct Model {
    int pp = 1;
    int n_micro = 1;  // micro-batches per pipeline
    std::vector<double> fwd, bwd, act;
};

// A pass on a device, packed into one int: micro-batch * 4 + model * 2 + backward.
inline int32_t encode(int model, int backward, int mb) { return mb * 4 + model * 2 + backward; }
inline int task_model(int32_t t) { return (t >> 1) & 1; }
inline int task_backward(int32_t t) { return t & 1; }
inline int task_mb(int32_t t) { return t >> 2; }

using Order = std::vector<std::vector<int32_t>>;  // per device, its passes in execution order

struct Eval {
    bool valid = false;  // false: deadlock (or a memory cap exceeded, where one was asked)
    double makespan = std::numeric_limits<double>::infinity();
    double peak = 0.0;                 // max over devices of the activation peak
    std::vector<double> device_peak;   // per device
    std::vector<double> device_end;    // per device, when its last pass ends
};

class Problem {
public:
    Problem(int n_devices, Model a, Model b, double p2p);  // throws std::invalid_argument on bad input

    int n_devices() const { return n_; }
    const Model& model(int m) const { return m_[m]; }
    double p2p() const { return p2p_; }
    int stage(int model, int device) const;
    int device(int model, int pipe, int stage) const;
    int pipe(int model, int device) const;
    double duration(int device, int32_t task) const;
    double act(int device, int32_t task) const;

    // Throws std::invalid_argument unless `order` holds every device's passes once each, in each
    // model's micro-batch order, every backward after its forward.
    void check_order(const Order& order) const;
    // No checks beyond deadlock (see check_order). `start`, when given, receives every pass's start
    // time at slot(model, backward, device, mb).
    Eval evaluate(const Order& order, std::vector<double>* start = nullptr) const;
    size_t slot(int model, int backward, int device, int mb) const {
        return (static_cast<size_t>(model * 2 + backward) * n_ + device) * mmax_ + mb;
    }
    // Makespan and peak of one model alone under 1F1B (its serial train call).
    Eval alone_1f1b(int model) const;
    Order serial_1f1b() const;  // model A's 1F1B, then model B's, on every device
    // List schedule: the pass that can start first runs next; ties: backward first, then the model
    // with the longer pass (§5.2's greedy). inflight_1f1b caps each model's forwards in flight on a
    // stage at its 1F1B count. With a primary model (0 or 1), that model keeps its 1F1B order and the
    // other one only backfills: one of its passes may run when it ends at most slack times its own
    // length after the primary's next pass would start in the primary's schedule alone. Primary 2:
    // both models keep their 1F1B order (with extra_warmup more warm-up forwards) and the list
    // schedule merges them. Returns an empty order when the memory cap stops it.
    Order greedy(bool inflight_1f1b, double memory_cap, int primary = -1, double slack = 0.0,
                 int extra_warmup = 0) const;
    double lower_bound() const;

private:
    int n_;
    Model m_[2];
    double p2p_;
    int mmax_;
};

struct SearchOptions {
    int64_t iterations = 20000;         // annealing steps for the makespan, per restart
    int64_t memory_iterations = 20000;  // annealing steps for the memory
    int restarts = 2;
    uint64_t seed = 0;
    double memory_cap = std::numeric_limits<double>::infinity();  // per device
    double t_start = 2e-4;  // initial temperature, a fraction of the start makespan (or peak)
    double t_end = 1e-6;
    double tie_share = 0.01;  // weight of the devices' mean end (or peak) in the energy
    int reach = 64;  // a move carries one pass up to this many places (1: adjacent swaps)
};

struct SearchResult {
    Order order;
    Eval eval;
    Eval greedy;      // the best start
    Eval serial;      // the two models one after the other (both alone, summed)
    double lower_bound = 0.0;
    int64_t evaluations = 0;
};

SearchResult search(const Problem& p, const SearchOptions& opt);

}  // namespace rl::fused
