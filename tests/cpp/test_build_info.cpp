// test_build_info.cpp: the host library links and reports what it was built with.
#include "check.h"
#include "common.h"

int main() {
  kdtree::BuildInfo b = kdtree::build_info();
  CHECK(!b.version.empty());
  CHECK(!b.compiler.empty());
  CHECK(!b.cpu_blas.empty());
  std::string why;
  bool ok = kdtree::cuda_available(&why);
  CHECK(ok || !why.empty());
  TEST_MAIN_END();
}
