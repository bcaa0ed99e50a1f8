// Training metrics on disk and on the terminal: a JSONL log (one JSON object per line), a
// TensorBoard event file (scalar summaries, readable by TensorBoard and its Python reader), and
// the progress display. Invariant: every line / record is flushed whole, so a crash leaves a
// file whose complete records all parse.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace tandem::train {

// CRC-32C (Castagnoli), as TFRecord uses it; `crc` continues a running checksum.
uint32_t crc32c(const void* data, size_t n, uint32_t crc = 0);
// TFRecord's masked CRC: ((crc >> 15) | (crc << 17)) + 0xa282ead8.
uint32_t masked_crc32c(const void* data, size_t n);

// Appends one JSON object per line to a file; each line is flushed when written. Not thread-safe.
class JsonlWriter {
 public:
  // Opens `path` for appending (a resumed run continues its log). With `keep_through_step`, first
  // drops the records whose "step" is above it (TensorBoard's purge_step: a run resumed from the
  // checkpoint of step S redoes the steps after S, and they were logged twice; a fresh run passes
  // -1 and starts an empty log). Throws IOError naming the path.
  explicit JsonlWriter(const std::string& path, std::optional<int64_t> keep_through_step = std::nullopt);
  ~JsonlWriter();
  JsonlWriter(const JsonlWriter&) = delete;
  JsonlWriter& operator=(const JsonlWriter&) = delete;
  void write(const nlohmann::json& record);
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::FILE* f_ = nullptr;
};

// A TensorBoard event file "events.out.tfevents.<unix seconds>.<host>.<pid>.<n>" in `dir` (n counts
// this process's writers, as PyTorch's). The file is
// a sequence of TFRecords (u64 length, masked CRC32C of the length, the bytes, masked CRC32C of
// the bytes), each holding a serialized tensorflow.Event: the first has file_version
// "brain.Event:2", then one Event {wall_time, step, summary {value {tag, simple_value}}} per
// scalar. The protobuf encoding is written by hand (four field types). Not thread-safe.
class TensorBoardWriter {
 public:
  // Creates `dir` if needed and the event file. Throws IOError naming the path.
  explicit TensorBoardWriter(const std::string& dir);
  ~TensorBoardWriter();
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;
  // One scalar (SummaryWriter.add_scalar); wall_time < 0 means now.
  void add_scalar(const std::string& tag, double value, int64_t step, double wall_time = -1);
  // Several scalars in one Event.
  void add_scalars(const std::vector<std::pair<std::string, double>>& values, int64_t step, double wall_time = -1);
  void flush();
  const std::string& path() const { return path_; }

 private:
  void write_record(const std::string& data);
  std::string path_;
  std::FILE* f_ = nullptr;
};

// The encoded tensorflow.Event for `values` (exposed for tests).
std::string encode_scalar_event(const std::vector<std::pair<std::string, double>>& values, int64_t step, double wall_time);

// What the progress display shows for one step.
struct ProgressFields {
  int64_t step = 0;  // steps done
  double loss = 0;
  double loss_scale = 1;
  double lr = 0;
  double samples_per_s = 0;
};

// Rank 0's progress display. Bar mode (a TTY) redraws one line in place, at most 10 times a second:
//   " 120/469 [=======>          ] 25.6 it/s ETA 0:13  loss 0.5123  scale 65536"
// Lines mode prints "step 120/469  loss 0.5123  lr 0.05  scale 65536  25.6 it/s  3171 samples/s  ETA 0:13"
// every `every` steps and at the last. None prints nothing. Not thread-safe.
class Progress {
 public:
  enum class Mode { Bar, Lines, None };
  // mode "auto": Bar when `out` is a terminal, else Lines.
  Progress(int64_t total_steps, const std::string& mode, int64_t every, std::FILE* out = stdout);
  void update(const ProgressFields& f);
  // Prints a message on its own line (keeping the bar below it).
  void message(const std::string& line);
  // Ends the bar's line.
  void finish();
  Mode mode() const { return mode_; }
  // "1:02:03" / "2:03" (exposed for tests).
  static std::string format_duration(double seconds);

 private:
  int64_t total_, every_;
  std::FILE* out_;
  Mode mode_;
  std::chrono::steady_clock::time_point start_, last_draw_;
  int64_t first_step_ = -1;
  bool drawn_ = false;
};

}  // namespace tandem::train
