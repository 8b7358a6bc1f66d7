// pybind11 entry point of realloc._C. Each engine part registers its functions here.
#include <pybind11/pybind11.h>

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
    m.doc() = "realloc C++ core: plan simulator and MCMC search";
    m.def("build_info", []() {
        return std::string("realloc._C C++") + std::to_string(__cplusplus) + " " + __VERSION__;
    });
}
