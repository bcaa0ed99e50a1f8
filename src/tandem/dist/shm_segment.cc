#include "tandem/dist/shm_segment.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>

#include "tandem/dist/error.h"

namespace tandem::dist::shm {

std::shared_ptr<Segment> Segment::create(const std::string& name, size_t bytes) {
  const int fd = shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  TANDEM_CHECK(fd >= 0, CommError, "shm backend: shm_open({}) failed: {} (is /dev/shm mounted and writable?)",
               name, std::strerror(errno));
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    const int e = errno;
    close(fd);
    shm_unlink(name.c_str());
    throw CommError(fmt::format("shm backend: cannot size segment {} to {} bytes: {}", name, bytes, std::strerror(e)));
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, fd, 0);
  const int e = errno;
  if (p == MAP_FAILED) {
    close(fd);
    shm_unlink(name.c_str());
    throw CommError(fmt::format("shm backend: cannot map segment {} ({} bytes): {}", name, bytes, std::strerror(e)));
  }
  auto s = std::shared_ptr<Segment>(new Segment());
  s->fd_ = fd;
  s->name_ = name;
  s->data_ = static_cast<uint8_t*>(p);
  s->size_ = bytes;
  s->linked_ = true;
  return s;
}

std::shared_ptr<Segment> Segment::open(const std::string& name) {
  const int fd = shm_open(name.c_str(), O_RDWR, 0600);
  TANDEM_CHECK(fd >= 0, CommError,
               "shm backend: cannot open segment {}: {} (the shm backend needs every rank on one host, "
               "sharing /dev/shm; use the mpi backend across hosts or containers)",
               name, std::strerror(errno));
  struct stat st{};
  if (fstat(fd, &st) != 0) {
    const int e = errno;
    close(fd);
    throw CommError(fmt::format("shm backend: fstat of segment {} failed: {}", name, std::strerror(e)));
  }
  const size_t bytes = static_cast<size_t>(st.st_size);
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, fd, 0);
  const int e = errno;
  close(fd);
  TANDEM_CHECK(p != MAP_FAILED, CommError, "shm backend: cannot map segment {} ({} bytes): {}", name, bytes,
               std::strerror(e));
  auto s = std::shared_ptr<Segment>(new Segment());
  s->name_ = name;
  s->data_ = static_cast<uint8_t*>(p);
  s->size_ = bytes;
  return s;
}

Segment::~Segment() {
  unlink();
  if (data_ != nullptr) munmap(data_, size_);
  if (fd_ >= 0) close(fd_);
}

int Segment::reserve(size_t offset, size_t bytes) noexcept {
  if (bytes == 0) return 0;
  if (fd_ < 0) return EBADF;
  int r;
  do {
    r = fallocate(fd_, 0, static_cast<off_t>(offset), static_cast<off_t>(bytes));
  } while (r != 0 && errno == EINTR);
  if (r == 0) return 0;
  return errno == EOPNOTSUPP || errno == ENOSYS ? 0 : errno;
}

std::string shm_space_summary() {
  struct statvfs v{};
  if (statvfs("/dev/shm", &v) != 0) return fmt::format("/dev/shm: statvfs failed: {}", std::strerror(errno));
  const double mib = 1024.0 * 1024.0;
  return fmt::format("/dev/shm has {:.1f} MiB free of {:.1f} MiB",
                     static_cast<double>(v.f_bavail) * static_cast<double>(v.f_frsize) / mib,
                     static_cast<double>(v.f_blocks) * static_cast<double>(v.f_frsize) / mib);
}

const char* const kShmSpaceHint =
    "give /dev/shm more room (in Docker: docker run --shm-size=8g or --ipc=host; elsewhere: "
    "mount -o remount,size=8G /dev/shm), or use the gloo or mpi backend";

void Segment::unlink() noexcept {
  if (linked_) {
    shm_unlink(name_.c_str());
    linked_ = false;
  }
}

// ---- Heap ----

Heap::Heap(std::shared_ptr<Segment> seg) : seg_(std::move(seg)) {
  if (seg_->size() > 0) free_[0] = seg_->size();
}

std::optional<size_t> Heap::allocate(size_t bytes, int* error) {
  const size_t align = bytes >= (64u << 10) ? 4096 : 64;
  const size_t need = (std::max<size_t>(bytes, 1) + 63) / 64 * 64;
  if (error != nullptr) *error = 0;
  std::lock_guard lock(mu_);
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    const size_t start = it->first, len = it->second;
    const size_t aligned = (start + align - 1) / align * align;
    if (aligned + need > start + len) continue;
    if (aligned + need > backed_) {
      // First use of these pages: back them now, while running out is still an error we can
      // report (a later first touch of a page tmpfs has no room for is SIGBUS).
      const size_t end = std::min(seg_->size(), (aligned + need + 4095) / 4096 * 4096);
      if (const int e = seg_->reserve(backed_, end - backed_); e != 0) {
        if (error != nullptr) *error = e;
        return std::nullopt;
      }
      backed_ = end;
    }
    free_.erase(it);
    if (aligned > start) free_[start] = aligned - start;
    if (aligned + need < start + len) free_[aligned + need] = start + len - (aligned + need);
    used_[aligned] = need;
    return aligned;
  }
  return std::nullopt;
}

void Heap::free(size_t offset) noexcept {
  std::lock_guard lock(mu_);
  auto u = used_.find(offset);
  if (u == used_.end()) return;
  size_t start = offset, len = u->second;
  used_.erase(u);
  auto next = free_.lower_bound(start);
  if (next != free_.end() && next->first == start + len) {
    len += next->second;
    next = free_.erase(next);
  }
  if (next != free_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == start) {
      start = prev->first;
      len += prev->second;
      free_.erase(prev);
    }
  }
  free_[start] = len;
}

std::optional<size_t> Heap::offset_of(const void* p, size_t bytes) const {
  const auto* b = static_cast<const uint8_t*>(p);
  if (b < seg_->data() || b + bytes > seg_->data() + seg_->size()) return std::nullopt;
  return static_cast<size_t>(b - seg_->data());
}

// ---- futex, liveness ----

void futex_wait(std::atomic<uint32_t>* word, uint32_t expected, std::chrono::nanoseconds timeout) {
  if (timeout.count() <= 0) return;
  timespec ts{};
  ts.tv_sec = static_cast<time_t>(timeout.count() / 1000000000);
  ts.tv_nsec = static_cast<long>(timeout.count() % 1000000000);
  // Shared (not FUTEX_PRIVATE): the word lives in a segment other processes map.
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void futex_wake_all(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

bool process_alive(pid_t pid) {
  if (pid <= 0) return true;  // unknown: do not call it dead
  if (kill(pid, 0) != 0 && errno == ESRCH) return false;
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%d/stat", static_cast<int>(pid));
  FILE* f = std::fopen(path, "r");
  if (f == nullptr) return errno != ENOENT;
  char buf[512];
  const size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  buf[n] = '\0';
  const char* paren = std::strrchr(buf, ')');
  if (paren == nullptr || paren[1] == '\0') return true;
  const char state = paren[2];
  return state != 'Z' && state != 'X' && state != 'x';
}

int online_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  const long n = sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? static_cast<int>(n) : 1;
}

}  // namespace tandem::dist::shm
