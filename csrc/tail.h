// Long-tail migration of a generation call (issue 31 item 3; rlhfuse.txt §4). The rules are in
// realloc/search/tail_problem.py and tail_reference.py (the Python reference); this is the C++ side.
#pragma once

#include <cstdint>
#include <vector>

namespace rl {

struct Problem;

// Per candidate of one generation call: the index of its R_t in the grid (-1: no migration), the devices
// from dev_lo that decode the tail (m replicas x tp) and the seconds of migration + phase 2. A migrating
// candidate's `time` is phase 1.
struct TailColumns {
    int call = -1;
    std::vector<int32_t> grid, width;
    std::vector<double> time;
    // Chunked streaming (chunk_cost.py): per candidate, seconds from its first split point to its last (empty or
    // 0: one split point).
    std::vector<double> lead;
};

// A consumer of a migrating call that may run in two parts (data edge `edge`): part times per consumer
// candidate i and grid index g at [i * n_grid + g]; the transfer's shares before and after, per grid index.
struct TailSplit {
    int edge = -1;
    int n_grid = 0;
    std::vector<double> part1, part2, share1, share2;
    // Chunked streaming (chunk_cost.py; n_chunk 0: none): the consumer's work on the chunks from j on, at
    // [(i * n_grid + g) * n_chunk + j], and the share of the producer's lead before split j's end, at
    // [g * n_chunk + j]. Part 1 is max(part1, max_j(work - lead * share)) (chunk_part1).
    int n_chunk = 0;
    std::vector<double> chunk_work, chunk_share;
};

// Part 1 of split `x` for consumer candidate `cand`, grid index `g`, when the producer's lead is `lead`.
double chunk_part1(const TailSplit& x, int cand, int g, double lead);

// Nodes that rank with the data transfers at equal ready times: a migrating call's tail node hands on the call's
// outputs (a free one passes them on at once, as a free transfer does).
inline bool first_rank(uint8_t kind) { return kind == 2 || kind == 3; }

// Where finalize() put one iteration's tail nodes, per call (-1: none).
struct TailPositions {
    std::vector<int> tail, part_data, part;
};

// Checks the tail arrays and derives Problem::tail_of_call and split_of_call; throws std::invalid_argument.
void prepare_tail(Problem& p, TailPositions& at);
// finalize()'s hooks: the nodes before call c's node (a split consumer's part-1 transfer and part 1) and after
// it (a migrating call's tail node).
void push_tail_nodes_before(Problem& p, int c, TailPositions& at);
void push_tail_node_after(Problem& p, int c, TailPositions& at);
// Moves the edges of the unrolled graph (kids: children per node) as tail_reference.rewire does.
void rewire_tail(const Problem& p, int per, const std::vector<int>& call_pos, const std::vector<int>& data_pos,
                 const TailPositions& at, std::vector<std::vector<int32_t>>& kids);

}  // namespace rl
