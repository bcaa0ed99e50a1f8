#include "tandem/core/error.h"

#include <cstdio>

namespace tandem {

int report(const std::exception& e) {
  std::fprintf(stderr, "error: %s\n", e.what());
  std::fflush(stderr);
  if (dynamic_cast<const ValueError*>(&e) != nullptr) return 2;
  if (dynamic_cast<const IOError*>(&e) != nullptr) return 3;
  return 1;
}

}  // namespace tandem
