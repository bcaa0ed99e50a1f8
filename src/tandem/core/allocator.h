// The CPU caching allocator. Blocks are 64-byte aligned and rounded up to a size class; a freed
// block goes back to a free list of its class and is handed out again without a system call.
// Invariant: current_bytes() counts the size-class bytes of blocks held by live storages.
#pragma once

#include <cstddef>
#include <cstdint>

namespace tandem {

struct AllocatorStats {
  int64_t current_bytes = 0;  // in use by tensors now
  int64_t peak_bytes = 0;     // highest current_bytes since start or reset_peak()
  int64_t cached_bytes = 0;   // held in free lists, ready for reuse
  int64_t num_allocs = 0;     // allocate() calls
  int64_t num_system_allocs = 0;  // of which went to the system (cache misses)
};

class CpuAllocator {
 public:
  // Thread-safe. Returns a 64-byte-aligned block of at least `nbytes` (nbytes 0 gives a valid
  // unique pointer). Throws Error when the system is out of memory.
  void* allocate(size_t nbytes);
  // Thread-safe. `nbytes` must be the value passed to allocate().
  void deallocate(void* ptr, size_t nbytes) noexcept;
  AllocatorStats stats() const;
  void reset_peak();
  // Returns every cached block to the system.
  void empty_cache();
  // The size class a request is rounded to.
  static size_t round_size(size_t nbytes);
};

// The process-wide CPU allocator (never destroyed, so storages freed at exit stay valid).
CpuAllocator& cpu_allocator();

// Shorthands on cpu_allocator().
inline int64_t current_allocated_bytes() { return cpu_allocator().stats().current_bytes; }
inline int64_t peak_allocated_bytes() { return cpu_allocator().stats().peak_bytes; }
inline void reset_peak_allocated_bytes() { cpu_allocator().reset_peak(); }

}  // namespace tandem
