// test_kdtr.cpp: the C++ KDTR reader on golden files written by Python
// (tests/golden/golden_kdtr.py): every dtype with recomputed values, 0-d / 0-size / many
// tensors, metadata text, the KdtrFile API, and every corrupt file of kdtr_corrupt.tsv rejected
// with its expected message.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <sys/stat.h>
#include <unistd.h>

#include "check.h"
#include "kdtr.h"

using kdtree::KdtrDtype;
using kdtree::KdtrFile;
using kdtree::KdtrTensor;

namespace {

// Runs `fn`; true if it throws kdtree::Error whose message contains `fragment`.
template <class Fn>
bool throws_with(Fn fn, const std::string& fragment, std::string* got = nullptr) {
  try {
    fn();
  } catch (const kdtree::Error& e) {
    if (got) *got = e.what();
    return std::string(e.what()).find(fragment) != std::string::npos;
  } catch (const std::exception& e) {
    if (got) *got = std::string("(not kdtree::Error) ") + e.what();
    return false;
  }
  if (got) *got = "(no exception)";
  return false;
}

bool same_bits(float a, float b) { return std::memcmp(&a, &b, 4) == 0; }

void test_helpers() {
  CHECK(kdtree::kdtr_crc32(0, "123456789", 9) == 0xCBF43926u);
  CHECK(kdtree::kdtr_crc32(0, "", 0) == 0u);
  // Incremental == one shot, across the 8-byte blocks of slicing-by-8.
  std::string s(1000, '\0');
  for (size_t i = 0; i < s.size(); ++i) s[i] = char((i * 131 + 7) & 0xff);
  uint32_t whole = kdtree::kdtr_crc32(0, s.data(), s.size());
  uint32_t part = kdtree::kdtr_crc32(kdtree::kdtr_crc32(0, s.data(), 13), s.data() + 13, s.size() - 13);
  CHECK(whole == part);

  CHECK(kdtree::kdtr_f16_to_f32(0x3C00) == 1.0f);
  CHECK(kdtree::kdtr_f16_to_f32(0xC100) == -2.5f);
  CHECK(kdtree::kdtr_f16_to_f32(0x7BFF) == 65504.0f);
  CHECK(kdtree::kdtr_f16_to_f32(0x0001) == std::ldexp(1.0f, -24));
  CHECK(kdtree::kdtr_f16_to_f32(0x7C00) == std::numeric_limits<float>::infinity());
  CHECK(std::isnan(kdtree::kdtr_f16_to_f32(0x7E00)));
  CHECK(same_bits(kdtree::kdtr_f16_to_f32(0x8000), -0.0f));
  CHECK(kdtree::kdtr_bf16_to_f32(0x3F80) == 1.0f);
  CHECK(kdtree::kdtr_bf16_to_f32(0xC049) == -3.140625f);

  for (int c = 0; c < 256; ++c) {
    bool valid = kdtree::kdtr_dtype_valid(uint8_t(c));
    CHECK(valid == (c >= 1 && c <= 13));
    if (valid) CHECK(kdtree::kdtr_dtype_size(KdtrDtype(c)) >= 1);
  }
  CHECK(std::string(kdtree::kdtr_dtype_name(KdtrDtype::kBf16)) == "bf16");
}

void test_all_dtypes() {
  KdtrFile f = KdtrFile::open(kdtest::golden_path("kdtr_golden_all.kdtr"));
  CHECK(f.tensors().size() == 18);
  CHECK(f.metadata_json() ==
        u8"{\"name\":\"golden_kdtr\",\"count\":3,\"pi\":3.25,\"nested\":{\"list\":[1,2,null,true,false]},"
        u8"\"text\":\"h\u00e9llo \u2713\"}");
  for (const KdtrTensor& t : f.tensors()) {
    CHECK(t.offset % 64 == 0);
    CHECK(reinterpret_cast<uintptr_t>(t.data) % 64 == 0);
    CHECK(t.nbytes == uint64_t(t.numel()) * kdtree::kdtr_dtype_size(t.dtype));
    CHECK(f.find(t.name) == &t);
  }

  const KdtrTensor& f32 = f.at("f32");
  CHECK(f32.dtype == KdtrDtype::kF32);
  CHECK((f32.shape == std::vector<int64_t>{2, 3, 4}));
  CHECK(f32.numel() == 24);
  for (int i = 0; i < 24; ++i) CHECK(f32.as<float>()[i] == (float(i) - 7.0f) * 0.25f);

  const std::vector<float> f16_expect = {0.0f, 1.0f, -2.5f, 65504.0f, std::ldexp(1.0f, -14), std::ldexp(1.0f, -24),
                                         INFINITY, -INFINITY, NAN, -0.0f};
  const KdtrTensor& f16 = f.at("f16");
  CHECK(f16.dtype == KdtrDtype::kF16);
  std::vector<float> f16v = f16.to_f32();
  CHECK(f16v.size() == f16_expect.size());
  for (size_t i = 0; i < f16v.size() && i < f16_expect.size(); ++i)
    CHECK(std::isnan(f16_expect[i]) ? std::isnan(f16v[i]) : same_bits(f16v[i], f16_expect[i]));

  const uint16_t bf16_bits[] = {0x3F80, 0xC049, 0x3F00, 0x4780, 0x3F80, 0x3F82, 0x7F80};
  const KdtrTensor& bf16 = f.at("bf16");
  CHECK(bf16.dtype == KdtrDtype::kBf16);
  CHECK(bf16.numel() == 7);
  for (int i = 0; i < 7; ++i) CHECK(bf16.as<uint16_t>()[i] == bf16_bits[i]);
  CHECK(bf16.to_f32()[1] == -3.140625f);

  const KdtrTensor& f64 = f.at("f64");
  for (int i = 0; i < 7; ++i) CHECK(f64.as<double>()[i] == double(i) / 3.0);
  const KdtrTensor& i8 = f.at("i8");
  for (int i = 0; i < 256; ++i) CHECK(i8.as<int8_t>()[i] == int8_t(i - 128));
  const KdtrTensor& u8 = f.at("u8");
  for (int i = 0; i < 256; ++i) CHECK(u8.as<uint8_t>()[i] == uint8_t(i));
  const int16_t* i16 = f.at("i16").as<int16_t>();
  CHECK(i16[0] == INT16_MIN && i16[1] == 0 && i16[2] == INT16_MAX);
  const KdtrTensor& i32 = f.at("i32");
  CHECK((i32.shape == std::vector<int64_t>{2, 2}));
  CHECK(i32.as<int32_t>()[0] == INT32_MIN && i32.as<int32_t>()[1] == -1 && i32.as<int32_t>()[2] == 0 &&
        i32.as<int32_t>()[3] == INT32_MAX);
  const int64_t* i64 = f.at("i64").as<int64_t>();
  CHECK(i64[0] == INT64_MIN && i64[1] == 0 && i64[2] == INT64_MAX);
  const bool* b = f.at("bool").as<bool>();
  for (int i = 0; i < 7; ++i) CHECK(b[i] == (i % 3 == 0));
  CHECK(f.at("u16").as<uint16_t>()[1] == 65535);
  CHECK(f.at("u32").as<uint32_t>()[1] == 4294967295u);
  CHECK(f.at("u64").as<uint64_t>()[1] == UINT64_MAX);

  const KdtrTensor& scalar = f.at("scalar_f32");
  CHECK(scalar.shape.empty());
  CHECK(scalar.numel() == 1);
  CHECK(*scalar.as<float>() == 42.5f);
  const KdtrTensor& e1 = f.at("empty_f32");
  CHECK((e1.shape == std::vector<int64_t>{0}) && e1.numel() == 0 && e1.nbytes == 0);
  CHECK(e1.to_f32().empty());
  const KdtrTensor& e3 = f.at("empty_3d_i64");
  CHECK((e3.shape == std::vector<int64_t>{3, 0, 2}) && e3.numel() == 0 && e3.dtype == KdtrDtype::kI64);

  const KdtrTensor& big = f.at("big_f32");
  CHECK((big.shape == std::vector<int64_t>{257, 63}));
  const float* bp = big.as<float>();
  bool big_ok = true;
  for (int64_t i = 0; i < big.numel(); ++i) big_ok = big_ok && bp[i] == float(i % 1000) * 0.5f;
  CHECK(big_ok);
  const KdtrTensor& uni = f.at(u8"unicode/\u00f1ame\u2713");
  CHECK(uni.as<uint8_t>()[0] == 7);

  // API: lookups and dtype checks name what is wrong.
  CHECK(f.find("missing") == nullptr);
  CHECK(throws_with([&] { f.at("no_such_tensor"); }, "no tensor named 'no_such_tensor'"));
  CHECK(throws_with([&] { f32.as<double>(); }, "tensor 'f32' has dtype f32, which cannot be viewed as double"));
  CHECK(throws_with([&] { f.at("bool").as<uint8_t>(); }, "'bool' has dtype bool"));
  CHECK(throws_with([&] { f.at("u16").as<int16_t>(); }, "u16"));
  CHECK(f.at("f16").as<uint16_t>()[1] == 0x3C00);

  // Move-only: moving keeps the mapping and the views valid.
  const float* before = f32.as<float>();
  KdtrFile g = std::move(f);
  CHECK(g.at("f32").as<float>() == before);
  CHECK(g.at("f32").as<float>()[23] == 4.0f);
  KdtrFile h = KdtrFile::open(kdtest::golden_path("kdtr_golden_empty.kdtr"));
  h = std::move(g);
  CHECK(h.tensors().size() == 18);
  CHECK(h.at("i8").as<int8_t>()[0] == -128);
}

void test_many_and_empty() {
  KdtrFile f = KdtrFile::open(kdtest::golden_path("kdtr_golden_many.kdtr"), /*verify_checksum=*/false);
  CHECK(f.tensors().size() == 300);
  CHECK(f.metadata_json() == "{\"n\":300}");
  for (int i = 0; i < 300; ++i) {
    char name[16];
    std::snprintf(name, sizeof name, "t/%03d", i);
    const KdtrTensor& t = f.tensors()[size_t(i)];
    CHECK(t.name == name);
    CHECK(t.dtype == KdtrDtype::kI32);
    CHECK((t.shape == std::vector<int64_t>{i % 5}));
    for (int k = 0; k < i % 5; ++k) CHECK(t.as<int32_t>()[k] == i * 100 + k);
  }
  KdtrFile e = KdtrFile::open(kdtest::golden_path("kdtr_golden_empty.kdtr"));
  CHECK(e.tensors().empty());
  CHECK(e.metadata_json() == "{}");
  CHECK(e.file_size() == 128);
}

void test_corrupt() {
  std::ifstream manifest(kdtest::golden_path("kdtr_corrupt.tsv"));
  CHECK(manifest.good());
  std::string line;
  std::set<std::string> seen;
  while (std::getline(manifest, line)) {
    size_t tab = line.find('\t');
    if (tab == std::string::npos) continue;
    std::string name = line.substr(0, tab), expected = line.substr(tab + 1);
    std::string path = kdtest::golden_path("kdtr_corrupt_" + name + ".kdtr"), got;
    bool ok = throws_with([&] { KdtrFile::open(path); }, expected, &got);
    if (!ok) std::fprintf(stderr, "corrupt case %s: expected \"%s\", got \"%s\"\n", name.c_str(), expected.c_str(), got.c_str());
    CHECK(ok);
    // Every message starts with the path it is about.
    CHECK(got.rfind(path + ": ", 0) == 0);
    seen.insert(name);
  }
  std::printf("%zu corrupt files rejected\n", seen.size());
  CHECK(seen.size() >= 40);
  for (const char* must : {"empty_file", "truncated_payload", "bad_magic", "bad_version", "checksum_payload",
                           "terabyte_file_size", "terabyte_table", "terabyte_tensor", "offset_outside", "overlap",
                           "misaligned_offset", "shape_mismatch", "shape_overflow", "negative_dim", "duplicate_name",
                           "metadata_bad_utf8", "metadata_bad_json", "bad_bool"})
    CHECK(seen.count(must) == 1);

  // Without the checksum a flipped payload byte loads (only the CRC can see it); structure is
  // still checked.
  KdtrFile f = KdtrFile::open(kdtest::golden_path("kdtr_corrupt_checksum_payload.kdtr"), false);
  CHECK(f.at("a").numel() == 16);
  CHECK(throws_with([] { KdtrFile::open(kdtest::golden_path("kdtr_corrupt_overlap.kdtr"), false); }, "overlap"));

  CHECK(throws_with([] { KdtrFile::open(kdtest::golden_path("does_not_exist.kdtr")); }, "cannot open"));
  CHECK(throws_with([] { KdtrFile::open(kdtest::golden_path("")); }, "not a regular file"));
}

// Paths that are not a readable regular file: a FIFO is refused without waiting for a writer (the
// open used to block forever; SIGALRM ends the test if it ever does again), a NUL inside the path
// is refused instead of opening the path cut short at it.
void test_special_paths() {
  char dir[] = "/tmp/kdtr_test_XXXXXX";
  CHECK(mkdtemp(dir) != nullptr);
  const std::string fifo = std::string(dir) + "/fifo.kdtr";
  CHECK(mkfifo(fifo.c_str(), 0600) == 0);
  alarm(60);
  std::string got;
  CHECK(throws_with([&] { KdtrFile::open(fifo); }, fifo + ": not a regular file", &got));
  alarm(0);
  ::unlink(fifo.c_str());
  ::rmdir(dir);
  const std::string good = kdtest::golden_path("kdtr_golden_all.kdtr");
  CHECK(KdtrFile::open(good).tensors().size() > 0);
  const std::string with_nul = good + std::string("\0.bak", 5);
  CHECK(throws_with([&] { KdtrFile::open(with_nul); }, "embedded null byte", &got));
}

}  // namespace

int main() {
  try {
    test_helpers();
    test_all_dtypes();
    test_many_and_empty();
    test_corrupt();
    test_special_paths();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "unexpected exception: %s\n", e.what());
    return 1;
  }
  TEST_MAIN_END();
}
