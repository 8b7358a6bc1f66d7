// Bounded staleness in the plan simulator, as the runtime orders it (realloc/search/stale_reference.py is the
// Python reference and states the rules; the runtime's are runtime/control/master_schedule.py's _snapshot_deps
// and _stale_readers). Which rule applies depends on the plan's layouts, the graph's edges do not: every
// plan-dependent edge goes through a gate node (NodeKind::kGate: no devices, no time) that the plan closes (it
// waits for its parents) or opens (ready at 0, its parents ignored).
#pragma once

#include <cstdint>
#include <vector>

namespace rl {

struct Problem;

// A gate of one iteration's template: node `tmpl`; closed when stale calls a and b share a layout that is not
// home's (`place` false: a copy both read), or when stale call a reads home in place (`place` true).
struct StaleGate {
    int tmpl = -1;
    int a = -1, b = -1, home = -1;
    bool place = false;
};

// Where finalize() put one iteration's staleness nodes, per call (-1: none): its snapshot, and the first of its
// gates `in` (one per stale call of its model), `same` (one per earlier one) and, for a chain's first call,
// `place` (one per stale call of its model).
struct StalePositions {
    std::vector<int> snapshot, in, same, place;
};

// finalize()'s hooks: the nodes at the start of call c's block, and the edges of every iteration.
void push_stale_nodes(Problem& p, int c, StalePositions& at);
void link_stale(const Problem& p, int per, const std::vector<int>& call_pos, const std::vector<int>& realloc_pos,
                const StalePositions& at, std::vector<std::vector<int32_t>>& kids);
// Under `plan`: whether a gate is closed; whether stale call c's snapshot is another's copy (an earlier stale
// call of its model has its layout: that one's snapshot is the copy c reads, so c's own costs nothing).
bool gate_closed(const Problem& p, const StaleGate& g, const int32_t* plan);
bool snapshot_aliased(const Problem& p, int c, const int32_t* plan);
// The template nodes whose price depends on a call other than their own and their source (aliased snapshots).
void add_stale_nodes(const Problem& p, std::vector<std::vector<int32_t>>& nodes_of);

}  // namespace rl
