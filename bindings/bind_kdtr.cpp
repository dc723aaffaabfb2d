// bind_kdtr.cpp: the C++ KDTR reader (cpp/kdtr.h) seen from Python, so tests can prove that C++
// reads exactly what kn.save_kdtr wrote. Errors (kdtree::Error) surface as ValueError.
//
//   _native.kdtr_read(path, verify=True)  -> ({name: ndarray}, metadata_json: str)
//   _native.kdtr_table(path, verify=True) -> [{name, dtype, shape, offset, nbytes}, ...]
//   _native.kdtr_crc32(data, value=0)     -> int  (the C++ CRC-32, for comparison with zlib)
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <memory>
#include <string>
#include <vector>

#include "kdtr.h"

namespace py = pybind11;

namespace {

// The numpy dtype of a payload as stored (bf16 as its raw uint16 bits).
py::dtype numpy_dtype(kdtree::KdtrDtype d) {
  using D = kdtree::KdtrDtype;
  switch (d) {
    case D::kF32: return py::dtype("<f4");
    case D::kF16: return py::dtype("<f2");
    case D::kBf16: return py::dtype("<u2");
    case D::kF64: return py::dtype("<f8");
    case D::kI8: return py::dtype("i1");
    case D::kU8: return py::dtype("u1");
    case D::kI16: return py::dtype("<i2");
    case D::kI32: return py::dtype("<i4");
    case D::kI64: return py::dtype("<i8");
    case D::kBool: return py::dtype("?");
    case D::kU16: return py::dtype("<u2");
    case D::kU32: return py::dtype("<u4");
    case D::kU64: return py::dtype("<u8");
  }
  throw kdtree::Error("unknown KDTR dtype");
}

// The path's bytes as the OS sees them: str (undecodable bytes carried as surrogate escapes),
// bytes or os.PathLike, through os.fsencode, as open() takes them.
std::string as_path(const py::object& path) {
  py::module_ os = py::module_::import("os");
  return os.attr("fsencode")(os.attr("fspath")(path)).cast<std::string>();
}

std::shared_ptr<kdtree::KdtrFile> open_file(const py::object& path, bool verify) {
  std::string p = as_path(path);
  try {
    py::gil_scoped_release nogil;  // the checksum pass can be long
    return std::make_shared<kdtree::KdtrFile>(kdtree::KdtrFile::open(p, verify));
  } catch (const kdtree::Error& e) {
    // The message starts with the path, which need not be UTF-8: decode it as os.fsdecode does,
    // so the text equals the Python reader's. (The GIL is held again here.)
    const std::string what = e.what();
    py::object msg = py::reinterpret_steal<py::object>(
        PyUnicode_DecodeFSDefaultAndSize(what.data(), py::ssize_t(what.size())));
    if (!msg) throw py::error_already_set();
    PyErr_SetObject(PyExc_ValueError, msg.ptr());
    throw py::error_already_set();
  }
}

}  // namespace

void bind_kdtr(py::module_& m) {
  m.def(
      "kdtr_read",
      [](const py::object& path, bool verify) {
        std::shared_ptr<kdtree::KdtrFile> file = open_file(path, verify);
        // Every array is a read-only view of the mapping; the capsule keeps the file mapped.
        py::capsule owner(new std::shared_ptr<kdtree::KdtrFile>(file),
                          [](void* p) { delete static_cast<std::shared_ptr<kdtree::KdtrFile>*>(p); });
        py::dict arrays;
        for (const kdtree::KdtrTensor& t : file->tensors()) {
          py::dtype dt = numpy_dtype(t.dtype);
          std::vector<py::ssize_t> shape(t.shape.begin(), t.shape.end());
          std::vector<py::ssize_t> strides(shape.size());
          py::ssize_t stride = dt.itemsize();
          for (size_t k = shape.size(); k-- > 0;) {
            strides[k] = stride;
            stride *= shape[k];
          }
          py::array a(dt, shape, strides, t.data, owner);
          a.attr("setflags")(py::arg("write") = false);
          arrays[py::str(t.name)] = a;
        }
        return py::make_tuple(arrays, py::str(file->metadata_json()));
      },
      py::arg("path"), py::arg("verify") = true,
      "Read a KDTR file with the C++ reader: ({name: read-only ndarray view}, metadata JSON text). "
      "bf16 tensors come back as their uint16 bits. Corrupt files raise ValueError.");

  m.def(
      "kdtr_table",
      [](const py::object& path, bool verify) {
        std::shared_ptr<kdtree::KdtrFile> file = open_file(path, verify);
        py::list out;
        for (const kdtree::KdtrTensor& t : file->tensors()) {
          py::dict e;
          e["name"] = py::str(t.name);
          e["dtype"] = kdtree::kdtr_dtype_name(t.dtype);
          py::tuple shape(t.shape.size());
          for (size_t k = 0; k < t.shape.size(); ++k) shape[k] = py::int_(t.shape[k]);
          e["shape"] = shape;
          e["offset"] = t.offset;
          e["nbytes"] = t.nbytes;
          out.append(e);
        }
        return out;
      },
      py::arg("path"), py::arg("verify") = true,
      "The tensor table as the C++ reader parsed it: [{name, dtype, shape, offset, nbytes}].");

  m.def(
      "kdtr_crc32",
      [](const py::buffer& data, uint32_t value) {
        py::buffer_info info = data.request();
        if (info.ndim > 1) {
          bool contiguous = true;
          py::ssize_t expect = info.itemsize;
          for (py::ssize_t k = info.ndim; k-- > 0;) {
            if (info.strides[k] != expect) contiguous = false;
            expect *= info.shape[k];
          }
          if (!contiguous) throw kdtree::Error("kdtr_crc32 needs a C-contiguous buffer");
        } else if (info.ndim == 1 && info.shape[0] > 1 && info.strides[0] != info.itemsize) {
          throw kdtree::Error("kdtr_crc32 needs a C-contiguous buffer");
        }
        size_t n = size_t(info.size) * size_t(info.itemsize);
        py::gil_scoped_release nogil;
        return kdtree::kdtr_crc32(value, info.ptr, n);
      },
      py::arg("data"), py::arg("value") = 0, "CRC-32 (zlib's) computed by the C++ reader's implementation.");
}
