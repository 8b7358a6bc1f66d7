#include "problem.h"

#include <algorithm>
#include <cmath>

namespace rl {

void PairCosts::set(int a, int b, double seconds) {
    if (a < 0 || a >= rows || b < 0 || b >= cols)
        throw std::invalid_argument("pair (" + std::to_string(a) + ", " + std::to_string(b) + ") is outside the " +
                                    std::to_string(rows) + "x" + std::to_string(cols) + " table");
    if (!(seconds >= 0.0) || !std::isfinite(seconds)) throw std::invalid_argument("costs must be finite and >= 0");
    if (2 * (n_ + 1) > keys_.size()) grow();
    const uint64_t key = pack(a, b);
    for (size_t i = mix(key) & mask_;; i = (i + 1) & mask_) {
        if (keys_[i] == key) {
            values_[i] = seconds;
            return;
        }
        if (keys_[i] == kEmpty) {
            keys_[i] = key;
            values_[i] = seconds;
            ++n_;
            return;
        }
    }
}

void PairCosts::grow() {
    std::vector<uint64_t> old_keys = std::move(keys_);
    std::vector<double> old_values = std::move(values_);
    const size_t cap = std::max<size_t>(64, old_keys.size() * 2);
    keys_.assign(cap, kEmpty);
    values_.assign(cap, 0.0);
    mask_ = cap - 1;
    for (size_t j = 0; j < old_keys.size(); ++j) {
        if (old_keys[j] == kEmpty) continue;
        for (size_t i = mix(old_keys[j]) & mask_;; i = (i + 1) & mask_)
            if (keys_[i] == kEmpty) {
                keys_[i] = old_keys[j];
                values_[i] = old_values[j];
                break;
            }
    }
}

PairCosts& Problem::table(int id) {
    if (id >= n_tables() && id < n_tables() + 2 * static_cast<int>(fused.size())) {  // fused_node.h
        FusedPair& f = fused[(id - n_tables()) / 2];
        return (id - n_tables()) % 2 ? f.extra : f.saving;
    }
    if (id < 0 || id >= n_tables()) throw std::invalid_argument("pair-cost table " + std::to_string(id) + " does not exist");
    return id < n_models() ? realloc[id] : data_edges[id - n_models()].cost;
}

const PairCosts& Problem::table(int id) const { return const_cast<Problem*>(this)->table(id); }

namespace {

[[noreturn]] void fail(const std::string& what) { throw std::invalid_argument(what); }

void check_table(const PairCosts& t, int min_rows, int min_cols, const std::string& name) {
    if (t.rows < min_rows || t.cols < min_cols)
        fail(name + ": table is " + std::to_string(t.rows) + "x" + std::to_string(t.cols) + " but the layouts need " +
             std::to_string(min_rows) + "x" + std::to_string(min_cols));
    if (!(t.provisional >= 0.0) || !std::isfinite(t.provisional)) fail(name + ": provisional cost must be >= 0");
}

void find_memory_runs(Candidates& k) {
    k.run_offset.assign(1, 0);
    k.run_device.clear();
    k.run_stage.clear();
    for (int i = 0; i < k.size(); ++i) {
        for (int64_t s = k.mem_offset[i]; s < k.mem_offset[i + 1]; ++s) {
            const bool same = s > k.mem_offset[i] && k.mem_static[s] == k.mem_static[s - 1] &&
                              k.mem_dynamic[s] == k.mem_dynamic[s - 1] && k.mem_param[s] == k.mem_param[s - 1];
            if (same) continue;
            k.run_device.push_back(k.dev_lo[i] + static_cast<int32_t>(s - k.mem_offset[i]) * k.stage_width[i]);
            k.run_stage.push_back(s);
        }
        k.run_offset.push_back(static_cast<int32_t>(k.run_device.size()));
    }
}

}  // namespace

void Problem::finalize() {
    const int n = n_calls();
    const int n_m = n_models();
    if (n_devices < 1) fail("n_devices must be positive");
    if (n_iterations < 3) fail("n_iterations must be at least 3 to measure a steady-state iteration");
    if (warmup < 0 || lookahead < 0 || last_priced() - first_priced() < 2)
        fail("warmup and lookahead must be >= 0 and leave at least 3 priced iterations of n_iterations");
    if (device_memory < 1) fail("device_memory must be positive");
    if (!(oom_alpha >= 1.0)) fail("oom_alpha must be at least 1");
    if (!(dispatch_latency >= 0.0) || !std::isfinite(dispatch_latency)) fail("dispatch_latency must be finite and >= 0");
    if (devices_per_node < 0 || (devices_per_node > 0 && n_devices % devices_per_node))
        fail("devices_per_node must divide n_devices (or be 0 for one host)");
    if (!(cores_per_node >= 0.0) || !std::isfinite(cores_per_node)) fail("cores_per_node must be finite and >= 0");
    if (pool_start.size() != pool_memory.size()) fail("pool_start and pool_memory must have one entry per pool");
    for (size_t i = 0; i < pool_start.size(); ++i) {
        if (i == 0 ? pool_start[0] != 0 : pool_start[i] <= pool_start[i - 1] || pool_start[i] >= n_devices)
            fail("pool_start must begin at 0 and increase below n_devices");
        if (pool_memory[i] < 1) fail("pool_memory must be positive");
    }
    if (n < 1) fail("the problem has no calls");
    check_fused_pairs(*this);  // fused_node.cpp
    check_home_keep(*this);    // home_keep.cpp
    if (static_cast<int>(cands.size()) != n) fail("need one candidate table per call");
    if (static_cast<int>(realloc.size()) != n_m) fail("need one reallocation table per model");

    model_calls.assign(n_m, {});
    for (int c = 0; c < n; ++c) {
        if (call_model[c] < 0 || call_model[c] >= n_m) fail("call " + std::to_string(c) + ": model index out of range");
        model_calls[call_model[c]].push_back(c);
    }
    std::vector<int> n_layouts(n_m, 0);
    for (int c = 0; c < n; ++c) {
        const Candidates& k = cands[c];
        const std::string who = "call " + std::to_string(c);
        const size_t s = k.time.size();
        if (s == 0) fail(who + ": no candidate placements");
        if (k.dev_lo.size() != s || k.dev_hi.size() != s || k.stage_width.size() != s || k.layout.size() != s ||
            k.mesh_id.size() != s || k.shape_class.size() != s || k.twin.size() != s || k.mem_offset.size() != s + 1 ||
            (!k.whole.empty() && k.whole.size() != s))
            fail(who + ": candidate arrays differ in length");
        const size_t pool = k.mem_static.size();
        if (k.mem_offset[0] != 0 || static_cast<size_t>(k.mem_offset[s]) != pool || k.mem_dynamic.size() != pool ||
            k.mem_param.size() != pool)
            fail(who + ": memory pools do not match mem_offset");
        for (size_t i = 0; i < s; ++i) {
            const int lo = k.dev_lo[i], hi = k.dev_hi[i], w = k.stage_width[i];
            if (lo < 0 || hi <= lo || hi > n_devices) fail(who + ": candidate mesh out of the cluster");
            if (w < 1 || (hi - lo) % w) fail(who + ": stage_width must divide the mesh size");
            if (k.mem_offset[i + 1] - k.mem_offset[i] != (hi - lo) / w)
                fail(who + ": memory needs one entry per pipeline stage ((dev_hi - dev_lo) / stage_width)");
            if (k.layout[i] < 0) fail(who + ": negative layout id");
            const int t = k.twin[i];
            if (t != -1 && (t < 0 || static_cast<size_t>(t) >= s || t == static_cast<int>(i) ||
                            k.twin[t] != static_cast<int>(i) || k.layout[t] != k.layout[i] ||
                            k.dev_lo[t] != lo || k.dev_hi[t] != hi || k.stage_width[t] != w))
                fail(who + ": twin must pair two candidates of the same layout (twin[twin[i]] == i) or be -1");
            if (!(k.time[i] >= 0.0) || !std::isfinite(k.time[i])) fail(who + ": times must be finite and >= 0");
            n_layouts[call_model[c]] = std::max(n_layouts[call_model[c]], k.layout[i] + 1);
        }
        for (size_t i = 0; i < pool; ++i)
            if (k.mem_static[i] < 0 || k.mem_dynamic[i] < 0 || k.mem_param[i] < 0) fail(who + ": negative memory");
        find_memory_runs(cands[c]);
    }
    for (int m = 0; m < n_m; ++m) {
        const int h = model_home[m];
        if (h < 0 || h >= n || call_model[h] != m) fail("model " + std::to_string(m) + ": home is not one of its calls");
        check_table(realloc[m], n_layouts[m], n_layouts[m], "model " + std::to_string(m) + " reallocation");
    }
    auto check_edge = [&](const std::array<int, 2>& e, bool forward, const char* kind) {
        if (e[0] < 0 || e[0] >= n || e[1] < 0 || e[1] >= n) fail(std::string(kind) + " edge: call index out of range");
        if (forward && e[0] >= e[1]) fail(std::string(kind) + " edge: calls must be numbered in topological order");
    };
    for (const auto& e : order_edges) check_edge(e, true, "order");
    for (const auto& e : carry_edges) check_edge(e, false, "carry");
    for (const DataEdge& d : data_edges) {
        check_edge({d.src, d.dst}, true, "data");
        check_table(d.cost, n_layouts[call_model[d.src]], n_layouts[call_model[d.dst]], "data edge");
    }

    // One iteration's nodes: before each call of a model with several calls its reallocation node
    // (from the layout of the model's previous call, which for its first call is its last call of
    // the previous iteration: the runtime moves the parameters along the chain of calls, so a
    // generation layout costs a move there and one back), and one transfer node per incoming
    // data edge. This order is topological.
    if (staleness < 0) fail("staleness must be >= 0");
    if (!stale.empty() && static_cast<int>(stale.size()) != n) fail("stale needs one entry per call");
    const bool async = staleness > 0 && !stale.empty();
    auto is_stale = [&](int c) { return async && stale[c] != 0; };
    // Each model's chain of reallocations: its calls, without the stale ones.
    std::vector<std::vector<int>> chain(n_m);
    for (int m = 0; m < n_m; ++m)
        for (int c : model_calls[m])
            if (!is_stale(c)) chain[m].push_back(c);
    for (int c = 0; c < n; ++c)
        if (is_stale(c)) {
            const auto& fresh = chain[call_model[c]];
            if (fresh.empty() || fresh.front() < c)
                fail("call " + std::to_string(c) + ": a stale call must come before its model's other calls");
        }
    TailPositions tail_at;
    prepare_tail(*this, tail_at);
    iter_nodes.clear();
    StalePositions stale_at;
    std::vector<int> call_pos(n), realloc_pos(n, -1), data_pos(data_edges.size());
    for (int c = 0; c < n; ++c) {
        push_stale_nodes(*this, c, stale_at);  // bounded staleness: gates and the snapshot (stale.cpp)
        const auto& seq = chain[call_model[c]];
        if (!is_stale(c) && seq.size() > 1) {
            const auto at = std::find(seq.begin(), seq.end(), c);
            const int prev = at == seq.begin() ? seq.back() : *(at - 1);
            realloc_pos[c] = static_cast<int>(iter_nodes.size());
            iter_nodes.push_back({NodeKind::kRealloc, c, prev, call_model[c]});
        }
        for (size_t e = 0; e < data_edges.size(); ++e)
            if (data_edges[e].dst == c) {
                data_pos[e] = static_cast<int>(iter_nodes.size());
                iter_nodes.push_back({NodeKind::kData, c, data_edges[e].src, n_m + static_cast<int>(e)});
            }
        push_tail_nodes_before(*this, c, tail_at);
        call_pos[c] = static_cast<int>(iter_nodes.size());
        iter_nodes.push_back({NodeKind::kCall, c, -1, -1});
        push_tail_node_after(*this, c, tail_at);
    }

    const int per = static_cast<int>(iter_nodes.size());
    const int total = per * n_iterations;
    std::vector<std::vector<int32_t>> kids(total);
    for (int t = 0; t < n_iterations; ++t) {
        const int base = t * per;
        for (int c = 0; c < n; ++c) {
            if (realloc_pos[c] < 0) continue;
            // Parameters move after the model's previous call, e.g. after the train step that
            // produced the parameter version (realhf.txt §4: "consecutive function calls from the
            // same model ... across two consecutive iterations").
            const auto& seq = chain[call_model[c]];
            const int i = static_cast<int>(std::find(seq.begin(), seq.end(), c) - seq.begin());
            const int r = base + realloc_pos[c];
            if (i > 0)
                kids[base + call_pos[seq[i - 1]]].push_back(r);
            else if (t > 0)
                kids[base - per + call_pos[seq.back()]].push_back(r);
            kids[r].push_back(base + call_pos[c]);
        }
        for (size_t e = 0; e < data_edges.size(); ++e) {
            const int d = base + data_pos[e];
            kids[base + call_pos[data_edges[e].src]].push_back(d);
            kids[d].push_back(base + call_pos[data_edges[e].dst]);
        }
        // A stale call's parameter edges (it before the train step; the train step before it in the next
        // iteration) are stale.cpp's.
        for (const auto& e : order_edges)
            if (!is_stale(e[0])) kids[base + call_pos[e[0]]].push_back(base + call_pos[e[1]]);
        if (t + 1 < n_iterations)
            for (const auto& e : carry_edges)
                if (!is_stale(e[1])) kids[base + call_pos[e[0]]].push_back(base + per + call_pos[e[1]]);
        // into a stale call, 1 + eta iterations later (the runtime's lag; from home, the snapshot's edge too)
        for (const auto& e : carry_edges)
            if (is_stale(e[1]) && t + 1 + staleness < n_iterations)
                kids[base + call_pos[e[0]]].push_back(base + (1 + staleness) * per + call_pos[e[1]]);
    }
    link_stale(*this, per, call_pos, realloc_pos, stale_at, kids);
    rewire_tail(*this, per, call_pos, data_pos, tail_at, kids);
    child_start.assign(total + 1, 0);
    children.clear();
    n_parents.assign(total, 0);
    for (int v = 0; v < total; ++v) {
        auto& k = kids[v];
        std::sort(k.begin(), k.end());
        k.erase(std::unique(k.begin(), k.end()), k.end());
        for (int u : k) {
            children.push_back(u);
            ++n_parents[u];
        }
        child_start[v + 1] = static_cast<int32_t>(children.size());
    }
    // Nodes of iteration 0 that reach iteration 1, found backwards from iteration 1 (graphs are the same
    // every iteration; children within an iteration have higher numbers, so one reverse pass suffices). Not
    // through a gate (stale.h): a plan may open it.
    if (n_iterations > 1) {
        std::vector<uint8_t> reaches(2 * per, 0);
        for (int v = per; v < 2 * per; ++v) reaches[v] = 1;
        for (int v = per - 1; v >= 0; --v)
            for (int i = child_start[v]; i < child_start[v + 1]; ++i)
                if (children[i] < 2 * per && reaches[children[i]] &&
                    iter_nodes[children[i] % per].kind != NodeKind::kGate)
                    reaches[v] = 1;
        iterations_chain = std::all_of(reaches.begin(), reaches.begin() + per, [](uint8_t x) { return x != 0; });
    }
    bump_pair_costs();
    finalized = true;
}

void Problem::check_plan(const std::vector<int32_t>& plan) const {
    if (!finalized) fail("problem is not finalized");
    if (static_cast<int>(plan.size()) != plan_size())
        fail("plan has " + std::to_string(plan.size()) + " entries for " + std::to_string(n_calls()) + " calls" +
             (fused.empty() ? "" : " and " + std::to_string(fused.size()) + " fused pairs"));
    for (int c = 0; c < n_calls(); ++c)
        if (plan[c] < 0 || plan[c] >= cands[c].size())
            fail("plan: call " + std::to_string(c) + " has no candidate " + std::to_string(plan[c]));
    for (int c = n_calls(); c < plan_size(); ++c)
        if (plan[c] != 0 && plan[c] != 1) fail("plan: fused pair " + std::to_string(c - n_calls()) + " must be 0 or 1");
}

}  // namespace rl
