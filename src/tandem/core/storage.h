// A Storage is one contiguous byte buffer on a device, shared by every tensor that views it.
// Owned storages return their block to the caching allocator; borrowed ones (from_blob) call
// the user's deleter, or nothing.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>

#include "tandem/core/allocator.h"

namespace tandem {

enum class DeviceType : uint8_t { cpu = 0, cuda = 1 };

struct Device {
  DeviceType type = DeviceType::cpu;
  int index = 0;
  bool operator==(const Device&) const = default;
};

inline constexpr Device kCPU{};

class Storage {
 public:
  // Allocates `nbytes` from the CPU caching allocator.
  static std::shared_ptr<Storage> allocate(size_t nbytes);
  // Wraps memory the caller owns; `deleter` (may be empty) runs when the last view dies.
  static std::shared_ptr<Storage> borrow(void* data, size_t nbytes, std::function<void(void*)> deleter);

  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  void* data() const { return data_; }
  size_t nbytes() const { return nbytes_; }
  Device device() const { return device_; }

  // PyTorch's version counter, shared by every view of these bytes (and by detach()): in-place
  // writes bump it, and autograd checks that a tensor saved for backward was not written since.
  uint32_t version() const { return version_.load(std::memory_order_relaxed); }
  void bump_version() { version_.fetch_add(1, std::memory_order_relaxed); }

 private:
  Storage() = default;
  void* data_ = nullptr;
  size_t nbytes_ = 0;
  Device device_{};
  bool owned_ = false;
  std::atomic<uint32_t> version_{0};
  std::function<void(void*)> deleter_;
};

}  // namespace tandem
