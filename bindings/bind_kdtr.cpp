// bind_kdtr.cpp: Python bindings for the kdtr area (placeholder until that area lands).
#include <pybind11/pybind11.h>
namespace py = pybind11;
void bind_kdtr(py::module_& m) { (void)m; }
