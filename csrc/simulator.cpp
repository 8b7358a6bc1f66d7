#include "simulator.h"

#include <algorithm>
#include <functional>
#include <limits>

namespace rl {

namespace {

constexpr int kBoundEvery = 2;  // simulate(): nodes between two checks of the early-stop bound (a power of 2)

}  // namespace

Evaluator::Evaluator(const Problem& problem) : p_(problem) {
    if (!p_.finalized) throw std::invalid_argument("problem is not finalized");
    const int n = p_.n_calls();
    const int total = p_.n_nodes();
    per_ = static_cast<int>(p_.iter_nodes.size());
    // Rank numbering (rank()): data transfers first, then the other nodes, each in node order.
    pos_.resize(total);
    order_.reserve(total);
    for (int data = 1; data >= 0; --data)
        for (int v = 0; v < total; ++v)
            if (first_rank(static_cast<uint8_t>(p_.iter_nodes[v % per_].kind)) == (data == 1)) {
                pos_[v] = static_cast<int32_t>(order_.size());
                order_.push_back(v);
            }
    link_.resize(total);
    n_parents_.resize(total);
    children_.reserve(p_.children.size());
    for (int r = 0; r < total; ++r) {
        const int v = order_[r];
        link_[r] = {v % per_, v / per_, static_cast<int32_t>(children_.size()), 0};
        for (int i = p_.child_start[v]; i < p_.child_start[v + 1]; ++i) children_.push_back(pos_[p_.children[i]]);
        link_[r].child_end = static_cast<int32_t>(children_.size());
        n_parents_[r] = p_.n_parents[v];
        // the release below completes a free node at once only if its children all rank after it (stale.h: the
        // train step of t waits for a node of t + eta, ranked after it)
        fast_.push_back(std::all_of(children_.begin() + link_[r].child_begin, children_.end(),
                                    [r](int32_t u) { return u > r; }));
        if (n_parents_[r] == 0) roots_.push_back(r);
        start_state_.push_back({0.0, n_parents_[r]});
    }
    // Which template nodes each call's candidate prices or places.
    std::vector<std::vector<int32_t>> nodes_of(n);
    for (int j = 0; j < per_; ++j) {
        const NodeTemplate& nt = p_.iter_nodes[j];
        if (nt.kind == NodeKind::kGate) continue;  // no price: a gate is a pass node (stale.h)
        nodes_of[nt.call].push_back(j);
        if (nt.other >= 0 && nt.other != nt.call) nodes_of[nt.other].push_back(j);
    }
    init_tail(nodes_of);  // long-tail migration (tail.cpp)
    add_home_keep_nodes(p_, nodes_of);  // home_keep.cpp
    add_stale_nodes(p_, nodes_of);      // stale.cpp
    call_nodes_start_.push_back(0);
    for (const auto& js : nodes_of) {
        call_nodes_.insert(call_nodes_.end(), js.begin(), js.end());
        call_nodes_start_.push_back(static_cast<int32_t>(call_nodes_.size()));
    }
    for (int j = 0; j < per_; ++j) {
        const NodeTemplate& nt = p_.iter_nodes[j];
        tmpl_call_.push_back(nt.call);
        tmpl_other_.push_back(nt.kind == NodeKind::kCall ? -1 : nt.other);
        tmpl_table_.push_back(nt.kind == NodeKind::kCall || nt.table < 0 ? nullptr : &p_.table(nt.table));
    }
    for (uint64_t end = 0; end < static_cast<uint64_t>(2 * n); ++end) ends_.push_back(end);  // placed by prepare()
    find_paths();
    setup_fused();
    atom_lo_.resize(n);
    atom_hi_.resize(n);
    slot_.resize(per_);
    pass_.assign(per_, 0);
    for (const StaleGate& g : p_.stale_gates) slot_[g.tmpl].pass = pass_[g.tmpl] = 1;
    pair_a_.assign(per_, 0);
    pair_b_.assign(per_, 0);
    in_place_.assign(per_, 0);
    last_plan_.assign(n, -1);
    changed_calls_.reserve(n);
    seen_.assign(per_, 0);
    free_.resize(ends_.size() + 1);
    left_.resize(ends_.size() + 1);
    ready_.resize(total);
    remaining_.resize(total);
    iter_end_.resize(p_.n_iterations);
    state_.resize(total);
    iter_.resize(p_.n_iterations);
    queue_.resize(total);
    mem_next_.resize(n);
    mem_run_.resize(n);
    mem_stat_.resize(n);
    mem_dyn_.resize(n);
    mem_copy_.resize(n);
    mem_keep_.resize(n);
    mem_home_.resize(n);
    for (int c = 0; c < n; ++c) mem_home_[c] = c == p_.model_home[p_.call_model[c]];
    if (p_.shares_cores()) {
        heap_.reserve(total);
        host_start_.resize(per_ + 1);
        fifo_.resize(2 * n + 1);
        fifo_head_.resize(2 * n + 1);
        finish_.resize(total);
        rate_.resize(total);
        start_.resize(total);
        host_busy_.resize(p_.n_devices / p_.host_size());
    }
}

// The path bound. Along any path of the unrolled graph a node ends no earlier than its predecessor's end
// + the predecessor's latency + its own cost (it is not ready before, and runs at most at full speed). An
// iteration ends with one of its "last" nodes, those without a child in their own iteration (any other
// node ends no later than its child). For last nodes x, y let A[x][y] be the length of a path from x in one
// iteration to y in the next. T_1 is the end of some last node x, and T_K is no earlier than the end of
// any node of iteration K, so T_K - T_1 >= the longest chain x -> ... (K - 1 steps of A), and the
// steady-state time (T_K - T_1) / (K - 1) is at least the smallest such chain over x, / (K - 1); the same holds for
// the priced window's T_last - T_first over last - first steps (problem.h). In a PPO
// graph the last nodes are the train steps; the critic's leads into the actor's cycle through the values
// the actor trains on. Per pair, the path kept is the one through the most nodes (a plan-independent
// stand-in for the longest). An OOM plan's cost is its time times at least oom_alpha, so this rejects
// most OOM proposals of the MCMC without simulating them.
void Evaluator::find_paths() {
    std::vector<int32_t> last;
    for (int x = 0; x < per_; ++x) {
        bool is_last = true;
        for (int i = p_.child_start[x]; i < p_.child_start[x + 1]; ++i)  // a gate child may be open (stale.h)
            is_last = is_last && (p_.children[i] >= per_ || p_.iter_nodes[p_.children[i]].kind == NodeKind::kGate);
        if (is_last) last.push_back(x);
    }
    const int m = static_cast<int>(last.size());
    std::vector<int32_t> depth(2 * per_), prev(2 * per_);  // two iterations: edges never go back one
    path_start_.assign(1, 0);
    path_pred_.clear();
    path_node_.clear();
    path_exists_.assign(m * m, 0);
    for (int i = 0; i < m; ++i) {
        const int x = last[i];
        std::fill(depth.begin(), depth.end(), -1);
        depth[x] = 0;
        for (int v = x; v < 2 * per_; ++v) {  // forward edges are topological
            if (depth[v] < 0) continue;
            for (int k = p_.child_start[v]; k < p_.child_start[v + 1]; ++k) {
                const int u = p_.children[k];
                // Not back (to an earlier iteration's train step: bounded staleness) nor through a gate, which a
                // plan may open (stale.h): a path must hold in every iteration and plan.
                if (u < v || p_.iter_nodes[u % per_].kind == NodeKind::kGate) continue;
                if (u < 2 * per_ && depth[v] + 1 > depth[u]) {
                    depth[u] = depth[v] + 1;
                    prev[u] = v;
                }
            }
        }
        for (int j = 0; j < m; ++j) {
            const int y = last[j] + per_;
            path_exists_[i * m + j] = depth[y] >= 0;
            const size_t at = path_node_.size();
            for (int u = y; depth[y] >= 0 && u != x; u = prev[u]) {
                path_pred_.push_back(prev[u] % per_);
                path_node_.push_back(u % per_);
            }
            std::reverse(path_pred_.begin() + at, path_pred_.end());
            std::reverse(path_node_.begin() + at, path_node_.end());
            path_start_.push_back(static_cast<int32_t>(path_node_.size()));
        }
    }
    // With many ending nodes the chains (m^2 per step) would cost about as much as a simulation.
    constexpr int kMaxLast = 16;
    n_last_ = m <= kMaxLast ? m : 0;
    chain_.resize(m * m + 2 * m);
}

bool Evaluator::paths_exceed(double stop_time) {
    if (!(stop_time < std::numeric_limits<double>::infinity()) || n_last_ == 0) return false;
    // the priced window's steps (problem.h): T_last - T_first >= a chain of that many steps from T_first's node
    const int m = n_last_, steps = p_.last_priced() - p_.first_priced();
    constexpr double kNone = -std::numeric_limits<double>::infinity();
    const Slot* slot = slot_.data();
    const int32_t* start = path_start_.data();
    const int32_t* pred = path_pred_.data();
    const int32_t* node = path_node_.data();
    double* a = chain_.data();  // A, then the chains from one start
    double longest = kNone;
    for (int ij = 0; ij < m * m; ++ij) {
        double length = kNone;
        if (path_exists_[ij]) {
            length = 0.0;
            for (int k = start[ij]; k < start[ij + 1]; ++k) length += slot[pred[k]].latency + slot[node[k]].cost;
        }
        a[ij] = length;
        longest = std::max(longest, length);
    }
    // the simulation's own rounding must never make a run that comes out just under the limit stop
    const double bar = stop_time * steps * (1.0 + 1e-9);
    if (!(longest * steps > bar)) return false;  // no chain is longer than `steps` longest steps
    double* d = a + m * m;
    double* next = d + m;
    for (int x = 0; x < m; ++x) {
        std::copy(a + x * m, a + x * m + m, d);
        for (int step = 1; step < steps; ++step) {
            for (int y = 0; y < m; ++y) {
                double best = kNone;
                for (int z = 0; z < m; ++z) best = std::max(best, d[z] + a[z * m + y]);
                next[y] = best;
            }
            std::copy(next, next + m, d);
        }
        if (!(*std::max_element(d, d + m) > bar)) return false;
    }
    return true;
}

// Cuts the device line at every call mesh's ends into atoms, and gives every template node its atoms.
void Evaluator::place_atoms_if_stale(const int32_t* plan) {
    if (!atoms_stale_) return;
    atoms_stale_ = false;
    // The ends keep their order from the last plan except around the meshes that moved, so an
    // insertion sort of the updated ends is short (no allocation, no binary searches).
    const int m = static_cast<int>(ends_.size());
    uint64_t* e = ends_.data();
    for (int i = 0; i < m; ++i) {
        const uint32_t who = static_cast<uint32_t>(e[i]);
        if (who >= 2u * p_.n_calls()) {  // a migrating call's first device after the tail (tail.cpp)
            e[i] = static_cast<uint64_t>(tail_split_device(who - 2 * p_.n_calls(), plan)) << 32 | who;
            continue;
        }
        const Candidates& k = p_.cands[who >> 1];
        const int x = who & 1 ? k.dev_hi[plan[who >> 1]] : k.dev_lo[plan[who >> 1]];
        e[i] = static_cast<uint64_t>(x) << 32 | who;
    }
    for (int i = 1; i < m; ++i) {
        const uint64_t x = e[i];
        int k = i;
        for (; k > 0 && e[k - 1] > x; --k) e[k] = e[k - 1];
        e[k] = x;
    }
    int atom = -1;  // atoms are numbered by their lower end among the distinct ends
    uint64_t last = ~0ull;
    for (int i = 0; i < m; ++i) {
        if (e[i] >> 32 != last) {
            last = e[i] >> 32;
            ++atom;
        }
        const uint32_t who = static_cast<uint32_t>(e[i]);
        if (who >= 2u * p_.n_calls())
            atom_split_[who - 2 * p_.n_calls()] = atom;
        else
            (who & 1 ? atom_hi_ : atom_lo_)[who >> 1] = atom;
    }
    n_atoms_ = atom;
    // A call runs on its mesh's atoms; a transfer also occupies the source's.
    const int32_t* lo = atom_lo_.data();
    const int32_t* hi = atom_hi_.data();
    for (int j = 0; j < per_; ++j) {
        Slot& s = slot_[j];
        const int c = tmpl_call_[j], o = tmpl_other_[j];
        s.a1 = lo[c];
        s.b1 = hi[c];
        s.a2 = s.b2 = 0;
        if (o < 0 || in_place_[j]) continue;
        if (lo[o] <= s.b1 && s.a1 <= hi[o]) {  // overlapping or touching: one range of atoms
            s.a1 = std::min(s.a1, lo[o]);
            s.b1 = std::max(s.b1, hi[o]);
        } else {
            s.a2 = lo[o];
            s.b2 = hi[o];
        }
    }
    place_tail_atoms();
}

// Cost, latency and pass-through of template node j under `plan`.
inline void Evaluator::price(int j, const int32_t* plan) {
    Slot& s = slot_[j];
    const int c = tmpl_call_[j], o = tmpl_other_[j];
    n_unknown_ -= !s.known;
    if (tail_tmpl_[j]) {  // long-tail migration (tail.cpp)
        price_tail(j, plan);
        return;
    }
    if (o < 0) {  // a call
        s.cost = p_.cands[c].time[plan[c]];
        s.latency = p_.dispatch_latency;
        s.pass = pass_[j] = 0;
        s.known = 1;
        return;
    }
    const NodeKind kind = p_.iter_nodes[j].kind;
    const int la = p_.cands[o].layout[plan[o]], lb = p_.cands[c].layout[plan[c]];
    double cost = 0.0;
    bool known = true;
    // Parameters already in the call's layout need no move: reallocation is free.
    // A home that kept its parameters: the way back is skipped (home_keep.cpp).
    // A stale call's snapshot that another's copy stands for (stale.cpp).
    if (kind == NodeKind::kData ||
        (la != lb && !home_skips_return(p_, c, plan) && !(kind == NodeKind::kRealloc && snapshot_aliased(p_, c, plan))))
        cost = tmpl_table_[j]->get(la, lb, known);
    set_transfer(j, s, la, lb, cost, known);
    s.latency = kind == NodeKind::kRealloc && !s.pass ? p_.dispatch_latency : 0.0;
    in_place_[j] = kind == NodeKind::kRealloc && p_.in_place(o, plan[o], c, plan[c]);
}

void Evaluator::set_transfer(int j, Slot& s, int la, int lb, double cost, bool known) {
    s.cost = cost;
    s.known = known;
    n_unknown_ += !known;
    pair_a_[j] = la;
    pair_b_[j] = lb;
    // A free transfer occupies no device and is no request: its consumer waits only for the producer.
    s.pass = pass_[j] = cost == 0.0;
}

bool Evaluator::prepare(const int32_t* plan, std::vector<MissingPair>* missing) {
    // Consecutive plans of a chain differ in a few calls: only the template nodes of those calls are
    // priced again, and the atoms are recut only when a mesh moved. Changed pair costs reset everything.
    const int n = p_.n_calls();
    if (cache_version_ != p_.pair_version) {
        std::fill(last_plan_.begin(), last_plan_.end(), -1);
        cache_version_ = p_.pair_version;
    }
    bool meshes_moved = false;
    changed_calls_.clear();
    for (int c = 0; c < n; ++c) {
        const int was = last_plan_[c];
        if (plan[c] == was) continue;
        changed_calls_.push_back(c);
        const Candidates& k = p_.cands[c];
        if (was < 0 || k.dev_lo[plan[c]] != k.dev_lo[was] || k.dev_hi[plan[c]] != k.dev_hi[was]) meshes_moved = true;
        if (was >= 0 && k.holds_whole(plan[c]) != k.holds_whole(was)) meshes_moved = true;  // in-place reallocations
        if (p_.tail_of_call[c] >= 0) meshes_moved = true;  // its tail devices may have moved
        last_plan_[c] = plan[c];
    }
    // the atoms wait for a simulation: the memory check and the path bound do not need them
    atoms_stale_ = atoms_stale_ || meshes_moved;
    if (++stamp_ == 0) {  // wrapped: forget which nodes were seen
        std::fill(seen_.begin(), seen_.end(), 0);
        stamp_ = 1;
    }
    for (int c : changed_calls_)
        for (int i = call_nodes_start_[c]; i < call_nodes_start_[c + 1]; ++i) {
            const int j = call_nodes_[i];
            if (seen_[j] == stamp_) continue;  // both its calls changed
            seen_[j] = stamp_;
            price(j, plan);
        }
    const bool fused_known = p_.fused.empty() || price_fused(plan, missing);  // fused_node.cpp
    if (missing)
        for (int j = 0; j < per_; ++j)
            if (!slot_[j].known) missing->push_back({p_.iter_nodes[j].table, pair_a_[j], pair_b_[j]});
    if (p_.shares_cores()) {
        // Busy devices each node adds per host: the union of its (at most two) device intervals.
        const int h = p_.host_size();
        host_load_.clear();
        for (int j = 0; j < per_; ++j) {
            host_start_[j] = static_cast<int32_t>(host_load_.size());
            if (slot_[j].pass) continue;
            const NodeTemplate& nt = p_.iter_nodes[j];
            int lo1 = p_.cands[nt.call].dev_lo[plan[nt.call]], hi1 = p_.cands[nt.call].dev_hi[plan[nt.call]];
            int lo2 = lo1, hi2 = lo1;
            if (nt.other >= 0 && !in_place_[j]) {
                lo2 = p_.cands[nt.other].dev_lo[plan[nt.other]];
                hi2 = p_.cands[nt.other].dev_hi[plan[nt.other]];
            }
            if (lo2 < hi2 && lo2 <= hi1 && lo1 <= hi2) {  // overlapping or touching: one interval
                lo1 = std::min(lo1, lo2);
                hi1 = std::max(hi1, hi2);
                lo2 = hi2 = 0;
            }
            for (const auto& [lo, hi] : {std::pair<int, int>{lo1, hi1}, std::pair<int, int>{lo2, hi2}})
                for (int x = lo; x < hi; x = (x / h + 1) * h) {
                    const int32_t host = x / h;
                    const int32_t count = std::min(hi, (host + 1) * h) - x;
                    if (host_load_.size() > static_cast<size_t>(host_start_[j]) && host_load_.back().first == host)
                        host_load_.back().second += count;
                    else
                        host_load_.emplace_back(host, count);
                }
        }
        host_start_[per_] = static_cast<int32_t>(host_load_.size());
    }
    return n_unknown_ == 0 && fused_known;
}

void Evaluator::record(const int32_t* plan, std::vector<NodeRecord>* records, int v, double start,
                       double end) const {
    const NodeTemplate& nt = p_.iter_nodes[v % per_];
    NodeRecord r{static_cast<int>(nt.kind), nt.call, nt.other, v / per_, start, end,
                 p_.cands[nt.call].dev_lo[plan[nt.call]], p_.cands[nt.call].dev_hi[plan[nt.call]], 0, 0};
    if (nt.other >= 0) {
        r.lo2 = p_.cands[nt.other].dev_lo[plan[nt.other]];
        r.hi2 = p_.cands[nt.other].dev_hi[plan[nt.other]];
    }
    (*records)[v] = r;
}

bool Evaluator::simulate(const int32_t* plan, std::vector<NodeRecord>* records, double stop_time) {
    place_atoms_if_stale(plan);
    open_gates(plan);
    const bool bounded = stop_time < std::numeric_limits<double>::infinity();
    if (n_fused_on_)  // fused pairs on (fused_node.h)
        return records ? run<false, true, true>(plan, records, stop_time)
                       : bounded ? run<true, false, true>(plan, nullptr, stop_time) : run<false, false, true>(plan, nullptr, stop_time);
    if (records) return run<false, true, false>(plan, records, stop_time);
    if (bounded) return run<true, false, false>(plan, nullptr, stop_time);
    return run<false, false, false>(plan, nullptr, stop_time);
}

// simulate() compiled once per use (MCMC: bounded; evaluate: whole; schedule: recorded), so that each
// loop carries only what it uses.
template <bool kBounded, bool kRecords, bool kFused>
bool Evaluator::run(const int32_t* plan, std::vector<NodeRecord>* records, double stop_time) {
    const int total = p_.n_nodes();
    const int K = p_.n_iterations;
    // The priced window (problem.h): once every node up to its last iteration is done, T_first and T_last are
    // final (a node's end is fixed when it leaves the queue), so an evaluation stops there; the lookahead
    // iterations' nodes that were ready before ran, which is all they are for.
    const int first = p_.first_priced(), last = p_.last_priced();
    int pending = (last + 1) * per_;
    const int n_atoms = n_atoms_;
    // Raw pointers: through the vectors, every store to the state would make the compiler reload
    // every vector's data pointer.
    Slot* slot = slot_.data();
    const uint8_t* pass_of = pass_.data();
    const Link* link = link_.data();
    const int32_t* children = children_.data();
    const uint8_t* fast = fast_.data();
    double* free = free_.data();
    NodeState* state = state_.data();
    IterState* iter = iter_.data();
    std::fill(free, free + n_atoms, 0.0);
    std::copy(start_state_.begin(), start_state_.end(), state);
    std::fill(iter, iter + K, IterState{0.0, per_});
    if (kRecords) records->assign(total, NodeRecord{});
    uint8_t* arrived = arrived_.data();
    if (kFused) std::fill(arrived, arrived + total, 0);
    // The queue is [head, tail), sorted. Every node enters it at most once, so it never wraps; it holds
    // few nodes and a new one usually becomes ready after those waiting, so insertion is short.
    ReadyKey* head = queue_.data();
    ReadyKey* tail = head;
    for (int32_t r : roots_) *tail++ = ready_key(0.0, r);  // all ready at 0, ascending rank
    auto push = [&head, &tail](double t, int32_t r) {
        const ReadyKey key = ready_key(t, r);
        ReadyKey* at = tail++;
        for (; at > head && at[-1] > key; --at) *at = at[-1];
        *at = key;
    };
    for (int32_t v : open_gates_) {  // ready at 0; their parents' ends count down below 0 and never release them
        state[pos_[v]].remaining = 0;
        push(0.0, pos_[v]);
    }

    // Early stop (evaluate_bounded) follows the atom `busy` with the most work per iteration (usually the
    // one that paces the plan): `left` seconds of work are still to come there (Slot::busy_cost per node).
    // Only when every node ends before T_K (Problem::iterations_chain): then T_K >= busy's free time.
    const bool use_busy = kBounded && p_.iterations_chain;
    int busy = 0;
    double left = -std::numeric_limits<double>::infinity();
    if (use_busy) {
        // the work per atom, to pick the busiest, as a difference array (rounding does not matter here)
        double* diff = left_.data();
        std::fill(diff, diff + n_atoms + 1, 0.0);
        for (int j = 0; j < per_; ++j) {
            const Slot& s = slot[j];
            if (s.pass || (kFused && s.joined == 2)) continue;  // a fused node's work counts once
            diff[s.a1] += s.cost;
            diff[s.b1] -= s.cost;
            if (s.a2 == s.b2) continue;
            diff[s.a2] += s.cost;
            diff[s.b2] -= s.cost;
        }
        double work = 0.0, most = -1.0;
        for (int a = 0; a < n_atoms; ++a) {
            work += diff[a];
            if (work > most) most = work, busy = a;
        }
        left = 0.0;
        for (int j = 0; j < per_; ++j) {
            Slot& s = slot[j];
            // a <= busy < b as one unsigned comparison
            const bool covers = static_cast<unsigned>(busy - s.a1) < static_cast<unsigned>(s.b1 - s.a1) ||
                                static_cast<unsigned>(busy - s.a2) < static_cast<unsigned>(s.b2 - s.a2);
            s.busy_cost = !s.pass && covers && !(kFused && s.joined == 2) ? s.cost : 0.0;
            left += s.busy_cost;
        }
        left *= last + 1;  // the priced iterations' work: every node up to the last one ends by T_last
    }
    // rounding in the work sums must never stop a run that would come out just under the limit
    const double stop_span = stop_time * (last - first) * (1.0 + 1e-9);

    // Algorithm 1: take the ready node with the smallest ready time (ties: the lowest rank); it starts
    // when its mesh's devices are all free.
    while (head < tail) {
        const ReadyKey key = *head++;
        const double t_ready = key_time(key);
        const int32_t r = static_cast<int32_t>(static_cast<uint32_t>(key));
        const Link node = link[r];
        const Slot& s = slot[node.tmpl];
        // A fused pair's call nodes run as one node (fused_node.h): the first to leave the queue waits, without
        // devices, for the other; the node starts when both are ready and ends both.
        int32_t q = -1;
        if (kFused && s.joined) {
            q = pos_[node.iter * per_ + joint_[node.tmpl]];
            if (!arrived[q]) {
                arrived[r] = 1;
                continue;
            }
        }
        double start = t_ready, end = t_ready;
        if (!s.pass) {
            const int a1 = s.a1, b1 = s.b1, a2 = s.a2, b2 = s.b2;
            for (int a = a1; a < b1; ++a) start = std::max(start, free[a]);
            for (int a = a2; a < b2; ++a) start = std::max(start, free[a]);
            end = start + s.cost;
            for (int a = a1; a < b1; ++a) free[a] = end;
            for (int a = a2; a < b2; ++a) free[a] = end;
            for (int a = a1; a < s.mid && s.hold > 0.0; ++a) free[a] = end + s.hold;  // the tail (tail.cpp)
            if (kBounded && node.iter <= last)
                left -= s.busy_cost + (kFused && q >= 0 ? slot[link[q].tmpl].busy_cost : 0.0);
        }
        auto done = [&](int32_t r, const Link& node, const Slot& s) {
            IterState& it = iter[node.iter];
            it.end = std::max(it.end, end);
            --it.left;
            pending -= node.iter <= last;
            if (kRecords) record(plan, records, order_[r], start, end);
            const double out = end + s.latency;
            for (int i = node.child_begin; i < node.child_end; ++i) {
                const int32_t u = children[i];
                NodeState& c = state[u];
                if (c.ready < out) c.ready = out;
                if (--c.remaining != 0) continue;
                if (!pass_of[link[u].tmpl] || !fast[u]) {
                    push(c.ready, u);
                    continue;
                }
                const Link child = link[u];
                // A free transfer whose parents are all done completes at once instead of waiting in the
                // queue: it occupies no device and its children rank after it, so it would leave the queue
                // before any of them anyway. Its children are calls (finalize builds no transfer after a
                // transfer), so one more level of release.
                const double t = c.ready;
                IterState& ct = iter[child.iter];
                ct.end = std::max(ct.end, t);
                --ct.left;
                pending -= child.iter <= last;
                if (kRecords) record(plan, records, order_[u], t, t);
                for (int k = child.child_begin; k < child.child_end; ++k) {
                    const int32_t w = children[k];
                    NodeState& g = state[w];
                    if (g.ready < t) g.ready = t;
                    if (--g.remaining == 0) push(g.ready, w);
                }
            }
        };
        done(r, node, s);
        if (kFused && q >= 0) done(q, link[q], slot[link[q].tmpl]);
        if (!kRecords && pending == 0) return true;  // the priced window is done
        // T_first is known once the first priced iteration is done. While the last one is not, T_last is at
        // least the next ready time (a node of it is still to come, and nodes leave the queue in order of ready
        // time), and max(next ready time, busy's free) + the work left there: no node starts earlier,
        // they run one after another, and all end by T_last.
        if (kBounded && iter[first].left == 0 && ((head - queue_.data()) & (kBoundEvery - 1)) == 0 && head < tail) {
            double t_k = iter[last].end;
            if (iter[last].left) {
                const double next = key_time(*head);
                t_k = std::max(t_k, next);
                if (use_busy) t_k = std::max(t_k, std::max(next, free[busy]) + left);
            }
            if (t_k - iter[first].end > stop_span) return false;
        }
    }
    return true;
}

// The shared-core simulation's release (in node numbering, into its heap).
void Evaluator::release_children(int v, double end) {
    const double ready = end + slot_[v % per_].latency;
    for (int i = p_.child_start[v]; i < p_.child_start[v + 1]; ++i) {
        const int u = p_.children[i];
        ready_[u] = std::max(ready_[u], ready);
        if (--remaining_[u] == 0) {
            heap_.emplace_back(ready_[u], rank(u));
            std::push_heap(heap_.begin(), heap_.end(), std::greater<std::pair<double, int32_t>>());
        }
    }
}

void Evaluator::finish(Evaluation& ev) const {
    const int first = p_.first_priced(), last = p_.last_priced();
    const double t_1 = p_.shares_cores() ? iter_end_[first] : iter_[first].end;
    const double t_k = p_.shares_cores() ? iter_end_[last] : iter_[last].end;
    ev.makespan = t_k;
    ev.time = (t_k - t_1) / (last - first);
    // realhf.txt §5.2 multiplies an OOM plan's time by a large alpha. We scale alpha by
    // (1 + overflow fraction) so that among OOM plans the chain still moves toward ones that fit.
    ev.cost = ev.feasible ? ev.time
                          : ev.time * p_.oom_alpha *
                                (1.0 + static_cast<double>(ev.overflow) / static_cast<double>(p_.device_memory));
}

Evaluation Evaluator::evaluate(const int32_t* plan, std::vector<MissingPair>* missing) {
    Evaluation ev;
    ev.exact = prepare(plan, missing);
    if (p_.shares_cores())
        simulate_shared(plan, nullptr);
    else
        simulate(plan, nullptr);
    check_memory(plan, ev);
    finish(ev);
    return ev;
}

Evaluation Evaluator::evaluate_bounded(const int32_t* plan, double limit, const Evaluation& best) {
    Evaluation ev;
    ev.exact = prepare(plan, nullptr);
    check_memory(plan, ev);
    // A plan that could become the best must be evaluated whole (mcmc.h better(): fitting first).
    if (ev.feasible == best.feasible)
        limit = std::max(limit, best.cost);
    else if (ev.feasible)
        limit = std::numeric_limits<double>::infinity();
    const double factor = ev.feasible ? 1.0 : p_.oom_alpha * (1.0 + static_cast<double>(ev.overflow) /
                                                                        static_cast<double>(p_.device_memory));
    if (paths_exceed(limit / factor)) {
        ev.complete = ev.simulated = false;
        ev.time = ev.cost = limit;  // lower bounds: the plan costs more
        return ev;
    }
    if (p_.shares_cores())
        simulate_shared(plan, nullptr);
    else if (!simulate(plan, nullptr, limit / factor)) {
        ev.complete = false;
        ev.time = ev.cost = limit;  // lower bounds: the plan costs more
        return ev;
    }
    finish(ev);
    return ev;
}

std::vector<NodeRecord> Evaluator::schedule(const int32_t* plan) {
    std::vector<NodeRecord> out;
    out.reserve(p_.n_nodes());
    prepare(plan, nullptr);
    if (p_.shares_cores())
        simulate_shared(plan, &out);
    else
        simulate(plan, &out);
    return out;  // in node order: iteration, then the iteration's node order
}

}  // namespace rl
