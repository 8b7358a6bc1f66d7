// Long-tail migration in the problem (finalize's nodes and edges) and in the simulator (pricing, atoms).
// Rules: realloc/search/tail_reference.py.
#include "tail.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "problem.h"
#include "simulator.h"

namespace rl {

namespace {

[[noreturn]] void fail(const std::string& what) { throw std::invalid_argument("tail: " + what); }

}  // namespace

double chunk_part1(const TailSplit& x, int cand, int g, double lead) {
    const size_t row = static_cast<size_t>(cand) * x.n_grid + g;
    double out = x.part1[row];
    for (int j = 0; j < x.n_chunk; ++j) {
        const double hidden = lead * x.chunk_share[static_cast<size_t>(g) * x.n_chunk + j];
        out = std::max(out, x.chunk_work[row * x.n_chunk + j] - hidden);
    }
    return out;
}

void prepare_tail(Problem& p, TailPositions& at) {
    const int n = p.n_calls();
    p.tail_of_call.assign(n, -1);
    p.split_of_call.assign(n, -1);
    at.tail.assign(n, -1);
    at.part_data.assign(n, -1);
    at.part.assign(n, -1);
    if (p.tail_cols.empty() && p.tail_splits.empty()) return;
    if (p.shares_cores()) fail("long-tail migration is not simulated when devices share CPU cores");
    for (size_t i = 0; i < p.tail_cols.size(); ++i) {
        const TailColumns& t = p.tail_cols[i];
        if (t.call < 0 || t.call >= n) fail("call index out of range");
        if (p.tail_of_call[t.call] >= 0) fail("call " + std::to_string(t.call) + " has two tail tables");
        const Candidates& k = p.cands[t.call];
        if (static_cast<int>(t.grid.size()) != k.size() || t.width.size() != t.grid.size() ||
            t.time.size() != t.grid.size())
            fail("call " + std::to_string(t.call) + ": need one grid, width and time per candidate");
        if (!t.lead.empty() && t.lead.size() != t.grid.size())
            fail("call " + std::to_string(t.call) + ": need one lead per candidate");
        for (int c = 0; c < k.size(); ++c) {
            if (t.grid[c] < 0) continue;
            // a multi-stage mesh streams only (its whole mesh decodes to the end, estimator/pp_stream_cost.py)
            if (k.stage_width[c] != k.dev_hi[c] - k.dev_lo[c] && t.width[c] != k.dev_hi[c] - k.dev_lo[c])
                fail("only single-stage meshes migrate their tail (a multi-stage one streams: all its devices)");
            if (t.width[c] < 1 || t.width[c] > k.dev_hi[c] - k.dev_lo[c])
                fail("the tail devices must be some of the mesh (all: stream only)");
            if (!(t.time[c] >= 0.0) || !std::isfinite(t.time[c])) fail("tail times must be finite and >= 0");
        }
        p.tail_of_call[t.call] = static_cast<int32_t>(i);
    }
    for (size_t s = 0; s < p.tail_splits.size(); ++s) {
        const TailSplit& x = p.tail_splits[s];
        if (x.edge < 0 || x.edge >= static_cast<int>(p.data_edges.size())) fail("split edge out of range");
        const int g = p.data_edges[x.edge].src, c = p.data_edges[x.edge].dst;
        if (p.tail_of_call[g] < 0) fail("a split's producer must be a call with a tail table");
        if (p.tail_of_call[c] >= 0 || p.split_of_call[c] >= 0)
            fail("call " + std::to_string(c) + " cannot split (it migrates itself or splits already)");
        const size_t need = static_cast<size_t>(p.cands[c].size()) * x.n_grid;
        if (x.n_grid < 1 || x.part1.size() != need || x.part2.size() != need || x.share1.size() != size_t(x.n_grid) ||
            x.share2.size() != size_t(x.n_grid))
            fail("split of call " + std::to_string(c) + ": arrays do not match its candidates and the grid");
        if (x.n_chunk < 0 || x.chunk_work.size() != need * x.n_chunk ||
            x.chunk_share.size() != static_cast<size_t>(x.n_grid) * x.n_chunk)
            fail("split of call " + std::to_string(c) + ": chunk arrays do not match its candidates and the grid");
        for (int gi : p.tail_cols[p.tail_of_call[g]].grid)
            if (gi >= x.n_grid) fail("a grid index exceeds the split's grid");
        p.split_of_call[c] = static_cast<int32_t>(s);
    }
}

void push_tail_nodes_before(Problem& p, int c, TailPositions& at) {
    if (p.split_of_call.empty() || p.split_of_call[c] < 0) return;
    const int e = p.tail_splits[p.split_of_call[c]].edge, g = p.data_edges[e].src;
    at.part_data[c] = static_cast<int>(p.iter_nodes.size());
    p.iter_nodes.push_back({NodeKind::kPartData, c, g, p.n_models() + e});
    at.part[c] = static_cast<int>(p.iter_nodes.size());
    p.iter_nodes.push_back({NodeKind::kPart, c, g, -1});
}

void push_tail_node_after(Problem& p, int c, TailPositions& at) {
    if (p.tail_of_call.empty() || p.tail_of_call[c] < 0) return;
    at.tail[c] = static_cast<int>(p.iter_nodes.size());
    p.iter_nodes.push_back({NodeKind::kTail, c, -1, -1});
}

void rewire_tail(const Problem& p, int per, const std::vector<int>& call_pos, const std::vector<int>& data_pos,
                 const TailPositions& at, std::vector<std::vector<int32_t>>& kids) {
    if (p.tail_cols.empty()) return;
    for (int t = 0; t < p.n_iterations; ++t)
        for (const TailColumns& tc : p.tail_cols) {
            const int gc = t * per + call_pos[tc.call], tg = t * per + at.tail[tc.call];
            kids[tg] = std::move(kids[gc]);
            kids[gc].assign(1, tg);
        }
    // every parent of a split consumer's call node but the tail transfer now precedes part 1
    const int total = per * p.n_iterations;
    std::vector<int32_t> part_of(total, -1), keep_of(total, -1);
    for (int t = 0; t < p.n_iterations; ++t)
        for (const TailSplit& s : p.tail_splits) {
            const int c = p.data_edges[s.edge].dst;
            part_of[t * per + call_pos[c]] = t * per + at.part[c];
            keep_of[t * per + call_pos[c]] = t * per + data_pos[s.edge];
        }
    for (int v = 0; v < total; ++v)
        for (int32_t& u : kids[v])
            if (part_of[u] >= 0 && keep_of[u] != v) u = part_of[u];
    for (int t = 0; t < p.n_iterations; ++t)
        for (const TailSplit& s : p.tail_splits) {
            const int g = p.data_edges[s.edge].src, c = p.data_edges[s.edge].dst, base = t * per;
            kids[base + call_pos[g]].push_back(base + at.part_data[c]);
            kids[base + at.part_data[c]].push_back(base + at.part[c]);
            kids[base + at.part[c]].push_back(base + call_pos[c]);
        }
}

// -- the simulator's side ------------------------------------------------------------------------------------

void Evaluator::init_tail(std::vector<std::vector<int32_t>>& nodes_of) {
    tail_tmpl_.assign(per_, 0);
    tmpl_split_.assign(per_, -1);
    atom_split_.assign(p_.tail_cols.size(), 0);
    const int n = p_.n_calls();
    for (size_t i = 0; i < p_.tail_cols.size(); ++i) ends_.push_back(static_cast<uint64_t>(2 * n + i));
    for (int j = 0; j < per_; ++j) {
        const NodeTemplate& nt = p_.iter_nodes[j];
        const int c = nt.call;
        if (nt.kind == NodeKind::kTail || (nt.kind == NodeKind::kCall && p_.tail_of_call[c] >= 0)) tail_tmpl_[j] = 1;
        if (p_.split_of_call[c] < 0) continue;
        const int s = p_.split_of_call[c];
        const int e = p_.tail_splits[s].edge;
        const bool tail_data = nt.kind == NodeKind::kData && nt.other == p_.data_edges[e].src &&
                               nt.table == p_.n_models() + e;
        if (nt.kind == NodeKind::kCall || nt.kind == NodeKind::kPart || nt.kind == NodeKind::kPartData || tail_data) {
            tail_tmpl_[j] = 1;
            tmpl_split_[j] = s;
        }
        if (nt.kind == NodeKind::kCall) nodes_of[p_.data_edges[e].src].push_back(j);  // part 2 reads the grid
    }
}

int Evaluator::tail_split_device(int i, const int32_t* plan) const {
    const TailColumns& t = p_.tail_cols[i];
    const Candidates& k = p_.cands[t.call];
    const int x = plan[t.call];
    return t.grid[x] >= 0 ? k.dev_lo[x] + t.width[x] : k.dev_hi[x];
}

// The grid index of split s's producer if its consumer runs in two parts under `plan`, else -1.
int Evaluator::split_grid(int s, const int32_t* plan) const {
    const DataEdge& e = p_.data_edges[p_.tail_splits[s].edge];
    const TailColumns& t = p_.tail_cols[p_.tail_of_call[e.src]];
    const int x = plan[e.src], g = t.grid[x];
    if (g < 0) return -1;
    const int lo = p_.cands[e.src].dev_lo[x], hi = lo + t.width[x];
    const int clo = p_.cands[e.dst].dev_lo[plan[e.dst]], chi = p_.cands[e.dst].dev_hi[plan[e.dst]];
    return chi <= lo || clo >= hi ? g : -1;
}

void Evaluator::price_tail(int j, const int32_t* plan) {
    Slot& s = slot_[j];
    const NodeTemplate& nt = p_.iter_nodes[j];
    const int c = nt.call;
    s.hold = 0.0;
    s.known = 1;
    if (nt.kind == NodeKind::kTail || (nt.kind == NodeKind::kCall && p_.tail_of_call[c] >= 0)) {
        const TailColumns& t = p_.tail_cols[p_.tail_of_call[c]];
        const bool on = t.grid[plan[c]] >= 0;
        if (nt.kind == NodeKind::kTail) {
            s.cost = on ? t.time[plan[c]] : 0.0;
            s.pass = pass_[j] = s.cost == 0.0;
            s.latency = s.pass ? 0.0 : p_.dispatch_latency;
        } else {  // phase 1; the tail devices stay busy for the tail node's time (run())
            s.cost = p_.cands[c].time[plan[c]];
            s.hold = on ? t.time[plan[c]] : 0.0;
            s.pass = pass_[j] = 0;
            s.latency = on ? 0.0 : p_.dispatch_latency;
        }
        return;
    }
    const TailSplit& x = p_.tail_splits[tmpl_split_[j]];
    const int g = split_grid(tmpl_split_[j], plan);
    const int cand = plan[c];
    if (nt.kind == NodeKind::kCall || nt.kind == NodeKind::kPart) {
        const bool part1 = nt.kind == NodeKind::kPart;
        const int src = p_.data_edges[x.edge].src;
        const TailColumns& t = p_.tail_cols[p_.tail_of_call[src]];
        const double lead = t.lead.empty() ? 0.0 : t.lead[plan[src]];
        s.cost = g < 0 ? (part1 ? 0.0 : p_.cands[c].time[cand])
                       : part1 ? chunk_part1(x, cand, g, lead) : x.part2[static_cast<size_t>(cand) * x.n_grid + g];
        s.pass = pass_[j] = part1 && s.cost == 0.0;
        s.latency = s.pass ? 0.0 : p_.dispatch_latency;
        return;
    }
    // the transfer of the finished rows (kPartData) or of the tail rows (the edge's own node)
    const int o = nt.other;
    const int la = p_.cands[o].layout[plan[o]], lb = p_.cands[c].layout[cand];
    double cost = 0.0;
    bool known = true;
    if (nt.kind == NodeKind::kData) {
        cost = tmpl_table_[j]->get(la, lb, known);
        if (g >= 0) cost *= x.share2[g];
    } else if (g >= 0) {
        cost = tmpl_table_[j]->get(la, lb, known) * x.share1[g];
    }
    set_transfer(j, s, la, lb, cost, known);
    s.latency = 0.0;
}

void Evaluator::place_tail_atoms() {
    for (int j = 0; j < per_; ++j) {
        if (!tail_tmpl_[j]) continue;
        Slot& s = slot_[j];
        const NodeTemplate& nt = p_.iter_nodes[j];
        const int c = nt.call;
        if (nt.kind == NodeKind::kTail) {
            s.a1 = s.b1 = s.a2 = s.b2 = 0;  // the tail devices are the call node's (Slot::hold)
        } else if (nt.kind == NodeKind::kPart || nt.kind == NodeKind::kPartData) {
            s.a1 = atom_lo_[c];
            s.b1 = atom_hi_[c];
            s.a2 = s.b2 = 0;
        } else if (nt.kind == NodeKind::kCall && p_.tail_of_call[c] >= 0) {
            s.mid = atom_split_[p_.tail_of_call[c]];
        }
    }
}

}  // namespace rl
