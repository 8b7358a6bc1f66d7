// Bounded staleness in the plan simulator (stale.h; the rules: realloc/search/stale_reference.py).
#include "stale.h"

#include <algorithm>

#include "simulator.h"

namespace rl {

namespace {

bool is_stale(const Problem& p, int c) { return p.staleness > 0 && !p.stale.empty() && p.stale[c]; }

// The model's stale calls and its chain (its other calls), in topological order.
void split_calls(const Problem& p, int m, std::vector<int>& st, std::vector<int>& chain) {
    st.clear();
    chain.clear();
    for (int c : p.model_calls[m]) (is_stale(p, c) ? st : chain).push_back(c);
}

int layout(const Problem& p, int c, const int32_t* plan) { return p.cands[c].layout[plan[c]]; }

}  // namespace

void push_stale_nodes(Problem& p, int c, StalePositions& at) {
    const int n = p.n_calls();
    if (at.snapshot.empty()) {
        for (auto* v : {&at.snapshot, &at.in, &at.same, &at.place}) v->assign(n, -1);
        p.stale_gates.clear();
    }
    if (p.staleness == 0 || p.stale.empty()) return;
    const int m = p.call_model[c];
    std::vector<int> st, chain;
    split_calls(p, m, st, chain);
    if (st.empty() || chain.empty()) return;
    auto gate = [&](int a, int b, bool place) {
        p.stale_gates.push_back({static_cast<int>(p.iter_nodes.size()), a, b, chain.back(), place});
        p.iter_nodes.push_back({NodeKind::kGate, c, a, -1});
    };
    if (c == chain.front()) {
        at.place[c] = static_cast<int>(p.iter_nodes.size());
        for (int x : st) gate(x, -1, true);
    }
    if (!is_stale(p, c)) return;
    at.in[c] = static_cast<int>(p.iter_nodes.size());
    for (int x : st) gate(x, c, false);
    at.same[c] = static_cast<int>(p.iter_nodes.size());
    for (int x : st) {
        if (x == c) break;
        gate(x, c, false);
    }
    at.snapshot[c] = static_cast<int>(p.iter_nodes.size());
    p.iter_nodes.push_back({NodeKind::kRealloc, c, chain.back(), m});
}

void link_stale(const Problem& p, int per, const std::vector<int>& call_pos, const std::vector<int>& realloc_pos,
                const StalePositions& at, std::vector<std::vector<int32_t>>& kids) {
    if (p.staleness == 0 || p.stale.empty()) return;
    const int eta = p.staleness, K = p.n_iterations;
    std::vector<int> st, chain;
    for (int m = 0; m < p.n_models(); ++m) {
        split_calls(p, m, st, chain);
        if (st.empty() || chain.empty()) continue;
        const int home = chain.back(), front = chain.front();
        const int first = realloc_pos[front] >= 0 ? realloc_pos[front] : call_pos[front];
        for (int t = 0; t < K; ++t) {
            const int base = t * per;
            for (size_t i = 0; i < st.size(); ++i) {
                const int c = st[i], s = base + at.snapshot[c];
                if (t - 1 - eta >= 0) kids[(t - 1 - eta) * per + call_pos[home]].push_back(s);
                kids[s].push_back(base + call_pos[c]);
                for (size_t k = 0; k < st.size(); ++k) {
                    const int g = base + at.in[c] + static_cast<int>(k);
                    if (t >= 1) kids[base - per + call_pos[st[k]]].push_back(g);
                    kids[g].push_back(s);
                }
                for (size_t k = 0; k < i; ++k) {
                    const int g = base + at.same[c] + static_cast<int>(k);
                    kids[base + at.snapshot[st[k]]].push_back(g);
                    kids[g].push_back(s);
                }
            }
            // what reads home's version t: the stale calls of t + eta (at the first iteration, of 0 .. eta)
            const int lo = t > 0 ? t + eta : 0, hi = t + eta;
            for (size_t k = 0; k < st.size(); ++k) {
                const int g = base + at.place[front] + static_cast<int>(k);
                for (int j = lo; j <= hi && j < K; ++j) {
                    kids[j * per + at.snapshot[st[k]]].push_back(base + first);
                    kids[j * per + call_pos[st[k]]].push_back(g);
                }
                kids[g].push_back(base + first);
            }
        }
    }
}

bool gate_closed(const Problem& p, const StaleGate& g, const int32_t* plan) {
    const int home = layout(p, g.home, plan), a = layout(p, g.a, plan);
    return g.place ? a == home : a == layout(p, g.b, plan) && a != home;
}

bool snapshot_aliased(const Problem& p, int c, const int32_t* plan) {
    if (!is_stale(p, c)) return false;
    for (int x : p.model_calls[p.call_model[c]]) {
        if (x == c) return false;
        if (is_stale(p, x) && layout(p, x, plan) == layout(p, c, plan)) return true;
    }
    return false;
}

void add_stale_nodes(const Problem& p, std::vector<std::vector<int32_t>>& nodes_of) {
    if (p.staleness == 0 || p.stale.empty()) return;
    const int per = static_cast<int>(p.iter_nodes.size());
    for (int j = 0; j < per; ++j) {
        const NodeTemplate& nt = p.iter_nodes[j];
        if (nt.kind != NodeKind::kRealloc || !is_stale(p, nt.call)) continue;
        for (int x : p.model_calls[p.call_model[nt.call]]) {
            if (x == nt.call) break;
            if (is_stale(p, x)) nodes_of[x].push_back(j);
        }
    }
}

// -- the simulator's side ------------------------------------------------------------------------------------

void Evaluator::open_gates(const int32_t* plan) {
    open_gates_.clear();
    for (const StaleGate& g : p_.stale_gates)
        if (!gate_closed(p_, g, plan))
            for (int t = 0; t < p_.n_iterations; ++t)
                if (p_.n_parents[t * per_ + g.tmpl] > 0) open_gates_.push_back(t * per_ + g.tmpl);
}

}  // namespace rl
