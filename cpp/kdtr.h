// kdtr.h: the C++ reader of KDTR files (format: docs/kdtr.md), the container in which Python
// hands golden data and snapshots to the native side. The file is memory-mapped (POSIX mmap)
// and validated exactly as the Python reader (python/kdtree_native/kdtr.py) does, same checks,
// same order, same messages; tensors are zero-copy views of the mapping.
//
//   kdtree::KdtrFile f = kdtree::KdtrFile::open(path);     // throws kdtree::Error
//   const float* lp = f.at("logprobs").as<float>();         // checks the dtype
//
// Requires a little-endian host (payloads are little-endian and handed out as-is).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "common.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the KDTR reader hands out little-endian payloads as-is and needs a little-endian host"
#endif

namespace kdtree {

// Format constants and reader limits (docs/kdtr.md, "Limits").
constexpr uint32_t kKdtrVersion = 1;
constexpr uint64_t kKdtrHeaderSize = 64;
constexpr uint64_t kKdtrAlign = 64;
constexpr uint64_t kKdtrEntryFixed = 24;
constexpr uint64_t kKdtrMaxTensors = uint64_t(1) << 20;
constexpr uint64_t kKdtrMaxNameLen = 1024;
constexpr uint64_t kKdtrMaxNdim = 32;
constexpr uint64_t kKdtrMaxMetadata = uint64_t(64) << 20;
constexpr int kKdtrMaxJsonDepth = 256;
constexpr size_t kKdtrMaxJsonNumberLen = 4000;

// Dtype codes as stored in the tensor table.
enum class KdtrDtype : uint8_t {
  kF32 = 1,
  kF16 = 2,
  kBf16 = 3,
  kF64 = 4,
  kI8 = 5,
  kU8 = 6,
  kI16 = 7,
  kI32 = 8,
  kI64 = 9,
  kBool = 10,
  kU16 = 11,
  kU32 = 12,
  kU64 = 13,
};

bool kdtr_dtype_valid(uint8_t code);
size_t kdtr_dtype_size(KdtrDtype dtype);       // bytes per element
const char* kdtr_dtype_name(KdtrDtype dtype);  // "f32", "bf16", ...

// CRC-32/ISO-HDLC (zlib's crc32): kdtr_crc32(kdtr_crc32(0, a, n), b, m) == crc of a then b.
uint32_t kdtr_crc32(uint32_t crc, const void* data, size_t n);

// Exact widening of half-precision bit patterns.
float kdtr_f16_to_f32(uint16_t bits);
float kdtr_bf16_to_f32(uint16_t bits);

// Which C++ element type views which dtype: uint16_t views u16 and the raw bits of f16/bf16.
template <class T>
bool kdtr_dtype_accepts(KdtrDtype d) {
  if constexpr (std::is_same_v<T, float>) return d == KdtrDtype::kF32;
  else if constexpr (std::is_same_v<T, double>) return d == KdtrDtype::kF64;
  else if constexpr (std::is_same_v<T, int8_t>) return d == KdtrDtype::kI8;
  else if constexpr (std::is_same_v<T, uint8_t>) return d == KdtrDtype::kU8;
  else if constexpr (std::is_same_v<T, int16_t>) return d == KdtrDtype::kI16;
  else if constexpr (std::is_same_v<T, uint16_t>)
    return d == KdtrDtype::kU16 || d == KdtrDtype::kF16 || d == KdtrDtype::kBf16;
  else if constexpr (std::is_same_v<T, int32_t>) return d == KdtrDtype::kI32;
  else if constexpr (std::is_same_v<T, uint32_t>) return d == KdtrDtype::kU32;
  else if constexpr (std::is_same_v<T, int64_t>) return d == KdtrDtype::kI64;
  else if constexpr (std::is_same_v<T, uint64_t>) return d == KdtrDtype::kU64;
  else if constexpr (std::is_same_v<T, bool>) return d == KdtrDtype::kBool;
  else static_assert(sizeof(T) == 0, "no KDTR dtype for this element type");
}

// One tensor of an open file: a view into the mapping, valid while the KdtrFile lives.
struct KdtrTensor {
  std::string name;
  KdtrDtype dtype = KdtrDtype::kF32;
  std::vector<int64_t> shape;  // empty for a scalar
  const void* data = nullptr;  // 64-byte aligned in the file; never dereference when nbytes == 0
  uint64_t nbytes = 0;
  uint64_t offset = 0;  // absolute file offset of the payload

  int64_t numel() const;
  // The payload as T[numel()]; throws kdtree::Error naming the tensor if the dtype differs.
  template <class T>
  const T* as() const {
    if (!kdtr_dtype_accepts<T>(dtype)) throw_dtype_mismatch(typeid_name<T>());
    return static_cast<const T*>(data);
  }
  // Any numeric dtype converted to float (f16/bf16 exactly, bool as 0/1, integers rounded).
  std::vector<float> to_f32() const;

 private:
  [[noreturn]] void throw_dtype_mismatch(const char* wanted) const;
  template <class T>
  static const char* typeid_name() {
    if constexpr (std::is_same_v<T, float>) return "float";
    else if constexpr (std::is_same_v<T, double>) return "double";
    else if constexpr (std::is_same_v<T, int8_t>) return "int8_t";
    else if constexpr (std::is_same_v<T, uint8_t>) return "uint8_t";
    else if constexpr (std::is_same_v<T, int16_t>) return "int16_t";
    else if constexpr (std::is_same_v<T, uint16_t>) return "uint16_t";
    else if constexpr (std::is_same_v<T, int32_t>) return "int32_t";
    else if constexpr (std::is_same_v<T, uint32_t>) return "uint32_t";
    else if constexpr (std::is_same_v<T, int64_t>) return "int64_t";
    else if constexpr (std::is_same_v<T, uint64_t>) return "uint64_t";
    else return "bool";
  }
};

// An open, validated KDTR file. Move-only; unmaps the file in its destructor.
class KdtrFile {
 public:
  // Maps and validates `path`; throws kdtree::Error "<path>: <problem>" (docs/kdtr.md,
  // "Validation"). verify_checksum=false skips the CRC pass over the payloads.
  static KdtrFile open(const std::string& path, bool verify_checksum = true);

  KdtrFile(KdtrFile&& other) noexcept;
  KdtrFile& operator=(KdtrFile&& other) noexcept;
  KdtrFile(const KdtrFile&) = delete;
  KdtrFile& operator=(const KdtrFile&) = delete;
  ~KdtrFile();

  const KdtrTensor* find(const std::string& name) const;  // nullptr if absent
  const KdtrTensor& at(const std::string& name) const;    // throws kdtree::Error naming it
  const std::vector<KdtrTensor>& tensors() const { return tensors_; }  // file order
  const std::string& metadata_json() const { return metadata_; }       // raw JSON text
  const std::string& path() const { return path_; }
  uint64_t file_size() const { return size_; }

 private:
  KdtrFile() = default;
  void validate(bool verify_checksum);
  void release() noexcept;

  std::string path_;
  const uint8_t* base_ = nullptr;  // the mapping, size_ bytes
  uint64_t size_ = 0;
  std::vector<KdtrTensor> tensors_;
  std::unordered_map<std::string, size_t> index_;  // name -> position in tensors_
  std::string metadata_;
};

}  // namespace kdtree
