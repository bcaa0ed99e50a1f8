#include "tandem/core/dtype.h"

#include "tandem/core/error.h"

namespace tandem {

size_t element_size(DType t) {
  switch (t) {
    case DType::f64: case DType::i64: return 8;
    case DType::f32: case DType::i32: return 4;
    case DType::f16: case DType::bf16: return 2;
    case DType::u8: case DType::b8: return 1;
  }
  throw DTypeError("element_size: unknown dtype");
}

std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "float32";
    case DType::f64: return "float64";
    case DType::f16: return "float16";
    case DType::bf16: return "bfloat16";
    case DType::i64: return "int64";
    case DType::i32: return "int32";
    case DType::u8: return "uint8";
    case DType::b8: return "bool";
  }
  return "unknown";
}

bool is_floating(DType t) {
  return t == DType::f32 || t == DType::f64 || t == DType::f16 || t == DType::bf16;
}

DType promote_types(DType a, DType b) {
  if (a == b) return a;
  const bool fa = is_floating(a), fb = is_floating(b);
  if (fa && !fb) return a;
  if (fb && !fa) return b;
  if (fa && fb) {
    if (a == DType::f64 || b == DType::f64) return DType::f64;
    return DType::f32;  // f32 with a 16-bit float, or f16 with bf16
  }
  // integers and bool: the wider signed type wins
  auto rank = [](DType t) { return t == DType::b8 ? 0 : t == DType::u8 ? 1 : t == DType::i32 ? 2 : 3; };
  return rank(a) >= rank(b) ? a : b;
}

}  // namespace tandem
