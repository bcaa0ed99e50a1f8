// Metrics: CRC-32C against its check value, TFRecord framing read back in C++, the event file
// read back by PyPI's tensorboard (skipped with a message when it is not installed), JSONL, and
// the progress display's two modes.
#include "tandem/train/metrics.h"

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <gtest/gtest.h>

#include "tandem/core/error.h"
#include "util/test_util.h"

namespace tandem::train {
namespace {

namespace fs = std::filesystem;

std::string read_all(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

uint64_t le64(const char* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(p[i]);
  return v;
}
uint32_t le32(const char* p) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(p[i]);
  return v;
}

// The records of a TFRecord file, every CRC checked.
std::vector<std::string> read_records(const std::string& path) {
  const std::string bytes = read_all(path);
  std::vector<std::string> out;
  size_t pos = 0;
  while (pos < bytes.size()) {
    EXPECT_LE(pos + 12, bytes.size());
    const uint64_t len = le64(bytes.data() + pos);
    EXPECT_EQ(le32(bytes.data() + pos + 8), masked_crc32c(bytes.data() + pos, 8));
    EXPECT_LE(pos + 12 + len + 4, bytes.size());
    const std::string data = bytes.substr(pos + 12, len);
    EXPECT_EQ(le32(bytes.data() + pos + 12 + len), masked_crc32c(data.data(), data.size()));
    out.push_back(data);
    pos += 12 + len + 4;
  }
  return out;
}

TEST(Metrics, Crc32cCheckValue) {
  // The CRC-32C check value (RFC 3720, and every CRC catalogue): crc32c("123456789").
  EXPECT_EQ(crc32c("123456789", 9), 0xE3069283u);
  EXPECT_EQ(crc32c("", 0), 0u);
  // Running checksums compose.
  EXPECT_EQ(crc32c("6789", 4, crc32c("12345", 5)), 0xE3069283u);
}

TEST(Metrics, ScalarEventEncoding) {
  // Event{wall_time=1.5, step=3, summary{value{tag="a", simple_value=2.0}}}, byte by byte.
  const std::string e = encode_scalar_event({{"a", 2.0}}, 3, 1.5);
  const std::string expected = std::string("\x09\x00\x00\x00\x00\x00\x00\xf8\x3f", 9) + "\x10\x03" + "\x2a\x0a" +
                               "\x0a\x08" + "\x0a\x01" "a" + std::string("\x15\x00\x00\x00\x40", 5);
  EXPECT_EQ(e, expected);
}

TEST(Metrics, EventFileFramingAndTensorBoardReader) {
  tandem::testing::TempDir dir;
  std::string path;
  {
    TensorBoardWriter w(dir.path() + "/tb");
    path = w.path();
    for (int step = 1; step <= 5; ++step) {
      w.add_scalars({{"train/loss", 1.0 / step}, {"train/lr", 0.1}}, step);
    }
    w.add_scalar("eval/accuracy", 0.875, 5);
  }
  EXPECT_NE(fs::path(path).filename().string().find("events.out.tfevents."), std::string::npos);
  const auto records = read_records(path);
  ASSERT_EQ(records.size(), 7u);
  EXPECT_NE(records[0].find("brain.Event:2"), std::string::npos);

  const std::string py = std::string(TANDEM_SOURCE_DIR) + "/.venv-test/bin/python";
  if (std::system((py + " -c 'import tensorboard' 2>/dev/null").c_str()) != 0) {
    GTEST_SKIP() << "PyPI's tensorboard is not importable from " << py
                 << "; run scripts/install-deps.sh to check the event file with TensorBoard's own reader";
  }
  const std::string script = dir.path() + "/read.py";
  std::ofstream(script) << R"(import sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
acc = EventAccumulator(sys.argv[1]); acc.Reload()
for tag in sorted(acc.Tags()['scalars']):
    for e in acc.Scalars(tag):
        print(tag, e.step, repr(e.value))
)";
  FILE* p = ::popen((py + " " + script + " " + dir.path() + "/tb 2>&1").c_str(), "r");
  ASSERT_NE(p, nullptr);
  std::string out;
  char buf[512];
  while (std::fgets(buf, sizeof buf, p)) out += buf;
  ASSERT_EQ(::pclose(p), 0) << out;
  std::string expected = "eval/accuracy 5 0.875\n";
  // The f32 values as Python prints them (repr of the float widened to double).
  expected += "train/loss 1 1.0\ntrain/loss 2 0.5\ntrain/loss 3 0.3333333432674408\ntrain/loss 4 0.25\ntrain/loss 5 0.20000000298023224\n";
  expected += "train/lr 1 0.10000000149011612\ntrain/lr 2 0.10000000149011612\ntrain/lr 3 0.10000000149011612\n"
              "train/lr 4 0.10000000149011612\ntrain/lr 5 0.10000000149011612\n";
  EXPECT_EQ(out, expected);
}

TEST(Metrics, JsonlAppendsOneObjectPerLine) {
  tandem::testing::TempDir dir;
  const std::string path = dir.path() + "/run/metrics.jsonl";
  {
    JsonlWriter w(path);
    w.write({{"step", 1}, {"loss", 2.5}});
  }
  {
    JsonlWriter w(path);  // a resumed run appends
    w.write({{"step", 2}, {"loss", 1.25}});
  }
  std::ifstream f(path);
  std::string line;
  std::vector<nlohmann::json> rows;
  while (std::getline(f, line)) rows.push_back(nlohmann::json::parse(line));
  ASSERT_EQ(rows.size(), 2u);
  EXPECT_EQ(rows[1]["step"], 2);
  EXPECT_EQ(rows[1]["loss"], 1.25);
}

// keep_through_step (TensorBoard's purge_step): later records are dropped before appending.
TEST(Metrics, JsonlDropsRecordsAfterTheStepARunContinuesFrom) {
  tandem::testing::TempDir dir;
  const std::string path = dir.path() + "/metrics.jsonl";
  {
    JsonlWriter w(path);
    for (int s = 1; s <= 5; ++s) w.write({{"step", s}, {"loss", 1.0 * s}});
    w.write({{"note", "no step"}});
  }
  {
    JsonlWriter w(path, 3);
    w.write({{"step", 4}, {"loss", 0.5}});
  }
  std::ifstream f(path);
  std::vector<nlohmann::json> rows;
  for (std::string line; std::getline(f, line);) rows.push_back(nlohmann::json::parse(line));
  ASSERT_EQ(rows.size(), 5u);
  EXPECT_EQ(rows[2]["step"], 3);
  EXPECT_EQ(rows[3]["note"], "no step");
  EXPECT_EQ(rows[4]["loss"], 0.5);
}

// Two writers in one process within a second: distinct files (the second truncated the first).
TEST(Metrics, TwoEventFilesOfOneProcessDoNotOverwriteEachOther) {
  tandem::testing::TempDir dir;
  TensorBoardWriter a(dir.path()), b(dir.path());
  EXPECT_NE(a.path(), b.path());
}

TEST(Metrics, ProgressLinesAndBar) {
  tandem::testing::TempDir dir;
  const std::string path = dir.path() + "/out.txt";
  {
    std::FILE* f = std::fopen(path.c_str(), "w");
    Progress lines(10, "auto", 5, f);  // a file is not a TTY: lines
    EXPECT_EQ(lines.mode(), Progress::Mode::Lines);
    for (int s = 1; s <= 10; ++s) lines.update({.step = s, .loss = 0.5, .loss_scale = 1024, .lr = 0.1, .samples_per_s = 10});
    Progress bar(4, "bar", 1, f);
    for (int s = 1; s <= 4; ++s) bar.update({.step = s, .loss = 0.25, .loss_scale = 2, .lr = 0.1});
    bar.message("eval accuracy 0.5");
    bar.finish();
    std::fclose(f);
  }
  const std::string out = read_all(path);
  EXPECT_NE(out.find("step 5/10  loss 0.5000  lr 0.1  scale 1024"), std::string::npos) << out;
  EXPECT_NE(out.find("step 10/10"), std::string::npos);
  EXPECT_EQ(out.find("step 4/10"), std::string::npos);  // only every 5 steps
  EXPECT_NE(out.find("\r     4/4 [========================] "), std::string::npos) << out;
  EXPECT_NE(out.find("loss 0.2500  scale 2"), std::string::npos);
  EXPECT_NE(out.find("eval accuracy 0.5\n"), std::string::npos);
  EXPECT_EQ(Progress::format_duration(65), "1:05");
  EXPECT_EQ(Progress::format_duration(3725), "1:02:05");
  EXPECT_THROW(Progress(1, "fancy", 1, stdout), Error);
}

}  // namespace
}  // namespace tandem::train
