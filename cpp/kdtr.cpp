// kdtr.cpp: the KDTR reader (docs/kdtr.md): mmap, validation in the order and with the messages
// of python/kdtree_native/kdtr.py, CRC-32, UTF-8 and JSON syntax checks, dtype helpers.
#include "kdtr.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <climits>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <utility>

namespace kdtree {

// ------------------------------------------------------------------------------ dtypes

bool kdtr_dtype_valid(uint8_t code) { return code >= 1 && code <= 13; }

size_t kdtr_dtype_size(KdtrDtype dtype) {
  switch (dtype) {
    case KdtrDtype::kF64: case KdtrDtype::kI64: case KdtrDtype::kU64: return 8;
    case KdtrDtype::kF32: case KdtrDtype::kI32: case KdtrDtype::kU32: return 4;
    case KdtrDtype::kF16: case KdtrDtype::kBf16: case KdtrDtype::kI16: case KdtrDtype::kU16: return 2;
    case KdtrDtype::kI8: case KdtrDtype::kU8: case KdtrDtype::kBool: return 1;
  }
  return 0;
}

const char* kdtr_dtype_name(KdtrDtype dtype) {
  switch (dtype) {
    case KdtrDtype::kF32: return "f32";
    case KdtrDtype::kF16: return "f16";
    case KdtrDtype::kBf16: return "bf16";
    case KdtrDtype::kF64: return "f64";
    case KdtrDtype::kI8: return "i8";
    case KdtrDtype::kU8: return "u8";
    case KdtrDtype::kI16: return "i16";
    case KdtrDtype::kI32: return "i32";
    case KdtrDtype::kI64: return "i64";
    case KdtrDtype::kBool: return "bool";
    case KdtrDtype::kU16: return "u16";
    case KdtrDtype::kU32: return "u32";
    case KdtrDtype::kU64: return "u64";
  }
  return "?";
}

float kdtr_bf16_to_f32(uint16_t bits) {
  uint32_t u = uint32_t(bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

float kdtr_f16_to_f32(uint16_t bits) {
  uint32_t sign = uint32_t(bits & 0x8000) << 16;
  uint32_t exp = (bits >> 10) & 0x1f;
  uint32_t mant = bits & 0x3ff;
  uint32_t u;
  if (exp == 0) {  // zero or subnormal: mant * 2^-24, exact in float
    float v = std::ldexp(float(mant), -24);
    return sign ? -v : v;
  } else if (exp == 31) {
    u = sign | 0x7f800000u | (mant << 13);
  } else {
    u = sign | ((exp + 112) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// ------------------------------------------------------------------------------ CRC-32

namespace {
// Slicing-by-8 tables of the reflected polynomial 0xEDB88320.
struct Crc32Tables {
  uint32_t t[8][256];
  Crc32Tables() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      t[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; ++i)
      for (int k = 1; k < 8; ++k) t[k][i] = (t[k - 1][i] >> 8) ^ t[0][t[k - 1][i] & 0xff];
  }
};

inline uint32_t load_u32(const uint8_t* p) {
  return uint32_t(p[0]) | uint32_t(p[1]) << 8 | uint32_t(p[2]) << 16 | uint32_t(p[3]) << 24;
}
inline uint16_t load_u16(const uint8_t* p) { return uint16_t(p[0] | p[1] << 8); }
inline uint64_t load_u64(const uint8_t* p) { return uint64_t(load_u32(p)) | uint64_t(load_u32(p + 4)) << 32; }
}  // namespace

uint32_t kdtr_crc32(uint32_t crc, const void* data, size_t n) {
  static const Crc32Tables tables;
  const auto& t = tables.t;
  const uint8_t* p = static_cast<const uint8_t*>(data);
  crc = ~crc;
  while (n >= 8) {
    uint32_t a = crc ^ load_u32(p), b = load_u32(p + 4);
    crc = t[7][a & 0xff] ^ t[6][(a >> 8) & 0xff] ^ t[5][(a >> 16) & 0xff] ^ t[4][a >> 24] ^
          t[3][b & 0xff] ^ t[2][(b >> 8) & 0xff] ^ t[1][(b >> 16) & 0xff] ^ t[0][b >> 24];
    p += 8;
    n -= 8;
  }
  while (n--) crc = t[0][(crc ^ *p++) & 0xff] ^ (crc >> 8);
  return ~crc;
}

// ------------------------------------------------------------------------------ UTF-8 / JSON

namespace {

// Well-formed UTF-8 (Unicode table 3-7), the same bytes Python's strict decoder accepts.
bool utf8_valid(const uint8_t* p, size_t n) {
  size_t i = 0;
  while (i < n) {
    uint8_t c = p[i];
    if (c < 0x80) { ++i; continue; }
    size_t len;
    uint8_t lo = 0x80, hi = 0xbf;
    if (c >= 0xc2 && c <= 0xdf) len = 2;
    else if (c == 0xe0) { len = 3; lo = 0xa0; }
    else if ((c >= 0xe1 && c <= 0xec) || c == 0xee || c == 0xef) len = 3;
    else if (c == 0xed) { len = 3; hi = 0x9f; }
    else if (c == 0xf0) { len = 4; lo = 0x90; }
    else if (c >= 0xf1 && c <= 0xf3) len = 4;
    else if (c == 0xf4) { len = 4; hi = 0x8f; }
    else return false;
    if (n - i < len || p[i + 1] < lo || p[i + 1] > hi) return false;
    for (size_t k = 2; k < len; ++k)
      if ((p[i + k] & 0xc0) != 0x80) return false;
    i += len;
  }
  return true;
}

// A JSON syntax checker (RFC 8259, no values built) that accepts exactly what the Python reader
// accepts: json.loads in strict mode, no NaN/Infinity, nesting <= kKdtrMaxJsonDepth, number
// tokens (scanned the way CPython's scanner does) <= kKdtrMaxJsonNumberLen characters.
class JsonSyntax {
 public:
  JsonSyntax(const uint8_t* s, size_t n) : s_(s), n_(n) {}

  // "" if valid, else the problem (a full message tail for depth/number limits).
  std::string check() {
    ws();
    if (!value(0)) return error_;
    ws();
    if (i_ != n_) syntax("extra data");
    return error_;
  }

 private:
  bool syntax(const char* what) {
    if (error_.empty()) error_ = std::string("metadata is not valid JSON: ") + what + " at byte " + std::to_string(i_);
    return false;
  }
  bool limit(const std::string& msg) {
    if (error_.empty()) error_ = msg;
    return false;
  }
  bool at(char c) const { return i_ < n_ && s_[i_] == uint8_t(c); }
  bool digit_at(size_t k) const { return k < n_ && s_[k] >= '0' && s_[k] <= '9'; }
  void ws() {
    while (i_ < n_ && (s_[i_] == ' ' || s_[i_] == '\t' || s_[i_] == '\n' || s_[i_] == '\r')) ++i_;
  }
  bool literal(const char* word) {
    size_t len = std::strlen(word);
    if (n_ - i_ < len || std::memcmp(s_ + i_, word, len) != 0) return syntax("expecting a value");
    i_ += len;
    return true;
  }

  bool value(int depth) {
    if (i_ >= n_) return syntax("expecting a value");
    switch (s_[i_]) {
      case '{': return object(depth + 1);
      case '[': return array(depth + 1);
      case '"': return string();
      case 't': return literal("true");
      case 'f': return literal("false");
      case 'n': return literal("null");
      default: return number();
    }
  }

  bool object(int depth) {
    if (depth > kKdtrMaxJsonDepth)
      return limit("metadata JSON is nested deeper than " + std::to_string(kKdtrMaxJsonDepth) + " levels");
    ++i_;
    ws();
    if (at('}')) { ++i_; return true; }
    for (;;) {
      if (!at('"')) return syntax("expecting a property name in double quotes");
      if (!string()) return false;
      ws();
      if (!at(':')) return syntax("expecting ':'");
      ++i_;
      ws();
      if (!value(depth)) return false;
      ws();
      if (at('}')) { ++i_; return true; }
      if (!at(',')) return syntax("expecting ',' or '}'");
      ++i_;
      ws();
    }
  }

  bool array(int depth) {
    if (depth > kKdtrMaxJsonDepth)
      return limit("metadata JSON is nested deeper than " + std::to_string(kKdtrMaxJsonDepth) + " levels");
    ++i_;
    ws();
    if (at(']')) { ++i_; return true; }
    for (;;) {
      if (!value(depth)) return false;
      ws();
      if (at(']')) { ++i_; return true; }
      if (!at(',')) return syntax("expecting ',' or ']'");
      ++i_;
      ws();
    }
  }

  bool string() {  // at the opening quote
    ++i_;
    for (;;) {
      if (i_ >= n_) return syntax("unterminated string");
      uint8_t c = s_[i_];
      if (c == '"') { ++i_; return true; }
      if (c < 0x20) return syntax("invalid control character in a string");
      if (c != '\\') { ++i_; continue; }
      if (++i_ >= n_) return syntax("unterminated string");
      c = s_[i_++];
      if (c == 'u') {
        for (int k = 0; k < 4; ++k, ++i_)
          if (i_ >= n_ || !std::isxdigit(s_[i_])) return syntax("invalid \\uXXXX escape");
      } else if (!std::strchr("\"\\/bfnrt", c) || c == 0) {
        return syntax("invalid escape");
      }
    }
  }

  // CPython's _match_number: '-'? ('0' | [1-9][0-9]*) ('.' [0-9]+)? ([eE] [-+]? [0-9]+)?, where
  // a '.' or exponent not followed by digits is left unconsumed (and fails as extra data later).
  bool number() {
    size_t start = i_;
    if (at('-')) ++i_;
    if (at('0')) {
      ++i_;
    } else if (i_ < n_ && s_[i_] >= '1' && s_[i_] <= '9') {
      while (digit_at(i_)) ++i_;
    } else {
      i_ = start;
      return syntax("expecting a value");
    }
    const size_t int_end = i_;
    if (at('.') && digit_at(i_ + 1)) {
      i_ += 2;
      while (digit_at(i_)) ++i_;
    }
    if (at('e') || at('E')) {
      size_t e = i_++;
      if (at('-') || at('+')) ++i_;
      size_t d = i_;
      while (digit_at(i_)) ++i_;
      if (i_ == d) i_ = e;
    }
    if (i_ - start > kKdtrMaxJsonNumberLen)
      return limit("metadata JSON has a number longer than " + std::to_string(kKdtrMaxJsonNumberLen) + " characters");
    if (i_ - start > int_end - start && overflows_double(start, int_end, i_))
      return limit("metadata JSON has a number outside the float64 range");
    return true;
  }

  // Whether the number token [start, end), whose integer part ends at int_end and which has a
  // fraction or an exponent, rounds to infinity as a double: Python's float() makes it inf
  // (1e400), which the Python reader refuses. from_chars rounds correctly, as float() does, and
  // reports both overflow and underflow to 0 as out of range; those lie hundreds of decades
  // apart, so the decimal exponent of the first non-zero digit tells them apart.
  bool overflows_double(size_t start, size_t int_end, size_t end) const {
    const char* s = reinterpret_cast<const char*>(s_);
    double v;
    auto r = std::from_chars(s + start, s + end, v);
    if (r.ec != std::errc::result_out_of_range) return false;
    int64_t exp10 = 0;  // exponent of the first non-zero digit, saturated
    size_t k = start + (s[start] == '-');
    bool seen = false;
    for (size_t q = k; q < end && s[q] != 'e' && s[q] != 'E'; ++q) {
      if (s[q] == '.') continue;
      if (!seen && s[q] != '0') {
        seen = true;
        exp10 = q < int_end ? int64_t(int_end - q) - 1 : -int64_t(q - int_end);
      }
    }
    for (size_t q = k; q < end; ++q) {
      if (s[q] != 'e' && s[q] != 'E') continue;
      bool neg = s[q + 1] == '-';
      int64_t e = 0;
      for (size_t d = q + 1 + (s[q + 1] == '-' || s[q + 1] == '+'); d < end; ++d)
        e = std::min<int64_t>(e * 10 + (s[d] - '0'), int64_t(1) << 40);
      exp10 += neg ? -e : e;
      break;
    }
    return seen && exp10 > 0;
  }

  const uint8_t* s_;
  size_t n_;
  size_t i_ = 0;
  std::string error_;
};

const char* json_top_type(uint8_t c) {
  switch (c) {
    case '{': return "object";
    case '[': return "array";
    case '"': return "string";
    case 't': case 'f': return "boolean";
    case 'n': return "null";
    default: return "number";
  }
}

uint64_t round_up(uint64_t n, uint64_t a) { return (n + a - 1) / a * a; }

// A tensor name as messages show it (same as kdtr.py _quote): control bytes, DEL, backslash and
// the apostrophe as \xNN, everything else (UTF-8 included) as is.
std::string quote(const std::string& name) {
  std::string out;
  for (unsigned char c : name) {
    if (c < 0x20 || c == 0x7f || c == '\\' || c == '\'') {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      out += buf;
    } else {
      out += char(c);
    }
  }
  return out;
}

}  // namespace

// ------------------------------------------------------------------------------ KdtrTensor

int64_t KdtrTensor::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

void KdtrTensor::throw_dtype_mismatch(const char* wanted) const {
  throw Error("KDTR tensor '" + quote(name) + "' has dtype " + kdtr_dtype_name(dtype) + ", which cannot be viewed as " +
              wanted);
}

std::vector<float> KdtrTensor::to_f32() const {
  const int64_t n = numel();
  std::vector<float> out(size_t(n > 0 ? n : 0));
  for (int64_t i = 0; i < n; ++i) {
    float v = 0.f;
    switch (dtype) {
      case KdtrDtype::kF32: v = static_cast<const float*>(data)[i]; break;
      case KdtrDtype::kF16: v = kdtr_f16_to_f32(static_cast<const uint16_t*>(data)[i]); break;
      case KdtrDtype::kBf16: v = kdtr_bf16_to_f32(static_cast<const uint16_t*>(data)[i]); break;
      case KdtrDtype::kF64: v = float(static_cast<const double*>(data)[i]); break;
      case KdtrDtype::kI8: v = float(static_cast<const int8_t*>(data)[i]); break;
      case KdtrDtype::kU8: v = float(static_cast<const uint8_t*>(data)[i]); break;
      case KdtrDtype::kI16: v = float(static_cast<const int16_t*>(data)[i]); break;
      case KdtrDtype::kI32: v = float(static_cast<const int32_t*>(data)[i]); break;
      case KdtrDtype::kI64: v = float(static_cast<const int64_t*>(data)[i]); break;
      case KdtrDtype::kBool: v = static_cast<const uint8_t*>(data)[i] ? 1.f : 0.f; break;
      case KdtrDtype::kU16: v = float(static_cast<const uint16_t*>(data)[i]); break;
      case KdtrDtype::kU32: v = float(static_cast<const uint32_t*>(data)[i]); break;
      case KdtrDtype::kU64: v = float(static_cast<const uint64_t*>(data)[i]); break;
    }
    out[size_t(i)] = v;
  }
  return out;
}

// ------------------------------------------------------------------------------ KdtrFile

KdtrFile::KdtrFile(KdtrFile&& o) noexcept
    : path_(std::move(o.path_)),
      base_(std::exchange(o.base_, nullptr)),
      size_(std::exchange(o.size_, 0)),
      tensors_(std::move(o.tensors_)),
      index_(std::move(o.index_)),
      metadata_(std::move(o.metadata_)) {}

KdtrFile& KdtrFile::operator=(KdtrFile&& o) noexcept {
  if (this != &o) {
    release();
    path_ = std::move(o.path_);
    base_ = std::exchange(o.base_, nullptr);
    size_ = std::exchange(o.size_, 0);
    tensors_ = std::move(o.tensors_);
    index_ = std::move(o.index_);
    metadata_ = std::move(o.metadata_);
  }
  return *this;
}

KdtrFile::~KdtrFile() { release(); }

void KdtrFile::release() noexcept {
  if (base_) munmap(const_cast<uint8_t*>(base_), size_t(size_));
  base_ = nullptr;
  size_ = 0;
}

const KdtrTensor* KdtrFile::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

const KdtrTensor& KdtrFile::at(const std::string& name) const {
  const KdtrTensor* t = find(name);
  if (!t) throw Error(path_ + ": no tensor named '" + quote(name) + "'");
  return *t;
}

KdtrFile KdtrFile::open(const std::string& path, bool verify_checksum) {
  KdtrFile f;
  f.path_ = path;
  // (as Python's open(): a NUL would silently cut the path short at the system call)
  if (path.find('\0') != std::string::npos) throw Error("embedded null byte");
  // O_NONBLOCK: opening a FIFO for reading would wait for a writer; it is refused as "not a
  // regular file" below instead. The flag does not matter to mmap.
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) throw Error(path + ": cannot open: " + std::strerror(errno));
  struct stat st;
  if (fstat(fd, &st) != 0) {
    int e = errno;
    ::close(fd);
    throw Error(path + ": cannot stat: " + std::strerror(e));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    throw Error(path + ": not a regular file");
  }
  const uint64_t size = uint64_t(st.st_size);
  if (size < kKdtrHeaderSize) {
    ::close(fd);
    throw Error(path + ": truncated file: " + std::to_string(size) + " bytes is smaller than the " +
                std::to_string(kKdtrHeaderSize) + "-byte KDTR header");
  }
  void* m = mmap(nullptr, size_t(size), PROT_READ, MAP_PRIVATE, fd, 0);
  int e = errno;
  ::close(fd);
  if (m == MAP_FAILED) throw Error(path + ": cannot mmap: " + std::strerror(e));
  f.base_ = static_cast<const uint8_t*>(m);
  f.size_ = size;
  f.validate(verify_checksum);  // on a throw, ~KdtrFile unmaps
  return f;
}

// The checks of docs/kdtr.md "Validation", in order; mirror of kdtr.py _parse().
void KdtrFile::validate(bool verify_checksum) {
  const uint8_t* p = base_;
  const uint64_t size = size_;
  auto fail = [&](const std::string& msg) { throw Error(path_ + ": " + msg); };
  auto num = [](uint64_t v) { return std::to_string(v); };

  static const uint8_t kMagic[8] = {0x89, 'K', 'D', 'T', 'R', '\r', '\n', 0x1a};
  if (std::memcmp(p, kMagic, 8) != 0) fail("bad magic: not a KDTR file");
  const uint32_t version = load_u32(p + 8), stored_crc = load_u32(p + 12);
  const uint64_t file_size = load_u64(p + 16), count = load_u64(p + 24), table_size = load_u64(p + 32),
                 meta_size = load_u64(p + 40), data_offset = load_u64(p + 48), flags = load_u64(p + 56);
  if (version != kKdtrVersion)
    fail("unsupported KDTR format version " + num(version) + " (this reader reads version " + num(kKdtrVersion) + ")");
  if (flags != 0) fail("unsupported header flags " + num(flags) + " (must be 0 in version " + num(kKdtrVersion) + ")");
  if (file_size > size)
    fail("truncated file: the header says " + num(file_size) + " bytes but the file has " + num(size));
  if (file_size < size)
    fail("trailing bytes: the header says " + num(file_size) + " bytes but the file has " + num(size));
  if (verify_checksum) {
    uint32_t computed = kdtr_crc32(0, p + 16, size_t(size - 16));
    if (computed != stored_crc) {
      char buf[96];
      std::snprintf(buf, sizeof buf, "checksum mismatch: stored CRC-32 %08x, computed %08x", stored_crc, computed);
      fail(buf);
    }
  }
  if (count > kKdtrMaxTensors) fail("too many tensors: " + num(count) + " (limit " + num(kKdtrMaxTensors) + ")");
  if (table_size > size - kKdtrHeaderSize)
    fail("tensor table (" + num(table_size) + " bytes) extends past the end of the file");
  const uint64_t meta_offset = kKdtrHeaderSize + table_size;
  if (meta_size > kKdtrMaxMetadata)
    fail("metadata too large: " + num(meta_size) + " bytes (limit " + num(kKdtrMaxMetadata) + ")");
  if (meta_size > size - meta_offset)
    fail("metadata (" + num(meta_size) + " bytes at offset " + num(meta_offset) + ") extends past the end of the file");
  const uint64_t expected = round_up(meta_offset + meta_size, kKdtrAlign);
  if (data_offset != expected)
    fail("bad data offset " + num(data_offset) + ": expected " + num(expected) + " (metadata end rounded up to " +
         num(kKdtrAlign) + ")");
  if (data_offset > size)
    fail("data offset " + num(data_offset) + " is past the end of the file (" + num(size) + " bytes)");
  if (count * kKdtrEntryFixed > table_size)
    fail("tensor table too small: " + num(table_size) + " bytes cannot hold " + num(count) + " entries");

  // count is now <= table_size / 24, and table_size lies inside the file.
  tensors_.reserve(size_t(count));
  uint64_t pos = kKdtrHeaderSize;
  const uint64_t table_end = kKdtrHeaderSize + table_size;
  for (uint64_t i = 0; i < count; ++i) {
    const std::string entry = "tensor #" + num(i);
    if (table_end - pos < kKdtrEntryFixed) fail("tensor table truncated in entry #" + num(i));
    const uint8_t* e = p + pos;
    const uint32_t name_len = load_u32(e);
    const uint8_t code = e[4], ndim = e[5];
    const uint16_t reserved = load_u16(e + 6);
    const uint64_t offset = load_u64(e + 8), nbytes = load_u64(e + 16);
    if (name_len == 0) fail(entry + ": empty name");
    if (name_len > kKdtrMaxNameLen)
      fail(entry + ": name length " + num(name_len) + " exceeds the limit " + num(kKdtrMaxNameLen));
    if (ndim > kKdtrMaxNdim) fail(entry + ": ndim " + num(ndim) + " exceeds the limit " + num(kKdtrMaxNdim));
    if (reserved != 0) fail(entry + ": reserved field is " + num(reserved) + " (must be 0)");
    const uint64_t entry_size = kKdtrEntryFixed + 8 * uint64_t(ndim) + round_up(name_len, 8);
    if (table_end - pos < entry_size) fail("tensor table truncated in entry #" + num(i));
    KdtrTensor t;
    t.shape.resize(ndim);
    for (uint32_t d = 0; d < ndim; ++d) t.shape[d] = int64_t(load_u64(e + kKdtrEntryFixed + 8 * d));
    const uint8_t* name = e + kKdtrEntryFixed + 8 * uint64_t(ndim);
    if (!utf8_valid(name, name_len)) fail(entry + ": name is not valid UTF-8");
    t.name.assign(reinterpret_cast<const char*>(name), name_len);
    if (index_.count(t.name)) fail("duplicate tensor name '" + quote(t.name) + "'");
    index_.emplace(t.name, tensors_.size());
    const std::string tensor = "tensor '" + quote(t.name) + "'";
    if (!kdtr_dtype_valid(code)) fail(tensor + ": unknown dtype code " + num(code));
    t.dtype = KdtrDtype(code);
    for (int64_t d : t.shape)
      if (d < 0) fail(tensor + ": negative dimension in shape " + shape_str(t.shape));
    // NumPy's rule: itemsize * (product of the non-zero dims) must fit in int64, so even an
    // empty tensor cannot carry absurd dimensions.
    uint64_t need = kdtr_dtype_size(t.dtype);
    bool empty = false;
    for (int64_t d : t.shape) {
      if (d == 0) empty = true;
      if (__builtin_mul_overflow(need, uint64_t(d == 0 ? 1 : d), &need) || need > uint64_t(INT64_MAX))
        fail(tensor + ": shape " + shape_str(t.shape) + " overflows a 64-bit byte count");
    }
    if (empty) need = 0;
    if (need != nbytes)
      fail(tensor + ": shape " + shape_str(t.shape) + " of " + kdtr_dtype_name(t.dtype) + " needs " + num(need) +
           " bytes but the table says " + num(nbytes));
    if (offset % kKdtrAlign != 0)
      fail(tensor + ": data offset " + num(offset) + " is not a multiple of " + num(kKdtrAlign));
    if (offset < data_offset || offset > size || nbytes > size - offset)
      fail(tensor + ": " + num(nbytes) + " bytes at offset " + num(offset) + " lie outside the payload area [" +
           num(data_offset) + ", " + num(size) + ")");
    t.offset = offset;
    t.nbytes = nbytes;
    t.data = p + offset;
    tensors_.push_back(std::move(t));
    pos += entry_size;
  }
  if (pos != table_end) fail("tensor table has " + num(table_end - pos) + " unused bytes after the last entry");

  // Overlaps: non-empty payloads sorted by (offset, table index); neighbours must not overlap.
  std::vector<std::pair<uint64_t, size_t>> spans;
  for (size_t i = 0; i < tensors_.size(); ++i)
    if (tensors_[i].nbytes) spans.emplace_back(tensors_[i].offset, i);
  std::sort(spans.begin(), spans.end());
  for (size_t k = 1; k < spans.size(); ++k) {
    const KdtrTensor& a = tensors_[spans[k - 1].second];
    const KdtrTensor& b = tensors_[spans[k].second];
    if (a.offset + a.nbytes > b.offset) fail("tensors '" + quote(a.name) + "' and '" + quote(b.name) + "' overlap");
  }

  for (const KdtrTensor& t : tensors_) {
    if (t.dtype != KdtrDtype::kBool) continue;
    const uint8_t* b = static_cast<const uint8_t*>(t.data);
    for (uint64_t k = 0; k < t.nbytes; ++k)
      if (b[k] > 1)
        fail("tensor '" + quote(t.name) + "': bool value " + num(b[k]) + " at element " + num(k) + " (must be 0 or 1)");
  }

  const uint8_t* meta = p + meta_offset;
  if (!utf8_valid(meta, size_t(meta_size))) fail("metadata is not valid UTF-8");
  std::string problem = JsonSyntax(meta, size_t(meta_size)).check();
  if (!problem.empty()) fail(problem);
  size_t first = 0;  // the top-level value's first byte (valid JSON: exists)
  while (meta[first] == ' ' || meta[first] == '\t' || meta[first] == '\n' || meta[first] == '\r') ++first;
  if (meta[first] != '{') fail(std::string("metadata JSON must be an object, not ") + json_top_type(meta[first]));
  metadata_.assign(reinterpret_cast<const char*>(meta), size_t(meta_size));
}

}  // namespace kdtree
