// The caching CPU allocator: byte accounting, peak tracking, alignment, reuse of cached blocks.
#include <cstdint>
#include <vector>

#include "util/test_util.h"

namespace td = tandem;
using td::Tensor;

TEST(Allocator, RoundSize) {
  using A = td::CpuAllocator;
  EXPECT_EQ(A::round_size(0), 64u);
  EXPECT_EQ(A::round_size(1), 64u);
  EXPECT_EQ(A::round_size(64), 64u);
  EXPECT_EQ(A::round_size(65), 128u);
  EXPECT_EQ(A::round_size(4096), 4096u);
  EXPECT_EQ(A::round_size(4097), 5120u);
  EXPECT_EQ(A::round_size(8193), 10240u);
  for (size_t n = 1; n < (1u << 22); n = n * 5 / 4 + 3) {
    const size_t r = A::round_size(n);
    EXPECT_GE(r, n);
    EXPECT_EQ(r % 64, 0u) << n;
    if (n > 4096) EXPECT_LE(static_cast<double>(r), 1.25 * static_cast<double>(n)) << n;  // <= 25% waste
  }
}

TEST(Allocator, CurrentAndPeakBytesFollowTensors) {
  const int64_t base = td::current_allocated_bytes();
  const int64_t sz = static_cast<int64_t>(td::CpuAllocator::round_size(1000 * 4));
  td::reset_peak_allocated_bytes();
  EXPECT_EQ(td::peak_allocated_bytes(), base);
  {
    Tensor a = td::empty({1000}, td::kFloat32);
    EXPECT_EQ(td::current_allocated_bytes(), base + sz);
    {
      Tensor b = td::empty({1000}, td::kFloat32);
      Tensor view = b.view({10, 100});  // a view allocates nothing
      EXPECT_EQ(td::current_allocated_bytes(), base + 2 * sz);
    }
    EXPECT_EQ(td::current_allocated_bytes(), base + sz);
    EXPECT_EQ(td::peak_allocated_bytes(), base + 2 * sz);
  }
  EXPECT_EQ(td::current_allocated_bytes(), base);
  EXPECT_EQ(td::peak_allocated_bytes(), base + 2 * sz);  // the peak stays until reset
  td::reset_peak_allocated_bytes();
  EXPECT_EQ(td::peak_allocated_bytes(), base);
}

TEST(Allocator, BlocksAre64ByteAligned) {
  std::vector<Tensor> keep;
  for (int64_t n : {0, 1, 3, 17, 63, 64, 65, 1000, 4097, 100003}) {
    for (td::DType dt : {td::kUInt8, td::kBFloat16, td::kFloat32, td::kFloat64}) {
      keep.push_back(td::empty({n}, dt));
      EXPECT_EQ(reinterpret_cast<uintptr_t>(keep.back().data_ptr()) % 64, 0u) << n;
    }
  }
  td::CpuAllocator& a = td::cpu_allocator();
  void* p0 = a.allocate(0);
  void* p1 = a.allocate(0);
  EXPECT_NE(p0, nullptr);
  EXPECT_NE(p0, p1);  // size 0 still gives unique pointers
  EXPECT_EQ(reinterpret_cast<uintptr_t>(p0) % 64, 0u);
  a.deallocate(p0, 0);
  a.deallocate(p1, 0);
}

TEST(Allocator, FreedBlocksAreReusedWithoutSystemCalls) {
  td::CpuAllocator& a = td::cpu_allocator();
  const size_t n = 123457;  // an unusual size class
  void* p = a.allocate(n);
  const td::AllocatorStats before = a.stats();
  a.deallocate(p, n);
  const td::AllocatorStats freed = a.stats();
  EXPECT_EQ(freed.current_bytes, before.current_bytes - static_cast<int64_t>(td::CpuAllocator::round_size(n)));
  EXPECT_EQ(freed.cached_bytes, before.cached_bytes + static_cast<int64_t>(td::CpuAllocator::round_size(n)));
  // Same size class (a slightly different request rounds to the same class): the cached block.
  void* q = a.allocate(n - 10);
  const td::AllocatorStats again = a.stats();
  EXPECT_EQ(q, p);
  EXPECT_EQ(again.num_system_allocs, before.num_system_allocs);
  EXPECT_EQ(again.num_allocs, before.num_allocs + 1);
  EXPECT_EQ(again.cached_bytes, freed.cached_bytes - static_cast<int64_t>(td::CpuAllocator::round_size(n)));
  a.deallocate(q, n - 10);

  // Through tensors: a freed tensor's block serves the next tensor of that size.
  const void* first;
  {
    Tensor t = td::empty({7777}, td::kFloat64);
    first = t.data_ptr();
  }
  Tensor u = td::empty({7777}, td::kFloat64);
  EXPECT_EQ(u.data_ptr(), first);

  a.empty_cache();
  EXPECT_EQ(a.stats().cached_bytes, 0);
  const int64_t sys = a.stats().num_system_allocs;
  void* r = a.allocate(n);
  EXPECT_EQ(a.stats().num_system_allocs, sys + 1);  // the cache was emptied
  a.deallocate(r, n);
}
