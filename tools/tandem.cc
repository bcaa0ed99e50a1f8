// The `tandem` command: dispatches argv[1] to a subcommand (tools/commands.h), one file each.
// Invariant: subcommands report their own errors and return the exit code; only main() exits.
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>

#include "tools/commands.h"

namespace {

using Main = int (*)(int, char**);

// One row per subcommand; `words` is how it is typed ("run", "bench allreduce").
struct Command {
  const char* words;
  Main main;
  const char* help;
};

constexpr Command kCommands[] = {
    {"run", tandem::tools::run_main, "launch N worker processes per node (torchrun-compatible)"},
    {"bench allreduce", tandem::tools::bench_allreduce_main, "time all_reduce over sizes (nccl-tests style rows)"},
    {"train", tandem::tools::train_main, "train a model from a JSON config (DeepSpeed keys), resumable"},
    {"env", tandem::tools::env_main, "what this machine and build offer (CPU features, cores, backends)"},
};

constexpr const char* kVersion = TANDEM_VERSION;

void print_usage(std::FILE* out) {
  std::fprintf(out, "usage: tandem <command> [args...]\n\ncommands:\n");
  for (const Command& c : kCommands) std::fprintf(out, "  %-18s %s\n", c.words, c.help);
  std::fprintf(out, "  %-18s %s\n  %-18s %s\n\n`tandem <command> --help` describes one command.\n", "help", "this text",
               "version", "print the version");
}

// Whether argv[1..] starts with the words of `c`; sets *used to how many argv entries they take.
bool matches(const Command& c, int argc, char** argv, int* used) {
  std::string words = c.words;
  int i = 1;
  size_t pos = 0;
  while (pos < words.size()) {
    size_t end = words.find(' ', pos);
    if (end == std::string::npos) end = words.size();
    if (i >= argc || words.compare(pos, end - pos, argv[i]) != 0 || std::strlen(argv[i]) != end - pos) return false;
    ++i;
    pos = end + 1;
  }
  *used = i - 1;
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  // Closed standard descriptors (`tandem run ... >&- 2>&-`) get /dev/null: else the next files or
  // pipes opened take fds 0-2, and output meant for the console lands in them (a launcher's
  // signal pipe read a worker's stderr bytes as signals).
  for (int fd = 0; fd <= 2; ++fd) {
    if (fcntl(fd, F_GETFD) == -1 && errno == EBADF) {
      const int null_fd = open("/dev/null", fd == 0 ? O_RDONLY : O_WRONLY);
      if (null_fd >= 0 && null_fd != fd) {
        dup2(null_fd, fd);
        close(null_fd);
      }
    }
  }
  if (argc < 2) {
    print_usage(stderr);
    return 2;
  }
  const std::string first = argv[1];
  if (first == "help" || first == "--help" || first == "-h") {
    print_usage(stdout);
    return 0;
  }
  if (first == "version" || first == "--version") {
    std::printf("tandem %s\n", kVersion);
    return 0;
  }
  // The longest match wins, so "bench allreduce" and a plain "bench" could coexist.
  const Command* best = nullptr;
  int best_used = 0;
  for (const Command& c : kCommands) {
    int used = 0;
    if (matches(c, argc, argv, &used) && used > best_used) {
      best = &c;
      best_used = used;
    }
  }
  if (best == nullptr) {
    std::string valid;
    for (const Command& c : kCommands) valid += std::string(valid.empty() ? "" : ", ") + c.words;
    std::fprintf(stderr, "tandem: unknown command \"%s\"; valid commands: %s, help, version (see `tandem help`)\n",
                 first.c_str(), valid.c_str());
    return 2;
  }
  // The subcommand sees its own name as argv[0], like a program of its own.
  return best->main(argc - best_used, argv + best_used);
}
