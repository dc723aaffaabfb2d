// check.h: a minimal test harness for the C++ tests (no framework dependency).
// CHECK(cond) records a failure and continues; main() returns failures() != 0.
#pragma once
#include <cstdio>
#include <cstdlib>
#include <string>

namespace kdtest {
inline int& failures() { static int n = 0; return n; }
inline int& checks() { static int n = 0; return n; }
inline std::string golden_path(const std::string& name) {
  const char* d = std::getenv("KDTREE_GOLDEN_DIR");
  return std::string(d ? d : "golden") + "/" + name;
}
}  // namespace kdtest

#define CHECK(cond)                                                                  \
  do {                                                                               \
    ++kdtest::checks();                                                              \
    if (!(cond)) {                                                                   \
      ++kdtest::failures();                                                          \
      std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
    }                                                                                \
  } while (0)

#define CHECK_THROWS(stmt)                                                           \
  do {                                                                               \
    ++kdtest::checks();                                                              \
    bool thrown_ = false;                                                            \
    try { stmt; } catch (const std::exception&) { thrown_ = true; }                  \
    if (!thrown_) {                                                                  \
      ++kdtest::failures();                                                          \
      std::fprintf(stderr, "%s:%d: expected an exception: %s\n", __FILE__, __LINE__, #stmt); \
    }                                                                                \
  } while (0)

#define TEST_MAIN_END()                                                              \
  std::printf("%d checks, %d failures\n", kdtest::checks(), kdtest::failures());     \
  return kdtest::failures() == 0 ? 0 : 1
