// A home that keeps its parameters across a narrowing trip (realloc/search/home_keep.py, the same rule; the
// runtime's is runtime/control/pool_dtypes.py). The reallocation that brings a model back into a home that kept
// its parameters is skipped by the runtime: the simulator prices it at 0. Whether it is skipped depends on every
// call of the model (its home, its train calls, the pools it visits), so a change to any of them prices the
// model's reallocation nodes again.
#include <algorithm>

#include "simulator.h"

namespace rl {

namespace {

int pool_of_device(const Problem& p, int device) {
    int pool = 0;
    while (pool + 1 < static_cast<int>(p.pool_start.size()) && p.pool_start[pool + 1] <= device) ++pool;
    return pool;
}

bool is_stale(const Problem& p, int c) { return p.staleness > 0 && !p.stale.empty() && p.stale[c]; }

}  // namespace

bool home_skips_return(const Problem& p, int call, const int32_t* plan) {
    if (p.pool_narrows.empty() || is_stale(p, call)) return false;
    const int m = p.call_model[call];
    std::vector<int> chain;  // a handful of calls
    for (int c : p.model_calls[m])
        if (!is_stale(p, c)) chain.push_back(c);
    const int k = static_cast<int>(chain.size());
    if (k < 2) return false;
    auto layout = [&](int c) { return p.cands[c].layout[plan[c]]; };
    auto pool = [&](int c) { return pool_of_device(p, p.cands[c].dev_lo[plan[c]]); };
    const int home = layout(chain.back());
    for (int c : chain)
        if (p.train_call[c] && layout(c) != home) return false;  // trained away from home: nothing kept
    const int n_pools = static_cast<int>(p.pool_start.size());
    bool kept = false;
    for (int i = 0; i < k; ++i) {  // the wrap from the previous iteration first, then chain order
        const int prev = chain[i == 0 ? k - 1 : i - 1], c = chain[i];
        const int la = layout(prev), lb = layout(c);
        if (la == lb) continue;
        bool skip = false;
        if (lb == home && kept) {
            skip = true;
            kept = false;
        } else if (la == home && p.pool_narrows[pool(prev) * n_pools + pool(c)]) {
            kept = true;
        }
        if (c == call) return skip;
    }
    return false;
}

void add_home_keep_nodes(const Problem& p, std::vector<std::vector<int32_t>>& nodes_of) {
    if (p.pool_narrows.empty()) return;
    const int per = static_cast<int>(p.iter_nodes.size());
    for (int j = 0; j < per; ++j) {
        const NodeTemplate& nt = p.iter_nodes[j];
        if (nt.kind != NodeKind::kRealloc || is_stale(p, nt.call)) continue;
        for (int c : p.model_calls[p.call_model[nt.call]]) {
            auto& js = nodes_of[c];
            if (std::find(js.begin(), js.end(), j) == js.end()) js.push_back(j);
        }
    }
}

void check_home_keep(const Problem& p) {
    if (p.pool_narrows.empty()) return;
    const size_t n_pools = p.pool_start.size();
    if (p.pool_narrows.size() != n_pools * n_pools)
        throw std::invalid_argument("pool_narrows needs one entry per pair of pools (set_pools first)");
    if (static_cast<int>(p.train_call.size()) != p.n_calls())
        throw std::invalid_argument("train_call needs one entry per call");
}

}  // namespace rl
