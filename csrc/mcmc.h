// Metropolis-Hastings search over execution plans (realhf.txt §5.2).
//
// A plan picks one candidate per call. Each step changes one call's candidate and accepts the
// new plan with probability min(1, exp(-(cost' - cost) / T)). T is in seconds: T = tau * t_ref,
// where t_ref is the best feasible iteration time found so far (the start plan's time before
// that) and tau is chosen so that a plan 1% slower than the current one is accepted with
// probability `accept_1pct` (tau = 0.01 / ln(1 / accept_1pct)).
//
// Transfer costs are priced lazily (problem.h, PairCosts). A plan whose evaluation used an
// unpriced pair is provisional: it can guide a chain but never becomes the best plan. Provisional
// plans that look better than their chain's best are kept as pending; between runs Python prices
// their missing pairs (missing_pairs(), then Problem.set_pair_costs) and resolve() re-evaluates
// them exactly.
//
// Several chains run on threads. run() advances every chain by a fixed number of proposals (or
// until a deadline); between runs the chains that lag the best plan by more than
// `restart_margin` restart from it. With an evaluation budget (no deadline) the result depends
// only on the seed, whatever the number of threads.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <vector>

#include "problem.h"
#include "simulator.h"

namespace rl {

struct SearchOptions {
    int n_chains = 2;
    int n_threads = 2;
    uint64_t seed = 0;
    double accept_1pct = 0.05;
    double restart_margin = 0.05;
    // Proposal mix: any candidate of the call; same mesh and strategy (other n_mbs); same mesh
    // (other strategy); same mesh shape, strategy and n_mbs at another position.
    double p_any = 0.25, p_mbs = 0.25, p_strategy = 0.25, p_position = 0.25;
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

class Search {
public:
    Search(const Problem& problem, const SearchOptions& options, const std::vector<int32_t>& start);

    // Advances every chain by up to `evals_per_chain` proposals, stopping early once `seconds`
    // (wall clock, <= 0: no limit) have passed since this call began. Returns true if stopped by time.
    bool run(int64_t evals_per_chain, double seconds);

    // Unpriced pairs of the pending plans (at most `limit` plans per chain, best first).
    std::vector<MissingPair> missing_pairs(int limit) const;
    // Re-evaluates the chains and their pending plans after new pair costs were set.
    void resolve();

    const std::vector<int32_t>& best_plan() const { return best_; }
    const Evaluation& best_eval() const { return best_ev_; }
    const Evaluation& start_eval() const { return start_ev_; }
    const std::vector<HistoryPoint>& history() const { return history_; }
    int64_t evals() const { return evals_.load(); }
    double elapsed() const;
    double temperature() const;

private:
    struct Chain {
        explicit Chain(const Problem& p, uint64_t seed) : ev(p), rng(seed) {}
        Evaluator ev;
        Rng rng;
        std::vector<int32_t> cur, best;
        Evaluation cur_ev, best_ev;
        int64_t done = 0;  // proposals in the current run
        std::vector<HistoryPoint> found;  // improvements of this chain's best in the current run
        std::vector<std::pair<Evaluation, std::vector<int32_t>>> pending;  // provisional, sorted by cost
    };

    void note_pending(Chain& ch, const Evaluation& ev);
    void improve(Chain& ch, const Evaluation& ev, const std::vector<int32_t>& plan);

    void step(Chain& ch, double temperature);
    int propose(Chain& ch, int call, int a);
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
    std::vector<std::unique_ptr<Chain>> chains_;
    std::vector<int32_t> best_;
    Evaluation best_ev_, start_ev_;
    std::vector<HistoryPoint> history_;
    std::atomic<int64_t> evals_{0};
    std::chrono::steady_clock::time_point t0_;
    double tau_;
};

// True if `a` is a better search result than `b`: fitting in memory first, then lower cost.
bool better(const Evaluation& a, const Evaluation& b);

}  // namespace rl
