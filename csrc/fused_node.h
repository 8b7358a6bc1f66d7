// The fused node of the plan simulator (rlhfuse.txt §5, intra-stage fusion; docs/fused-training.md).
//
// A fused pair (Problem::fused) is two train calls a and b that a plan may run as one pipeline schedule on one
// mesh. Pair p is *on* under a plan when its plan entry (plan[n_calls + p]) is 1 and both calls' candidates sit
// on the same devices with the same pp; an entry of 1 on calls placed apart fuses nothing.
//
// Time. The pair runs as one node: it is ready when both calls' dependencies are (each call keeps its own
// edges), takes the mesh's devices, and lasts time_a + time_b - saving, the fused schedule's price
// (estimator/fused_cost.py), but no less than the longer call alone; then both calls' children are released.
// An unpriced saving reads as bound_a + bound_b (the pipeline bubbles both calls could fill) and makes the
// evaluation inexact, like an unpriced transfer.
//
// Memory. While it runs, every device of the mesh holds its static bytes, the larger of the two calls' dynamic
// bytes there, and `extra` (the activation bytes the schedule adds on its most affected stage group; 0 while
// unpriced). The second model's calls on the pair's mesh count their stages in reverse order, as the runtime
// places them (stage_at); with a pair on, check_memory() is the per-device pass of check_fused_memory().
//
// With shared cores (Problem::shares_cores) the event-driven schedule (shared_cores.cpp) runs the fused node the
// same way: the first call node waits without devices for the other, which runs it at its host's rate.
#pragma once

#include <algorithm>

#include "problem.h"

namespace rl {

// Whether pair `f` is on under `plan` (its entry is `on`).
inline bool fused_pair_on(const Problem& p, const FusedPair& f, int32_t on, const int32_t* plan) {
    if (!on) return false;
    const Candidates &ka = p.cands[f.a], &kb = p.cands[f.b];
    const int i = plan[f.a], j = plan[f.b];
    return ka.dev_lo[i] == kb.dev_lo[j] && ka.dev_hi[i] == kb.dev_hi[j] &&
           ka.mem_offset[i + 1] - ka.mem_offset[i] == kb.mem_offset[j + 1] - kb.mem_offset[j];
}

// The stage groups call c's mesh runs in reverse order under `plan`, or 0: the runtime reverses the second model's
// stages on an on pair's mesh in all of that model's calls there (graph/fused.second_model_meshes), so that its
// stage k sits on the mesh's group pp - 1 - k (pp: the pair's second call's).
int reversed_groups(const Problem& p, const int32_t* plan, int c);

// Call c's stage (within its candidate) on device x of its mesh under `plan`, reversed where reversed_groups says.
int64_t stage_at(const Problem& p, const int32_t* plan, int c, int x);

// Seconds the fused node of pair `f` lasts with candidates (i, j), and whether its saving is priced.
inline double fused_time(const Problem& p, const FusedPair& f, int i, int j, bool& known) {
    const double ta = p.cands[f.a].time[i], tb = p.cands[f.b].time[j];
    double s = f.saving.get(i, j, known);
    if (!known) s = f.bound_a[i] + f.bound_b[j];
    return std::max(std::max(ta, tb), ta + tb - s);
}

}  // namespace rl
