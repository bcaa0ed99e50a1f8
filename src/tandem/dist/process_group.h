// ProcessGroup and Work, after PyTorch c10d: collectives on contiguous buffers (pointer, count,
// dtype, device), issued asynchronously and completed in issue order by one progress thread per
// group. Invariant: every wait has a timeout; a failed or timed-out collective fails its Work
// with an error naming the op, its sequence number, the ranks that did not arrive and the cause.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "tandem/core/dtype.h"
#include "tandem/core/storage.h"
#include "tandem/core/tensor.h"
#include "tandem/dist/error.h"
#include "tandem/dist/store.h"

namespace tandem::dist {

// c10d's ReduceOp. AVG divides the sum by the group size (integers: truncating division).
enum class ReduceOp : uint8_t { SUM, AVG, MAX, MIN, PRODUCT };
const char* reduce_op_name(ReduceOp op);

// A contiguous run of `count` elements of `dtype` at `data` on `device`. Collectives never
// own it: the caller keeps it alive until the Work completes.
struct Buffer {
  void* data = nullptr;
  int64_t count = 0;
  DType dtype = DType::f32;
  Device device = kCPU;

  size_t nbytes() const { return static_cast<size_t>(count) * element_size(dtype); }
};
// A contiguous tensor's elements; throws ValueError for a non-contiguous tensor.
Buffer as_buffer(const Tensor& t);

// The handle of one issued collective (c10d's Work).
//
// Blocking: only wait() blocks. Throws: wait() rethrows the collective's error (CommError,
// Timeout, ValueError, ...). Completion: the collective's output buffers are written and may be
// read once wait() returned or is_completed() is true; on failure their contents are unspecified.
// Thread safety: every method may be called from any thread. A completed Work answers
// is_completed(), is_success() and wait() without taking a lock or reading a clock.
class Work {
 public:
  // `description` names the op for errors, e.g. "all_reduce #812 (f32, 4096, SUM)". Backends
  // that issue many small collectives leave it empty and override describe(), so the text is
  // only built when an error or a caller asks for it.
  explicit Work(std::string description = {});
  virtual ~Work() = default;
  Work(const Work&) = delete;
  Work& operator=(const Work&) = delete;

  // Whether the collective finished, successfully or not. Never blocks.
  bool is_completed() const { return done_.load(std::memory_order_acquire); }
  // Whether it finished without an error. Never blocks.
  bool is_success() const { return is_completed() && !error_; }
  // The error of a failed collective, or null (also while it runs).
  std::exception_ptr exception() const { return is_completed() ? error_ : nullptr; }
  // Blocks until the collective finished; rethrows its error. With a timeout: throws Timeout
  // naming the op when it has not finished by then (the collective itself keeps running and
  // fails on its own timeout). Without: waits at most the group's timeout plus a grace period.
  void wait();
  void wait(std::chrono::milliseconds timeout);
  // The op's name for messages; built on first use (then fixed).
  const std::string& description() const;

  // For backends: complete the work (once). finish(nullptr) is success.
  void finish(std::exception_ptr error = nullptr);
  // For backends: the limit for wait() without an argument.
  void set_default_wait(std::chrono::milliseconds timeout) { default_wait_ = timeout; }

  // A Work that is already complete (world size 1, count 0) or already failed.
  static std::shared_ptr<Work> completed(std::string description = {});
  static std::shared_ptr<Work> failed(std::exception_ptr error, std::string description = {});

 protected:
  // The description when none was given to the constructor; called at most once, under the
  // Work's lock, by the first description() call.
  virtual std::string describe() const { return {}; }

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  // error_ is written once, before done_ is set (release); read only after done_ is seen (acquire).
  std::atomic<bool> done_{false};
  std::exception_ptr error_;
  mutable std::atomic<bool> described_{false};
  mutable std::string description_;
  std::chrono::milliseconds default_wait_{Store::kDefaultTimeout + std::chrono::seconds(60)};
};

struct ProcessGroupOptions {
  std::chrono::milliseconds timeout = Store::kDefaultTimeout;  // every collective and store wait
};

// The collectives of a group of `size()` processes. Output and input buffers of one call must
// not overlap unless the call says so (all_reduce and broadcast work in place). Every rank of
// the group must issue the same collectives in the same order with matching counts and dtypes;
// a mismatch is detected when possible and diagnosed on timeout (desync diagnosis).
//
// dtypes: f32, f64, f16, bf16, i32, i64, u8 (bool too for broadcast/gather/all_to_all, which
// only move bytes). f16/bf16 reductions accumulate in f32 and round once at the end.
//
// Backends derive from this class; a collective a backend lacks throws ValueError
// "<backend> does not support <op>".
class ProcessGroup : public std::enable_shared_from_this<ProcessGroup> {
 public:
  ProcessGroup(int rank, int size, ProcessGroupOptions options = {});
  virtual ~ProcessGroup() = default;
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  const ProcessGroupOptions& options() const { return options_; }
  std::chrono::milliseconds timeout() const { return options_.timeout; }
  virtual std::string backend_name() const = 0;

  // ---- collectives (async; each returns a Work) ----
  // In place: buf = op over ranks of buf.
  virtual std::shared_ptr<Work> all_reduce(Buffer buf, ReduceOp op = ReduceOp::SUM);
  // In place: buf = root's buf.
  virtual std::shared_ptr<Work> broadcast(Buffer buf, int root);
  // In place on root: buf = op over ranks; other ranks' buf is left unspecified (c10d).
  virtual std::shared_ptr<Work> reduce(Buffer buf, int root, ReduceOp op = ReduceOp::SUM);
  // Flat: out has size()*in.count elements; rank r's input lands at out[r*in.count].
  virtual std::shared_ptr<Work> all_gather(Buffer out, Buffer in);
  // List: outs[r] (each in.count elements) receives rank r's input.
  virtual std::shared_ptr<Work> all_gather(std::vector<Buffer> outs, Buffer in);
  // in has size()*out.count elements; out = op over ranks of in[rank*out.count ...].
  virtual std::shared_ptr<Work> reduce_scatter(Buffer out, Buffer in, ReduceOp op = ReduceOp::SUM);
  // On root, out has size()*in.count elements (rank order); elsewhere out is ignored.
  virtual std::shared_ptr<Work> gather(Buffer out, Buffer in, int root);
  // On root, in has size()*out.count elements; rank r receives in[r*out.count ...].
  virtual std::shared_ptr<Work> scatter(Buffer out, Buffer in, int root);
  // Equal splits: in and out have size()*k elements; block j of rank i's in lands in block i
  // of rank j's out.
  virtual std::shared_ptr<Work> all_to_all(Buffer out, Buffer in);
  virtual std::shared_ptr<Work> barrier();
  // Point to point; matched by (peer, tag) in issue order.
  virtual std::shared_ptr<Work> send(Buffer buf, int dst, int tag = 0);
  virtual std::shared_ptr<Work> recv(Buffer buf, int src, int tag = 0);

  // Memory the backend reaches without a copy (shm: inside the group's shared segment, so peers
  // reduce it in place; elsewhere ordinary 64-byte aligned memory). Collectives on buffers that
  // lie inside an allocation are zero-copy; any other buffer works too, through a copy.
  virtual std::shared_ptr<void> allocate(size_t bytes);

  // Tensor conveniences: contiguous tensors only, in place like the Buffer forms.
  std::shared_ptr<Work> all_reduce(const Tensor& t, ReduceOp op = ReduceOp::SUM);
  std::shared_ptr<Work> broadcast(const Tensor& t, int root);

  // Sequence number of the next collective this group issues (numbered from 0).
  virtual int64_t next_sequence_number() const { return 0; }

 protected:
  [[noreturn]] void unsupported(const char* op) const;

 private:
  int rank_;
  int size_;
  ProcessGroupOptions options_;
};

// ---- process-group setup (torch.distributed's module-level functions) ----

struct InitOptions {
  std::string backend = "shm";       // "shm", "mpi", "gloo", "nccl"
  // "env://" (default: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; or OpenMPI's / Slurm's
  // variables), "tcp://host:port", "file:///path".
  std::string init_method = "env://";
  int world_size = -1;               // -1: from the environment
  int rank = -1;                     // -1: from the environment
  std::chrono::milliseconds timeout = Store::kDefaultTimeout;
  std::shared_ptr<Store> store;      // instead of init_method (tests: a HashStore)
  std::string group_name;            // default: "default_pg"
};

// Where this process is in the job, read from the environment. Missing values are -1 / empty.
struct LaunchEnv {
  int rank = -1, world_size = -1, local_rank = -1, local_world_size = -1;
  std::string master_addr;
  int master_port = -1;
  std::string source;  // "torchrun", "openmpi", "slurm" or "" (nothing found)
};
// Reads RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE/MASTER_ADDR/MASTER_PORT, else
// OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK/LOCAL_SIZE, else SLURM_PROCID/NTASKS/LOCALID/
// first host of SLURM_STEP_NODELIST (else SLURM_JOB_NODELIST, SLURM_NODELIST). Throws ValueError for a malformed value, naming it.
LaunchEnv read_launch_env();

// Creates the default group (once; a second call throws ValueError) and returns it. A missing
// variable is an error naming it and how to set it. The rank that hosts the TCPStore (rank 0
// unless a launcher hosts it) returns only once every rank has built the group, so it may leave
// at once without cutting a slower rank off the store; new_group likewise. At the rendezvous every
// rank compares its world size and backend with rank 0's (a disagreement stops both sides at once,
// naming both values), and a rank's key is set once: a second process with the same RANK, or a
// store an earlier group used (a file:// path used again), is a ValueError saying which.
std::shared_ptr<ProcessGroup> init_process_group(const InitOptions& options = {});
bool is_initialized();
// The default group; throws ValueError when init_process_group has not been called.
std::shared_ptr<ProcessGroup> default_group();
int get_rank();        // of the default group
int get_world_size();  // of the default group
// A subgroup of the default group; every rank of the default group must call it, with the same
// ranks (c10d). Ranks outside `ranks` get nullptr.
std::shared_ptr<ProcessGroup> new_group(const std::vector<int>& ranks,
                                        std::chrono::milliseconds timeout = Store::kDefaultTimeout);
// torch's new_subgroups(group_size): the default group cut into consecutive groups of
// `group_size` ranks; every rank makes every group (new_group's rule) and gets its own. Throws
// ValueError when group_size does not divide the default group's size.
std::shared_ptr<ProcessGroup> new_subgroups(int group_size, std::chrono::milliseconds timeout = Store::kDefaultTimeout);
// Forgets the default group and every group made from it: is_initialized() is false again and
// init_process_group may be called anew. A group is destroyed (its threads, shared memory and,
// on the rank hosting it, the store's port released) when its last reference goes, so groups and
// DDP objects the caller still holds keep working until dropped (PyTorch's shuts them down);
// re-initialising on the same port while one is held is an error saying so.
void destroy_process_group();
// A barrier on the default group, waited for.
void barrier();

// Creates a backend's group directly on a store (what init_process_group and new_group use).
std::shared_ptr<ProcessGroup> make_process_group(const std::string& backend,
                                                 std::shared_ptr<Store> store, int rank, int size,
                                                 ProcessGroupOptions options = {});

}  // namespace tandem::dist
