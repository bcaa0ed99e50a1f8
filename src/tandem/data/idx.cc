#include "tandem/data/idx.h"

#include <zlib.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <vector>

namespace tandem::data {
namespace {

// Reads the whole (possibly gzip'd) file; gzread passes plain files through unchanged.
std::vector<unsigned char> slurp(const std::string& path) {
  TANDEM_CHECK(std::filesystem::exists(path), IOError, "{}: no such file", path);
  gzFile f = gzopen(path.c_str(), "rb");
  TANDEM_CHECK(f != nullptr, IOError, "{}: cannot open: {}", path, std::strerror(errno));
  std::unique_ptr<gzFile_s, int (*)(gzFile)> guard(f, gzclose);
  std::vector<unsigned char> out;
  unsigned char buf[1 << 16];
  for (;;) {
    const int n = gzread(f, buf, sizeof(buf));
    if (n < 0) {
      int code = 0;
      const char* msg = gzerror(f, &code);
      throw IOError(fmt::format("{}: corrupt gzip data after {} bytes: {}", path, out.size(), msg));
    }
    if (n == 0) break;
    out.insert(out.end(), buf, buf + n);
  }
  return out;
}

uint32_t be32(const unsigned char* p) {
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | uint32_t{p[3]};
}

}  // namespace

Tensor read_idx(const std::string& path) {
  const std::vector<unsigned char> bytes = slurp(path);
  TANDEM_CHECK(bytes.size() >= 4, IOError, "{}: truncated: {} bytes, an IDX header needs at least 4", path, bytes.size());
  TANDEM_CHECK(bytes[0] == 0 && bytes[1] == 0, IOError,
               "{}: not an IDX file (magic starts with {:#04x} {:#04x}, expected 0x00 0x00)", path, bytes[0], bytes[1]);
  const unsigned type = bytes[2], ndim = bytes[3];
  TANDEM_CHECK(ndim >= 1 && ndim <= 8, IOError, "{}: IDX header gives {} dimensions (expected 1..8)", path, ndim);
  size_t esize;
  DType dtype;
  switch (type) {
    case 0x08: esize = 1; dtype = kUInt8; break;
    case 0x09: esize = 1; dtype = kInt32; break;
    case 0x0B: esize = 2; dtype = kInt32; break;
    case 0x0C: esize = 4; dtype = kInt32; break;
    case 0x0D: esize = 4; dtype = kFloat32; break;
    case 0x0E: esize = 8; dtype = kFloat64; break;
    default: throw IOError(fmt::format("{}: unknown IDX element type {:#04x}", path, type));
  }
  const size_t header = 4 + 4 * static_cast<size_t>(ndim);
  TANDEM_CHECK(bytes.size() >= header, IOError, "{}: truncated header: {} bytes, {} dims need {}", path, bytes.size(),
               ndim, header);
  Shape shape;
  size_t count = 1;
  bool overflow = false;  // dims of up to 2^32 each: the product can wrap around, even to 0
  for (unsigned d = 0; d < ndim; ++d) {
    const uint32_t s = be32(&bytes[4 + 4 * d]);
    shape.push_back(s);
    overflow |= __builtin_mul_overflow(count, size_t{s}, &count);
  }
  size_t data_bytes = 0;
  overflow |= __builtin_mul_overflow(count, esize, &data_bytes) || data_bytes > (size_t{1} << 62);
  TANDEM_CHECK(!overflow, IOError, "{}: truncated: shape {} needs more than 2^62 bytes of data, the file has {}", path,
               shape_str(shape), bytes.size() - header);
  const size_t expected = header + data_bytes;
  TANDEM_CHECK(bytes.size() >= expected, IOError, "{}: truncated: shape {} needs {} bytes of data, the file has {}", path,
               shape_str(shape), count * esize, bytes.size() - header);
  TANDEM_CHECK(bytes.size() == expected, IOError, "{}: {} unexpected bytes after the data of shape {}", path,
               bytes.size() - expected, shape_str(shape));
  Tensor t = empty(shape, dtype);
  const unsigned char* src = bytes.data() + header;
  for (size_t i = 0; i < count; ++i) {
    const unsigned char* e = src + i * esize;
    switch (type) {
      case 0x08: static_cast<uint8_t*>(t.data_ptr())[i] = e[0]; break;
      case 0x09: static_cast<int32_t*>(t.data_ptr())[i] = static_cast<int8_t>(e[0]); break;
      case 0x0B: static_cast<int32_t*>(t.data_ptr())[i] = static_cast<int16_t>((e[0] << 8) | e[1]); break;
      case 0x0C: static_cast<int32_t*>(t.data_ptr())[i] = static_cast<int32_t>(be32(e)); break;
      case 0x0D: {
        const uint32_t u = be32(e);
        std::memcpy(static_cast<float*>(t.data_ptr()) + i, &u, 4);
        break;
      }
      case 0x0E: {
        uint64_t u = (uint64_t{be32(e)} << 32) | be32(e + 4);
        std::memcpy(static_cast<double*>(t.data_ptr()) + i, &u, 8);
        break;
      }
    }
  }
  return t;
}

std::string fashion_mnist_dir() {
  if (const char* d = std::getenv("TANDEM_DATA_DIR"); d != nullptr && *d != '\0') {
    return std::string(d) + "/fashion-mnist";
  }
  return "/usr/share/datasets/fashion-mnist";
}

ImageClassification fashion_mnist(const std::string& split, const std::string& root_in) {
  TANDEM_CHECK(split == "train" || split == "test", ValueError,
               "fashion_mnist: split must be \"train\" or \"test\", got \"{}\"", split);
  const std::string root = root_in.empty() ? fashion_mnist_dir() : root_in;
  const std::string prefix = split == "train" ? "train" : "t10k";
  auto find = [&](const std::string& stem) {
    for (const std::string& name : {stem + ".gz", stem}) {
      if (std::filesystem::exists(root + "/" + name)) return root + "/" + name;
    }
    throw IOError(fmt::format("fashion_mnist: {}/{}.gz not found; install the data with "
                              "scripts/install-deps.sh (Debian package dataset-fashion-mnist) or set TANDEM_DATA_DIR",
                              root, stem));
  };
  ImageClassification ds;
  const std::string images_path = find(prefix + "-images-idx3-ubyte");
  ds.images = read_idx(images_path);
  TANDEM_CHECK(ds.images.dtype() == kUInt8, IOError,
               "fashion_mnist: {} holds {} values; Fashion-MNIST images are unsigned bytes (IDX type 0x08)",
               images_path, dtype_name(ds.images.dtype()));
  ds.labels = read_idx(find(prefix + "-labels-idx1-ubyte")).to(kInt64);
  TANDEM_CHECK(ds.images.dim() == 3 && ds.labels.dim() == 1 && ds.images.size(0) == ds.labels.size(0), IOError,
               "fashion_mnist: images {} and labels {} in {} do not match", shape_str(ds.images.shape()),
               shape_str(ds.labels.shape()), root);
  return ds;
}

}  // namespace tandem::data
