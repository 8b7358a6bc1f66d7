// Metropolis-Hastings search over execution plans (realhf.txt §5.2).
//
// A plan picks one candidate per call. A step changes the candidate of one call (or, for a
// swap, of two) and accepts the new plan with probability min(1, exp(-(cost' - cost) / T)),
// the Metropolis-Hastings rule for P(plan) ~ exp(-cost / T) with a symmetric proposal.
// T is in seconds: T = tau * t_ref, t_ref being the best feasible iteration time found so far
// (the best start plan's before that), and tau chosen so that a plan 1% slower than the current
// one is accepted with probability `accept_1pct` (tau = 0.01 / ln(1 / accept_1pct)).
//
// Plans whose peak memory exceeds the device memory cost alpha * (1 + overflow / memory) times
// their time (problem.h oom_alpha): the OOM penalty of §5.2, scaled so that a chain among OOM
// plans still moves toward ones that fit.
//
// The paper runs one chain at one temperature. We run `n_chains` independent chains (one or
// more per thread), each a ladder of `n_temps` replicas at temperatures T * ladder^k that swap
// states now and then (parallel tempering): hot replicas cross the barriers that memory limits
// put between good plans, the coldest one refines.
//
// Transfer costs are priced lazily (problem.h, PairCosts). A plan whose evaluation used an
// unpriced pair is provisional: it can guide a chain but never becomes the best plan. Provisional
// plans that look better than their chain's best are kept as pending; between runs Python prices
// their missing pairs (missing_pairs(), then Problem.set_pair_costs) and resolve() re-evaluates
// them exactly.
//
// run() advances every replica by a fixed number of proposals (or until a deadline). Between
// runs, chains whose coldest replica lags the best plan by more than `restart_margin` restart
// it from the best plan. With an evaluation budget (no deadline) the result depends only on the
// seed and the start plans, whatever the number of threads.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <unordered_map>
#include <vector>

#include "problem.h"
#include "simulator.h"

namespace rl {

struct SearchOptions {
    int n_chains = 2;
    int n_threads = 2;
    int n_temps = 3;
    double ladder = 4.0;
    uint64_t seed = 0;
    double accept_1pct = 0.2;
    double restart_margin = 0.02;
    // Proposal mix: any candidate of the call; same mesh and strategy (other n_mbs or recompute); same
    // mesh (other strategy); same shape, strategy and n_mbs at another position; a candidate on the
    // mesh another call uses; two calls of one mesh shape exchange positions; the same placement with
    // the other recomputation choice (Candidates::twin).
    double p_any = 0.2, p_mbs = 0.15, p_strategy = 0.2, p_position = 0.15, p_colocate = 0.2, p_swap = 0.1,
           p_recompute = 0.05;
    // Heat-bath block move: evaluate sampled candidate combinations of one or two calls and draw
    // the next plan among them with Boltzmann weights (probability per step; costs many evals).
    double p_heat = 0.05;
    int heat_one = 32;  // candidates sampled for a one-call block
    int heat_two = 8;   // candidates sampled per call for a two-call block
    // Stop simulating a proposal once it is proven rejected (Evaluator::evaluate_bounded); the
    // chains take the same steps either way.
    bool early_reject = true;
    // Fusing or unfusing a fused pair (Problem::fused; fused_node.h), co-placing its calls when they are apart
    // (probability per step; no draw when the problem has no fused pairs).
    double p_fuse = 0.1;
};

struct HistoryPoint {
    double seconds;   // since the search started
    int64_t evals;    // plans evaluated by all chains by then
    double cost;
    double time;
    bool feasible;
};

class Rng {
public:
    explicit Rng(uint64_t seed);
    uint64_t next();
    uint64_t below(uint64_t n) { return static_cast<uint64_t>((static_cast<__uint128_t>(next()) * n) >> 64); }
    double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }

private:
    uint64_t s_[4];
};

// True if `a` is a better search result than `b`: fitting in memory first, then lower cost.
bool better(const Evaluation& a, const Evaluation& b);

class Search {
public:
    // Chain i starts from starts[i % starts.size()]; every start must be exactly priced.
    Search(const Problem& problem, const SearchOptions& options, const std::vector<std::vector<int32_t>>& starts);

    // Advances every replica by up to `evals_per_replica` proposals, stopping early once `seconds`
    // (wall clock, <= 0: no limit) have passed since this call began. Returns true if stopped by time.
    bool run(int64_t evals_per_replica, double seconds);

    // Unpriced pairs of the pending plans (at most `limit` plans per chain, best first).
    std::vector<MissingPair> missing_pairs(int limit) const;
    // Re-evaluates the replicas and the pending plans after new pair costs were set.
    void resolve();

    const std::vector<int32_t>& best_plan() const { return best_; }
    const Evaluation& best_eval() const { return best_ev_; }
    const std::vector<HistoryPoint>& history() const { return history_; }
    int64_t evals() const { return evals_.load(); }
    // Evaluations simulated to the end; the others stopped once their proposal was proven rejected.
    int64_t simulations() const { return simulations_.load(); }
    // Evaluations proven rejected before any simulation (Evaluator::evaluate_bounded's path bound).
    int64_t unsimulated() const { return unsimulated_.load(); }
    double elapsed() const;
    double temperature() const;  // of the coldest replicas
    double swap_rate() const { return swaps_tried_ ? static_cast<double>(swaps_done_) / swaps_tried_ : 0.0; }

private:
    struct Replica {
        std::vector<int32_t> cur;
        Evaluation cur_ev;
        double temp_scale = 1.0;
    };
    struct Chain {
        Chain(const Problem& p, uint64_t seed) : ev(p), rng(seed) {}
        std::vector<int32_t> block_a, block_b;   // heat-bath workspace
        std::vector<Evaluation> block_ev;
        std::vector<double> block_w;
        Evaluator ev;
        Rng rng;
        int64_t simulated = 0;    // evaluations in the current slice simulated to the end
        int64_t unsimulated = 0;  // and rejected without simulating
        std::vector<Replica> reps;
        std::vector<int32_t> best;
        Evaluation best_ev;
        int64_t done = 0;                 // evaluations per replica in the current run
        int64_t swaps_tried = 0, swaps_done = 0;
        std::vector<HistoryPoint> found;  // improvements of this chain's best in the current run
        std::vector<std::pair<Evaluation, std::vector<int32_t>>> pending;  // provisional, sorted by cost
    };

    // One proposal evaluating at most `room` plans; returns how many it evaluated.
    int step(Chain& ch, Replica& r, double temperature, int64_t room);
    int heat_bath(Chain& ch, Replica& r, double temperature);
    void observe(Chain& ch, const Evaluation& ev, const std::vector<int32_t>& plan);
    void exchange(Chain& ch, double temperature);
    // Proposes new candidates for one or two calls; returns how many (0: nothing to propose).
    int propose(Chain& ch, const std::vector<int32_t>& cur, int (&calls)[2], int (&to)[2]);
    int propose_fuse(Chain& ch, const std::vector<int32_t>& cur, int (&calls)[2], int (&to)[2]);  // fused_node.cpp
    void setup_fuse_moves();                                                                     // fused_node.cpp
    void note_pending(Chain& ch, const Evaluation& ev, const std::vector<int32_t>& plan);
    void improve(Chain& ch, const Evaluation& ev, const std::vector<int32_t>& plan);
    void run_chains(const std::vector<int>& ids, int64_t quota, std::chrono::steady_clock::time_point deadline,
                    bool has_deadline, double temperature);
    void merge();

    const Problem& p_;
    SearchOptions opt_;
    std::vector<int> movable_;  // calls with more than one candidate
    // For each call and group kind (0: layout, 1: mesh, 2: shape class): groups of candidate ids,
    // and each candidate's group.
    std::vector<std::array<std::vector<std::vector<int32_t>>, 3>> groups_;
    std::vector<std::array<std::vector<int32_t>, 3>> group_of_;
    std::vector<std::vector<int32_t>> mesh_group_;  // per call: mesh id -> its group of kind 1, or -1
    std::vector<std::unordered_map<uint64_t, int32_t>> at_mesh_;  // per call: (shape class, mesh id) -> candidate
    // per fused pair and side (0: a moves to b, 1: b moves to a): the mover's candidates grouped by (devices, pp),
    // and per candidate of the other call its group (-1: none)
    std::vector<std::array<std::vector<std::vector<int32_t>>, 2>> coplace_;
    std::vector<std::array<std::vector<int32_t>, 2>> coplace_of_;
    std::vector<std::unique_ptr<Chain>> chains_;
    std::vector<int32_t> best_;
    Evaluation best_ev_;
    std::vector<HistoryPoint> history_;
    std::atomic<int64_t> evals_{0};
    std::atomic<int64_t> simulations_{0};
    std::atomic<int64_t> unsimulated_{0};
    std::chrono::steady_clock::time_point t0_;
    double tau_;
    int64_t swaps_tried_ = 0, swaps_done_ = 0;
};

}  // namespace rl
