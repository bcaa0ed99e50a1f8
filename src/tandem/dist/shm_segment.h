// Shared-memory plumbing of the shm backend: POSIX segments (shm_open + mmap, unlinked once every
// rank mapped them, so they vanish with the last process even after a crash), a first-fit heap
// inside a segment (ProcessGroup::allocate and per-collective scratch), cross-process futex waits,
// and process liveness. Everything here is local to one host.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

namespace tandem::dist::shm {

// One mapped POSIX shared-memory object. Unmapped on destruction (noexcept).
class Segment {
 public:
  // Creates `name` (O_EXCL) of `bytes` (sparse: pages are allocated on first touch) and maps it.
  static std::shared_ptr<Segment> create(const std::string& name, size_t bytes);
  // Maps an existing segment; throws CommError naming it when it does not exist.
  static std::shared_ptr<Segment> open(const std::string& name);
  ~Segment();
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;

  uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& name() const { return name_; }
  // Removes the name (the memory stays while mapped). Idempotent, noexcept.
  void unlink() noexcept;
  // Backs [offset, offset + bytes) with memory now (fallocate), so that a full /dev/shm shows
  // here as ENOSPC instead of as SIGBUS at the first touch of a page. Returns 0 or the errno;
  // 0 also where the file system cannot tell (no fallocate), as before. Created segments only.
  int reserve(size_t offset, size_t bytes) noexcept;

 private:
  Segment() = default;
  int fd_ = -1;  // kept open by create() for reserve()
  std::string name_;
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
  bool linked_ = false;
};

// First-fit allocator over a segment's bytes. Thread-safe. Offsets are relative to the segment.
class Heap {
 public:
  explicit Heap(std::shared_ptr<Segment> seg);
  // An offset of `bytes` (64-byte aligned; 4096 for >= 64 KiB), or nullopt when full: no free
  // range (*error = 0) or no room left in /dev/shm to back it (*error = ENOSPC or another errno
  // of fallocate). Pages are backed as the heap's high-water mark grows.
  std::optional<size_t> allocate(size_t bytes, int* error = nullptr);
  void free(size_t offset) noexcept;
  // Offset of [p, p+bytes) when it lies inside the segment.
  std::optional<size_t> offset_of(const void* p, size_t bytes) const;
  uint8_t* base() const { return seg_->data(); }
  const std::shared_ptr<Segment>& segment() const { return seg_; }

 private:
  std::shared_ptr<Segment> seg_;
  std::mutex mu_;
  std::map<size_t, size_t> free_;  // offset -> length, coalesced
  std::map<size_t, size_t> used_;  // offset -> length
  size_t backed_ = 0;              // [0, backed_) is backed by memory (Segment::reserve)
};

// "/dev/shm has 12.0 MiB free of 64.0 MiB": for errors about shared memory running out.
std::string shm_space_summary();
// What to do about it (a larger /dev/shm, e.g. docker run --shm-size).
extern const char* const kShmSpaceHint;

// Cross-process futex on a 32-bit word in shared memory: sleeps while *word == expected, at most
// `timeout`. Spurious returns are fine (callers re-check).
void futex_wait(std::atomic<uint32_t>* word, uint32_t expected, std::chrono::nanoseconds timeout);
void futex_wake_all(std::atomic<uint32_t>* word);

// Whether process `pid` still runs (a zombie counts as dead).
bool process_alive(pid_t pid);

// Number of CPUs this process may run on.
int online_cpus();

}  // namespace tandem::dist::shm
