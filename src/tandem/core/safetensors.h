// safetensors files (the Hugging Face format): named tensors and string metadata, readable by
// Python's `safetensors` and written by it. Tensor-level only; nn/serialize.h builds module
// checkpoints on top. Invariant: a file is only ever read through full validation of its header,
// so a corrupt or hostile file gives IOError, never a crash or an allocation past its own size.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tandem/core/tensor.h"

namespace tandem {

// The format, as read and written here:
//
//   [8 bytes]  N, little-endian u64: the header's length in bytes
//   [N bytes]  UTF-8 JSON object, padded with spaces to a multiple of 8 bytes:
//                {"__metadata__": {"key": "value", ...},               (optional)
//                 "<name>": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}, ...}
//   [rest]     every tensor's raw little-endian row-major bytes; offsets count from the first
//              byte after the header, and the tensors tile [0, rest) with no gap, overlap or
//              trailing byte.
//
// dtype spellings: F32 F64 F16 BF16 I64 I32 U8 BOOL (the other safetensors dtypes, I8, U16, F8_*,
// ..., are recognised and refused with a message saying Tandem has no such dtype).

// The safetensors spelling of a Tandem dtype ("F32", "BF16", "BOOL", ...).
std::string_view safetensors_dtype_name(DType dtype);
// The Tandem dtype spelled `name` in safetensors, or nullopt (unknown, or not a Tandem dtype).
std::optional<DType> safetensors_dtype_from_name(std::string_view name);

// The largest header load_safetensors accepts (the reference implementation's limit too).
inline constexpr uint64_t kSafetensorsMaxHeaderBytes = 100'000'000;

// Writes `tensors` and `metadata` to `path` as a safetensors file.
//  * Atomic: the bytes go to "<path>.tmp.<pid>", which is fsync'ed and then renamed over `path`,
//    so a reader sees the old file or the whole new one, never a torn one; on failure the
//    temporary is removed and `path` is untouched.
//  * Layout: tensors are stored largest element size first (a stable sort, so tensors of one
//    dtype keep the caller's order), which starts every tensor at a multiple of its element size
//    as Python's writer does; the header lists them in that stored order.
//  * Non-contiguous tensors are written as their contiguous copies; a tensor that shares storage
//    with another (tied weights) is written in full under each of its names.
// Blocks until the file is durable. Throws ValueError for an undefined tensor, a duplicate name,
// the reserved name "__metadata__", a non-CPU tensor, or names and metadata that are not valid
// UTF-8 (all checked before anything is written); IOError naming the path and the OS error when
// writing fails. Thread-safe for different paths; concurrent saves to one path from one process
// share the temporary's name and must not overlap.
void save_safetensors(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata = {});

// A loaded file. Tensors own their memory (nothing is mapped), are contiguous, and come in the
// order the header lists them.
struct SafetensorsFile {
  std::vector<std::pair<std::string, Tensor>> tensors;
  std::map<std::string, std::string> metadata;

  // The tensor named `name`; throws ValueError naming it when the file has none.
  const Tensor& at(const std::string& name) const;
  bool contains(const std::string& name) const;
};

// Reads and fully validates the safetensors file at `path`. Throws IOError naming `path` and the
// exact problem: missing or unreadable file; shorter than 8 bytes; header length past the file or
// over kSafetensorsMaxHeaderBytes; header not a JSON object (or not UTF-8); a tensor entry missing
// "dtype", "shape" or "data_offsets", or with a malformed one; unknown dtype; offsets that end
// before they begin, run past the data, disagree with shape x element size, overlap or leave a
// gap; bytes after the last tensor; a BOOL byte other than 0 or 1; duplicate names. Memory used
// is bounded by a small multiple of the file's size.
SafetensorsFile load_safetensors(const std::string& path);

}  // namespace tandem
