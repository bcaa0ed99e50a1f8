// The MPI process-group backend (OpenMPI, many nodes). One progress thread per group runs the
// collectives in issue order as ordinary blocking MPI calls (OpenMPI's tuned algorithms are about
// twice as fast as its nonblocking schedules); a watchdog fails the running collective's Work with
// Timeout at its deadline, since MPI itself never times out. Invariant: after construction only
// the progress thread calls MPI on the group's communicator (MPI_THREAD_MULTIPLE is requested so
// several groups and the user may call MPI concurrently).
#include "tandem/dist/backends.h"
#include "tandem/dist/collective_call.h"

#ifndef TANDEM_WITH_MPI

namespace tandem::dist {
std::shared_ptr<ProcessGroup> make_mpi_group(std::shared_ptr<Store>, int, int, ProcessGroupOptions) {
  throw ValueError("Tandem was built without MPI: install libopenmpi-dev and rebuild");
}
}  // namespace tandem::dist

#else

#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <set>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "tandem/core/convert.h"

namespace tandem::dist {
namespace {

using Clock = std::chrono::steady_clock;

// ---- process-wide MPI state: MPI_Init_thread once, MPI_Finalize at exit ----

class MpiGroup;

// 16-bit float reductions. Default: one rounding. all_reduce and reduce_scatter move raw 16-bit
// blocks (all_to_all), reduce them in f32 on the owning rank and round once (<= 1/2 ulp plus the
// f32 error: within 1 ulp of the exact sum), then all_gather: 16-bit wire bytes. reduce (to a
// root) widens the buffer to f32 and reduces it with MPI's f32 op (one rounding, twice the bytes).
// TANDEM_MPI_HALF_WIRE=1 instead uses these user ops (MPI_Op_create) on the 16-bit values: each
// pairwise step widens both operands to f32, combines them and rounds back to 16 bits, so an
// N-rank sum is rounded N-1 times (up to ~(N-1)/2 ulp; the sweep's 1-ulp check fails on 3 ranks).
template <class T, ReduceOp kOp>
void reduce16(void* in, void* inout, int* len, MPI_Datatype*) {
  const T* a = static_cast<const T*>(in);
  T* b = static_cast<T*>(inout);
  for (int i = 0; i < *len; ++i) {
    const float x = a[i], y = b[i];
    float r;
    if constexpr (kOp == ReduceOp::SUM) r = x + y;
    else if constexpr (kOp == ReduceOp::PRODUCT) r = x * y;
    else if constexpr (kOp == ReduceOp::MAX) r = (x > y || x != x) ? x : y;
    else r = (x < y || x != x) ? x : y;
    b[i] = T(r);
  }
}

class MpiRuntime {
 public:
  // The runtime, initializing MPI on first use. Throws CommError when MPI cannot start.
  static MpiRuntime& get() {
    static MpiRuntime* runtime = new MpiRuntime();  // never destroyed: used from atexit
    return *runtime;
  }

  int world_rank() const { return world_rank_; }
  int world_size() const { return world_size_; }
  void note_abandoned_collective() { abandoned_ = true; }

  void add(MpiGroup* g) {
    std::lock_guard lock(mu_);
    groups_.insert(g);
  }
  void remove(MpiGroup* g) {
    std::lock_guard lock(mu_);
    groups_.erase(g);
  }

  // The user op reducing 16-bit floats pairwise (see reduce16).
  MPI_Op op16(DType dt, ReduceOp op) const {
    const int d = dt == DType::bf16 ? 1 : 0;
    switch (op) {
      case ReduceOp::SUM: case ReduceOp::AVG: return ops16_[d][0];
      case ReduceOp::PRODUCT: return ops16_[d][1];
      case ReduceOp::MAX: return ops16_[d][2];
      case ReduceOp::MIN: return ops16_[d][3];
    }
    return ops16_[d][0];
  }
  MPI_Datatype type16() const { return type16_; }

 private:
  MpiRuntime() {
    int initialized = 0, finalized = 0;
    MPI_Initialized(&initialized);
    MPI_Finalized(&finalized);
    TANDEM_CHECK(!finalized, CommError, "mpi backend: MPI was already finalized in this process; "
                 "create MPI process groups before MPI_Finalize");
    int provided = 0;
    if (!initialized) {
      const int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
      TANDEM_CHECK(rc == MPI_SUCCESS, CommError, "mpi backend: MPI_Init_thread failed (code {}); "
                   "start the program with mpirun or srun", rc);
      std::atexit(&MpiRuntime::finalize_at_exit);
    } else {
      MPI_Query_thread(&provided);
    }
    TANDEM_CHECK(provided >= MPI_THREAD_MULTIPLE, CommError,
                 "mpi backend: MPI provides thread level {} but the backend calls MPI from its "
                 "progress threads and needs MPI_THREAD_MULTIPLE ({}); initialize MPI with "
                 "MPI_Init_thread(..., MPI_THREAD_MULTIPLE, ...) or use an MPI built with threads",
                 provided, MPI_THREAD_MULTIPLE);
    MPI_Comm_rank(MPI_COMM_WORLD, &world_rank_);
    MPI_Comm_size(MPI_COMM_WORLD, &world_size_);
    MPI_Type_contiguous(2, MPI_BYTE, &type16_);
    MPI_Type_commit(&type16_);
    MPI_Op_create(&reduce16<half, ReduceOp::SUM>, 1, &ops16_[0][0]);
    MPI_Op_create(&reduce16<half, ReduceOp::PRODUCT>, 1, &ops16_[0][1]);
    MPI_Op_create(&reduce16<half, ReduceOp::MAX>, 1, &ops16_[0][2]);
    MPI_Op_create(&reduce16<half, ReduceOp::MIN>, 1, &ops16_[0][3]);
    MPI_Op_create(&reduce16<bfloat16, ReduceOp::SUM>, 1, &ops16_[1][0]);
    MPI_Op_create(&reduce16<bfloat16, ReduceOp::PRODUCT>, 1, &ops16_[1][1]);
    MPI_Op_create(&reduce16<bfloat16, ReduceOp::MAX>, 1, &ops16_[1][2]);
    MPI_Op_create(&reduce16<bfloat16, ReduceOp::MIN>, 1, &ops16_[1][3]);
  }

  static void finalize_at_exit();

  int world_rank_ = 0, world_size_ = 1;
  MPI_Datatype type16_;
  MPI_Op ops16_[2][4];
  std::mutex mu_;
  std::set<MpiGroup*> groups_;
  // Set once a progress thread was left inside a collective that never returned: MPI_Finalize
  // would then tear down memory that thread still polls (a crash at exit), so it is skipped.
  std::atomic<bool> abandoned_{false};
};

std::string mpi_error(int rc) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) return fmt::format("MPI error {}", rc);
  return std::string(text, static_cast<size_t>(len));
}

MPI_Datatype mpi_type(DType dt) {
  switch (dt) {
    case DType::f32: return MPI_FLOAT;
    case DType::f64: return MPI_DOUBLE;
    case DType::i32: return MPI_INT32_T;
    case DType::i64: return MPI_INT64_T;
    case DType::u8: return MPI_UINT8_T;
    case DType::b8: return MPI_UINT8_T;  // data movement only
    case DType::f16: case DType::bf16: return MpiRuntime::get().type16();
  }
  return MPI_BYTE;
}

MPI_Op mpi_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::SUM: case ReduceOp::AVG: return MPI_SUM;
    case ReduceOp::PRODUCT: return MPI_PROD;
    case ReduceOp::MAX: return MPI_MAX;
    case ReduceOp::MIN: return MPI_MIN;
  }
  return MPI_SUM;
}

// Whether 16-bit reductions travel as 16-bit values (pairwise rounding; see reduce16).
bool half_wire() {
  const char* v = std::getenv("TANDEM_MPI_HALF_WIRE");
  return v != nullptr && std::string(v) == "1";
}

// x /= n for AVG (integers: truncating division, like c10d's integer AVG).
void divide(void* data, DType dt, int64_t count, int n) {
  TANDEM_DISPATCH_ALL(dt, "all_reduce(AVG)", [&] {
    if constexpr (!std::is_same_v<scalar_t, bool>) {
      auto* p = static_cast<scalar_t*>(data);
      for (int64_t i = 0; i < count; ++i) {
        p[i] = static_cast<scalar_t>(static_cast<compute_t<scalar_t>>(p[i]) / static_cast<compute_t<scalar_t>>(n));
      }
    }
  });
}

constexpr int64_t kMaxChunk = int64_t{1} << 30;  // elements per MPI call (MPI counts are int)

// One issued operation: `run` does the MPI work on the progress thread (blocking).
struct Task {
  std::shared_ptr<Work> work;
  std::function<void()> run;
  bool p2p = false;
  bool is_recv = false;
  std::function<void(MPI_Request*)> post;  // p2p: posts the request instead of run
  CollectiveCall call;                     // collectives: exchanged first (collective_call.h)
  int64_t seq = 0;
};

// Shared by a group and its progress thread, so that a thread left blocked inside MPI by a
// timed-out collective can outlive the group without touching it when MPI finally returns.
struct Lifeline {
  std::mutex mu;
  bool group_gone = false;
};

// A posted point-to-point request with its deadline.
struct Pending {
  std::shared_ptr<Work> work;
  MPI_Request request;
  Clock::time_point deadline;
  bool is_recv;
};

class MpiGroup final : public ProcessGroup {
 public:
  MpiGroup(std::shared_ptr<Store> store, int rank, int size, ProcessGroupOptions options)
      : ProcessGroup(rank, size, options), store_(std::move(store)) {
    MpiRuntime& rt = MpiRuntime::get();
    create_communicator(rt);
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    // Rank 0's environment decides for the group what changes which MPI calls a collective makes
    // (ranks whose settings differed would run different calls undetected): the 16-bit wire
    // (TANDEM_MPI_HALF_WIRE) and the exchange of calls before collectives (TANDEM_COLLECTIVE_CHECK).
    int32_t choices[2] = {half_wire() ? 1 : 0, collective_check_wanted() ? 1 : 0};
    check_rc("MPI_Bcast", MPI_Bcast(choices, 2, MPI_INT32_T, 0, comm_));
    half_wire_ = choices[0] != 0;
    check_calls_ = choices[1] != 0;
    rt.add(this);
    progress_ = std::thread([this, lifeline = lifeline_] { progress_loop(lifeline); });
    watchdog_ = std::thread([this] { watchdog_loop(); });
  }

  ~MpiGroup() override { shutdown("the process group was destroyed"); }

  std::string backend_name() const override { return "mpi"; }
  int64_t next_sequence_number() const override {
    std::lock_guard lock(mu_);
    return seq_;
  }

  // Stops the threads and fails what is still queued; frees the communicator unless a collective
  // is stuck in it. Idempotent; called by the destructor and before MPI_Finalize at exit.
  void shutdown(const std::string& why) noexcept {
    std::deque<Task> dropped;
    {
      std::lock_guard lock(mu_);
      if (stopped_) return;
      stopped_ = true;
      dropped.swap(queue_);
    }
    cv_.notify_all();
    for (auto& t : dropped) t.work->finish(std::make_exception_ptr(CommError(fmt::format("{}: not run: {}", t.work->description(), why))));
    if (watchdog_.joinable()) watchdog_.join();
    {
      // A collective still running in time is waited for (until its deadline), as c10d does.
      std::unique_lock lock(mu_);
      if (!broken_) cv_.wait_until(lock, running_deadline_, [&] { return running_ == nullptr; });
    }
    bool inside_mpi;
    std::shared_ptr<Work> running;
    {
      std::lock_guard life(lifeline_->mu);
      std::lock_guard lock(mu_);
      inside_mpi = running_ != nullptr;
      running = running_;
      if (inside_mpi) lifeline_->group_gone = true;
    }
    if (inside_mpi) {
      // Blocked inside a collective (a timed-out one never returns): leave the thread behind; it
      // exits without touching this group if MPI ever returns.
      progress_.detach();
      MpiRuntime::get().note_abandoned_collective();
      running->finish(std::make_exception_ptr(CommError(fmt::format("{}: abandoned: {}", running->description(), why))));
    } else if (progress_.joinable()) {
      progress_.join();
    }
    const bool stuck = inside_mpi;
    MpiRuntime::get().remove(this);
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!stuck && !finalized && comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
  }

  // Whether the progress thread is inside a collective right now.
  bool inside_collective() const {
    std::lock_guard lock(mu_);
    return running_ != nullptr;
  }

  // ---- collectives ----

  std::shared_ptr<Work> all_reduce(Buffer buf, ReduceOp op) override {
    check_buffer("all_reduce", buf);
    check_reducible("all_reduce", buf.dtype, op);
    return issue(fmt::format("all_reduce #{} ({}, {}, {})", peek_seq(), dtype_name(buf.dtype), buf.count, reduce_op_name(op)),
                 CollectiveCall{.op = CallOp::all_reduce, .dtype = buf.dtype, .redop = op, .count = buf.count},
                 [this, buf, op] { reduce_impl(buf, op, -1); });
  }

  std::shared_ptr<Work> reduce(Buffer buf, int root, ReduceOp op) override {
    check_buffer("reduce", buf);
    check_root("reduce", root);
    check_reducible("reduce", buf.dtype, op);
    return issue(fmt::format("reduce #{} ({}, {}, {}, root {})", peek_seq(), dtype_name(buf.dtype), buf.count, reduce_op_name(op), root),
                 CollectiveCall{.op = CallOp::reduce, .dtype = buf.dtype, .redop = op, .root = root, .count = buf.count},
                 [this, buf, op, root] { reduce_impl(buf, op, root); });
  }

  std::shared_ptr<Work> broadcast(Buffer buf, int root) override {
    check_buffer("broadcast", buf);
    check_root("broadcast", root);
    return issue(fmt::format("broadcast #{} ({}, {}, root {})", peek_seq(), dtype_name(buf.dtype), buf.count, root),
                 CollectiveCall{.op = CallOp::broadcast, .dtype = buf.dtype, .root = root, .count = buf.count},
                 [this, buf, root] {
                   auto* p = static_cast<char*>(buf.data);
                   const size_t es = element_size(buf.dtype);
                   for (int64_t off = 0; off < buf.count; off += kMaxChunk) {
                     const int n = static_cast<int>(std::min(kMaxChunk, buf.count - off));
                     check_rc("MPI_Bcast", MPI_Bcast(p + off * es, n, mpi_type(buf.dtype), root, comm_));
                   }
                 });
  }

  std::shared_ptr<Work> all_gather(Buffer out, Buffer in) override {
    check_buffer("all_gather", in);
    check_buffer("all_gather", out);
    check_same_dtype("all_gather", out, in);
    TANDEM_CHECK(out.count == in.count * size(), ValueError,
                 "all_gather: the output needs world size {} x input count {} = {} elements, got {}",
                 size(), in.count, in.count * size(), out.count);
    check_int_count("all_gather", in.count);
    return issue(fmt::format("all_gather #{} ({}, {})", peek_seq(), dtype_name(in.dtype), in.count),
                 CollectiveCall{.op = CallOp::all_gather, .dtype = in.dtype, .count = in.count}, [this, out, in] {
      check_rc("MPI_Allgather", MPI_Allgather(in.data, static_cast<int>(in.count), mpi_type(in.dtype), out.data,
                                              static_cast<int>(in.count), mpi_type(in.dtype), comm_));
    });
  }

  std::shared_ptr<Work> all_gather(std::vector<Buffer> outs, Buffer in) override {
    check_buffer("all_gather", in);
    TANDEM_CHECK(static_cast<int>(outs.size()) == size(), ValueError,
                 "all_gather: expected one output buffer per rank ({}), got {}", size(), outs.size());
    for (auto& o : outs) {
      check_buffer("all_gather", o);
      check_same_dtype("all_gather", o, in);
      TANDEM_CHECK(o.count == in.count, ValueError, "all_gather: every output buffer needs the input's {} elements, got {}", in.count, o.count);
    }
    check_int_count("all_gather", in.count);
    return issue(fmt::format("all_gather #{} ({}, {}, list)", peek_seq(), dtype_name(in.dtype), in.count),
                 CollectiveCall{.op = CallOp::all_gather, .dtype = in.dtype, .count = in.count}, [this, outs, in] {
      std::vector<char> flat(in.nbytes() * static_cast<size_t>(size()));
      check_rc("MPI_Allgather", MPI_Allgather(in.data, static_cast<int>(in.count), mpi_type(in.dtype), flat.data(),
                                              static_cast<int>(in.count), mpi_type(in.dtype), comm_));
      for (int r = 0; r < size(); ++r) {
        if (in.nbytes() > 0) std::memcpy(outs[r].data, flat.data() + r * in.nbytes(), in.nbytes());
      }
    });
  }

  std::shared_ptr<Work> reduce_scatter(Buffer out, Buffer in, ReduceOp op) override {
    check_buffer("reduce_scatter", in);
    check_buffer("reduce_scatter", out);
    check_same_dtype("reduce_scatter", out, in);
    check_reducible("reduce_scatter", in.dtype, op);
    TANDEM_CHECK(in.count == out.count * size(), ValueError,
                 "reduce_scatter: the input needs world size {} x output count {} = {} elements, got {}",
                 size(), out.count, out.count * size(), in.count);
    check_int_count("reduce_scatter", out.count);
    return issue(fmt::format("reduce_scatter #{} ({}, {}, {})", peek_seq(), dtype_name(in.dtype), out.count, reduce_op_name(op)),
                 CollectiveCall{.op = CallOp::reduce_scatter, .dtype = in.dtype, .redop = op, .count = out.count},
                 [this, out, in, op] {
                   const int n = static_cast<int>(out.count);
                   if (is_reduced_float(in.dtype) && !half_wire_) {
                     // Every rank's raw 16-bit block for us, then one f32 reduction, rounded once.
                     auto* recv = scratch16(in.count);
                     check_rc("MPI_Alltoall", MPI_Alltoall(in.data, n, mpi_type(in.dtype), recv, n, mpi_type(in.dtype), comm_));
                     reduce_blocks16(recv, in.dtype, out.count, op, out.data);
                     return;
                   }
                   const MPI_Op mop = is_reduced_float(in.dtype) ? MpiRuntime::get().op16(in.dtype, op) : mpi_op(op);
                   check_rc("MPI_Reduce_scatter_block", MPI_Reduce_scatter_block(in.data, out.data, n, mpi_type(in.dtype), mop, comm_));
                   if (op == ReduceOp::AVG) divide(out.data, out.dtype, out.count, size());
                 });
  }

  std::shared_ptr<Work> gather(Buffer out, Buffer in, int root) override {
    check_buffer("gather", in);
    check_root("gather", root);
    if (rank() == root) {
      check_buffer("gather", out);
      check_same_dtype("gather", out, in);
      TANDEM_CHECK(out.count == in.count * size(), ValueError,
                   "gather: the root's output needs world size {} x input count {} = {} elements, got {}",
                   size(), in.count, in.count * size(), out.count);
    }
    check_int_count("gather", in.count);
    return issue(fmt::format("gather #{} ({}, {}, root {})", peek_seq(), dtype_name(in.dtype), in.count, root),
                 CollectiveCall{.op = CallOp::gather, .dtype = in.dtype, .root = root, .count = in.count}, [this, out, in, root] {
      check_rc("MPI_Gather", MPI_Gather(in.data, static_cast<int>(in.count), mpi_type(in.dtype), rank() == root ? out.data : nullptr,
                                        static_cast<int>(in.count), mpi_type(in.dtype), root, comm_));
    });
  }

  std::shared_ptr<Work> scatter(Buffer out, Buffer in, int root) override {
    check_buffer("scatter", out);
    check_root("scatter", root);
    if (rank() == root) {
      check_buffer("scatter", in);
      check_same_dtype("scatter", out, in);
      TANDEM_CHECK(in.count == out.count * size(), ValueError,
                   "scatter: the root's input needs world size {} x output count {} = {} elements, got {}",
                   size(), out.count, out.count * size(), in.count);
    }
    check_int_count("scatter", out.count);
    return issue(fmt::format("scatter #{} ({}, {}, root {})", peek_seq(), dtype_name(out.dtype), out.count, root),
                 CollectiveCall{.op = CallOp::scatter, .dtype = out.dtype, .root = root, .count = out.count}, [this, out, in, root] {
      check_rc("MPI_Scatter", MPI_Scatter(rank() == root ? in.data : nullptr, static_cast<int>(out.count), mpi_type(out.dtype),
                                          out.data, static_cast<int>(out.count), mpi_type(out.dtype), root, comm_));
    });
  }

  std::shared_ptr<Work> all_to_all(Buffer out, Buffer in) override {
    check_buffer("all_to_all", in);
    check_buffer("all_to_all", out);
    check_same_dtype("all_to_all", out, in);
    TANDEM_CHECK(in.count == out.count && in.count % size() == 0, ValueError,
                 "all_to_all: input and output need the same count, a multiple of the world size {}; got {} and {}",
                 size(), in.count, out.count);
    const int64_t k = in.count / size();
    check_int_count("all_to_all", k);
    return issue(fmt::format("all_to_all #{} ({}, {})", peek_seq(), dtype_name(in.dtype), in.count),
                 CollectiveCall{.op = CallOp::all_to_all, .dtype = in.dtype, .count = in.count}, [this, out, in, k] {
      check_rc("MPI_Alltoall", MPI_Alltoall(in.data, static_cast<int>(k), mpi_type(in.dtype), out.data, static_cast<int>(k),
                                            mpi_type(in.dtype), comm_));
    });
  }

  std::shared_ptr<Work> barrier() override {
    return issue(fmt::format("barrier #{}", peek_seq()), CollectiveCall{},
                 [this] { check_rc("MPI_Barrier", MPI_Barrier(comm_)); });
  }

  std::shared_ptr<Work> send(Buffer buf, int dst, int tag) override {
    check_buffer("send", buf);
    check_peer("send", dst);
    check_int_count("send", buf.count);
    return issue_p2p(fmt::format("send #{} ({}, {}, to {}, tag {})", peek_seq(), dtype_name(buf.dtype), buf.count, dst, tag), false,
                     [this, buf, dst, tag](MPI_Request* req) {
                       check_rc("MPI_Isend", MPI_Isend(buf.data, static_cast<int>(buf.count), mpi_type(buf.dtype), dst, tag, comm_, req));
                     });
  }

  std::shared_ptr<Work> recv(Buffer buf, int src, int tag) override {
    check_buffer("recv", buf);
    check_peer("recv", src);
    check_int_count("recv", buf.count);
    return issue_p2p(fmt::format("recv #{} ({}, {}, from {}, tag {})", peek_seq(), dtype_name(buf.dtype), buf.count, src, tag), true,
                     [this, buf, src, tag](MPI_Request* req) {
                       check_rc("MPI_Irecv", MPI_Irecv(buf.data, static_cast<int>(buf.count), mpi_type(buf.dtype), src, tag, comm_, req));
                     });
  }

 private:
  // ---- setup ----

  void create_communicator(MpiRuntime& rt) {
    const Clock::time_point deadline = Clock::now() + timeout();
    if (!store_) {
      // No store: the group is MPI_COMM_WORLD itself.
      TANDEM_CHECK(size() == rt.world_size() && rank() == rt.world_rank(), ValueError,
                   "mpi backend: without a store the group must be MPI_COMM_WORLD (rank {} of {}), got rank {} of {}; "
                   "launch with mpirun -np {} or pass a store to make a subgroup",
                   rt.world_rank(), rt.world_size(), rank(), size(), size());
      MPI_Request req;
      check_rc("MPI_Comm_idup", MPI_Comm_idup(MPI_COMM_WORLD, &comm_, &req));
      wait_request(req, deadline, "creating the communicator (MPI_Comm_idup of MPI_COMM_WORLD)");
      return;
    }
    TANDEM_CHECK(size() <= rt.world_size(), ValueError,
                 "mpi backend: the group has {} ranks but MPI_COMM_WORLD has {}; start the program with "
                 "mpirun -np {} (or srun -n {})", size(), rt.world_size(), size(), size());
    // Rendezvous through the store: each member publishes its MPI world rank under its group rank.
    store_->set(fmt::format("mpi/world_rank/{}", rank()), std::to_string(rt.world_rank()));
    std::vector<int> world_ranks(static_cast<size_t>(size()));
    for (int r = 0; r < size(); ++r) {
      const std::string key = fmt::format("mpi/world_rank/{}", r);
      try {
        store_->wait({key}, std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()));
      } catch (const Timeout& e) {
        throw Timeout(fmt::format("mpi backend: rank {} did not arrive at the rendezvous within {} ms ({})", r,
                                  timeout().count(), e.what()));
      }
      world_ranks[r] = std::stoi(to_string(store_->get(key)));
    }
    std::vector<int> sorted = world_ranks;
    std::sort(sorted.begin(), sorted.end());
    TANDEM_CHECK(std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end(), ValueError,
                 "mpi backend: two group ranks are the same MPI process (world ranks {}); give each MPI process one rank",
                 fmt::join(world_ranks, ","));
    MPI_Group world_group, group;
    MPI_Comm_group(MPI_COMM_WORLD, &world_group);
    MPI_Group_incl(world_group, size(), world_ranks.data(), &group);
    // Every member has arrived (above), so this collective over the members returns promptly.
    const int rc = MPI_Comm_create_group(MPI_COMM_WORLD, group, /*tag=*/7107, &comm_);
    MPI_Group_free(&group);
    MPI_Group_free(&world_group);
    check_rc("MPI_Comm_create_group", rc);
  }

  // ---- argument checks (caller thread; throw ValueError) ----

  void check_buffer(const char* op, const Buffer& b) const {
    TANDEM_CHECK(b.device.type == DeviceType::cpu, ValueError,
                 "mpi backend: {} needs CPU buffers, got a CUDA buffer; use the nccl backend for GPU memory", op);
    TANDEM_CHECK(b.count >= 0, ValueError, "{}: negative element count {}", op, b.count);
    TANDEM_CHECK(b.count == 0 || b.data != nullptr, ValueError, "{}: null data pointer for {} elements", op, b.count);
  }
  void check_same_dtype(const char* op, const Buffer& a, const Buffer& b) const {
    TANDEM_CHECK(a.dtype == b.dtype, ValueError, "{}: input and output dtypes differ ({} vs {})", op,
                 dtype_name(b.dtype), dtype_name(a.dtype));
  }
  void check_reducible(const char* op, DType dt, ReduceOp rop) const {
    TANDEM_CHECK(dt != DType::b8, ValueError, "{}: mpi backend cannot reduce bool buffers; use uint8", op);
  }
  void check_root(const char* op, int root) const {
    TANDEM_CHECK(root >= 0 && root < size(), ValueError, "{}: root {} is outside the group of size {}", op, root, size());
  }
  void check_peer(const char* op, int peer) const {
    TANDEM_CHECK(peer >= 0 && peer < size(), ValueError, "{}: peer {} is outside the group of size {}", op, peer, size());
  }
  void check_int_count(const char* op, int64_t count) const {
    TANDEM_CHECK(count <= INT_MAX, ValueError, "mpi backend: {} of {} elements per rank exceeds MPI's int count limit {}; split it",
                 op, count, INT_MAX);
  }
  void check_rc(const char* call, int rc) const {
    if (rc != MPI_SUCCESS) throw CommError(fmt::format("mpi backend (rank {} of {}): {} failed: {}", rank(), size(), call, mpi_error(rc)));
  }

  void wait_request(MPI_Request& req, Clock::time_point deadline, const char* what) {
    int done = 0;
    for (int spins = 0;; ++spins) {
      check_rc("MPI_Test", MPI_Test(&req, &done, MPI_STATUS_IGNORE));
      if (done) return;
      if (Clock::now() > deadline) {
        throw Timeout(fmt::format("mpi backend (rank {} of {}): {} timed out after {} ms; did every rank create the group?",
                                  rank(), size(), what, timeout().count()));
      }
      if (spins > 1000) std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }

  // ---- reductions ----

  // all_reduce (root < 0) or reduce to root, in place; 16-bit floats through f32 unless half_wire_.
  void reduce_impl(Buffer buf, ReduceOp op, int root) {
    if (buf.count == 0) return;
    if (root < 0 && is_reduced_float(buf.dtype) && !half_wire_ && buf.count <= INT_MAX) {
      all_reduce16(buf, op);
      return;
    }
    const bool widen = is_reduced_float(buf.dtype) && !half_wire_;
    float* wide = widen ? scratch(0, buf.count) : nullptr;
    void* data = buf.data;
    DType dt = buf.dtype;
    if (widen) {
      convert(buf.data, buf.dtype, wide, DType::f32, buf.count);
      data = wide;
      dt = DType::f32;
    }
    const MPI_Op mop = is_reduced_float(dt) ? MpiRuntime::get().op16(dt, op) : mpi_op(op);
    const size_t es = element_size(dt);
    auto* p = static_cast<char*>(data);
    for (int64_t off = 0; off < buf.count; off += kMaxChunk) {
      const int n = static_cast<int>(std::min(kMaxChunk, buf.count - off));
      if (root < 0) {
        check_rc("MPI_Allreduce", MPI_Allreduce(MPI_IN_PLACE, p + off * es, n, mpi_type(dt), mop, comm_));
      } else if (rank() == root) {
        check_rc("MPI_Reduce", MPI_Reduce(MPI_IN_PLACE, p + off * es, n, mpi_type(dt), mop, root, comm_));
      } else {
        check_rc("MPI_Reduce", MPI_Reduce(p + off * es, nullptr, n, mpi_type(dt), mop, root, comm_));
      }
    }
    if (root >= 0 && rank() != root) return;  // non-root contents are unspecified (c10d)
    if (op == ReduceOp::AVG) divide(data, dt, buf.count, size());
    if (widen) convert(wide, DType::f32, buf.data, buf.dtype, buf.count);
  }

  // 16-bit all_reduce with one rounding on a 16-bit wire (the bytes of a 16-bit ring, half of
  // an f32 all_reduce): an all_to_all hands rank j every rank's raw block j, rank j reduces
  // them in f32 in rank order and rounds once, and an all_gather returns the reduced blocks.
  // Each element is reduced by one rank only, so every rank ends with the same bits.
  void all_reduce16(Buffer buf, ReduceOp op) {
    const int n = size();
    const int64_t base = buf.count / n, rem = buf.count % n;
    auto len = [&](int j) { return static_cast<int>(base + (j < rem ? 1 : 0)); };
    auto off = [&](int j) { return static_cast<int>(j * base + std::min<int64_t>(j, rem)); };
    const int mine = len(rank());
    std::vector<int> scounts(n), sdispls(n), rcounts(n), rdispls(n);
    for (int j = 0; j < n; ++j) {
      scounts[j] = len(j);
      sdispls[j] = off(j);
      rcounts[j] = mine;
      rdispls[j] = j * mine;
    }
    auto* recv = scratch16(int64_t{mine} * n);
    const MPI_Datatype t = mpi_type(buf.dtype);
    check_rc("MPI_Alltoallv", MPI_Alltoallv(buf.data, scounts.data(), sdispls.data(), t, recv, rcounts.data(), rdispls.data(), t, comm_));
    reduce_blocks16(recv, buf.dtype, mine, op, static_cast<uint16_t*>(buf.data) + off(rank()));
    for (int j = 0; j < n; ++j) {
      rcounts[j] = len(j);
      rdispls[j] = off(j);
    }
    check_rc("MPI_Allgatherv", MPI_Allgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, buf.data, rcounts.data(), rdispls.data(), t, comm_));
  }

  // out[i] = op over r of blocks[r * k + i] (size() blocks of k 16-bit values), in f32, rounded
  // once. Works through cache-sized chunks so the f32 values never leave L1/L2: memory traffic is
  // the 16-bit blocks read once and the result written once.
  void reduce_blocks16(const uint16_t* blocks, DType dt, int64_t k, ReduceOp op, void* out) {
    constexpr int64_t kChunk = 4096;
    float* acc = scratch(0, kChunk);
    float* next = scratch(1, kChunk);
    for (int64_t c0 = 0; c0 < k; c0 += kChunk) {
      const int64_t m = std::min(kChunk, k - c0);
      convert(blocks + c0, dt, acc, DType::f32, m);
      for (int r = 1; r < size(); ++r) {
        convert(blocks + r * k + c0, dt, next, DType::f32, m);
        switch (op) {
          case ReduceOp::SUM: case ReduceOp::AVG: for (int64_t i = 0; i < m; ++i) acc[i] += next[i]; break;
          case ReduceOp::PRODUCT: for (int64_t i = 0; i < m; ++i) acc[i] *= next[i]; break;
          case ReduceOp::MAX: for (int64_t i = 0; i < m; ++i) acc[i] = (acc[i] >= next[i] || acc[i] != acc[i]) ? acc[i] : next[i]; break;
          case ReduceOp::MIN: for (int64_t i = 0; i < m; ++i) acc[i] = (acc[i] <= next[i] || acc[i] != acc[i]) ? acc[i] : next[i]; break;
        }
      }
      if (op == ReduceOp::AVG) {
        // x / n, not x * (1/n): the same rounding as the other backends' division.
        for (int64_t i = 0; i < m; ++i) acc[i] /= static_cast<float>(size());
      }
      convert(acc, DType::f32, static_cast<uint16_t*>(out) + c0, dt, m);
    }
  }

  uint16_t* scratch16(int64_t count) {
    if (static_cast<int64_t>(scratch16_.size()) < count) scratch16_.resize(static_cast<size_t>(count));
    return scratch16_.data();
  }

  // f32 staging for 16-bit reductions, kept between collectives: a fresh 64 MiB vector per call
  // costs more in page faults than the reduction itself. Progress thread only.
  float* scratch(int which, int64_t count) {
    auto& v = scratch_[which];
    if (static_cast<int64_t>(v.size()) < count) v.resize(static_cast<size_t>(count));
    return v.data();
  }

  // ---- issue and progress ----

  int64_t peek_seq() const {
    std::lock_guard lock(mu_);
    return seq_;
  }

  std::shared_ptr<Work> issue(std::string description, const CollectiveCall& call, std::function<void()> run) {
    auto work = std::make_shared<Work>(std::move(description));
    work->set_default_wait(timeout() + std::chrono::seconds(60));
    {
      std::lock_guard lock(mu_);
      const int64_t seq = seq_++;
      if (stopped_ || broken_) {
        work->finish(std::make_exception_ptr(CommError(fmt::format(
            "{}: the mpi process group is unusable: {}", work->description(), broken_ ? broken_reason_ : "it was shut down"))));
        return work;
      }
      queue_.push_back(Task{work, std::move(run), false, false, {}, call, seq});
    }
    cv_.notify_all();
    return work;
  }

  std::shared_ptr<Work> issue_p2p(std::string description, bool is_recv, std::function<void(MPI_Request*)> post) {
    auto work = std::make_shared<Work>(std::move(description));
    work->set_default_wait(timeout() + std::chrono::seconds(60));
    {
      std::lock_guard lock(mu_);
      ++seq_;
      if (stopped_ || broken_) {
        work->finish(std::make_exception_ptr(CommError(fmt::format(
            "{}: the mpi process group is unusable: {}", work->description(), broken_ ? broken_reason_ : "it was shut down"))));
        return work;
      }
      queue_.push_back(Task{work, {}, true, is_recv, std::move(post)});
    }
    cv_.notify_all();
    return work;
  }

  void progress_loop(std::shared_ptr<Lifeline> lifeline) {
    std::vector<Pending> pending;
    for (;;) {
      Task task;
      bool have = false;
      {
        std::unique_lock lock(mu_);
        if (pending.empty()) {
          cv_.wait(lock, [&] { return stopped_ || !queue_.empty(); });
        }
        if (stopped_) break;
        if (!queue_.empty()) {
          task = std::move(queue_.front());
          queue_.pop_front();
          have = true;
          if (!task.p2p) {
            running_ = task.work;
            ++running_id_;
            running_deadline_ = Clock::now() + timeout();
          }
        }
      }
      if (have && task.p2p) {
        Pending p{task.work, MPI_REQUEST_NULL, Clock::now() + timeout(), task.is_recv};
        try {
          task.post(&p.request);
          pending.push_back(std::move(p));
        } catch (...) {
          task.work->finish(std::current_exception());
        }
      } else if (have) {
        cv_.notify_all();  // the watchdog now watches this task
        std::exception_ptr error;
        try {
          if (check_calls_) check_call(task);
          task.run();
        } catch (...) {
          error = std::current_exception();
        }
        bool timed_out;
        {
          std::lock_guard life(lifeline->mu);
          if (lifeline->group_gone) return;  // the group was destroyed while we were inside MPI
          std::lock_guard lock(mu_);
          running_ = nullptr;
          timed_out = broken_;
        }
        cv_.notify_all();  // shutdown may wait for this
        // After a timeout the watchdog has already failed this Work; a late success changes nothing.
        if (!timed_out) task.work->finish(error);
        if (error && !timed_out) mark_broken(fmt::format("{} failed", task.work->description()));
      }
      poll_pending(pending);
      if (!have && !pending.empty()) std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    for (auto& p : pending) {
      p.work->finish(std::make_exception_ptr(CommError(fmt::format("{}: not completed: the process group was shut down", p.work->description()))));
    }
  }

  void poll_pending(std::vector<Pending>& pending) {
    const auto now = Clock::now();
    for (size_t i = 0; i < pending.size();) {
      Pending& p = pending[i];
      int done = 0;
      const int rc = MPI_Test(&p.request, &done, MPI_STATUS_IGNORE);
      if (rc != MPI_SUCCESS) {
        p.work->finish(std::make_exception_ptr(CommError(fmt::format("{}: MPI_Test failed: {}", p.work->description(), mpi_error(rc)))));
      } else if (done) {
        p.work->finish();
      } else if (now > p.deadline) {
        if (p.is_recv) {
          MPI_Cancel(&p.request);
        }
        MPI_Request_free(&p.request);
        p.work->finish(std::make_exception_ptr(Timeout(fmt::format(
            "{}: timed out after {} ms on rank {}; the peer never matched it", p.work->description(), timeout().count(), rank()))));
      } else {
        ++i;
        continue;
      }
      pending.erase(pending.begin() + static_cast<std::ptrdiff_t>(i));
    }
  }

  // Fails the running collective at its deadline. MPI cannot abort it, so the progress thread
  // stays blocked in it and the group is unusable from then on.
  void watchdog_loop() {
    std::unique_lock lock(mu_);
    for (;;) {
      if (stopped_) return;
      if (running_ == nullptr || broken_) {
        cv_.wait(lock);
        continue;
      }
      const std::shared_ptr<Work> watched = running_;
      const uint64_t id = running_id_;
      const Clock::time_point deadline = running_deadline_;
      if (cv_.wait_until(lock, deadline, [&] { return stopped_ || running_id_ != id || running_ == nullptr; })) continue;
      // Still inside the same collective at its deadline.
      const std::string what = watched->description();
      lock.unlock();
      const std::string peers = diagnose(what);
      const std::string reason = fmt::format(
          "{} timed out after {} ms on rank {} of {} (MPI cannot abort a collective; the group is now unusable){}",
          what, timeout().count(), rank(), size(), peers);
      lock.lock();
      // The diagnosis takes up to 5 s without the lock: the collective may have completed
      // meanwhile (and the next one started), and then there is nothing to fail.
      if (stopped_ || running_id_ != id || running_ == nullptr) {
        // Withdraw what the diagnosis published, or a later diagnosis of a peer reads it as where
        // this rank is stuck.
        if (store_) {
          lock.unlock();
          try {
            store_->delete_key(fmt::format("mpi/desync/{}", rank()));
          } catch (...) {
          }
          lock.lock();
        }
        continue;
      }
      broken_ = true;
      broken_reason_ = reason;
      std::deque<Task> dropped;
      dropped.swap(queue_);
      lock.unlock();
      watched->finish(std::make_exception_ptr(Timeout(reason)));
      for (auto& t : dropped) {
        t.work->finish(std::make_exception_ptr(CommError(fmt::format("{}: not run: {}", t.work->description(), reason))));
      }
      lock.lock();
    }
  }

  // Desync diagnosis: publish what this rank is stuck in and read what the others report, for a
  // few seconds. Returns "; rank 1 is in broadcast #7 (...); rank 2 did not report ..." or "".
  std::string diagnose(const std::string& what) {
    if (!store_) return "";
    try {
      store_->set(fmt::format("mpi/desync/{}", rank()), what);
      const auto until = Clock::now() + std::min<std::chrono::milliseconds>(timeout(), std::chrono::seconds(5));
      std::vector<int> missing, same;
      std::string out;
      for (int r = 0; r < size(); ++r) {
        if (r == rank()) continue;
        const std::string key = fmt::format("mpi/desync/{}", r);
        bool found = false;
        while (!(found = store_->check({key})) && Clock::now() < until) std::this_thread::sleep_for(std::chrono::milliseconds(20));
        if (found) {
          const std::string theirs = to_string(store_->get(key));
          if (theirs != what) out += fmt::format("; rank {} is in {} while rank {} waits in {}", r, theirs, rank(), what);
          else same.push_back(r);
        } else {
          missing.push_back(r);
        }
      }
      if (!missing.empty()) out += fmt::format("; ranks that did not report (dead, or not blocked in a collective): {}", fmt::join(missing, ","));
      if (!same.empty()) out += fmt::format("; ranks {} are stuck in the same collective", fmt::join(same, ","));
      return out;
    } catch (const std::exception& e) {
      return fmt::format("; desync diagnosis through the store failed: {}", e.what());
    }
  }

  // Every rank gathers every rank's call (16 bytes each, a fixed size that cannot mismatch) and
  // finds the same first difference, so every rank fails this collective with the same message.
  void check_call(const Task& task) {
    std::vector<CollectiveCall> all(static_cast<size_t>(size()));
    CollectiveCall mine = task.call;
    check_rc("MPI_Allgather", MPI_Allgather(&mine, sizeof(CollectiveCall), MPI_BYTE, all.data(), sizeof(CollectiveCall),
                                            MPI_BYTE, comm_));
    if (std::string m = call_mismatch(all, task.seq); !m.empty()) throw CommError(m);
  }

  void mark_broken(const std::string& reason) {
    std::deque<Task> dropped;
    {
      std::lock_guard lock(mu_);
      if (broken_) return;
      broken_ = true;
      broken_reason_ = reason;
      dropped.swap(queue_);
    }
    for (auto& t : dropped) t.work->finish(std::make_exception_ptr(CommError(fmt::format("{}: not run: {}", t.work->description(), reason))));
  }

  std::shared_ptr<Store> store_;
  std::shared_ptr<Lifeline> lifeline_ = std::make_shared<Lifeline>();
  MPI_Comm comm_ = MPI_COMM_NULL;
  bool half_wire_ = false;
  bool check_calls_ = true;
  std::vector<float> scratch_[2];  // see scratch()
  std::vector<uint16_t> scratch16_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Task> queue_;
  int64_t seq_ = 0;
  bool stopped_ = false;
  bool broken_ = false;
  std::string broken_reason_;
  std::shared_ptr<Work> running_;  // the collective the progress thread is inside, or null
  uint64_t running_id_ = 0;        // counts started collectives (the watchdog's identity check)
  Clock::time_point running_deadline_{};
  std::thread progress_;
  std::thread watchdog_;
};

void MpiRuntime::finalize_at_exit() {
  MpiRuntime& rt = get();
  std::vector<MpiGroup*> groups;
  {
    std::lock_guard lock(rt.mu_);
    groups.assign(rt.groups_.begin(), rt.groups_.end());
  }
  bool stuck = rt.abandoned_;
  for (MpiGroup* g : groups) {
    stuck = stuck || g->inside_collective();
    g->shutdown("MPI is being finalized at process exit");
  }
  int finalized = 0;
  MPI_Finalized(&finalized);
  // MPI_Finalize would wait forever for a collective that never completes, or free what an
  // abandoned one still polls: skip it then (mpirun reports that the rank did not finalize).
  if (!finalized && !stuck) MPI_Finalize();
}

}  // namespace

std::shared_ptr<ProcessGroup> make_mpi_group(std::shared_ptr<Store> store, int rank, int size, ProcessGroupOptions options) {
  return std::make_shared<MpiGroup>(std::move(store), rank, size, options);
}

}  // namespace tandem::dist

#endif  // TANDEM_WITH_MPI
