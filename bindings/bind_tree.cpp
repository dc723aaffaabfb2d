// bind_tree.cpp: Python bindings for the tree area (placeholder until that area lands).
#include <pybind11/pybind11.h>
namespace py = pybind11;
void bind_tree(py::module_& m) { (void)m; }
