// Work's completion protocol and ProcessGroup's defaults (unsupported ops, plain allocation).
#include "tandem/dist/process_group.h"

#include <cstdlib>

#include <fmt/ranges.h>

namespace tandem::dist {

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::SUM: return "SUM";
    case ReduceOp::AVG: return "AVG";
    case ReduceOp::MAX: return "MAX";
    case ReduceOp::MIN: return "MIN";
    case ReduceOp::PRODUCT: return "PRODUCT";
  }
  return "?";
}

Buffer as_buffer(const Tensor& t) {
  TANDEM_CHECK(t.defined(), ValueError, "collective on an undefined tensor");
  TANDEM_CHECK(t.is_contiguous(), ValueError,
               "collectives need a contiguous tensor, got shape {} with strides {}; call .contiguous() first",
               fmt::join(t.shape(), "x"), fmt::join(t.strides(), ","));
  return Buffer{t.data_ptr(), t.numel(), t.dtype(), t.device()};
}

// ---- Work ----

Work::Work(std::string description) : described_(!description.empty()), description_(std::move(description)) {}

const std::string& Work::description() const {
  if (!described_.load(std::memory_order_acquire)) {
    std::lock_guard lock(mu_);
    if (!described_.load(std::memory_order_relaxed)) {
      description_ = describe();
      described_.store(true, std::memory_order_release);
    }
  }
  return description_;
}

// (A backend's default is its group timeout plus a margin: kept within what wait() accepts.)
void Work::wait() { wait(std::min(default_wait_, detail::kMaxTimeout)); }

void Work::wait(std::chrono::milliseconds timeout) {
  // (0 polls: a completed work returns, another times out at once.)
  if (timeout.count() > 0) detail::check_timeout(timeout, "Work::wait");
  // Completed already (the common case for small collectives run on the caller's thread): no
  // lock, no clock.
  if (!done_.load(std::memory_order_acquire)) {
    std::unique_lock lock(mu_);
    if (!cv_.wait_for(lock, timeout, [&] { return done_.load(std::memory_order_relaxed); })) {
      lock.unlock();
      const std::string& what = description();
      throw Timeout(fmt::format("{}: Work::wait timed out after {} ms; the collective has not finished "
                                "(are all ranks issuing the same collectives?)",
                                what.empty() ? "collective" : what, timeout.count()));
    }
  }
  if (error_) std::rethrow_exception(error_);
}

void Work::finish(std::exception_ptr error) {
  {
    std::lock_guard lock(mu_);
    if (done_.load(std::memory_order_relaxed)) return;
    error_ = std::move(error);
    done_.store(true, std::memory_order_release);
  }
  cv_.notify_all();
}

std::shared_ptr<Work> Work::completed(std::string description) {
  auto w = std::make_shared<Work>(std::move(description));
  w->finish();
  return w;
}

std::shared_ptr<Work> Work::failed(std::exception_ptr error, std::string description) {
  auto w = std::make_shared<Work>(std::move(description));
  w->finish(std::move(error));
  return w;
}

// ---- ProcessGroup defaults ----

ProcessGroup::ProcessGroup(int rank, int size, ProcessGroupOptions options)
    : rank_(rank), size_(size), options_(options) {
  TANDEM_CHECK(size >= 1, ValueError, "process group size must be >= 1, got {}", size);
  TANDEM_CHECK(rank >= 0 && rank < size, ValueError, "rank {} is outside the group of size {}", rank, size);
  detail::check_timeout(options.timeout, "process group");
}

void ProcessGroup::unsupported(const char* op) const {
  throw ValueError(fmt::format("backend '{}' does not support {}", backend_name(), op));
}

std::shared_ptr<Work> ProcessGroup::all_reduce(Buffer, ReduceOp) { unsupported("all_reduce"); }
std::shared_ptr<Work> ProcessGroup::broadcast(Buffer, int) { unsupported("broadcast"); }
std::shared_ptr<Work> ProcessGroup::reduce(Buffer, int, ReduceOp) { unsupported("reduce"); }
std::shared_ptr<Work> ProcessGroup::all_gather(Buffer, Buffer) { unsupported("all_gather"); }
std::shared_ptr<Work> ProcessGroup::all_gather(std::vector<Buffer>, Buffer) { unsupported("all_gather (list)"); }
std::shared_ptr<Work> ProcessGroup::reduce_scatter(Buffer, Buffer, ReduceOp) { unsupported("reduce_scatter"); }
std::shared_ptr<Work> ProcessGroup::gather(Buffer, Buffer, int) { unsupported("gather"); }
std::shared_ptr<Work> ProcessGroup::scatter(Buffer, Buffer, int) { unsupported("scatter"); }
std::shared_ptr<Work> ProcessGroup::all_to_all(Buffer, Buffer) { unsupported("all_to_all"); }
std::shared_ptr<Work> ProcessGroup::barrier() { unsupported("barrier"); }
std::shared_ptr<Work> ProcessGroup::send(Buffer, int, int) { unsupported("send"); }
std::shared_ptr<Work> ProcessGroup::recv(Buffer, int, int) { unsupported("recv"); }

std::shared_ptr<void> ProcessGroup::allocate(size_t bytes) {
  size_t rounded = (bytes + 63) / 64 * 64;
  void* p = std::aligned_alloc(64, rounded == 0 ? 64 : rounded);
  TANDEM_CHECK(p != nullptr, ValueError, "allocate({} bytes) failed: out of memory", bytes);
  return std::shared_ptr<void>(p, [](void* q) { std::free(q); });
}

std::shared_ptr<Work> ProcessGroup::all_reduce(const Tensor& t, ReduceOp op) { return all_reduce(as_buffer(t), op); }
std::shared_ptr<Work> ProcessGroup::broadcast(const Tensor& t, int root) { return broadcast(as_buffer(t), root); }

}  // namespace tandem::dist
