// The fused node in the plan simulator: see fused_node.h.
#include "fused_node.h"

#include <algorithm>
#include <climits>
#include <map>
#include <string>

#include "simulator.h"

namespace rl {

void check_fused_pairs(const Problem& p) {
    std::vector<uint8_t> seen(p.n_calls(), 0);
    for (size_t i = 0; i < p.fused.size(); ++i) {
        const FusedPair& f = p.fused[i];
        const std::string name = "fused pair " + std::to_string(i);
        if (f.a < 0 || f.a >= p.n_calls() || f.b < 0 || f.b >= p.n_calls() || f.a == f.b)
            throw std::invalid_argument(name + ": calls out of range or equal");
        if (seen[f.a] || seen[f.b]) throw std::invalid_argument(name + ": a call is in two fused pairs");
        seen[f.a] = seen[f.b] = 1;
        if (p.call_model[f.a] == p.call_model[f.b]) throw std::invalid_argument(name + ": both calls train one model");
        if (static_cast<int>(f.bound_a.size()) != p.cands[f.a].size() ||
            static_cast<int>(f.bound_b.size()) != p.cands[f.b].size())
            throw std::invalid_argument(name + ": bound_a and bound_b need one entry per candidate");
    }
}

void Evaluator::setup_fused() {
    const int n = p_.n_calls();
    call_tmpl_.assign(n, -1);
    for (int j = 0; j < per_; ++j)
        if (p_.iter_nodes[j].kind == NodeKind::kCall) call_tmpl_[p_.iter_nodes[j].call] = j;
    // The pair's calls must not depend on each other within an iteration (graph/fused.py): the fused node would
    // wait for itself. Template nodes are numbered topologically; children below per_ are in the same iteration.
    for (size_t k = 0; k < p_.fused.size(); ++k)
        for (const auto& [from, to] : {std::pair{p_.fused[k].a, p_.fused[k].b}, std::pair{p_.fused[k].b, p_.fused[k].a}}) {
            std::vector<uint8_t> seen(per_, 0);
            seen[call_tmpl_[from]] = 1;
            for (int v = call_tmpl_[from]; v < per_; ++v)
                for (int i = p_.child_start[v]; seen[v] && i < p_.child_start[v + 1]; ++i)
                    if (p_.children[i] < per_) seen[p_.children[i]] = 1;
            if (seen[call_tmpl_[to]])
                throw std::invalid_argument("fused pair " + std::to_string(k) + ": call " + std::to_string(to) +
                                            " depends on call " + std::to_string(from) + " within an iteration");
        }
    joint_.assign(per_, -1);
    fused_on_.assign(p_.fused.size(), 0);
    arrived_.assign(p_.fused.empty() ? 0 : p_.n_nodes(), 0);
}

bool Evaluator::price_fused(const int32_t* plan, std::vector<MissingPair>* missing) {
    const int n = p_.n_calls();
    bool all_known = true;
    n_fused_on_ = 0;
    for (size_t k = 0; k < p_.fused.size(); ++k) {
        const FusedPair& f = p_.fused[k];
        const int ja = call_tmpl_[f.a], jb = call_tmpl_[f.b];
        const bool on = fused_pair_on(p_, f, plan[n + k], plan);
        // back to the calls' own price (simulator.cpp price() of a call node), then fused
        slot_[ja].cost = p_.cands[f.a].time[plan[f.a]];
        slot_[jb].cost = p_.cands[f.b].time[plan[f.b]];
        fused_on_[k] = on;
        slot_[ja].joined = slot_[jb].joined = 0;
        joint_[ja] = joint_[jb] = -1;
        if (!on) continue;
        ++n_fused_on_;
        const int i = plan[f.a], j = plan[f.b];
        bool known_s = false, known_x = false;
        const double cost = fused_time(p_, f, i, j, known_s);
        f.extra.get(i, j, known_x);
        const int t = p_.n_tables() + 2 * static_cast<int>(k);
        if (missing && !known_s) missing->push_back({t, i, j});
        if (missing && !known_x) missing->push_back({t + 1, i, j});
        all_known = all_known && known_s && known_x;
        // Both call nodes carry the fused node's duration (the path bound reads either); its work counts once.
        slot_[ja].cost = slot_[jb].cost = cost;
        slot_[ja].joined = 1;
        slot_[jb].joined = 2;
        joint_[ja] = jb;
        joint_[jb] = ja;
    }
    return all_known;
}

int reversed_groups(const Problem& p, const int32_t* plan, int c) {
    const Candidates& k = p.cands[c];
    const int i = plan[c];
    for (size_t q = 0; q < p.fused.size(); ++q) {
        const FusedPair& f = p.fused[q];
        if (p.call_model[c] != p.call_model[f.b] || !fused_pair_on(p, f, plan[p.n_calls() + q], plan)) continue;
        const Candidates& kb = p.cands[f.b];
        const int j = plan[f.b];
        if (k.dev_lo[i] == kb.dev_lo[j] && k.dev_hi[i] == kb.dev_hi[j])
            return static_cast<int>(kb.mem_offset[j + 1] - kb.mem_offset[j]);
    }
    return 0;
}

int64_t stage_at(const Problem& p, const int32_t* plan, int c, int x) {
    const Candidates& k = p.cands[c];
    const int i = plan[c];
    const int local = x - k.dev_lo[i], groups = reversed_groups(p, plan, c);
    if (groups <= 1) return local / k.stage_width[i];
    // the mesh's devices in groups of `size`, the groups in reverse order; the call's stages over that order
    const int size = (k.dev_hi[i] - k.dev_lo[i]) / groups;
    return ((groups - 1 - local / size) * size + local % size) / k.stage_width[i];
}

namespace {

// Static and dynamic bytes call c puts on device x under `plan` (the memory.cpp rules, one device at a time).
void bytes_at(const Problem& p, const int32_t* plan, int c, int x, int64_t& stat, int64_t& dyn) {
    const Candidates& k = p.cands[c];
    const int i = plan[c];
    stat = dyn = 0;
    if (x < k.dev_lo[i] || x >= k.dev_hi[i]) return;
    const int64_t s = k.mem_offset[i] + stage_at(p, plan, c, x);
    const int home = p.model_home[p.call_model[c]];
    const bool copy = c != home && k.layout[i] != p.cands[home].layout[plan[home]];
    const bool keep = copy && p.staleness > 0 && !p.stale.empty() && p.stale[c];
    stat = c == home ? k.mem_static[s] : keep ? k.mem_param[s] : 0;
    dyn = k.mem_dynamic[s] + (copy && !keep ? k.mem_param[s] : 0);
}

int64_t capacity(const Problem& p, int x) {
    int64_t cap = p.device_memory;
    for (size_t i = 0; i < p.pool_start.size() && p.pool_start[i] <= x; ++i) cap = p.pool_memory[i];
    return cap;
}

// Calls fn(f, x, extra) for every device x of every fused node on under `plan` (extra: the bytes fusion adds).
template <typename Fn>
void for_each_fused_device(const Problem& p, const int32_t* plan, Fn fn) {
    for (size_t k = 0; k < p.fused.size(); ++k) {
        const FusedPair& f = p.fused[k];
        if (!fused_pair_on(p, f, plan[p.n_calls() + k], plan)) continue;
        bool known = false;
        const int64_t extra = static_cast<int64_t>(f.extra.get(plan[f.a], plan[f.b], known));
        for (int x = p.cands[f.a].dev_lo[plan[f.a]]; x < p.cands[f.a].dev_hi[plan[f.a]]; ++x) fn(f, x, extra);
    }
}

}  // namespace

// With a fused pair on: every device's bytes one device at a time (the second model's stages reversed, stage_at),
// a fused node's mesh with the larger of its calls' dynamic bytes plus what fusion adds; the plan's peak, its
// device and call, overflow and fit as check_memory()'s sweep finds them. Returns false (nothing done) when no
// pair is on, where the sweep holds.
bool Evaluator::check_fused_memory(const int32_t* plan, Evaluation& ev) {
    const int n = p_.n_calls();
    bool any = false;
    for (size_t k = 0; k < p_.fused.size(); ++k) any = any || fused_pair_on(p_, p_.fused[k], plan[n + k], plan);
    if (!any) return false;
    std::vector<int64_t> extra(p_.n_devices, -1);  // per device: the bytes fusion adds there, -1 off a fused mesh
    std::vector<int> pair_of(p_.n_devices, -1);
    for_each_fused_device(p_, plan, [&](const FusedPair& f, int x, int64_t e) {
        extra[x] = e;
        pair_of[x] = static_cast<int>(&f - p_.fused.data());
    });
    int64_t peak = -1, excess = INT64_MIN;
    for (int x = 0; x < p_.n_devices; ++x) {
        int64_t stat = 0, dyn = 0, pair = 0;
        int call = -1;
        for (int c = 0; c < n; ++c) {
            int64_t s, d;
            bytes_at(p_, plan, c, x, s, d);
            stat += s;
            if (d > dyn) dyn = d, call = c;
            if (pair_of[x] >= 0 && (c == p_.fused[pair_of[x]].a || c == p_.fused[pair_of[x]].b))
                pair = std::max(pair, d);
        }
        int64_t total = stat + dyn;
        if (pair_of[x] >= 0 && stat + pair + extra[x] > total) {
            total = stat + pair + extra[x];
            call = p_.fused[pair_of[x]].a;
        }
        if (total > peak) {
            peak = total;
            ev.peak_device = x;
            ev.peak_call = call;
        }
        excess = std::max(excess, total - capacity(p_, x));
    }
    ev.peak_memory = peak;
    if (p_.pool_start.empty()) {
        ev.overflow = std::max<int64_t>(0, peak - p_.device_memory);
        ev.feasible = peak <= p_.device_memory;
    } else {
        ev.overflow = std::max<int64_t>(0, excess);
        ev.feasible = excess <= 0;
    }
    return true;
}

void Evaluator::fused_memory_report(const int32_t* plan, MemoryReport& r) {
    for_each_fused_device(p_, plan, [&](const FusedPair& f, int x, int64_t extra) {
        int64_t s, da, db;
        bytes_at(p_, plan, f.a, x, s, da);
        bytes_at(p_, plan, f.b, x, s, db);
        const int64_t fused = r.device_static[x] + std::max(da, db) + extra;
        r.device_peak[x] = std::max(r.device_peak[x], fused);
        r.call_peak[f.a] = std::max(r.call_peak[f.a], fused);
        r.call_peak[f.b] = std::max(r.call_peak[f.b], fused);
    });
}

}  // namespace rl

// The MCMC's fuse move (mcmc.h SearchOptions::p_fuse), here to keep mcmc.cpp's moves apart from fusion.
#include "mcmc.h"

namespace rl {

void Search::setup_fuse_moves() {
    coplace_.assign(p_.fused.size(), {});
    coplace_of_.assign(p_.fused.size(), {});
    auto key = [&](int c, int i) {
        const Candidates& k = p_.cands[c];
        return std::array<int64_t, 3>{k.dev_lo[i], k.dev_hi[i], k.mem_offset[i + 1] - k.mem_offset[i]};
    };
    for (size_t f = 0; f < p_.fused.size(); ++f)
        for (int side = 0; side < 2; ++side) {
            const int mover = side ? p_.fused[f].b : p_.fused[f].a, stay = side ? p_.fused[f].a : p_.fused[f].b;
            std::map<std::array<int64_t, 3>, int32_t> index;
            for (int i = 0; i < p_.cands[mover].size(); ++i) {
                auto it = index.emplace(key(mover, i), static_cast<int32_t>(index.size())).first;
                if (it->second == static_cast<int32_t>(coplace_[f][side].size())) coplace_[f][side].emplace_back();
                coplace_[f][side][it->second].push_back(i);
            }
            for (int i = 0; i < p_.cands[stay].size(); ++i) {
                const auto it = index.find(key(stay, i));
                coplace_of_[f][side].push_back(it == index.end() ? -1 : it->second);
            }
        }
}

int Search::propose_fuse(Chain& ch, const std::vector<int32_t>& cur, int (&calls)[2], int (&to)[2]) {
    const int n = p_.n_calls();
    const int f = static_cast<int>(ch.rng.below(p_.fused.size()));
    const FusedPair& pair = p_.fused[f];
    calls[0] = n + f;
    to[0] = !cur[n + f];
    if (cur[n + f] || fused_pair_on(p_, pair, 1, cur.data())) return 1;  // unfuse, or fuse where they stand
    // fuse: one call (either, at random) moves to a candidate on the other's devices with its pp
    const int first = static_cast<int>(ch.rng.below(2));
    for (int t = 0; t < 2; ++t) {
        const int side = first ^ t;
        const int stay = side ? pair.a : pair.b;
        const int g = coplace_of_[f][side][cur[stay]];
        if (g < 0) continue;
        const auto& group = coplace_[f][side][g];
        calls[1] = side ? pair.b : pair.a;
        to[1] = group[ch.rng.below(group.size())];
        return 2;
    }
    return 0;
}

}  // namespace rl
