// The shm backend: every rank of the group on one host, collectives through shared memory.
//
// Segments. Rank 0 creates a control segment (per-rank progress counters, futex words,
// fingerprints of recent collectives, small-message slots, point-to-point mailboxes); every rank
// creates a heap segment (ProcessGroup::allocate and scratch). Names travel through the store;
// every rank maps every segment and each creator unlinks its own as soon as all ranks mapped it,
// so nothing is left in /dev/shm after a crash.
//
// Protocol. Rank r publishes progress[r] = (seq << 32) | step, monotonically: step 0 "entering
// #seq" (done with #seq-1), step 1 "entered collective #seq, its descriptor (fingerprint + where
// its input lies) is readable", steps 2.. "my chunk k is reduced", kFinal "done with #seq, my
// buffers may be reused". The descriptor sits in the progress word's cache line (a seqlock on the
// step-0 store) and in a ring of recent ones for diagnosis. Waiting for a peer is spin-then-futex
// on the peer's epoch word (bumped by every publish; a peer that last ran on our CPU gets it
// handed over by sched_yield instead of spinning), in slices of at most 10 ms so the group's
// deadline, a dead peer (pid gone or zombie), a peer that left the group and an abort raised by
// another rank are all noticed. A wait already satisfied by the last value seen reads nothing
// shared, and no clock is read unless a wait has to spin.
//
// all_reduce. A reduce-scatter + all-gather over shared memory in which rank r owns 1/N of the
// elements and reads that slice of every rank's input in place, chunk by chunk
// (TANDEM_SHM_CHUNK_BYTES, 256 KiB). Default (TANDEM_SHM_ALLREDUCE=push): the all-gather is fused
// into the reduction, each reduced vector is stored into our buffer and straight into every
// peer's in the same pass (reduce_arrays_to), one barrier at the end; this touches about 2x the
// buffer per rank instead of 2.5x.
// TANDEM_SHM_ALLREDUCE=pull: the owner publishes each reduced chunk and the others copy it as soon
// as it is ready (reduce and copy overlap), starting at their ring neighbour. Buffers from
// allocate() are read and written in place (zero-copy); others go through a slot (<= 64 KiB) or
// heap scratch (one copy in, one out). Small messages (<= TANDEM_SHM_SMALL_BYTES, default 16 KiB)
// push too, in one chunk (two barriers; in place it moves about half the cache lines of the slot
// scheme), unless there are more ranks than CPUs, where each barrier costs context switches: then
// every rank copies its input into its slot and reduces all slots in rank order (one barrier).
// Rank 0's environment decides these (TANDEM_SHM_ALLREDUCE, _SMALL_ALLREDUCE, _SMALL_BYTES,
// _CHUNK_BYTES) for the whole group.
// TANDEM_SHM_SMALL_ALLREDUCE=push|slot overrides; rank 0's choice holds for the group. Inputs are
// always combined in rank order, so every rank gets bit-identical results.
//
// Threads. One progress thread per group runs queued work in issue order. A small operation
// issued while nothing is queued runs at once on the caller's thread (latency: no thread
// hand-off); TANDEM_SHM_INLINE_BYTES=0 turns that off. Its Work is complete when returned and its
// description is only built if someone asks (errors, Work::description()).
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <fstream>
#include <immintrin.h>
#include <random>
#include <thread>

#include <fmt/ranges.h>

#include "tandem/core/hash.h"
#include "tandem/dist/backends.h"
#include "tandem/dist/shm_kernels.h"
#include "tandem/dist/shm_segment.h"

namespace tandem::dist {
namespace shm {
namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

constexpr uint64_t kMagic = 0x54414e44454d5348ull;  // "TANDEMSH"
constexpr int kMaxRanks = 256;
constexpr int kRecent = 16;
constexpr int64_t kMaxLead = 8;  // < kRecent: a descriptor outlives every reader
constexpr int kMailDepth = 16;
constexpr size_t kSlotBytes = 64 << 10;
constexpr uint32_t kFinal = 0xffffffffu;
constexpr uint64_t kSlotCode = 1ull << 63;

enum class Op : uint8_t { none, all_reduce, broadcast, reduce, all_gather, reduce_scatter, gather, scatter,
                          all_to_all, barrier, send, recv };

const char* op_name(Op op) {
  switch (op) {
    case Op::none: return "nothing";
    case Op::all_reduce: return "all_reduce";
    case Op::broadcast: return "broadcast";
    case Op::reduce: return "reduce";
    case Op::all_gather: return "all_gather";
    case Op::reduce_scatter: return "reduce_scatter";
    case Op::gather: return "gather";
    case Op::scatter: return "scatter";
    case Op::all_to_all: return "all_to_all";
    case Op::barrier: return "barrier";
    case Op::send: return "send";
    case Op::recv: return "recv";
  }
  return "?";
}

bool has_root(Op op) { return op == Op::broadcast || op == Op::reduce || op == Op::gather || op == Op::scatter; }
bool has_redop(Op op) { return op == Op::all_reduce || op == Op::reduce || op == Op::reduce_scatter; }

// What a rank is doing in collective #seq: its fingerprint and where its input lies.
struct Desc {
  int64_t seq = -1;
  Op op = Op::none;
  DType dtype = DType::f32;
  ReduceOp redop = ReduceOp::SUM;
  int32_t root = 0;
  int64_t count = 0;
  uint64_t code = 0;  // kSlotCode, or an offset into the rank's heap
  // A hash of every collective this rank ran before this one (their calls as same_call compares
  // them, count-0 ones included). A broadcast or scatter in which several ranks take themselves
  // for the root reads no peer, so nothing compares it there; the next collective's comparison of
  // histories catches it.
  uint64_t history = 0;

  bool same_call(const Desc& o) const {
    return op == o.op && (op == Op::barrier || (dtype == o.dtype && count == o.count)) &&
           (!has_root(op) || root == o.root) && (!has_redop(op) || redop == o.redop);
  }
  // The history after this call: mixes in exactly what same_call compares.
  uint64_t history_after() const {
    const int64_t fields[5] = {static_cast<int64_t>(op), op == Op::barrier ? -1 : static_cast<int64_t>(dtype),
                               op == Op::barrier ? -1 : count, has_root(op) ? root : -1,
                               has_redop(op) ? static_cast<int64_t>(redop) : -1};
    return fnv1a(fields, sizeof(fields), history);
  }
  // "all_reduce #12 (f32, 4096, SUM)" after `prefix`. Appended by hand rather than through
  // fmt::format: it runs for every collective, on the latency path of small ones.
  std::string str(const char* prefix = "") const {
    std::string s;
    s.reserve(64);
    s += prefix;
    char num[24];
    auto append_int = [&](int64_t v) { s.append(num, std::to_chars(num, num + sizeof(num), v).ptr); };
    s += op_name(op);
    s += " #";
    append_int(seq);
    if (op == Op::barrier) return s;
    s += " (";
    s += short_dtype_name(dtype);
    s += ", ";
    append_int(count);
    if (has_root(op)) {
      s += ", root ";
      append_int(root);
    }
    if (has_redop(op)) {
      s += ", ";
      s += reduce_op_name(redop);
    }
    s += ')';
    return s;
  }
};

struct Header {
  uint64_t magic;
  int32_t size;
  std::atomic<int32_t> abort_rank;  // 0: none, else rank + 1 of the first rank that failed
  // Rank 0's protocol choices, which every rank follows (from rank 0's environment: ranks whose
  // TANDEM_SHM_* differ would otherwise run different algorithms on one buffer).
  int32_t small_push;    // small all_reduce: push or slots (TANDEM_SHM_SMALL_ALLREDUCE)
  int32_t push;          // all_reduce: push or pull (TANDEM_SHM_ALLREDUCE)
  uint64_t small_bytes;  // TANDEM_SHM_SMALL_BYTES
  uint64_t chunk_bytes;  // TANDEM_SHM_CHUNK_BYTES
};

// The call a rank is in, packed into one word: op | dtype << 8 | redop << 16 | root << 32.
uint64_t pack_call(const Desc& d) {
  return static_cast<uint64_t>(d.op) | static_cast<uint64_t>(d.dtype) << 8 | static_cast<uint64_t>(d.redop) << 16 |
         static_cast<uint64_t>(static_cast<uint32_t>(d.root)) << 32;
}

struct alignas(64) RankCtl {
  // One cache line that peers poll: the progress word and the fingerprint and input location of
  // the collective it names, so a peer that sees us enter reads our descriptor without a second
  // cache miss. Seqlock: enter() stores progress (seq, 0) before rewriting cur_*, so a reader
  // that read cur_* and then still sees progress naming seq (step >= 1) read seq's values.
  alignas(64) std::atomic<uint64_t> progress;
  std::atomic<uint64_t> cur_call;   // pack_call()
  std::atomic<int64_t> cur_count;
  std::atomic<uint64_t> cur_code;
  std::atomic<uint64_t> cur_history;
  std::atomic<int32_t> cpu;  // the CPU this rank last entered a collective on (a hint for waiters)
  alignas(64) std::atomic<uint32_t> epoch;  // futex word, bumped on every publish
  std::atomic<uint32_t> waiters;
  alignas(64) std::atomic<int32_t> pid;
  std::atomic<uint64_t> pid_scope;  // my_pid_scope_hash(): where pid means something
  std::atomic<int32_t> state;  // 0 running, 1 left the group, 2 failed
  Desc recent[kRecent];        // recent[seq % kRecent]
  char error[1024];            // why this rank failed (state 2)
};

struct Msg {
  int32_t tag;
  DType dtype;
  int64_t count;
  uint64_t code;  // offset into the sender's heap
};
struct alignas(64) Mailbox {  // one per ordered pair (src, dst)
  alignas(64) std::atomic<uint64_t> posted;    // written by src
  alignas(64) std::atomic<uint64_t> consumed;  // written by dst
  Msg msgs[kMailDepth];
};

size_t round_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

struct Layout {
  size_t ctl_off, slot_off, mail_off, total;
  explicit Layout(int n) {
    ctl_off = round_up(sizeof(Header), 4096);
    slot_off = round_up(ctl_off + sizeof(RankCtl) * n, 4096);
    mail_off = slot_off + kSlotBytes * 2 * n;
    total = round_up(mail_off + sizeof(Mailbox) * n * n, 4096);
  }
};

size_t env_bytes(const char* name, size_t fallback) {
  const char* s = std::getenv(name);
  if (s == nullptr || *s == '\0') return fallback;
  char* end = nullptr;
  const unsigned long long v = std::strtoull(s, &end, 10);
  TANDEM_CHECK(end != s && *end == '\0', ValueError, "{}='{}' is not a byte count", name, s);
  return static_cast<size_t>(v);
}

inline void cpu_relax() { _mm_pause(); }

// pid_scope() (backends.h: boot and pid namespace) and its hash: pids are comparable only
// between processes with the same scope.
const std::string& my_pid_scope() {
  static const std::string scope = pid_scope();
  return scope;
}
uint64_t my_pid_scope_hash() {
  static const uint64_t h = fnv1a(my_pid_scope().data(), my_pid_scope().size());
  return h;
}

std::string host_identity() {
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  std::string boot;
  std::ifstream f("/proc/sys/kernel/random/boot_id");
  std::getline(f, boot);
  return std::string(host) + "/" + boot;
}

// ---- one queued operation ----
struct Task {
  Op op = Op::none;
  int64_t seq = -1;  // collectives only
  Buffer a, b;       // a: in/out or out; b: in
  std::vector<Buffer> outs;
  int root = 0;
  ReduceOp redop = ReduceOp::SUM;
  int peer = -1, tag = 0;
  std::shared_ptr<Work> work;
  Desc desc() const {
    Desc d;
    d.seq = seq;
    d.op = op;
    d.root = root;
    d.redop = redop;
    switch (op) {
      case Op::all_reduce: case Op::broadcast: case Op::reduce:
        d.dtype = a.dtype; d.count = a.count; break;
      case Op::all_gather: case Op::gather: case Op::all_to_all:
        d.dtype = b.dtype; d.count = b.count; break;
      case Op::reduce_scatter: case Op::scatter:
        d.dtype = a.dtype; d.count = a.count; break;
      default: break;
    }
    return d;
  }
};

// A Work whose description ("shm all_reduce #12 (f32, 4096, SUM)") is built only when an error
// message or a caller asks for it: not on the latency path of every small collective.
class ShmWork final : public Work {
 public:
  ShmWork(const Desc& d, int peer, int tag) : desc_(d), peer_(peer), tag_(tag) {}

 protected:
  std::string describe() const override {
    if (desc_.op == Op::send || desc_.op == Op::recv) {
      return fmt::format("shm {} {} rank {} (tag {}, {}, {})", op_name(desc_.op), desc_.op == Op::send ? "to" : "from",
                         peer_, tag_, short_dtype_name(desc_.dtype), desc_.count);
    }
    return desc_.str("shm ");
  }

 private:
  Desc desc_;
  int peer_, tag_;
};

class ShmGroup final : public ProcessGroup {
 public:
  ShmGroup(std::shared_ptr<Store> store, int rank, int size, ProcessGroupOptions options);
  ~ShmGroup() override;

  std::string backend_name() const override { return "shm"; }

  std::shared_ptr<Work> all_reduce(Buffer buf, ReduceOp op) override;
  std::shared_ptr<Work> broadcast(Buffer buf, int root) override;
  std::shared_ptr<Work> reduce(Buffer buf, int root, ReduceOp op) override;
  std::shared_ptr<Work> all_gather(Buffer out, Buffer in) override;
  std::shared_ptr<Work> all_gather(std::vector<Buffer> outs, Buffer in) override;
  std::shared_ptr<Work> reduce_scatter(Buffer out, Buffer in, ReduceOp op) override;
  std::shared_ptr<Work> gather(Buffer out, Buffer in, int root) override;
  std::shared_ptr<Work> scatter(Buffer out, Buffer in, int root) override;
  std::shared_ptr<Work> all_to_all(Buffer out, Buffer in) override;
  std::shared_ptr<Work> barrier() override;
  std::shared_ptr<Work> send(Buffer buf, int dst, int tag) override;
  std::shared_ptr<Work> recv(Buffer buf, int src, int tag) override;
  std::shared_ptr<void> allocate(size_t bytes) override;
  int64_t next_sequence_number() const override {
    std::lock_guard lock(q_mu_);
    return next_seq_;
  }

 private:
  // ---- segments ----
  Header* hdr() const { return reinterpret_cast<Header*>(ctl_seg_->data()); }
  RankCtl& ctl(int r) const { return reinterpret_cast<RankCtl*>(ctl_seg_->data() + layout_.ctl_off)[r]; }
  uint8_t* slot(int r, int64_t seq) const {
    return ctl_seg_->data() + layout_.slot_off + (static_cast<size_t>(r) * 2 + static_cast<size_t>(seq & 1)) * kSlotBytes;
  }
  Mailbox& mailbox(int src, int dst) const {
    return reinterpret_cast<Mailbox*>(ctl_seg_->data() + layout_.mail_off)[src * size() + dst];
  }
  const uint8_t* peer_ptr(int p, uint64_t code, int64_t seq) const {
    return (code & kSlotCode) ? slot(p, seq) : heaps_[p]->data() + code;
  }

  // The constructor's work; on a failure the constructor tells the other ranks through the store.
  void setup(int rank, int size, const ProcessGroupOptions& options);

  // ---- issuing ----
  std::shared_ptr<Work> issue(Task t, size_t bytes);
  void progress_loop();
  void execute(Task& t) noexcept;
  void run(Task& t);

  // ---- protocol ----
  struct Ctx {
    const Task* task;
    Desc desc;
    // The deadline is set by the first wait that has to spin (a clock read per collective only
    // when a wait is not already satisfied): the group's timeout from then on.
    Clock::time_point deadline{};
    bool has_deadline = false;
    // "shm all_reduce #12 (f32, 4096, SUM)", the Work's description (built on first use).
    const std::string& what() const { return task->work->description(); }
  };
  struct Exposure {
    uint64_t code = 0;
    uint8_t* ptr = nullptr;
    std::optional<size_t> scratch;
    bool trailing = false;  // peers read our heap: wait for them before returning
  };
  // Where peers find our input: our slot (small), our heap buffer in place (when `src` lies in
  // it and nbytes > slot size, or always with `in_place`), or heap scratch.
  Exposure expose(Ctx& c, const void* src, size_t nbytes, bool copy_in, bool in_place = false);
  void release(Exposure& e) noexcept;
  struct ExposureGuard {  // RAII for an exposure's scratch
    ShmGroup* g;
    Exposure* e;
    ~ExposureGuard() { g->release(*e); }
  };
  std::optional<size_t> scratch_alloc(Ctx& c, size_t nbytes);
  void enter(Ctx& c, uint64_t code);
  void publish(int64_t seq, uint32_t step);
  void publish_quiet(int64_t seq, uint32_t step);  // no wake-up: for steps nobody waits on
  void wait_progress(Ctx& c, int p, int64_t seq, uint32_t step, const char* what);
  // p entered c's collective, with a matching fingerprint; returns where p's input lies.
  uint64_t arrived(Ctx& c, int p);
  void wait_all_final(Ctx& c);
  template <class Pred>
  void wait_until(Ctx& c, int p, Pred pred, const std::function<std::string()>& what);
  void check_peers(Ctx& c, int waiting_for, const std::function<std::string()>& what);
  [[noreturn]] void fail(Ctx& c, const std::string& msg, bool timeout);
  // Marks this rank failed with `msg` and aborts the group, so that peers waiting on it stop
  // with the reason (once; fail() and any other exception out of an operation).
  void announce_failure(const std::string& msg) noexcept;
  std::string describe_rank(int p, int64_t my_seq) const;
  std::string diagnosis(Ctx& c, const char* label = "Desync") const;
  void validate(const Buffer& b, const char* op, const char* which) const;

  // ---- collectives ----
  void do_all_reduce(Ctx& c, Buffer buf, ReduceOp op, int root /* -1: all */);
  void do_broadcast(Ctx& c, Buffer buf, int root);
  void do_all_gather(Ctx& c, const std::vector<Buffer>& outs, Buffer in);
  void do_reduce_scatter(Ctx& c, Buffer out, Buffer in, ReduceOp op);
  void do_gather(Ctx& c, Buffer out, Buffer in, int root);
  void do_scatter(Ctx& c, Buffer out, Buffer in, int root);
  void do_all_to_all(Ctx& c, Buffer out, Buffer in);
  void do_barrier(Ctx& c);
  void do_send(Ctx& c, Buffer buf, int dst, int tag);
  void do_recv(Ctx& c, Buffer buf, int src, int tag);
  void reclaim_sends() noexcept;

  std::shared_ptr<Store> store_;
  Layout layout_;
  std::shared_ptr<Segment> ctl_seg_;
  std::vector<std::shared_ptr<Segment>> heaps_;  // every rank's heap, mapped here
  std::shared_ptr<Heap> heap_;                   // ours
  size_t small_bytes_, inline_bytes_, chunk_bytes_;
  int64_t spin_ns_;         // the most a wait spins before blocking
  int64_t spin_budget_ns_;  // what it spins now (adaptive)
  bool oversubscribed_;
  bool push_;  // all_reduce: fused reduce + write to peers (TANDEM_SHM_ALLREDUCE=push) or pull
  uint64_t history_ = 0;  // Desc::history of the next collective
  bool small_push_;  // small all_reduce: push too (2 barriers, in place) rather than slots (1)
  // Last progress value read from each rank: waits on a step already seen skip the shared line.
  // Touched only by the thread running the current operation (busy_ hands it over under q_mu_).
  std::vector<uint64_t> seen_;

  mutable std::mutex q_mu_;
  std::condition_variable q_cv_;
  std::deque<Task> queue_;
  bool busy_ = false, stop_ = false;
  int64_t next_seq_ = 0;
  std::exception_ptr broken_;  // the first failure; the group is unusable after it
  std::atomic<bool> broken_flag_{false};
  int64_t pending_send_count_ = 0;
  std::vector<std::vector<std::pair<uint64_t, size_t>>> pending_sends_;  // per dst: (message index, scratch)
  std::thread thread_;
};

std::atomic<uint64_t> g_group_counter{0};

ShmGroup::ShmGroup(std::shared_ptr<Store> store, int rank, int size, ProcessGroupOptions options)
    : ProcessGroup(rank, size, options), store_(std::move(store)), layout_(size) {
  try {
    setup(rank, size, options);
  } catch (const std::exception& e) {
    // Tell the others, who wait for this rank's keys below and would otherwise learn nothing
    // before their timeout (30 minutes by default).
    try {
      store_->set(fmt::format("shm/failed/{}", rank), std::string(e.what()));
      // Stay until every rank has failed too (each learns the reason from the store, which this
      // process may host) or for at most 5 s (a rank that died never counts itself in).
      const auto until = Clock::now() + std::min<Clock::duration>(std::chrono::seconds(5), options.timeout);
      for (int64_t n = store_->add("shm/failures", 1); n < size && Clock::now() < until; n = store_->add("shm/failures", 0)) {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
    } catch (...) {
    }
    throw;
  }
}

void ShmGroup::setup(int rank, int size, const ProcessGroupOptions& options) {
  TANDEM_CHECK(size <= kMaxRanks, ValueError, "shm backend: at most {} ranks on one host, got {}", kMaxRanks, size);
  small_bytes_ = std::min(env_bytes("TANDEM_SHM_SMALL_BYTES", 16 << 10), kSlotBytes);
  inline_bytes_ = env_bytes("TANDEM_SHM_INLINE_BYTES", 64 << 10);
  chunk_bytes_ = std::max<size_t>(4096, env_bytes("TANDEM_SHM_CHUNK_BYTES", 256 << 10));
  const size_t heap_bytes = std::max<size_t>(1 << 20, env_bytes("TANDEM_SHM_HEAP_BYTES", size_t{4} << 30));
  oversubscribed_ = size > online_cpus();
  {
    const char* a = std::getenv("TANDEM_SHM_ALLREDUCE");
    const std::string algo = a == nullptr ? "push" : a;
    TANDEM_CHECK(algo == "push" || algo == "pull", ValueError,
                 "TANDEM_SHM_ALLREDUCE='{}' must be push (fused reduce + write) or pull (reduce-scatter, then all-gather)", algo);
    push_ = algo == "push";
  }
  spin_ns_ = static_cast<int64_t>(env_bytes("TANDEM_SHM_SPIN_NS", oversubscribed_ ? 5000 : 50000));
  spin_budget_ns_ = spin_ns_;
  const auto timeout = options.timeout;

  // Same host: the segments are only shared there.
  const std::string me_host = host_identity();
  store_->set(fmt::format("shm/host/{}", rank), me_host);
  store_->set(fmt::format("shm/pid/{}", rank), fmt::format("{} {}", static_cast<long>(getpid()), my_pid_scope()));
  // While waiting for the others' keys: a rank that failed to set up (it published why) or died
  // (its pid, on this host) ends the wait at once instead of at the timeout.
  std::vector<long> peer_pids(static_cast<size_t>(size), -1);  // -1: not known yet, 0: another pid scope
  auto peer_failure = [&]() -> std::string {
    if (store_->add("shm/failures", 0) > 0) {
      for (int r = 0; r < size; ++r) {
        const std::string failed = fmt::format("shm/failed/{}", r);
        if (r != rank && store_->check({failed})) {
          return fmt::format("rank {} failed to set up the group: {}", r, to_string(store_->get(failed)));
        }
      }
    }
    for (int r = 0; r < size; ++r) {
      long& p = peer_pids[static_cast<size_t>(r)];
      if (r == rank || p == 0) continue;
      if (p < 0) {
        const std::string key = fmt::format("shm/pid/{}", r);
        if (!store_->check({key})) continue;
        const std::string v = to_string(store_->get(key));  // "pid scope"
        const size_t space = v.find(' ');
        p = space != std::string::npos && v.substr(space + 1) == my_pid_scope() ? std::atol(v.c_str()) : 0;
      }
      if (p > 0 && !process_alive(static_cast<pid_t>(p))) {
        return fmt::format("rank {} (pid {}) died while the group was being set up", r, p);
      }
    }
    return {};
  };
  // Polls (check, then sleep 1, 2, 4 ... 20 ms): a store wait cut short by a timeout would drop
  // its connection.
  auto wait_watching = [&](const std::vector<std::string>& keys) {
    const auto deadline = Clock::now() + timeout;
    for (auto nap = std::chrono::milliseconds(1);; nap = std::min(nap * 2, std::chrono::milliseconds(20))) {
      if (store_->check(keys)) return;
      if (const std::string why = peer_failure(); !why.empty()) {
        // A rank that finished setting up may leave at once; it only could once every rank had
        // set its last key, so the keys are there now if that is what happened.
        if (store_->check(keys)) return;
        throw CommError(fmt::format("shm backend: rank {} stops setting up the group: {}", rank, why));
      }
      if (Clock::now() >= deadline) {
        throw Timeout(fmt::format("shm backend: waited {} ms for {}", timeout.count(), fmt::join(keys, ", ")));
      }
      std::this_thread::sleep_for(nap);
    }
  };
  std::string tag;
  {
    std::random_device rd;
    tag = fmt::format("{}-{}-{:08x}", static_cast<long>(getpid()), g_group_counter.fetch_add(1), rd());
  }
  if (rank == 0) {
    ctl_seg_ = Segment::create(fmt::format("/tandem-{}-ctl", tag), layout_.total);
    if (const int e = ctl_seg_->reserve(0, layout_.total); e != 0) {
      throw CommError(fmt::format("shm backend: no room in shared memory for the group's control segment ({} bytes; "
                                  "{}: {}); {}", layout_.total, std::strerror(e), shm_space_summary(), kShmSpaceHint));
    }
    Header* h = hdr();
    h->magic = kMagic;
    h->size = size;
    h->abort_rank.store(0);
    // Small all_reduce: push (in place, two barriers, about half the cache-line traffic of slots)
    // unless there are more ranks than CPUs, where every extra barrier costs context switches.
    // Rank 0 decides for the group, so every rank runs the same algorithm.
    {
      const char* a = std::getenv("TANDEM_SHM_SMALL_ALLREDUCE");
      const long cpus = sysconf(_SC_NPROCESSORS_ONLN);
      const std::string algo = a != nullptr && *a != '\0' ? a : (cpus <= 0 || size <= cpus ? "push" : "slot");
      TANDEM_CHECK(algo == "push" || algo == "slot", ValueError,
                   "TANDEM_SHM_SMALL_ALLREDUCE='{}' must be push (in place, reduce + write to peers) or slot "
                   "(every rank copies its input to a slot and reduces all slots)", algo);
      h->small_push = algo == "push" ? 1 : 0;
    }
    h->push = push_ ? 1 : 0;
    h->small_bytes = small_bytes_;
    h->chunk_bytes = chunk_bytes_;
    store_->set("shm/ctl", ctl_seg_->name());
  }
  heap_ = std::make_shared<Heap>(Segment::create(fmt::format("/tandem-{}-heap{}", tag, rank), heap_bytes));
  store_->set(fmt::format("shm/heap/{}", rank), heap_->segment()->name());

  auto wait_keys = [&](const std::string& prefix, const char* stage) {
    std::vector<std::string> keys;
    for (int r = 0; r < size; ++r) keys.push_back(fmt::format("{}/{}", prefix, r));
    try {
      wait_watching(keys);
    } catch (const Timeout&) {
      std::vector<int> missing;
      for (int r = 0; r < size; ++r) {
        if (!store_->check({keys[r]})) missing.push_back(r);
      }
      throw Timeout(fmt::format("shm backend: rank(s) {} of {} did not {} within {} ms (rank {} waited)",
                                fmt::join(missing, ", "), size, stage, timeout.count(), rank));
    }
  };
  wait_keys("shm/heap", "create their shared-memory segments");
  if (rank != 0) {
    wait_watching({"shm/ctl"});
    const std::string host0 = to_string(store_->get("shm/host/0"));
    TANDEM_CHECK(host0 == me_host, ValueError,
                 "shm backend: rank {} runs on another host than rank 0 ({} vs {}); the shm backend needs "
                 "every rank on one host: use backend \"mpi\" across hosts",
                 rank, me_host.substr(0, me_host.find('/')), host0.substr(0, host0.find('/')));
    ctl_seg_ = Segment::open(to_string(store_->get("shm/ctl")));
    TANDEM_CHECK(ctl_seg_->size() >= layout_.total && hdr()->magic == kMagic && hdr()->size == size, CommError,
                 "shm backend: control segment {} does not match a group of {} ranks", ctl_seg_->name(), size);
  }
  small_push_ = hdr()->small_push != 0;
  push_ = hdr()->push != 0;
  small_bytes_ = static_cast<size_t>(hdr()->small_bytes);
  chunk_bytes_ = static_cast<size_t>(hdr()->chunk_bytes);
  seen_.assign(static_cast<size_t>(size), 0);
  heaps_.resize(size);
  for (int r = 0; r < size; ++r) {
    heaps_[r] = r == rank ? heap_->segment() : Segment::open(to_string(store_->get(fmt::format("shm/heap/{}", r))));
  }
  RankCtl& mine = ctl(rank);
  mine.pid.store(static_cast<int32_t>(getpid()));
  mine.pid_scope.store(my_pid_scope_hash());
  mine.state.store(0);
  store_->set(fmt::format("shm/mapped/{}", rank), "1");
  wait_keys("shm/mapped", "map the group's segments");
  heap_->segment()->unlink();
  if (rank == 0) ctl_seg_->unlink();
  pending_sends_.resize(size);
  thread_ = std::thread([this] { progress_loop(); });
}

ShmGroup::~ShmGroup() {
  {
    std::lock_guard lock(q_mu_);
    stop_ = true;
  }
  q_cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  if (ctl_seg_) {
    RankCtl& mine = ctl(rank());
    if (mine.state.load() == 0) mine.state.store(1);
    mine.epoch.fetch_add(1);
    futex_wake_all(&mine.epoch);
  }
  if (heap_) heap_->segment()->unlink();
  if (ctl_seg_ && rank() == 0) ctl_seg_->unlink();
}

// ---- issuing and the progress thread ----

std::shared_ptr<Work> ShmGroup::issue(Task t, size_t bytes) {
  std::unique_lock lock(q_mu_);
  const bool collective = t.op != Op::send && t.op != Op::recv;
  if (collective) t.seq = next_seq_++;
  {
    Desc d = t.desc();
    if (!collective) {
      d.dtype = t.a.dtype;
      d.count = t.a.count;
    }
    t.work = std::make_shared<ShmWork>(d, t.peer, t.tag);
  }
  t.work->set_default_wait(timeout() * 2 + 10s);
  auto work = t.work;
  // Progress words hold the sequence number in 32 bits; past that, waits would compare wrapped
  // numbers and pass early. Every rank reaches the limit at the same collective.
  if (collective && t.seq >= (int64_t{1} << 32) - 1) {
    work->finish(std::make_exception_ptr(CommError(fmt::format(
        "{}: this group has run 2^32 - 1 collectives, as many as its sequence numbers count; create a new "
        "group (dist::new_group over the same ranks) and go on with that one", work->description()))));
    return work;
  }
  if (broken_) {
    try {
      std::rethrow_exception(broken_);
    } catch (const std::exception& e) {
      work->finish(std::make_exception_ptr(
          CommError(fmt::format("{}: the group failed earlier and cannot be used; create a new group. "
                                "The first failure: {}", work->description(), e.what()))));
    }
    return work;
  }
  if (queue_.empty() && !busy_ && !stop_ && bytes <= inline_bytes_) {
    busy_ = true;
    lock.unlock();
    execute(t);
    lock.lock();
    busy_ = false;
    if (!queue_.empty()) q_cv_.notify_all();
    return work;
  }
  queue_.push_back(std::move(t));
  q_cv_.notify_all();
  return work;
}

void ShmGroup::progress_loop() {
  std::unique_lock lock(q_mu_);
  for (;;) {
    q_cv_.wait(lock, [&] { return stop_ || (!queue_.empty() && !busy_); });
    if (queue_.empty() && stop_) return;
    if (queue_.empty() || busy_) continue;
    Task t = std::move(queue_.front());
    queue_.pop_front();
    if (stop_) {
      t.work->finish(std::make_exception_ptr(CommError(
          fmt::format("{}: the group was destroyed before this operation ran", t.work->description()))));
      continue;
    }
    busy_ = true;
    lock.unlock();
    execute(t);
    lock.lock();
    busy_ = false;
  }
}

void ShmGroup::execute(Task& t) noexcept {
  std::exception_ptr err;
  if (broken_flag_.load(std::memory_order_acquire)) {
    std::lock_guard lock(q_mu_);
    err = broken_;
  }
  if (err) {
    try {
      std::rethrow_exception(err);
    } catch (const std::exception& e) {
      t.work->finish(std::make_exception_ptr(CommError(fmt::format(
          "{}: the group failed earlier and cannot be used; create a new group. The first failure: {}",
          t.work->description(), e.what()))));
    }
    return;
  }
  try {
    run(t);
    t.work->finish();
  } catch (...) {
    auto e = std::current_exception();
    // Not through fail() (out of memory, say): the peers must not wait for this rank until their
    // timeout.
    try {
      try {
        throw;
      } catch (const std::exception& x) {
        announce_failure(fmt::format("rank {} failed in {}: {}", rank(), t.work->description(), x.what()));
      }
    } catch (...) {  // not a std::exception, or no memory left to say more
      announce_failure("a rank failed in a collective (no message)");
    }
    {
      std::lock_guard lock(q_mu_);
      if (!broken_) broken_ = e;
      broken_flag_.store(true, std::memory_order_release);
    }
    t.work->finish(e);
  }
}

void ShmGroup::run(Task& t) {
  reclaim_sends();
  Ctx c{&t, t.desc()};
  if (t.seq >= 0) {
    c.desc.history = history_;
    history_ = c.desc.history_after();
  }
  if (t.seq >= 0 && t.op != Op::barrier && c.desc.count == 0) {
    // Nothing to move; still numbered and announced so that later collectives line up.
    enter(c, 0);
    publish(t.seq, kFinal);
    return;
  }
  switch (t.op) {
    case Op::all_reduce: return do_all_reduce(c, t.a, t.redop, -1);
    case Op::reduce: return do_all_reduce(c, t.a, t.redop, t.root);
    case Op::broadcast: return do_broadcast(c, t.a, t.root);
    case Op::all_gather: return do_all_gather(c, t.outs, t.b);
    case Op::reduce_scatter: return do_reduce_scatter(c, t.a, t.b, t.redop);
    case Op::gather: return do_gather(c, t.a, t.b, t.root);
    case Op::scatter: return do_scatter(c, t.a, t.b, t.root);
    case Op::all_to_all: return do_all_to_all(c, t.a, t.b);
    case Op::barrier: return do_barrier(c);
    case Op::send: return do_send(c, t.a, t.peer, t.tag);
    case Op::recv: return do_recv(c, t.a, t.peer, t.tag);
    case Op::none: return;
  }
}

// ---- waiting, failing, diagnosing ----

void ShmGroup::publish_quiet(int64_t seq, uint32_t step) {
  ctl(rank()).progress.store((static_cast<uint64_t>(seq) << 32) | step, std::memory_order_release);
}

void ShmGroup::publish(int64_t seq, uint32_t step) {
  RankCtl& mine = ctl(rank());
  mine.progress.store((static_cast<uint64_t>(seq) << 32) | step, std::memory_order_release);
  mine.epoch.fetch_add(1, std::memory_order_seq_cst);
  if (mine.waiters.load(std::memory_order_seq_cst) > 0) futex_wake_all(&mine.epoch);
}

template <class Pred>
void ShmGroup::wait_until(Ctx& c, int p, Pred pred, const std::function<std::string()>& what) {
  if (pred()) return;
  // Spin, then block. The spin budget adapts: it grows while peers keep arriving within it and
  // shrinks when we end up blocking anyway (oversubscribed or loaded cores), where spinning only
  // takes the core from the rank we wait for. The first 16 pauses (well under a microsecond on
  // current cores: a peer a step behind usually lands here) read no clock; after 2 us of
  // pause-spinning we yield between checks.
  for (int k = 0; k < 16; ++k) {
    cpu_relax();
    if (pred()) {
      spin_budget_ns_ = std::min<int64_t>(spin_ns_, spin_budget_ns_ * 2 + 1000);
      return;
    }
  }
  const auto t0 = Clock::now();
  if (!c.has_deadline) {
    c.deadline = t0 + timeout();
    c.has_deadline = true;
  }
  {
    const auto budget = std::chrono::nanoseconds(spin_budget_ns_);
    // The peer last ran on our CPU (the scheduler stacked us there, e.g. beside a busy process on
    // the other one): it cannot progress while we spin, so hand the CPU over at once.
    const bool same_cpu = ctl(p).cpu.load(std::memory_order_relaxed) == sched_getcpu();
    for (int i = 0;; ++i) {
      if (same_cpu) sched_yield();
      for (int k = 0; k < 16; ++k) {
        cpu_relax();
        if (pred()) {
          spin_budget_ns_ = std::min<int64_t>(spin_ns_, spin_budget_ns_ * 2 + 1000);
          return;
        }
      }
      if ((i & 7) == 0) {
        const auto spent = Clock::now() - t0;
        if (spent >= budget) break;
        if (!same_cpu && spent > std::chrono::microseconds(2)) sched_yield();
      }
    }
    spin_budget_ns_ = std::max<int64_t>(std::max<int64_t>(1000, spin_ns_ / 8), spin_budget_ns_ * 3 / 4);
  }
  RankCtl& pc = ctl(p);
  auto next_check = Clock::now() + 20ms;
  for (;;) {
    pc.waiters.fetch_add(1, std::memory_order_seq_cst);
    const uint32_t e = pc.epoch.load(std::memory_order_seq_cst);
    if (pred()) {
      pc.waiters.fetch_sub(1, std::memory_order_seq_cst);
      return;
    }
    const auto now = Clock::now();
    const auto slice = std::min<Clock::duration>(10ms, c.deadline - now);
    if (slice.count() > 0 && hdr()->abort_rank.load() == 0) futex_wait(&pc.epoch, e, slice);
    pc.waiters.fetch_sub(1, std::memory_order_seq_cst);
    if (pred()) return;
    const auto after = Clock::now();
    if (after >= next_check || hdr()->abort_rank.load() != 0) {
      check_peers(c, p, what);
      next_check = after + 50ms;
    }
    if (after >= c.deadline) {
      fail(c, fmt::format("{} timed out after {} ms waiting for {}. {}", c.what(), timeout().count(), what(),
                          diagnosis(c)),
           true);
    }
  }
}

void ShmGroup::check_peers(Ctx& c, int waiting_for, const std::function<std::string()>& what) {
  const int aborted = hdr()->abort_rank.load();
  if (aborted != 0 && aborted - 1 != rank()) {
    const int a = aborted - 1;
    throw CommError(fmt::format("{} failed: rank {} aborted the group: {}", c.what(), a,
                                std::string(ctl(a).error, strnlen(ctl(a).error, sizeof(ctl(a).error)))));
  }
  // The peer we wait for first, then everyone else that still owes this collective something: a
  // dead rank that has not finished it dooms it. One that finished it (a non-root of a gather
  // whose input sat in a slot, say) may have left since, as may a rank outside a send/recv pair;
  // whoever waits for them in a later collective reports it there.
  const bool collective = c.desc.seq >= 0;
  const uint64_t finished = collective ? (static_cast<uint64_t>(c.desc.seq) << 32 | kFinal) : 0;
  for (int i = -1; i < size(); ++i) {
    const int p = i < 0 ? waiting_for : i;
    if (p == rank() || (i >= 0 && p == waiting_for)) continue;
    RankCtl& pc = ctl(p);
    if (i >= 0 && (!collective || pc.progress.load(std::memory_order_acquire) >= finished)) continue;
    const pid_t pid = pc.pid.load();
    // Only a pid of our own pid namespace names a process we can look up (containers sharing
    // /dev/shm and a host name may not share one); elsewhere state, abort and timeout tell.
    if (pc.pid_scope.load() == my_pid_scope_hash() && !process_alive(pid)) {
      fail(c, fmt::format("{} failed: rank {} (pid {}) died while rank {} waited for {}. {}", c.what(), p,
                          static_cast<long>(pid), rank(), what(), diagnosis(c, "Last seen")),
           false);
    }
    if (pc.state.load() == 1) {
      fail(c, fmt::format("{} failed: rank {} left the group (destroyed it) while rank {} waited for {}. {}",
                          c.what(), p, rank(), what(), diagnosis(c, "Last seen")),
           false);
    }
  }
}

void ShmGroup::fail(Ctx& c, const std::string& msg, bool timeout) {
  announce_failure(msg);
  if (timeout) throw Timeout(msg);
  throw CommError(msg);
}

void ShmGroup::announce_failure(const std::string& msg) noexcept {
  RankCtl& mine = ctl(rank());
  if (mine.state.load() == 2) return;  // announced already
  std::snprintf(mine.error, sizeof(mine.error), "%s", msg.c_str());
  mine.state.store(2);
  int32_t expected = 0;
  hdr()->abort_rank.compare_exchange_strong(expected, rank() + 1);
  for (int p = 0; p < size(); ++p) {
    ctl(p).epoch.fetch_add(1);
    futex_wake_all(&ctl(p).epoch);
  }
}

std::string ShmGroup::describe_rank(int p, int64_t my_seq) const {
  const RankCtl& pc = ctl(p);
  const uint64_t v = pc.progress.load(std::memory_order_acquire);
  const int64_t s = static_cast<int64_t>(v >> 32);
  const uint32_t step = static_cast<uint32_t>(v);
  if (v == 0) return fmt::format("rank {} has not issued any collective", p);
  const Desc d = pc.recent[s % kRecent];
  const std::string at = d.seq == s ? d.str() : fmt::format("collective #{}", s);
  if (step == kFinal) {
    if (s + 1 == my_seq) return fmt::format("rank {} finished {} and has not issued #{}", p, at, my_seq);
    return fmt::format("rank {} finished {}", p, at);
  }
  return fmt::format("rank {} is at {}", p, at);
}

std::string ShmGroup::diagnosis(Ctx& c, const char* label) const {
  if (c.desc.seq < 0) return {};
  std::vector<std::string> parts;
  for (int p = 0; p < size(); ++p) {
    if (p == rank()) continue;
    const uint64_t v = ctl(p).progress.load(std::memory_order_acquire);
    const int64_t s = static_cast<int64_t>(v >> 32);
    if (s == c.desc.seq && static_cast<uint32_t>(v) >= 1) {
      const Desc d = ctl(p).recent[s % kRecent];
      if (d.seq == s && !d.same_call(c.desc)) parts.push_back(fmt::format("rank {} is at {}", p, d.str()));
      continue;  // in the same collective
    }
    parts.push_back(describe_rank(p, c.desc.seq));
  }
  if (parts.empty()) return fmt::format("Every rank is in #{}.", c.desc.seq);
  return fmt::format("{}: {} while rank {} waits in {}.", label, fmt::join(parts, "; "), rank(), c.desc.str());
}

void ShmGroup::wait_progress(Ctx& c, int p, int64_t seq, uint32_t step, const char* what) {
  const uint64_t target = (static_cast<uint64_t>(seq) << 32) | step;
  uint64_t& seen = seen_[static_cast<size_t>(p)];
  if (seen >= target) return;  // progress is monotonic: no need to touch p's cache line
  std::atomic<uint64_t>& prog = ctl(p).progress;
  seen = prog.load(std::memory_order_acquire);
  if (seen >= target) return;  // before building the closures
  wait_until(c, p, [&] { return (seen = prog.load(std::memory_order_acquire)) >= target; },
             [&] { return fmt::format("rank {} ({})", p, what); });
}

uint64_t ShmGroup::arrived(Ctx& c, int p) {
  const int64_t seq = c.desc.seq;
  wait_progress(c, p, seq, 1, "to enter the collective");
  // Fast path: p's descriptor from the progress line we just read (seqlock, see RankCtl).
  RankCtl& pc = ctl(p);
  if (static_cast<int64_t>(seen_[static_cast<size_t>(p)] >> 32) == seq) {
    const uint64_t call = pc.cur_call.load(std::memory_order_relaxed);
    const int64_t count = pc.cur_count.load(std::memory_order_relaxed);
    const uint64_t code = pc.cur_code.load(std::memory_order_relaxed);
    const uint64_t history = pc.cur_history.load(std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_acquire);
    const uint64_t again = pc.progress.load(std::memory_order_relaxed);
    if (static_cast<int64_t>(again >> 32) == seq) {
      Desc mine = c.desc;
      if (call == pack_call(mine) && (count == mine.count || mine.op == Op::barrier) && history == mine.history) {
        return code;
      }
    }
  }
  // p moved on already (or does not match): its descriptor from the ring of recent ones.
  const Desc d = pc.recent[seq % kRecent];
  if (d.seq != seq || !d.same_call(c.desc)) {
    fail(c, fmt::format("{}: collective mismatch at #{}: rank {} called {} while rank {} called {}; every rank "
                        "must issue the same collectives in the same order with the same dtype, count and root",
                        c.what(), seq, p, d.str(), rank(), c.desc.str()),
         false);
  }
  if (d.history != c.desc.history) {
    // An earlier collective differed where nobody compared it (e.g. two ranks each broadcast as
    // the root): name it when it is still in both rings.
    std::string which = "in a collective no longer in both ranks' rings of recent ones";
    const RankCtl& me = ctl(rank());
    for (int64_t s = std::max<int64_t>(0, seq - kRecent + 1); s < seq; ++s) {
      const Desc& theirs = pc.recent[s % kRecent];
      const Desc& ours = me.recent[s % kRecent];
      if (theirs.seq == s && ours.seq == s && !theirs.same_call(ours)) {
        which = fmt::format("at #{}: rank {} called {} while rank {} called {}", s, p, theirs.str(), rank(), ours.str());
        break;
      }
    }
    fail(c, fmt::format("{}: collective mismatch before #{}: rank {} and rank {} issued different collectives "
                        "earlier, {}; every rank must issue the same collectives in the same order with the same "
                        "dtype, count and root",
                        c.what(), seq, p, rank(), which),
         false);
  }
  return d.code;
}

void ShmGroup::wait_all_final(Ctx& c) {
  for (int i = 1; i < size(); ++i) {
    const int p = (rank() + i) % size();
    wait_progress(c, p, c.desc.seq, kFinal, "to finish reading this rank's buffer");
  }
}

void ShmGroup::enter(Ctx& c, uint64_t code) {
  // Bounded lead: collectives that need no peer (count 0, a broadcast root) could otherwise run
  // arbitrarily far ahead and overwrite descriptors in recent[] that a slower rank still reads.
  if (c.desc.seq >= kMaxLead) {
    for (int i = 1; i < size(); ++i) {
      const int p = (rank() + i) % size();
      wait_progress(c, p, c.desc.seq - kMaxLead, 1, "to catch up: a rank runs at most 8 collectives ahead");
    }
  }
  Desc d = c.desc;
  d.code = code;
  RankCtl& mine = ctl(rank());
  // Seqlock write of the descriptor in the progress line: (seq, 0) first, so a reader that
  // catches the new values also sees that progress moved on (and falls back to recent[]).
  mine.progress.store(static_cast<uint64_t>(d.seq) << 32, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  mine.cur_call.store(pack_call(d), std::memory_order_relaxed);
  mine.cur_count.store(d.count, std::memory_order_relaxed);
  mine.cur_code.store(code, std::memory_order_relaxed);
  mine.cur_history.store(d.history, std::memory_order_relaxed);
  mine.cpu.store(sched_getcpu(), std::memory_order_relaxed);
  mine.recent[d.seq % kRecent] = d;
  publish(d.seq, 1);
}

std::optional<size_t> ShmGroup::scratch_alloc(Ctx& c, size_t nbytes) {
  int error = 0;
  auto off = heap_->allocate(nbytes, &error);
  if (!off && error != 0) {
    fail(c, fmt::format("{}: no room in shared memory for {} bytes of scratch ({}: {}); {}", c.what(), nbytes,
                        std::strerror(error), shm_space_summary(), kShmSpaceHint),
         false);
  } else if (!off) {
    fail(c, fmt::format("{}: no room for {} bytes of scratch in the shm heap ({} bytes); raise "
                        "TANDEM_SHM_HEAP_BYTES or free allocate()d buffers",
                        c.what(), nbytes, heap_->segment()->size()),
         false);
  }
  return off;
}

ShmGroup::Exposure ShmGroup::expose(Ctx& c, const void* src, size_t nbytes, bool copy_in, bool in_place) {
  Exposure e;
  if (in_place) {
    if (auto off = heap_->offset_of(src, nbytes)) {
      e.trailing = true;
      e.code = *off;
      e.ptr = heap_->base() + *off;
      return e;
    }
  }
  if (nbytes <= kSlotBytes) {
    // Our slot of this parity was last read in #seq-2; a peer that entered #seq-1 is done with it.
    if (c.desc.seq >= 1) {
      for (int i = 1; i < size(); ++i) {
        const int p = (rank() + i) % size();
        wait_progress(c, p, c.desc.seq - 1, 1, "to enter the previous collective");
      }
    }
    e.code = kSlotCode;
    e.ptr = slot(rank(), c.desc.seq);
    if (copy_in && nbytes > 0) std::memcpy(e.ptr, src, nbytes);
    return e;
  }
  e.trailing = true;
  if (auto off = heap_->offset_of(src, nbytes)) {
    e.code = *off;
    e.ptr = heap_->base() + *off;
    return e;
  }
  e.scratch = scratch_alloc(c, nbytes);
  e.code = *e.scratch;
  e.ptr = heap_->base() + *e.scratch;
  if (copy_in) std::memcpy(e.ptr, src, nbytes);
  return e;
}

void ShmGroup::release(Exposure& e) noexcept {
  if (e.scratch) heap_->free(*e.scratch);
  e.scratch.reset();
}

// ---- collectives ----

void ShmGroup::do_all_reduce(Ctx& c, Buffer buf, ReduceOp op, int root) {
  const int n = size(), me = rank();
  const int64_t seq = c.desc.seq;
  const size_t es = element_size(buf.dtype);
  const size_t nbytes = buf.nbytes();
  if (buf.count == 0) return;
  // Per-rank pointers and input locations, on the stack for up to 8 ranks (no allocation on the
  // latency path).
  const void* ins_small[8];
  void* outs_small[8];
  uint64_t codes_small[8];
  std::vector<const void*> ins_heap(n > 8 ? n : 0);
  std::vector<void*> outs_heap(n > 8 ? n : 0);
  std::vector<uint64_t> codes_heap(n > 8 ? n : 0);
  const void** ins = n > 8 ? ins_heap.data() : ins_small;
  void** outs = n > 8 ? outs_heap.data() : outs_small;
  uint64_t* codes = n > 8 ? codes_heap.data() : codes_small;
  const bool small = nbytes <= small_bytes_;
  if (small && !(small_push_ && root < 0)) {
    // Slots: one synchronisation (every rank copies its input to its slot, then reduces all slots).
    Exposure e = expose(c, buf.data, nbytes, true);
    enter(c, e.code);
    for (int i = 1; i < n; ++i) arrived(c, (me + i) % n);
    if (root < 0 || root == me) {
      // Our own input straight from the caller's buffer (same values as our slot, already in
      // this core's cache); the output overwrites it element by element, which reduce_arrays allows.
      for (int p = 0; p < n; ++p) ins[p] = p == me ? buf.data : peer_ptr(p, kSlotCode, seq);
      reduce_arrays(buf.data, ins, n, buf.count, buf.dtype, op, n);
    }
    // Nobody waits for this step (a slot is recycled once its readers entered the next
    // collective), so a plain store: no fence, no wake-up check.
    publish_quiet(seq, kFinal);
    return;
  }
  // In place when the buffer is ours to share (allocate()): peers read and write it directly.
  // Otherwise a slot (small) or heap scratch holds a copy; the result is copied back at the end.
  Exposure e = expose(c, buf.data, nbytes, true, /*in_place=*/true);
  ExposureGuard guard{this, &e};
  enter(c, e.code);
  codes[me] = e.code;
  for (int i = 1; i < n; ++i) {
    const int p = (me + i) % n;
    codes[p] = arrived(c, p);
  }
  // Slices of ~count/n elements, each a multiple of 64 bytes; chunks of chunk_bytes_.
  const int64_t align = std::max<int64_t>(1, 64 / static_cast<int64_t>(es));
  const int64_t per = (buf.count + n - 1) / n;
  const int64_t slice = (per + align - 1) / align * align;
  const int64_t chunk = std::max<int64_t>(align, static_cast<int64_t>(chunk_bytes_ / es) / align * align);
  auto slice_of = [&](int p) {
    const int64_t lo = std::min<int64_t>(buf.count, p * slice);
    return std::pair<int64_t, int64_t>(lo, std::min<int64_t>(buf.count, lo + slice));
  };
  if (root < 0 && (push_ || small)) {
    // Push: reduce our slice chunk by chunk (rank order) into our exposure and write each reduced
    // chunk straight into every peer's exposure (nobody else reads or writes that slice), so
    // there is no separate all-gather pass. One barrier at the end: after it our exposure holds
    // the whole result and nobody touches it any more. Every element is combined by one rank,
    // in rank order, so all ranks get the same bits.
    auto [lo, hi] = slice_of(me);
    for (int64_t b = lo; b < hi; b += chunk) {
      const int64_t m = std::min(chunk, hi - b);
      for (int p = 0; p < n; ++p) ins[p] = (p == me ? e.ptr : peer_ptr(p, codes[p], seq)) + b * es;
      // Each result vector is stored into our exposure and every peer's in the same pass
      // (measured on W1's 7.4 MB of f32 gradients over 2 ranks: 0.57 -> 0.46 ms of CPU per
      // rank, against a reduce followed by a memcpy per peer).
      outs[0] = e.ptr + b * es;
      for (int i = 1; i < n; ++i) outs[i] = const_cast<void*>(ins[(me + i) % n]);
      reduce_arrays_to(outs, n, ins, n, m, buf.dtype, op, n);
    }
    publish(seq, kFinal);
    wait_all_final(c);
    if (e.ptr != buf.data) std::memcpy(buf.data, e.ptr, nbytes);
    return;
  }
  // Reduce-scatter: our slice, chunk by chunk, from every rank's buffer (rank order) into ours.
  {
    auto [lo, hi] = slice_of(me);
    uint32_t step = 2;
    for (int64_t b = lo; b < hi; b += chunk, ++step) {
      const int64_t m = std::min(chunk, hi - b);
      for (int p = 0; p < n; ++p) ins[p] = (p == me ? e.ptr : peer_ptr(p, codes[p], seq)) + b * es;
      reduce_arrays(e.ptr + b * es, ins, n, m, buf.dtype, op, n);
      publish(seq, step);
    }
  }
  // All-gather: the other slices, chunk by chunk as their owners finish them.
  if (root < 0 || root == me) {
    auto* out = static_cast<uint8_t*>(buf.data);
    for (int i = 1; i < n; ++i) {
      const int p = (me + i) % n;
      auto [lo, hi] = slice_of(p);
      const uint8_t* src = peer_ptr(p, codes[p], seq);
      uint32_t step = 2;
      for (int64_t b = lo; b < hi; b += chunk, ++step) {
        const int64_t m = std::min(chunk, hi - b);
        wait_progress(c, p, seq, step, "to reduce its slice");
        std::memcpy(out + b * es, src + b * es, static_cast<size_t>(m) * es);
      }
    }
    if (e.ptr != out) {
      auto [lo, hi] = slice_of(me);
      if (hi > lo) std::memcpy(out + lo * es, e.ptr + lo * es, static_cast<size_t>(hi - lo) * es);
    }
  }
  publish(seq, kFinal);
  wait_all_final(c);
}

void ShmGroup::do_broadcast(Ctx& c, Buffer buf, int root) {
  const int64_t seq = c.desc.seq;
  const size_t nbytes = buf.nbytes();
  if (buf.count == 0) return;
  if (rank() == root) {
    Exposure e = expose(c, buf.data, nbytes, true);
    ExposureGuard guard{this, &e};
    enter(c, e.code);
    publish(seq, kFinal);
    if (e.trailing) wait_all_final(c);
    return;
  }
  enter(c, 0);
  arrived(c, root);
  const uint64_t code = ctl(root).recent[seq % kRecent].code;
  std::memcpy(buf.data, peer_ptr(root, code, seq), nbytes);
  publish(seq, kFinal);
}

void ShmGroup::do_all_gather(Ctx& c, const std::vector<Buffer>& outs, Buffer in) {
  const int n = size(), me = rank();
  const int64_t seq = c.desc.seq;
  const size_t nbytes = in.nbytes();
  if (in.count == 0) return;
  Exposure e = expose(c, in.data, nbytes, true);
  ExposureGuard guard{this, &e};
  enter(c, e.code);
  std::memcpy(outs[me].data, in.data, nbytes);
  for (int i = 1; i < n; ++i) {
    const int p = (me + i) % n;
    arrived(c, p);
    std::memcpy(outs[p].data, peer_ptr(p, ctl(p).recent[seq % kRecent].code, seq), nbytes);
  }
  publish(seq, kFinal);
  if (e.trailing) wait_all_final(c);
}

void ShmGroup::do_reduce_scatter(Ctx& c, Buffer out, Buffer in, ReduceOp op) {
  const int n = size(), me = rank();
  const int64_t seq = c.desc.seq;
  if (out.count == 0) return;
  Exposure e = expose(c, in.data, in.nbytes(), true);
  ExposureGuard guard{this, &e};
  enter(c, e.code);
  for (int i = 1; i < n; ++i) arrived(c, (me + i) % n);
  std::vector<const void*> ins(n);
  const size_t off = static_cast<size_t>(me) * out.nbytes();
  for (int p = 0; p < n; ++p) {
    ins[p] = (p == me ? static_cast<const uint8_t*>(in.data) : peer_ptr(p, ctl(p).recent[seq % kRecent].code, seq)) + off;
  }
  reduce_arrays(out.data, ins.data(), n, out.count, out.dtype, op, n);
  publish(seq, kFinal);
  if (e.trailing) wait_all_final(c);
}

void ShmGroup::do_gather(Ctx& c, Buffer out, Buffer in, int root) {
  const int n = size(), me = rank();
  const int64_t seq = c.desc.seq;
  const size_t nbytes = in.nbytes();
  if (in.count == 0) return;
  if (me != root) {
    Exposure e = expose(c, in.data, nbytes, true);
    ExposureGuard guard{this, &e};
    enter(c, e.code);
    publish(seq, kFinal);
    if (e.trailing) wait_progress(c, root, seq, kFinal, "to finish reading this rank's buffer");
    return;
  }
  enter(c, 0);
  auto* o = static_cast<uint8_t*>(out.data);
  std::memcpy(o + static_cast<size_t>(me) * nbytes, in.data, nbytes);
  for (int i = 1; i < n; ++i) {
    const int p = (me + i) % n;
    arrived(c, p);
    std::memcpy(o + static_cast<size_t>(p) * nbytes, peer_ptr(p, ctl(p).recent[seq % kRecent].code, seq), nbytes);
  }
  publish(seq, kFinal);
}

void ShmGroup::do_scatter(Ctx& c, Buffer out, Buffer in, int root) {
  const int64_t seq = c.desc.seq;
  const size_t nbytes = out.nbytes();
  if (out.count == 0) return;
  if (rank() == root) {
    Exposure e = expose(c, in.data, in.nbytes(), true);
    ExposureGuard guard{this, &e};
    enter(c, e.code);
    std::memcpy(out.data, static_cast<const uint8_t*>(in.data) + static_cast<size_t>(rank()) * nbytes, nbytes);
    publish(seq, kFinal);
    if (e.trailing) wait_all_final(c);
    return;
  }
  enter(c, 0);
  arrived(c, root);
  const uint8_t* src = peer_ptr(root, ctl(root).recent[seq % kRecent].code, seq);
  std::memcpy(out.data, src + static_cast<size_t>(rank()) * nbytes, nbytes);
  publish(seq, kFinal);
}

void ShmGroup::do_all_to_all(Ctx& c, Buffer out, Buffer in) {
  const int n = size(), me = rank();
  const int64_t seq = c.desc.seq;
  if (in.count == 0) return;
  const size_t blk = in.nbytes() / static_cast<size_t>(n);
  Exposure e = expose(c, in.data, in.nbytes(), true);
  ExposureGuard guard{this, &e};
  enter(c, e.code);
  auto* o = static_cast<uint8_t*>(out.data);
  std::memcpy(o + me * blk, static_cast<const uint8_t*>(in.data) + me * blk, blk);
  for (int i = 1; i < n; ++i) {
    const int p = (me + i) % n;
    arrived(c, p);
    std::memcpy(o + p * blk, peer_ptr(p, ctl(p).recent[seq % kRecent].code, seq) + me * blk, blk);
  }
  publish(seq, kFinal);
  if (e.trailing) wait_all_final(c);
}

void ShmGroup::do_barrier(Ctx& c) {
  enter(c, 0);
  for (int i = 1; i < size(); ++i) arrived(c, (rank() + i) % size());
  publish(c.desc.seq, kFinal);
}

// Point to point: eager. The sender copies into its heap, posts a message in the (src, dst)
// mailbox and is done; the receiver copies out and bumps `consumed`, which frees the copy.
void ShmGroup::do_send(Ctx& c, Buffer buf, int dst, int tag) {
  Mailbox& mb = mailbox(rank(), dst);
  const uint64_t idx = mb.posted.load(std::memory_order_relaxed);
  wait_until(c, dst, [&] { return mb.consumed.load(std::memory_order_acquire) + kMailDepth > idx; },
             [&] { return fmt::format("rank {} to receive earlier messages ({} in flight)", dst, kMailDepth); });
  reclaim_sends();
  size_t off = 0;
  if (buf.nbytes() > 0) {
    off = *scratch_alloc(c, buf.nbytes());
    std::memcpy(heap_->base() + off, buf.data, buf.nbytes());
    pending_sends_[dst].push_back({idx, off});
    ++pending_send_count_;
  }
  mb.msgs[idx % kMailDepth] = Msg{tag, buf.dtype, buf.count, off};
  mb.posted.store(idx + 1, std::memory_order_release);
  {
    RankCtl& mine = ctl(rank());
    mine.epoch.fetch_add(1, std::memory_order_seq_cst);
    if (mine.waiters.load(std::memory_order_seq_cst) > 0) futex_wake_all(&mine.epoch);
  }
}

void ShmGroup::do_recv(Ctx& c, Buffer buf, int src, int tag) {
  Mailbox& mb = mailbox(src, rank());
  const uint64_t idx = mb.consumed.load(std::memory_order_relaxed);
  wait_until(c, src, [&] { return mb.posted.load(std::memory_order_acquire) > idx; },
             [&] { return fmt::format("rank {} to send (tag {})", src, tag); });
  const Msg m = mb.msgs[idx % kMailDepth];
  if (m.tag != tag || m.dtype != buf.dtype || m.count != buf.count) {
    fail(c, fmt::format("{}: the next message from rank {} is tag {} ({}, {}) but this recv expects tag {} ({}, {}); "
                        "sends and recvs between two ranks are matched in issue order",
                        c.what(), src, m.tag, short_dtype_name(m.dtype), m.count, tag, short_dtype_name(buf.dtype),
                        buf.count),
         false);
  }
  if (buf.nbytes() > 0) std::memcpy(buf.data, heaps_[src]->data() + m.code, buf.nbytes());
  mb.consumed.store(idx + 1, std::memory_order_release);
  RankCtl& mine = ctl(rank());
  mine.epoch.fetch_add(1, std::memory_order_seq_cst);
  if (mine.waiters.load(std::memory_order_seq_cst) > 0) futex_wake_all(&mine.epoch);
}

void ShmGroup::reclaim_sends() noexcept {
  if (pending_send_count_ == 0) return;
  for (int dst = 0; dst < size(); ++dst) {
    auto& v = pending_sends_[dst];
    if (v.empty()) continue;
    const uint64_t consumed = mailbox(rank(), dst).consumed.load(std::memory_order_acquire);
    size_t k = 0;
    while (k < v.size() && v[k].first < consumed) heap_->free(v[k++].second);
    pending_send_count_ -= static_cast<int64_t>(k);
    v.erase(v.begin(), v.begin() + static_cast<ptrdiff_t>(k));
  }
}

// ---- the public collectives: validation on the caller's thread, then issue ----

void ShmGroup::validate(const Buffer& b, const char* op, const char* which) const {
  TANDEM_CHECK(b.device == kCPU, ValueError, "shm {}: the {} buffer is on a CUDA device; the shm backend moves host "
               "memory only (use the nccl backend for CUDA buffers)", op, which);
  TANDEM_CHECK(b.count >= 0, ValueError, "shm {}: the {} buffer has a negative count {}", op, which, b.count);
  TANDEM_CHECK(b.count == 0 || b.data != nullptr, ValueError, "shm {}: the {} buffer has {} elements but no data",
               op, which, b.count);
}

void check_root(int root, int size, const char* op) {
  TANDEM_CHECK(root >= 0 && root < size, ValueError, "shm {}: root {} is outside the group of size {}", op, root, size);
}
void check_reducible(DType d, ReduceOp op, const char* name) {
  TANDEM_CHECK(d != DType::b8, ValueError, "shm {}: {} on a bool buffer: reductions need a numeric dtype (cast to u8)",
               name, reduce_op_name(op));
}
void check_same(const Buffer& a, const Buffer& b, int64_t expected_a_count, const char* op, const char* rule) {
  TANDEM_CHECK(a.dtype == b.dtype, ValueError, "shm {}: output dtype {} differs from input dtype {}", op,
               short_dtype_name(a.dtype), short_dtype_name(b.dtype));
  TANDEM_CHECK(a.count == expected_a_count, ValueError, "shm {}: {} (got {}, expected {})", op, rule, a.count,
               expected_a_count);
}

std::shared_ptr<Work> ShmGroup::all_reduce(Buffer buf, ReduceOp op) {
  validate(buf, "all_reduce", "");
  check_reducible(buf.dtype, op, "all_reduce");
  Task t;
  t.op = Op::all_reduce;
  t.a = buf;
  t.redop = op;
  return issue(std::move(t), buf.nbytes());
}

std::shared_ptr<Work> ShmGroup::broadcast(Buffer buf, int root) {
  validate(buf, "broadcast", "");
  check_root(root, size(), "broadcast");
  Task t;
  t.op = Op::broadcast;
  t.a = buf;
  t.root = root;
  return issue(std::move(t), buf.nbytes());
}

std::shared_ptr<Work> ShmGroup::reduce(Buffer buf, int root, ReduceOp op) {
  validate(buf, "reduce", "");
  check_root(root, size(), "reduce");
  check_reducible(buf.dtype, op, "reduce");
  Task t;
  t.op = Op::reduce;
  t.a = buf;
  t.root = root;
  t.redop = op;
  return issue(std::move(t), buf.nbytes());
}

std::shared_ptr<Work> ShmGroup::all_gather(Buffer out, Buffer in) {
  validate(out, "all_gather", "output");
  validate(in, "all_gather", "input");
  check_same(out, in, in.count * size(), "all_gather", "the output must hold size() * input count elements");
  std::vector<Buffer> outs(size());
  for (int r = 0; r < size(); ++r) {
    outs[r] = Buffer{static_cast<uint8_t*>(out.data) + static_cast<size_t>(r) * in.nbytes(), in.count, in.dtype, out.device};
  }
  return all_gather(std::move(outs), in);
}

std::shared_ptr<Work> ShmGroup::all_gather(std::vector<Buffer> outs, Buffer in) {
  validate(in, "all_gather", "input");
  TANDEM_CHECK(static_cast<int>(outs.size()) == size(), ValueError,
               "shm all_gather: the output list has {} buffers, expected one per rank ({})", outs.size(), size());
  for (auto& o : outs) {
    validate(o, "all_gather", "output");
    check_same(o, in, in.count, "all_gather", "each output buffer must hold the input count");
  }
  Task t;
  t.op = Op::all_gather;
  t.outs = std::move(outs);
  t.b = in;
  return issue(std::move(t), in.nbytes() * static_cast<size_t>(size()));
}

std::shared_ptr<Work> ShmGroup::reduce_scatter(Buffer out, Buffer in, ReduceOp op) {
  validate(out, "reduce_scatter", "output");
  validate(in, "reduce_scatter", "input");
  check_reducible(in.dtype, op, "reduce_scatter");
  check_same(in, out, out.count * size(), "reduce_scatter", "the input must hold size() * output count elements");
  Task t;
  t.op = Op::reduce_scatter;
  t.a = out;
  t.b = in;
  t.redop = op;
  return issue(std::move(t), in.nbytes());
}

std::shared_ptr<Work> ShmGroup::gather(Buffer out, Buffer in, int root) {
  validate(in, "gather", "input");
  check_root(root, size(), "gather");
  if (rank() == root) {
    validate(out, "gather", "output");
    check_same(out, in, in.count * size(), "gather", "the root's output must hold size() * input count elements");
  }
  Task t;
  t.op = Op::gather;
  t.a = out;
  t.b = in;
  t.root = root;
  return issue(std::move(t), in.nbytes() * static_cast<size_t>(size()));
}

std::shared_ptr<Work> ShmGroup::scatter(Buffer out, Buffer in, int root) {
  validate(out, "scatter", "output");
  check_root(root, size(), "scatter");
  if (rank() == root) {
    validate(in, "scatter", "input");
    check_same(in, out, out.count * size(), "scatter", "the root's input must hold size() * output count elements");
  }
  Task t;
  t.op = Op::scatter;
  t.a = out;
  t.b = in;
  t.root = root;
  return issue(std::move(t), out.nbytes() * static_cast<size_t>(size()));
}

std::shared_ptr<Work> ShmGroup::all_to_all(Buffer out, Buffer in) {
  validate(out, "all_to_all", "output");
  validate(in, "all_to_all", "input");
  TANDEM_CHECK(in.count % size() == 0, ValueError,
               "shm all_to_all: the input count {} is not a multiple of the group size {}", in.count, size());
  check_same(out, in, in.count, "all_to_all", "output and input must have the same count");
  Task t;
  t.op = Op::all_to_all;
  t.a = out;
  t.b = in;
  return issue(std::move(t), in.nbytes());
}

std::shared_ptr<Work> ShmGroup::barrier() {
  Task t;
  t.op = Op::barrier;
  return issue(std::move(t), 0);
}

std::shared_ptr<Work> ShmGroup::send(Buffer buf, int dst, int tag) {
  validate(buf, "send", "");
  TANDEM_CHECK(dst >= 0 && dst < size() && dst != rank(), ValueError,
               "shm send: destination {} must be another rank of the group of size {} (this is rank {})", dst,
               size(), rank());
  Task t;
  t.op = Op::send;
  t.a = buf;
  t.peer = dst;
  t.tag = tag;
  return issue(std::move(t), buf.nbytes());
}

std::shared_ptr<Work> ShmGroup::recv(Buffer buf, int src, int tag) {
  validate(buf, "recv", "");
  TANDEM_CHECK(src >= 0 && src < size() && src != rank(), ValueError,
               "shm recv: source {} must be another rank of the group of size {} (this is rank {})", src, size(),
               rank());
  Task t;
  t.op = Op::recv;
  t.a = buf;
  t.peer = src;
  t.tag = tag;
  return issue(std::move(t), buf.nbytes());
}

std::shared_ptr<void> ShmGroup::allocate(size_t bytes) {
  auto off = heap_->allocate(bytes);
  if (!off) return ProcessGroup::allocate(bytes);  // heap full: ordinary memory, collectives copy
  std::shared_ptr<Heap> heap = heap_;
  return std::shared_ptr<void>(heap->base() + *off, [heap, o = *off](void*) { heap->free(o); });
}

}  // namespace
}  // namespace shm

std::shared_ptr<ProcessGroup> make_shm_group(std::shared_ptr<Store> store, int rank, int size,
                                             ProcessGroupOptions options) {
  TANDEM_CHECK(store != nullptr, ValueError, "make_shm_group: the store is null");
  return std::make_shared<shm::ShmGroup>(std::move(store), rank, size, options);
}

}  // namespace tandem::dist
