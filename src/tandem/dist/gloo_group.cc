// The gloo process-group backend (Debian's libgloo), for comparison with shm and mpi: TCP pairs
// between every two ranks, rendezvous through our Store. all_reduce, broadcast, all_gather and
// barrier; other collectives throw "backend 'gloo' does not support ...". Invariant: one progress
// thread per group runs the collectives in issue order; gloo enforces the group's timeout itself.
// Each collective is preceded by an exchange of the ranks' calls (collective_call.h).
#include "tandem/dist/backends.h"

#ifndef TANDEM_WITH_GLOO

namespace tandem::dist {
std::shared_ptr<ProcessGroup> make_gloo_group(std::shared_ptr<Store>, int, int, ProcessGroupOptions) {
  throw ValueError("Tandem was built without gloo: install libgloo-dev and rebuild");
}
}  // namespace tandem::dist

#else

#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>

#include "tandem/core/convert.h"
#include "tandem/dist/collective_call.h"
#include "tandem/dist/shm_segment.h"

namespace tandem::dist {
namespace {

// gloo's rendezvous store interface over ours (keys and values pass through unchanged).
class GlooStore final : public gloo::rendezvous::Store {
 public:
  explicit GlooStore(std::shared_ptr<dist::Store> store) : store_(std::move(store)) {}
  void set(const std::string& key, const std::vector<char>& data) override {
    store_->set(key, Bytes(data.begin(), data.end()));
  }
  std::vector<char> get(const std::string& key) override {
    const Bytes b = store_->get(key);
    return std::vector<char>(b.begin(), b.end());
  }
  void wait(const std::vector<std::string>& keys) override { store_->wait(keys); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    store_->wait(keys, timeout);
  }

 private:
  std::shared_ptr<dist::Store> store_;
};

// Where a pid means something: the machine (hostname and boot id) and the pid namespace. Two
// ranks with the same identity can check each other's pid.
std::string host_identity() {
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  return fmt::format("{} {}", host, pid_scope());
}

template <class T>
void reduce_fn(ReduceOp op, void* c_, const void* a_, const void* b_, size_t n) {
  T* c = static_cast<T*>(c_);
  const T* a = static_cast<const T*>(a_);
  const T* b = static_cast<const T*>(b_);
  switch (op) {
    case ReduceOp::SUM: case ReduceOp::AVG: for (size_t i = 0; i < n; ++i) c[i] = static_cast<T>(a[i] + b[i]); break;
    case ReduceOp::PRODUCT: for (size_t i = 0; i < n; ++i) c[i] = static_cast<T>(a[i] * b[i]); break;
    case ReduceOp::MAX: for (size_t i = 0; i < n; ++i) c[i] = std::max(a[i], b[i]); break;
    case ReduceOp::MIN: for (size_t i = 0; i < n; ++i) c[i] = std::min(a[i], b[i]); break;
  }
}

using Call = CollectiveCall;  // exchanged before each collective (collective_call.h)

struct Task {
  std::shared_ptr<Work> work;
  std::function<void()> run;
  Call call;
  int64_t seq = 0;
};

class GlooGroup final : public ProcessGroup {
 public:
  GlooGroup(std::shared_ptr<Store> store, int rank, int size, ProcessGroupOptions options)
      : ProcessGroup(rank, size, options) {
    TANDEM_CHECK(store != nullptr, ValueError, "gloo backend: needs a store for the rendezvous, got none");
    gloo::transport::tcp::attr attr;
    const char* host = std::getenv("TANDEM_GLOO_HOST");  // the address peers reach us at
    attr.hostname = host != nullptr ? host : "127.0.0.1";
    // gloo writes to its sockets without MSG_NOSIGNAL, so a write to a dead peer raises SIGPIPE,
    // whose default action kills the whole process before the error could be reported. SIGPIPE
    // from a write goes to the writing thread: every thread that writes to gloo's sockets (this
    // one during the rendezvous, gloo's device loop and our progress thread, which inherit the
    // mask at their creation below) blocks it, so the write fails with EPIPE and gloo throws.
    // The process's other threads and its signal dispositions are left alone.
    sigset_t sigpipe, previous;
    sigemptyset(&sigpipe);
    sigaddset(&sigpipe, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &sigpipe, &previous);
    struct RestoreMask {
      sigset_t mask;
      ~RestoreMask() {
        // A rendezvous write to a peer that died left a SIGPIPE pending here: take it before
        // unblocking, or it would kill the process now (the constructor throws instead).
        sigset_t pending, only;
        sigemptyset(&only);
        sigaddset(&only, SIGPIPE);
        if (sigpending(&pending) == 0 && sigismember(&pending, SIGPIPE) == 1 && sigismember(&mask, SIGPIPE) == 0) {
          const timespec now{0, 0};
          sigtimedwait(&only, nullptr, &now);
        }
        pthread_sigmask(SIG_SETMASK, &mask, nullptr);
      }
    } restore{previous};
    try {
      auto device = gloo::transport::tcp::CreateDevice(attr);
      auto context = std::make_shared<gloo::rendezvous::Context>(rank, size);
      context->setTimeout(options.timeout);
      GlooStore adapter(std::make_shared<PrefixStore>("gloo", store));
      context->connectFullMesh(adapter, device);
      context_ = context;
      // Every rank's host and pid, so that a failure can name a peer that died on this host
      // (gloo's own error only gives the socket's address).
      PrefixStore peers("gloo-peers", store);
      const std::string mine = fmt::format("{}\n{}", getpid(), identity_);
      peers.set(std::to_string(rank), Bytes(mine.begin(), mine.end()));
      for (int r = 0; r < size; ++r) {
        const Bytes b = peers.get(std::to_string(r));
        const std::string v(b.begin(), b.end());
        const size_t nl = v.find('\n');
        peer_pids_.push_back(nl == std::string::npos ? 0 : static_cast<pid_t>(std::atoll(v.substr(0, nl).c_str())));
        peer_hosts_.push_back(nl == std::string::npos ? std::string() : v.substr(nl + 1));
      }
      if (rank == 0) peers.set("check-calls", collective_check_wanted() ? "1" : "0");
      check_calls_ = to_string(peers.get("check-calls")) == "1";
    } catch (const Error&) {
      throw;
    } catch (const std::exception& e) {
      throw CommError(fmt::format("gloo backend (rank {} of {}): connecting the ranks over TCP ({}) failed: {}", rank,
                                  size, attr.hostname, e.what()));
    }
    progress_ = std::thread([this] { progress_loop(); });
  }

  ~GlooGroup() override {
    std::deque<Task> dropped;
    {
      std::lock_guard lock(mu_);
      stopped_ = true;
      dropped.swap(queue_);
    }
    cv_.notify_all();
    for (auto& t : dropped) t.work->finish(std::make_exception_ptr(CommError(fmt::format("{}: not run: the process group was destroyed", t.work->description()))));
    if (progress_.joinable()) progress_.join();  // a running collective ends by gloo's own timeout
  }

  std::string backend_name() const override { return "gloo"; }
  int64_t next_sequence_number() const override {
    std::lock_guard lock(mu_);
    return seq_;
  }

  std::shared_ptr<Work> all_reduce(Buffer buf, ReduceOp op) override {
    check_buffer("all_reduce", buf);
    TANDEM_CHECK(buf.dtype != DType::b8, ValueError, "all_reduce: gloo backend cannot reduce bool buffers; use uint8");
    const int64_t seq = peek();
    const Call call{.op = CallOp::all_reduce, .dtype = buf.dtype, .redop = op, .count = buf.count};
    return issue(fmt::format("all_reduce #{} ({}, {}, {})", seq, dtype_name(buf.dtype), buf.count, reduce_op_name(op)), call, [=, this] {
      if (buf.count == 0) return;
      if (is_reduced_float(buf.dtype)) {
        // Widened to f32, reduced in f32 and rounded once.
        // The f32 staging is kept between calls (progress thread only): page faults of a fresh
        // buffer per call would cost more than the reduction.
        if (static_cast<int64_t>(wide_.size()) < buf.count) wide_.resize(static_cast<size_t>(buf.count));
        convert(buf.data, buf.dtype, wide_.data(), DType::f32, buf.count);
        allreduce_typed<float>(wide_.data(), buf.count, op, seq);
        convert(wide_.data(), DType::f32, buf.data, buf.dtype, buf.count);
        return;
      }
      switch (buf.dtype) {
        case DType::f32: allreduce_typed<float>(static_cast<float*>(buf.data), buf.count, op, seq); break;
        case DType::f64: allreduce_typed<double>(static_cast<double*>(buf.data), buf.count, op, seq); break;
        case DType::i32: allreduce_typed<int32_t>(static_cast<int32_t*>(buf.data), buf.count, op, seq); break;
        case DType::i64: allreduce_typed<int64_t>(static_cast<int64_t*>(buf.data), buf.count, op, seq); break;
        case DType::u8: allreduce_typed<uint8_t>(static_cast<uint8_t*>(buf.data), buf.count, op, seq); break;
        default: break;
      }
    });
  }

  std::shared_ptr<Work> broadcast(Buffer buf, int root) override {
    check_buffer("broadcast", buf);
    TANDEM_CHECK(root >= 0 && root < size(), ValueError, "broadcast: root {} is outside the group of size {}", root, size());
    const int64_t seq = peek();
    const Call call{.op = CallOp::broadcast, .dtype = buf.dtype, .root = root, .count = buf.count};
    return issue(fmt::format("broadcast #{} ({}, {}, root {})", seq, dtype_name(buf.dtype), buf.count, root), call, [=, this] {
      if (buf.count == 0) return;
      gloo::BroadcastOptions opts(context_);
      opts.setOutput(static_cast<uint8_t*>(buf.data), buf.nbytes());
      opts.setRoot(root);
      opts.setTag(static_cast<uint32_t>(seq));
      opts.setTimeout(timeout());
      gloo::broadcast(opts);
    });
  }

  std::shared_ptr<Work> all_gather(Buffer out, Buffer in) override {
    check_buffer("all_gather", in);
    check_buffer("all_gather", out);
    TANDEM_CHECK(in.dtype == out.dtype, ValueError, "all_gather: input and output dtypes differ ({} vs {})",
                 dtype_name(in.dtype), dtype_name(out.dtype));
    TANDEM_CHECK(out.count == in.count * size(), ValueError,
                 "all_gather: the output needs world size {} x input count {} = {} elements, got {}", size(), in.count,
                 in.count * size(), out.count);
    const int64_t seq = peek();
    const Call call{.op = CallOp::all_gather, .dtype = in.dtype, .count = in.count};
    return issue(fmt::format("all_gather #{} ({}, {})", seq, dtype_name(in.dtype), in.count), call, [=, this] {
      if (in.count == 0) return;
      gloo::AllgatherOptions opts(context_);
      opts.setInput(static_cast<uint8_t*>(in.data), in.nbytes());
      opts.setOutput(static_cast<uint8_t*>(out.data), out.nbytes());
      opts.setTag(static_cast<uint32_t>(seq));
      opts.setTimeout(timeout());
      gloo::allgather(opts);
    });
  }

  std::shared_ptr<Work> barrier() override {
    const int64_t seq = peek();
    return issue(fmt::format("barrier #{}", seq), Call{}, [=, this] {
      gloo::BarrierOptions opts(context_);
      opts.setTag(static_cast<uint32_t>(seq));
      opts.setTimeout(timeout());
      gloo::barrier(opts);
    });
  }

 private:
  template <class T>
  void allreduce_typed(T* data, int64_t count, ReduceOp op, int64_t seq) {
    gloo::AllreduceOptions opts(context_);
    opts.setOutput(data, static_cast<size_t>(count));
    opts.setReduceFunction([op](void* c, const void* a, const void* b, size_t n) { reduce_fn<T>(op, c, a, b, n); });
    opts.setTag(static_cast<uint32_t>(seq));
    opts.setTimeout(timeout());
    gloo::allreduce(opts);
    if (op == ReduceOp::AVG) {
      for (int64_t i = 0; i < count; ++i) data[i] = static_cast<T>(data[i] / static_cast<T>(size()));
    }
  }

  void check_buffer(const char* op, const Buffer& b) const {
    TANDEM_CHECK(b.device.type == DeviceType::cpu, ValueError,
                 "gloo backend: {} needs CPU buffers, got a CUDA buffer; use the nccl backend for GPU memory", op);
    TANDEM_CHECK(b.count >= 0, ValueError, "{}: negative element count {}", op, b.count);
    TANDEM_CHECK(b.count == 0 || b.data != nullptr, ValueError, "{}: null data pointer for {} elements", op, b.count);
  }

  int64_t peek() const {
    std::lock_guard lock(mu_);
    return seq_;
  }

  std::shared_ptr<Work> issue(std::string description, const Call& call, std::function<void()> run) {
    auto work = std::make_shared<Work>(std::move(description));
    work->set_default_wait(timeout() * (check_calls_ ? 2 : 1) + std::chrono::seconds(60));
    {
      std::lock_guard lock(mu_);
      const int64_t seq = seq_++;
      if (broken_) {
        work->finish(std::make_exception_ptr(CommError(fmt::format("{}: the gloo process group is unusable: {}", work->description(), broken_reason_))));
        return work;
      }
      queue_.push_back(Task{work, std::move(run), call, seq});
    }
    cv_.notify_all();
    return work;
  }

  void progress_loop() {
    for (;;) {
      Task task;
      {
        std::unique_lock lock(mu_);
        cv_.wait(lock, [&] { return stopped_ || !queue_.empty(); });
        if (stopped_) return;
        task = std::move(queue_.front());
        queue_.pop_front();
      }
      try {
        if (check_calls_) check_call(task);
        task.run();
        task.work->finish();
      } catch (const std::exception& e) {
        // gloo reports timeouts and dead peers as IoException; the pairs are unusable afterwards.
        const std::string reason =
            fmt::format("{} failed on rank {} of {}: {}{}", task.work->description(), rank(), size(), e.what(), dead_peers());
        // gloo says "Timed out waiting 3000ms for recv operation to complete".
        const std::string what = e.what();
        const bool timed_out = what.find("Timed out") != std::string::npos || what.find("imeout") != std::string::npos;
        task.work->finish(timed_out ? std::make_exception_ptr(Timeout(reason)) : std::make_exception_ptr(CommError(reason)));
        std::deque<Task> dropped;
        {
          std::lock_guard lock(mu_);
          broken_ = true;
          broken_reason_ = reason;
          dropped.swap(queue_);
        }
        for (auto& t : dropped) t.work->finish(std::make_exception_ptr(CommError(fmt::format("{}: not run: {}", t.work->description(), reason))));
      }
    }
  }

  void check_call(const Task& task) {
    std::vector<Call> all(static_cast<size_t>(size()));
    Call mine = task.call;
    gloo::AllgatherOptions opts(context_);
    opts.setInput(reinterpret_cast<uint8_t*>(&mine), sizeof(Call));
    opts.setOutput(reinterpret_cast<uint8_t*>(all.data()), sizeof(Call) * all.size());
    opts.setTag(static_cast<uint32_t>(task.seq) | 0x80000000u);  // apart from the collectives' tags
    opts.setTimeout(timeout());
    gloo::allgather(opts);
    if (std::string m = call_mismatch(all, task.seq); !m.empty()) throw CommError(m);
  }

  // "; rank 2 (pid 1234) died (no such process left on this host)" for the peers on this host
  // whose process is gone (or a zombie), else empty. A peer killed a moment ago may still be exiting
  // when its closed sockets fail our collective: look again for up to 200 ms before saying none.
  std::string dead_peers() const {
    for (int attempt = 0; attempt < 40; ++attempt) {
      std::vector<std::string> gone;
      for (int r = 0; r < size(); ++r) {
        if (r == rank() || peer_hosts_.at(static_cast<size_t>(r)) != identity_) continue;
        const pid_t pid = peer_pids_.at(static_cast<size_t>(r));
        if (!shm::process_alive(pid)) gone.push_back(fmt::format("rank {} (pid {})", r, pid));
      }
      if (!gone.empty()) {
        return fmt::format("; {} died (no such process left on this host)", fmt::join(gone, ", "));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return "";
  }

  const std::string identity_ = host_identity();
  std::vector<pid_t> peer_pids_;          // by rank
  std::vector<std::string> peer_hosts_;   // by rank: host_identity() of each rank
  std::shared_ptr<gloo::Context> context_;
  std::vector<float> wide_;  // f32 staging of 16-bit all_reduce
  bool check_calls_ = true;  // calls exchanged before each collective (rank 0's TANDEM_COLLECTIVE_CHECK)
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Task> queue_;
  int64_t seq_ = 0;
  bool stopped_ = false;
  bool broken_ = false;
  std::string broken_reason_;
  std::thread progress_;
};

}  // namespace

std::shared_ptr<ProcessGroup> make_gloo_group(std::shared_ptr<Store> store, int rank, int size, ProcessGroupOptions options) {
  return std::make_shared<GlooGroup>(std::move(store), rank, size, options);
}

}  // namespace tandem::dist

#endif  // TANDEM_WITH_GLOO
