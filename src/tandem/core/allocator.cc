#include "tandem/core/allocator.h"

#include <cstdlib>
#include <map>
#include <mutex>
#include <vector>

#include "tandem/core/error.h"

namespace tandem {
namespace {

constexpr size_t kAlign = 64;

struct State {
  mutable std::mutex mu;
  std::map<size_t, std::vector<void*>> free_lists;  // size class -> cached blocks
  AllocatorStats stats;
};

State& state() {
  static State* s = new State;  // leaked on purpose: storages may be freed during static teardown
  return *s;
}

}  // namespace

size_t CpuAllocator::round_size(size_t nbytes) {
  if (nbytes <= 4096) return ((nbytes + kAlign - 1) / kAlign) * kAlign + (nbytes == 0 ? kAlign : 0);
  // Four classes per power of two above 4 KiB: at most 25% waste, few distinct classes.
  // Past 2^62 bytes no class exists (p * 2 would wrap and the loop never end): a request that
  // size cannot be met anyway.
  TANDEM_CHECK(nbytes <= (size_t{1} << 62), Error, "CPU allocator: out of memory allocating {} bytes", nbytes);
  size_t p = 4096;
  while (p * 2 < nbytes) p *= 2;
  const size_t step = p / 4;
  return ((nbytes + step - 1) / step) * step;
}

void* CpuAllocator::allocate(size_t nbytes) {
  const size_t size = round_size(nbytes);
  State& s = state();
  {
    std::lock_guard<std::mutex> lock(s.mu);
    s.stats.num_allocs++;
    auto it = s.free_lists.find(size);
    if (it != s.free_lists.end() && !it->second.empty()) {
      void* p = it->second.back();
      it->second.pop_back();
      s.stats.cached_bytes -= static_cast<int64_t>(size);
      s.stats.current_bytes += static_cast<int64_t>(size);
      if (s.stats.current_bytes > s.stats.peak_bytes) s.stats.peak_bytes = s.stats.current_bytes;
      return p;
    }
  }
  void* p = std::aligned_alloc(kAlign, size);
  if (p == nullptr) {
    empty_cache();
    p = std::aligned_alloc(kAlign, size);
  }
  TANDEM_CHECK(p != nullptr, Error, "CPU allocator: out of memory allocating {} bytes ({} in use)", size,
               stats().current_bytes);
  std::lock_guard<std::mutex> lock(s.mu);
  s.stats.num_system_allocs++;
  s.stats.current_bytes += static_cast<int64_t>(size);
  if (s.stats.current_bytes > s.stats.peak_bytes) s.stats.peak_bytes = s.stats.current_bytes;
  return p;
}

void CpuAllocator::deallocate(void* ptr, size_t nbytes) noexcept {
  if (ptr == nullptr) return;
  const size_t size = round_size(nbytes);
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.stats.current_bytes -= static_cast<int64_t>(size);
  s.stats.cached_bytes += static_cast<int64_t>(size);
  try {
    s.free_lists[size].push_back(ptr);
  } catch (...) {
    s.stats.cached_bytes -= static_cast<int64_t>(size);
    std::free(ptr);
  }
}

AllocatorStats CpuAllocator::stats() const {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.stats;
}

void CpuAllocator::reset_peak() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.stats.peak_bytes = s.stats.current_bytes;
}

void CpuAllocator::empty_cache() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  for (auto& [size, blocks] : s.free_lists) {
    for (void* p : blocks) std::free(p);
    blocks.clear();
  }
  s.free_lists.clear();
  s.stats.cached_bytes = 0;
}

CpuAllocator& cpu_allocator() {
  static CpuAllocator* a = new CpuAllocator;
  return *a;
}

}  // namespace tandem
