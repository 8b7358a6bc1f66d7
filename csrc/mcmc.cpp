#include "mcmc.h"

#include <algorithm>
#include <cmath>
#include <limits>
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

inline uint64_t mesh_key(int32_t shape_class, int32_t mesh_id) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(shape_class)) << 32) | static_cast<uint32_t>(mesh_id);
}

constexpr int64_t kSlice = 256;     // proposals per replica between tempering swaps and clock checks
constexpr size_t kMaxPending = 16;  // provisional plans a chain keeps for pricing
constexpr double kHeatCut = 60.0;   // heat-bath weights below e^-kHeatCut of the largest count as 0

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

Search::Search(const Problem& problem, const SearchOptions& options, const std::vector<std::vector<int32_t>>& starts)
    : p_(problem), opt_(options) {
    if (starts.empty()) throw std::invalid_argument("give at least one start plan");
    for (const auto& s : starts) p_.check_plan(s);
    if (opt_.n_chains < 1 || opt_.n_threads < 1 || opt_.n_temps < 1)
        throw std::invalid_argument("n_chains, n_threads and n_temps must be >= 1");
    if (!(opt_.ladder >= 1.0)) throw std::invalid_argument("ladder must be >= 1");
    if (!(opt_.accept_1pct > 0.0 && opt_.accept_1pct < 1.0))
        throw std::invalid_argument("accept_1pct must be strictly between 0 and 1");
    if (!(opt_.p_heat >= 0.0 && opt_.p_heat <= 1.0) || opt_.heat_one < 1 || opt_.heat_two < 1)
        throw std::invalid_argument("p_heat must be in [0, 1] and heat_one, heat_two >= 1");
    const double mix[] = {opt_.p_any,      opt_.p_mbs,  opt_.p_strategy, opt_.p_position,
                          opt_.p_colocate, opt_.p_swap, opt_.p_recompute};
    double total = 0;
    for (double x : mix) {
        if (!(x >= 0)) throw std::invalid_argument("move probabilities must be non-negative");
        total += x;
    }
    if (total <= 0) throw std::invalid_argument("move probabilities must not all be zero");
    tau_ = 0.01 / std::log(1.0 / opt_.accept_1pct);

    const int n = p_.n_calls();
    groups_.resize(n);
    group_of_.resize(n);
    mesh_group_.resize(n);
    at_mesh_.resize(n);
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
            if (g == 1)
                for (const auto& [mesh, gi] : index) {
                    if (mesh >= static_cast<int32_t>(mesh_group_[c].size())) mesh_group_[c].resize(mesh + 1, -1);
                    if (mesh >= 0) mesh_group_[c][mesh] = gi;
                }
        }
        for (int i = 0; i < k.size(); ++i) at_mesh_[c].emplace(mesh_key(k.shape_class[i], k.mesh_id[i]), i);
    }

    setup_fuse_moves();
    Evaluator ev(p_);
    std::vector<Evaluation> start_ev;
    for (const auto& s : starts) {
        start_ev.push_back(ev.evaluate(s.data()));
        if (!start_ev.back().exact)
            throw std::invalid_argument("a start plan uses transfer costs that are not priced yet; price them first");
    }
    size_t first = 0;
    for (size_t i = 1; i < starts.size(); ++i)
        if (better(start_ev[i], start_ev[first])) first = i;
    best_ = starts[first];
    best_ev_ = start_ev[first];
    for (int i = 0; i < opt_.n_chains; ++i) {
        uint64_t s = opt_.seed * 0x100000001B3ull + static_cast<uint64_t>(i) + 1;
        auto ch = std::make_unique<Chain>(p_, splitmix64(s));
        const size_t j = static_cast<size_t>(i) % starts.size();
        double scale = 1.0;
        for (int k = 0; k < opt_.n_temps; ++k, scale *= opt_.ladder) ch->reps.push_back({starts[j], start_ev[j], scale});
        ch->best = starts[j];
        ch->best_ev = start_ev[j];
        chains_.push_back(std::move(ch));
    }
    t0_ = std::chrono::steady_clock::now();
    history_.push_back({0.0, 0, best_ev_.cost, best_ev_.time, best_ev_.feasible});
}

double Search::elapsed() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
}

double Search::temperature() const { return tau_ * (best_ev_.time > 0 ? best_ev_.time : 1.0); }

int Search::propose(Chain& ch, const std::vector<int32_t>& cur, int (&calls)[2], int (&to)[2]) {
    if (!p_.fused.empty() && opt_.p_fuse > 0.0 && ch.rng.uniform() < opt_.p_fuse) {
        const int n = propose_fuse(ch, cur, calls, to);
        if (n) return n;
    }
    const int c = movable_[ch.rng.below(movable_.size())];
    const int a = cur[c];
    const Candidates& k = p_.cands[c];
    calls[0] = c;
    const double mix[] = {opt_.p_any,      opt_.p_mbs,  opt_.p_strategy, opt_.p_position,
                          opt_.p_colocate, opt_.p_swap, opt_.p_recompute};
    double u = ch.rng.uniform() * (mix[0] + mix[1] + mix[2] + mix[3] + mix[4] + mix[5] + mix[6]);
    int kind = 0;
    while (kind < 6 && (u -= mix[kind]) >= 0) ++kind;
    // Each move is uniform over a set that contains both the old and the new candidate (or, for
    // a swap, over a relation that is its own inverse), so proposals are symmetric. A move with
    // nothing to offer falls back to "any candidate".
    auto pick_other = [&](const std::vector<int32_t>& g, int self) -> int {
        const int b = g[ch.rng.below(g.size() - 1)];
        return b == self ? g.back() : b;
    };
    if (kind == 6) {
        if (k.twin[a] >= 0) {
            to[0] = k.twin[a];
            return 1;
        }
    } else if (kind >= 1 && kind <= 3) {
        const auto& g = groups_[c][kind - 1][group_of_[c][kind - 1][a]];
        if (g.size() > 1) {
            to[0] = pick_other(g, a);
            return 1;
        }
    } else if ((kind == 4 || kind == 5) && p_.n_calls() > 1) {
        int d = static_cast<int>(ch.rng.below(p_.n_calls() - 1));
        if (d >= c) ++d;
        const int mesh_d = p_.cands[d].mesh_id[cur[d]], mesh_c = k.mesh_id[a];
        if (mesh_d != mesh_c) {
            if (kind == 4) {
                // colocate: any candidate of c on the mesh d uses
                const int gi = mesh_d < static_cast<int>(mesh_group_[c].size()) ? mesh_group_[c][mesh_d] : -1;
                if (gi >= 0) {
                    const auto& g = groups_[c][1][gi];
                    to[0] = g[ch.rng.below(g.size())];
                    return 1;
                }
            } else {
                // swap: c and d exchange mesh positions, each keeping its shape, strategy and n_mbs
                const auto ic = at_mesh_[c].find(mesh_key(k.shape_class[a], mesh_d));
                const auto id = at_mesh_[d].find(mesh_key(p_.cands[d].shape_class[cur[d]], mesh_c));
                if (ic != at_mesh_[c].end() && id != at_mesh_[d].end()) {
                    calls[1] = d;
                    to[0] = ic->second;
                    to[1] = id->second;
                    return 2;
                }
            }
        }
    }
    const int b = static_cast<int>(ch.rng.below(k.size() - 1));
    to[0] = b >= a ? b + 1 : b;
    return 1;
}

void Search::improve(Chain& ch, const Evaluation& ev, const std::vector<int32_t>& plan) {
    ch.best = plan;
    ch.best_ev = ev;
    ch.found.push_back({elapsed(), evals_.load(std::memory_order_relaxed), ev.cost, ev.time, ev.feasible});
}

void Search::note_pending(Chain& ch, const Evaluation& ev, const std::vector<int32_t>& plan) {
    auto& pend = ch.pending;
    if (pend.size() == kMaxPending && !(ev.cost < pend.back().first.cost)) return;
    for (const auto& q : pend)
        if (q.second == plan) return;
    auto at = std::upper_bound(pend.begin(), pend.end(), ev.cost,
                               [](double c, const auto& q) { return c < q.first.cost; });
    pend.insert(at, {ev, plan});
    if (pend.size() > kMaxPending) pend.pop_back();
}

void Search::observe(Chain& ch, const Evaluation& ev, const std::vector<int32_t>& plan) {
    if (better(ev, ch.best_ev)) {
        if (ev.exact)
            improve(ch, ev, plan);
        else
            note_pending(ch, ev, plan);
    }
}

int Search::step(Chain& ch, Replica& r, double temperature, int64_t room) {
    // A heat-bath move runs only if its largest block fits in what is left of the budget.
    const int64_t largest = std::max<int64_t>(1 + opt_.heat_one, (1 + opt_.heat_two) * (1 + opt_.heat_two));
    if (opt_.p_heat > 0 && ch.rng.uniform() < opt_.p_heat && room >= largest) return heat_bath(ch, r, temperature);
    int calls[2], to[2], from[2];
    const int n = propose(ch, r.cur, calls, to);
    for (int i = 0; i < n; ++i) {
        from[i] = r.cur[calls[i]];
        r.cur[calls[i]] = to[i];
    }
    // Metropolis: a worse plan is accepted if u < exp(-delta / T), i.e. delta < -T ln u. Drawing u first
    // tells how costly the proposal may be and still be accepted; beyond that (and beyond what would
    // make it the chain's best) the simulation may stop early: the chain takes the same step.
    const double u = ch.rng.uniform();
    const double t = temperature * r.temp_scale;
    double limit = std::numeric_limits<double>::infinity();
    if (opt_.early_reject && u > 0.0) limit = r.cur_ev.cost - t * std::log(u);
    const Evaluation ev = ch.ev.evaluate_bounded(r.cur.data(), limit, ch.best_ev);
    ch.simulated += ev.complete;
    ch.unsimulated += !ev.simulated;
    if (ev.complete) observe(ch, ev, r.cur);
    const double delta = ev.cost - r.cur_ev.cost;
    if (ev.complete && (delta <= 0.0 || u < std::exp(-delta / t))) {
        r.cur_ev = ev;
    } else {
        for (int i = 0; i < n; ++i) r.cur[calls[i]] = from[i];
    }
    return 1;
}

int Search::heat_bath(Chain& ch, Replica& r, double temperature) {
    // A block of one or two calls; the current candidates are always among the sampled ones.
    const int c = movable_[ch.rng.below(movable_.size())];
    int d = -1;
    if (movable_.size() > 1 && ch.rng.uniform() < 0.5) {
        d = movable_[ch.rng.below(movable_.size() - 1)];
        if (d == c) d = movable_.back();
    }
    auto sample = [&](int call, int want, std::vector<int32_t>& out) {
        const int k = p_.cands[call].size();
        out.assign(1, r.cur[call]);
        if (k - 1 <= want) {
            for (int i = 0; i < k; ++i)
                if (i != r.cur[call]) out.push_back(i);
        } else {
            for (int i = 0; i < want; ++i) {
                const int b = static_cast<int>(ch.rng.below(k - 1));
                out.push_back(b >= r.cur[call] ? b + 1 : b);
            }
        }
    };
    sample(c, d < 0 ? opt_.heat_one : opt_.heat_two, ch.block_a);
    if (d >= 0)
        sample(d, opt_.heat_two, ch.block_b);
    else
        ch.block_b.assign(1, -1);
    ch.block_ev.clear();
    // Plans more than kHeatCut temperatures above the cheapest get weight 0 (e^-60 of it): their
    // simulation may stop as soon as that is proven (the first plan, the current one, is always whole).
    const double t = temperature * r.temp_scale;
    double lowest = std::numeric_limits<double>::infinity();
    for (int32_t x : ch.block_a)
        for (int32_t y : ch.block_b) {
            r.cur[c] = x;
            if (d >= 0) r.cur[d] = y;
            const double cut = opt_.early_reject ? lowest + kHeatCut * t : std::numeric_limits<double>::infinity();
            const Evaluation ev = ch.ev.evaluate_bounded(r.cur.data(), cut, ch.best_ev);
            ch.unsimulated += !ev.simulated;
            if (ev.complete) {
                ++ch.simulated;
                observe(ch, ev, r.cur);
                lowest = std::min(lowest, ev.cost);
            }
            ch.block_ev.push_back(ev);
        }
    ch.block_w.resize(ch.block_ev.size());
    double total = 0.0;
    for (size_t i = 0; i < ch.block_ev.size(); ++i) {
        const Evaluation& e = ch.block_ev[i];
        total += ch.block_w[i] = e.complete && e.cost - lowest <= kHeatCut * t ? std::exp(-(e.cost - lowest) / t) : 0.0;
    }
    double u = ch.rng.uniform() * total;
    size_t pick = 0;
    while (pick + 1 < ch.block_w.size() && (u -= ch.block_w[pick]) >= 0.0) ++pick;
    while (ch.block_w[pick] == 0.0) --pick;  // rounding can run past the last weighted plan
    const size_t nb = ch.block_b.size();
    r.cur[c] = ch.block_a[pick / nb];
    if (d >= 0) r.cur[d] = ch.block_b[pick % nb];
    r.cur_ev = ch.block_ev[pick];
    return static_cast<int>(ch.block_ev.size());
}

void Search::exchange(Chain& ch, double temperature) {
    // Parallel tempering: neighbours k, k+1 swap states with probability
    // min(1, exp((c_k - c_{k+1}) * (1/T_k - 1/T_{k+1}))), which keeps each replica's distribution.
    for (size_t k = 0; k + 1 < ch.reps.size(); ++k) {
        Replica& a = ch.reps[k];
        Replica& b = ch.reps[k + 1];
        const double x = (a.cur_ev.cost - b.cur_ev.cost) * (1.0 / (temperature * a.temp_scale) -
                                                             1.0 / (temperature * b.temp_scale));
        ++ch.swaps_tried;
        if (x >= 0.0 || ch.rng.uniform() < std::exp(x)) {
            std::swap(a.cur, b.cur);
            std::swap(a.cur_ev, b.cur_ev);
            ++ch.swaps_done;
        }
    }
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
            int64_t evals = 0;
            for (Replica& r : ch.reps)
                for (int64_t i = 0; i < n;) {
                    const int e = step(ch, r, temperature, n - i);
                    i += e;
                    evals += e;
                }
            exchange(ch, temperature);
            ch.done += n;
            evals_.fetch_add(evals, std::memory_order_relaxed);
            simulations_.fetch_add(ch.simulated, std::memory_order_relaxed);
            unsimulated_.fetch_add(ch.unsimulated, std::memory_order_relaxed);
            ch.simulated = ch.unsimulated = 0;
            more = more || ch.done < quota;
        }
        if (has_deadline && std::chrono::steady_clock::now() >= deadline) return;
    }
}

bool Search::run(int64_t evals_per_replica, double seconds) {
    if (movable_.empty() || evals_per_replica <= 0) return false;
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
        run_chains(assign[0], evals_per_replica, deadline, has_deadline, temp);
    } else {
        std::vector<std::thread> threads;
        for (int t = 0; t < n_threads; ++t)
            threads.emplace_back(&Search::run_chains, this, std::cref(assign[t]), evals_per_replica, deadline,
                                 has_deadline, temp);
        for (auto& th : threads) th.join();
    }
    merge();
    bool by_time = false;
    for (auto& ch : chains_) by_time = by_time || ch->done < evals_per_replica;
    return by_time;
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
        for (Replica& r : ch->reps) r.cur_ev = ch->ev.evaluate(r.cur.data());
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
    // A coldest replica far behind the best restarts from it, so that chains pool their progress.
    for (auto& ch : chains_) {
        Replica& cold = ch->reps.front();
        if ((best_ev_.feasible && !cold.cur_ev.feasible) ||
            cold.cur_ev.cost > best_ev_.cost * (1.0 + opt_.restart_margin)) {
            cold.cur = best_;
            cold.cur_ev = best_ev_;
        }
    }
    swaps_tried_ = swaps_done_ = 0;
    for (const auto& ch : chains_) {
        swaps_tried_ += ch->swaps_tried;
        swaps_done_ += ch->swaps_done;
    }
}

}  // namespace rl
