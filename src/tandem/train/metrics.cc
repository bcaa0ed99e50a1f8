// JSONL and TensorBoard writers, and the progress display.
#include "tandem/train/metrics.h"

#include <unistd.h>

#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "tandem/core/error.h"

namespace tandem::train {
namespace {

// The reflected CRC-32C table (polynomial 0x82F63B78).
const std::array<uint32_t, 256>& crc_table() {
  static const std::array<uint32_t, 256> t = [] {
    std::array<uint32_t, 256> out{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
      out[i] = c;
    }
    return out;
  }();
  return t;
}

// ---- protobuf wire format: just what Event / Summary / Value need ----
void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}
void put_tag(std::string& out, uint32_t field, uint32_t wire_type) { put_varint(out, (field << 3) | wire_type); }
void put_fixed64(std::string& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
void put_fixed32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
void put_bytes(std::string& out, uint32_t field, const std::string& bytes) {
  put_tag(out, field, 2);
  put_varint(out, bytes.size());
  out += bytes;
}

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace

uint32_t crc32c(const void* data, size_t n, uint32_t crc) {
  const auto* p = static_cast<const unsigned char*>(data);
  const auto& t = crc_table();
  crc = ~crc;
  for (size_t i = 0; i < n; ++i) crc = t[(crc ^ p[i]) & 0xff] ^ (crc >> 8);
  return ~crc;
}

uint32_t masked_crc32c(const void* data, size_t n) {
  const uint32_t c = crc32c(data, n);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

// ---------------------------------------------------------------------------------------------
JsonlWriter::JsonlWriter(const std::string& path, std::optional<int64_t> keep_through_step) : path_(path) {
  std::error_code ec;
  const auto parent = std::filesystem::path(path).parent_path();
  if (!parent.empty()) std::filesystem::create_directories(parent, ec);
  if (keep_through_step && std::filesystem::exists(path, ec)) {
    std::ifstream in(path);
    TANDEM_CHECK(in.good(), IOError, "metrics: cannot read {}: {}", path, std::strerror(errno));
    std::string kept, line;
    while (std::getline(in, line)) {
      const nlohmann::json rec = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
      const bool later = rec.is_object() && rec.contains("step") && rec["step"].is_number_integer() &&
                         rec["step"].get<int64_t>() > *keep_through_step;
      if (!later) kept += line + "\n";
    }
    // Rewritten beside it and renamed over it: a crash leaves the old log or the new one.
    const std::string tmp = path + ".tmp";
    {
      std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
      out << kept;
      out.flush();
      TANDEM_CHECK(out.good(), IOError, "metrics: cannot write {}: {}", tmp, std::strerror(errno));
    }
    std::filesystem::rename(tmp, path, ec);
    TANDEM_CHECK(!ec, IOError, "metrics: cannot replace {}: {}", path, ec.message());
  }
  f_ = std::fopen(path.c_str(), "a");
  TANDEM_CHECK(f_ != nullptr, IOError, "metrics: cannot open {} for appending: {}", path, std::strerror(errno));
}

JsonlWriter::~JsonlWriter() {
  if (f_) std::fclose(f_);
}

void JsonlWriter::write(const nlohmann::json& record) {
  const std::string line = record.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
  TANDEM_CHECK(std::fwrite(line.data(), 1, line.size(), f_) == line.size() && std::fflush(f_) == 0, IOError,
               "metrics: writing {} failed: {}", path_, std::strerror(errno));
}

// ---------------------------------------------------------------------------------------------
std::string encode_scalar_event(const std::vector<std::pair<std::string, double>>& values, int64_t step, double wall_time) {
  // Summary { repeated Value value = 1; }  Value { string tag = 1; float simple_value = 2; }
  std::string summary;
  for (const auto& [tag, v] : values) {
    std::string value;
    put_bytes(value, 1, tag);
    put_tag(value, 2, 5);
    const float f = static_cast<float>(v);
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    put_fixed32(value, bits);
    put_bytes(summary, 1, value);
  }
  // Event { double wall_time = 1; int64 step = 2; Summary summary = 5; }
  std::string event;
  put_tag(event, 1, 1);
  uint64_t wt;
  std::memcpy(&wt, &wall_time, 8);
  put_fixed64(event, wt);
  put_tag(event, 2, 0);
  put_varint(event, static_cast<uint64_t>(step));
  put_bytes(event, 5, summary);
  return event;
}

TensorBoardWriter::TensorBoardWriter(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  TANDEM_CHECK(!ec, IOError, "metrics: cannot create {}: {}", dir, ec.message());
  char host[256] = "localhost";
  ::gethostname(host, sizeof host - 1);
  // PyTorch's EventFileWriter names add a per-process counter: two writers of one process within
  // a second (a run stopped and resumed in-process) got the same name and the second truncated it.
  static std::atomic<int64_t> next_uid{0};
  path_ = fmt::format("{}/events.out.tfevents.{}.{}.{}.{}", dir, static_cast<int64_t>(now_seconds()), host, ::getpid(),
                      next_uid.fetch_add(1));
  f_ = std::fopen(path_.c_str(), "wb");
  TANDEM_CHECK(f_ != nullptr, IOError, "metrics: cannot create {}: {}", path_, std::strerror(errno));
  // Event { double wall_time = 1; string file_version = 3; }
  std::string first;
  put_tag(first, 1, 1);
  const double wt = now_seconds();
  uint64_t bits;
  std::memcpy(&bits, &wt, 8);
  put_fixed64(first, bits);
  put_bytes(first, 3, "brain.Event:2");
  write_record(first);
  flush();
}

TensorBoardWriter::~TensorBoardWriter() {
  if (f_) std::fclose(f_);
}

void TensorBoardWriter::write_record(const std::string& data) {
  std::string header;
  put_fixed64(header, data.size());
  const uint32_t len_crc = masked_crc32c(header.data(), 8);
  put_fixed32(header, len_crc);
  std::string footer;
  put_fixed32(footer, masked_crc32c(data.data(), data.size()));
  const std::string rec = header + data + footer;
  TANDEM_CHECK(std::fwrite(rec.data(), 1, rec.size(), f_) == rec.size(), IOError, "metrics: writing {} failed: {}", path_,
               std::strerror(errno));
}

void TensorBoardWriter::add_scalar(const std::string& tag, double value, int64_t step, double wall_time) {
  add_scalars({{tag, value}}, step, wall_time);
}

void TensorBoardWriter::add_scalars(const std::vector<std::pair<std::string, double>>& values, int64_t step,
                                    double wall_time) {
  write_record(encode_scalar_event(values, step, wall_time < 0 ? now_seconds() : wall_time));
  flush();
}

void TensorBoardWriter::flush() {
  TANDEM_CHECK(std::fflush(f_) == 0, IOError, "metrics: flushing {} failed: {}", path_, std::strerror(errno));
}

// ---------------------------------------------------------------------------------------------
Progress::Progress(int64_t total_steps, const std::string& mode, int64_t every, std::FILE* out)
    : total_(total_steps), every_(std::max<int64_t>(1, every)), out_(out), start_(std::chrono::steady_clock::now()) {
  if (mode == "bar") {
    mode_ = Mode::Bar;
  } else if (mode == "lines") {
    mode_ = Mode::Lines;
  } else if (mode == "none") {
    mode_ = Mode::None;
  } else {
    TANDEM_CHECK(mode == "auto", ValueError, "Progress: mode \"{}\", expected auto, bar, lines or none", mode);
    mode_ = ::isatty(::fileno(out)) ? Mode::Bar : Mode::Lines;
  }
}

std::string Progress::format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  const auto s = static_cast<int64_t>(seconds + 0.5);
  if (s >= 3600) return fmt::format("{}:{:02d}:{:02d}", s / 3600, (s / 60) % 60, s % 60);
  return fmt::format("{}:{:02d}", s / 60, s % 60);
}

void Progress::update(const ProgressFields& f) {
  if (mode_ == Mode::None) return;
  if (first_step_ < 0) {
    // The rate counts from the first update (its time is unknown), so a resumed run's rate is its own.
    first_step_ = f.step;
    start_ = std::chrono::steady_clock::now();
  }
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  const double rate = elapsed > 0 && f.step > first_step_ ? static_cast<double>(f.step - first_step_) / elapsed : 0.0;
  const double eta = rate > 0 ? static_cast<double>(total_ - f.step) / rate : -1;
  if (mode_ == Mode::Bar) {
    // At most ~10 redraws a second (fast steps would otherwise spend their time on the terminal).
    const auto now = std::chrono::steady_clock::now();
    if (drawn_ && f.step != total_ && now - last_draw_ < std::chrono::milliseconds(100)) return;
    last_draw_ = now;
    constexpr int kWidth = 24;
    const double frac = total_ > 0 ? std::min(1.0, static_cast<double>(f.step) / static_cast<double>(total_)) : 0.0;
    const int filled = static_cast<int>(frac * kWidth);
    std::string bar(static_cast<size_t>(filled), '=');
    if (filled < kWidth) bar += '>' + std::string(static_cast<size_t>(kWidth - filled - 1), ' ');
    std::fprintf(out_, "\r%6lld/%lld [%s] %.1f it/s ETA %s  loss %.4f  scale %g\x1b[K", static_cast<long long>(f.step),
                 static_cast<long long>(total_), bar.c_str(), rate, format_duration(eta).c_str(), f.loss, f.loss_scale);
    std::fflush(out_);
    drawn_ = true;
    return;
  }
  if (f.step % every_ != 0 && f.step != total_) return;
  std::fprintf(out_, "step %lld/%lld  loss %.4f  lr %.4g  scale %g  %.1f it/s  %.0f samples/s  ETA %s\n",
               static_cast<long long>(f.step), static_cast<long long>(total_), f.loss, f.lr, f.loss_scale, rate,
               f.samples_per_s, format_duration(eta).c_str());
  std::fflush(out_);
}

void Progress::message(const std::string& line) {
  if (mode_ == Mode::Bar && drawn_) {
    std::fprintf(out_, "\r\x1b[K%s\n", line.c_str());
  } else {
    std::fprintf(out_, "%s\n", line.c_str());
  }
  std::fflush(out_);
}

void Progress::finish() {
  if (mode_ == Mode::Bar && drawn_) {
    std::fprintf(out_, "\n");
    std::fflush(out_);
    drawn_ = false;
  }
}

}  // namespace tandem::train
