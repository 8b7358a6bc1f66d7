#include "mcmc.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <thread>

namespace rl {

namespace {

uint64_t splitmix64(uint64_t& x) {
    uint64_t z = (x += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

inline uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

constexpr int64_t kSlice = 256;  // proposals a chain runs before its thread checks the clock
constexpr size_t kMaxPending = 16;  // provisional plans a chain keeps for pricing

}  // namespace

Rng::Rng(uint64_t seed) {
    for (auto& s : s_) s = splitmix64(seed);
}

// xoshiro256**: fast, and identical on every platform (unlike std distributions).
uint64_t Rng::next() {
    const uint64_t result = rotl(s_[1] * 5, 7) * 9;
    const uint64_t t = s_[1] << 17;
    s_[2] ^= s_[0];
    s_[3] ^= s_[1];
    s_[1] ^= s_[2];
    s_[0] ^= s_[3];
    s_[2] ^= t;
    s_[3] = rotl(s_[3], 45);
    return result;
}

bool better(const Evaluation& a, const Evaluation& b) {
    if (a.feasible != b.feasible) return a.feasible;
    return a.cost < b.cost;
}

Search::Search(const Problem& problem, const SearchOptions& options, const std::vector<int32_t>& start)
    : p_(problem), opt_(options) {
    p_.check_plan(start);
    if (opt_.n_chains < 1 || opt_.n_threads < 1) throw std::invalid_argument("n_chains and n_threads must be >= 1");
    if (!(opt_.accept_1pct > 0.0 && opt_.accept_1pct < 1.0))
        throw std::invalid_argument("accept_1pct must be strictly between 0 and 1");
    if (!(opt_.p_any >= 0 && opt_.p_mbs >= 0 && opt_.p_strategy >= 0 && opt_.p_position >= 0) ||
        opt_.p_any + opt_.p_mbs + opt_.p_strategy + opt_.p_position <= 0)
        throw std::invalid_argument("move probabilities must be non-negative and not all zero");
    tau_ = 0.01 / std::log(1.0 / opt_.accept_1pct);

    const int n = p_.n_calls();
    groups_.resize(n);
    group_of_.resize(n);
    for (int c = 0; c < n; ++c) {
        const Candidates& k = p_.cands[c];
        if (k.size() > 1) movable_.push_back(c);
        const std::vector<int32_t>* keys[3] = {&k.layout, &k.mesh_id, &k.shape_class};
        for (int g = 0; g < 3; ++g) {
            std::map<int32_t, int32_t> index;
            group_of_[c][g].resize(k.size());
            for (int i = 0; i < k.size(); ++i) {
                auto it = index.emplace((*keys[g])[i], static_cast<int32_t>(index.size())).first;
                if (it->second == static_cast<int32_t>(groups_[c][g].size())) groups_[c][g].emplace_back();
                groups_[c][g][it->second].push_back(i);
                group_of_[c][g][i] = it->second;
            }
        }
    }

    Evaluator ev(p_);
    start_ev_ = ev.evaluate(start.data());
    if (!start_ev_.exact)
        throw std::invalid_argument("the start plan uses transfer costs that are not priced yet; price them first");
    best_ = start;
    best_ev_ = start_ev_;
    for (int i = 0; i < opt_.n_chains; ++i) {
        uint64_t s = opt_.seed * 0x100000001B3ull + static_cast<uint64_t>(i) + 1;
        auto ch = std::make_unique<Chain>(p_, splitmix64(s));
        ch->cur = ch->best = start;
        ch->cur_ev = ch->best_ev = start_ev_;
        chains_.push_back(std::move(ch));
    }
    t0_ = std::chrono::steady_clock::now();
    history_.push_back({0.0, 0, start_ev_.cost, start_ev_.time, start_ev_.feasible});
}

double Search::elapsed() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
}

double Search::temperature() const {
    // Seconds: a plan 1% slower than the best known is accepted with probability accept_1pct.
    return tau_ * (best_ev_.time > 0 ? best_ev_.time : 1.0);
}

int Search::propose(Chain& ch, int call, int a) {
    const Candidates& k = p_.cands[call];
    const double total = opt_.p_any + opt_.p_mbs + opt_.p_strategy + opt_.p_position;
    double u = ch.rng.uniform() * total;
    int kind = -1;  // -1: any candidate; else the group kind
    if ((u -= opt_.p_any) < 0) kind = -1;
    else if ((u -= opt_.p_mbs) < 0) kind = 0;
    else if ((u -= opt_.p_strategy) < 0) kind = 1;
    else kind = 2;
    if (kind >= 0) {
        const auto& g = groups_[call][kind][group_of_[call][kind][a]];
        if (g.size() > 1) {
            // Uniform over the group's other members: symmetric, since a and b share the group.
            int b = g[ch.rng.below(g.size() - 1)];
            return b == a ? g.back() : b;
        }
    }
    int b = static_cast<int>(ch.rng.below(k.size() - 1));
    return b >= a ? b + 1 : b;
}

void Search::improve(Chain& ch, const Evaluation& ev, const std::vector<int32_t>& plan) {
    ch.best = plan;
    ch.best_ev = ev;
    ch.found.push_back({elapsed(), evals_.load(std::memory_order_relaxed), ev.cost, ev.time, ev.feasible});
}

void Search::note_pending(Chain& ch, const Evaluation& ev) {
    auto& pend = ch.pending;
    if (pend.size() == kMaxPending && !(ev.cost < pend.back().first.cost)) return;
    for (const auto& q : pend)
        if (q.second == ch.cur) return;
    auto at = std::upper_bound(pend.begin(), pend.end(), ev.cost,
                               [](double c, const auto& q) { return c < q.first.cost; });
    pend.insert(at, {ev, ch.cur});
    if (pend.size() > kMaxPending) pend.pop_back();
}

void Search::step(Chain& ch, double temperature) {
    const int call = movable_[ch.rng.below(movable_.size())];
    const int a = ch.cur[call];
    const int b = propose(ch, call, a);
    ch.cur[call] = b;
    const Evaluation ev = ch.ev.evaluate(ch.cur.data());
    if (better(ev, ch.best_ev)) {
        if (ev.exact)
            improve(ch, ev, ch.cur);
        else
            note_pending(ch, ev);
    }
    const double delta = ev.cost - ch.cur_ev.cost;
    if (delta <= 0.0 || ch.rng.uniform() < std::exp(-delta / temperature))
        ch.cur_ev = ev;
    else
        ch.cur[call] = a;
}

std::vector<MissingPair> Search::missing_pairs(int limit) const {
    std::vector<MissingPair> out;
    for (const auto& ch : chains_) {
        const int n = std::min<int>(limit, static_cast<int>(ch->pending.size()));
        for (int i = 0; i < n; ++i) ch->ev.evaluate(ch->pending[i].second.data(), &out);
    }
    std::sort(out.begin(), out.end());
    out.erase(std::unique(out.begin(), out.end()), out.end());
    return out;
}

void Search::resolve() {
    for (auto& ch : chains_) {
        ch->found.clear();
        ch->cur_ev = ch->ev.evaluate(ch->cur.data());
        std::vector<std::pair<Evaluation, std::vector<int32_t>>> still;
        for (auto& [old, plan] : ch->pending) {
            const Evaluation ev = ch->ev.evaluate(plan.data());
            if (!ev.exact)
                still.emplace_back(ev, std::move(plan));
            else if (better(ev, ch->best_ev))
                improve(*ch, ev, plan);
        }
        ch->pending = std::move(still);
    }
    merge();
}

void Search::run_chains(const std::vector<int>& ids, int64_t quota, std::chrono::steady_clock::time_point deadline,
                        bool has_deadline, double temperature) {
    bool more = true;
    while (more) {
        more = false;
        for (int id : ids) {
            Chain& ch = *chains_[id];
            const int64_t n = std::min(kSlice, quota - ch.done);
            if (n <= 0) continue;
            for (int64_t i = 0; i < n; ++i) step(ch, temperature);
            ch.done += n;
            evals_.fetch_add(n, std::memory_order_relaxed);
            more = more || ch.done < quota;
        }
        if (has_deadline && std::chrono::steady_clock::now() >= deadline) return;
    }
}

bool Search::run(int64_t evals_per_chain, double seconds) {
    if (movable_.empty() || evals_per_chain <= 0) return false;
    const auto begin = std::chrono::steady_clock::now();
    const bool has_deadline = seconds > 0;
    const auto deadline = begin + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                      std::chrono::duration<double>(has_deadline ? seconds : 0.0));
    const double temp = temperature();
    for (auto& ch : chains_) {
        ch->done = 0;
        ch->found.clear();
    }
    const int n_threads = std::min(opt_.n_threads, opt_.n_chains);
    std::vector<std::vector<int>> assign(n_threads);
    for (int i = 0; i < opt_.n_chains; ++i) assign[i % n_threads].push_back(i);
    if (n_threads == 1) {
        run_chains(assign[0], evals_per_chain, deadline, has_deadline, temp);
    } else {
        std::vector<std::thread> threads;
        for (int t = 0; t < n_threads; ++t)
            threads.emplace_back(&Search::run_chains, this, std::cref(assign[t]), evals_per_chain, deadline,
                                 has_deadline, temp);
        for (auto& th : threads) th.join();
    }
    merge();
    bool by_time = false;
    for (auto& ch : chains_) by_time = by_time || ch->done < evals_per_chain;
    return by_time;
}

void Search::merge() {
    // History: the chains' improvements in time order, kept where they beat the running best.
    std::vector<HistoryPoint> found;
    for (const auto& ch : chains_) found.insert(found.end(), ch->found.begin(), ch->found.end());
    std::stable_sort(found.begin(), found.end(),
                     [](const HistoryPoint& x, const HistoryPoint& y) { return x.seconds < y.seconds; });
    Evaluation running = best_ev_;
    for (const auto& h : found) {
        Evaluation e;
        e.cost = h.cost;
        e.feasible = h.feasible;
        if (better(e, running)) {
            running = e;
            history_.push_back(h);
        }
    }
    // The best plan: from the best chain, the lowest index on ties, so one seed gives one answer.
    for (const auto& ch : chains_)
        if (better(ch->best_ev, best_ev_)) {
            best_ = ch->best;
            best_ev_ = ch->best_ev;
        }
    // Chains far behind the best restart from it, so that threads pool their progress.
    for (auto& ch : chains_)
        if ((best_ev_.feasible && !ch->cur_ev.feasible) || ch->cur_ev.cost > best_ev_.cost * (1.0 + opt_.restart_margin)) {
            ch->cur = best_;
            ch->cur_ev = best_ev_;
        }
}

}  // namespace rl
