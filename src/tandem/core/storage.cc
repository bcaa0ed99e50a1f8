#include "tandem/core/storage.h"

namespace tandem {

std::shared_ptr<Storage> Storage::allocate(size_t nbytes) {
  std::shared_ptr<Storage> s(new Storage);
  s->data_ = cpu_allocator().allocate(nbytes);
  s->nbytes_ = nbytes;
  s->owned_ = true;
  return s;
}

std::shared_ptr<Storage> Storage::borrow(void* data, size_t nbytes, std::function<void(void*)> deleter) {
  std::shared_ptr<Storage> s(new Storage);
  s->data_ = data;
  s->nbytes_ = nbytes;
  s->deleter_ = std::move(deleter);
  return s;
}

Storage::~Storage() {
  if (owned_) {
    cpu_allocator().deallocate(data_, nbytes_);
  } else if (deleter_) {
    try {
      deleter_(data_);
    } catch (...) {
    }
  }
}

}  // namespace tandem
