// realloc._C bindings of chunked streaming's arrays (tail.h: TailColumns::lead, TailSplit's chunk arrays;
// realloc/search/tail_problem.py hands them over).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include "problem.h"
#include "tail.h"

namespace py = pybind11;

namespace {

using Doubles = py::array_t<double, py::array::c_style | py::array::forcecast>;

}  // namespace

void bind_chunks(py::module_& m) {
    m.def(
        "set_tail_lead",
        [](rl::Problem& p, int column, const Doubles& lead) {
            if (column < 0 || column >= static_cast<int>(p.tail_cols.size()))
                throw std::invalid_argument("set_tail_lead: no tail column " + std::to_string(column));
            if (lead.ndim() != 1) throw std::invalid_argument("set_tail_lead: lead must be 1-D");
            p.tail_cols[column].lead.assign(lead.data(), lead.data() + lead.size());
            p.finalized = false;
        },
        py::arg("problem"), py::arg("column"), py::arg("lead"),
        "Chunked streaming: seconds from each candidate's first split point to its last (csrc/tail.h).");
    m.def(
        "set_split_chunks",
        [](rl::Problem& p, int split, const Doubles& work, const Doubles& share) {
            if (split < 0 || split >= static_cast<int>(p.tail_splits.size()))
                throw std::invalid_argument("set_split_chunks: no split " + std::to_string(split));
            if (work.ndim() != 3 || share.ndim() != 2 || work.shape(2) != share.shape(1))
                throw std::invalid_argument("set_split_chunks: work is [candidates, grid, chunks], share [grid, chunks]");
            rl::TailSplit& s = p.tail_splits[split];
            s.n_chunk = static_cast<int>(work.shape(2));
            s.chunk_work.assign(work.data(), work.data() + work.size());
            s.chunk_share.assign(share.data(), share.data() + share.size());
            p.finalized = false;
        },
        py::arg("problem"), py::arg("split"), py::arg("work"), py::arg("share"),
        "Chunked streaming: a split consumer's work from each chunk on and the lead's shares (csrc/tail.h).");
}
