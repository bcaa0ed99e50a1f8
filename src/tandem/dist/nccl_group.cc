// The NCCL process-group backend (TANDEM_WITH_CUDA): CUDA buffers only, one device per process.
// Collectives are enqueued on the group's own stream by its progress thread, in issue order;
// a CUDA event after each marks completion, and the thread polls the events against the group's
// timeout. Invariant: a collective still running at its deadline aborts the communicator
// (ncclCommAbort), fails every outstanding Work, and leaves the group unusable.
#include "tandem/dist/backends.h"

#ifndef TANDEM_WITH_CUDA

namespace tandem::dist {
std::shared_ptr<ProcessGroup> make_nccl_group(std::shared_ptr<Store>, int, int, ProcessGroupOptions) {
  throw ValueError("Tandem was built without CUDA: install the CUDA toolkit (with NCCL) at /usr/local/cuda and rebuild");
}
}  // namespace tandem::dist

#else

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>

#include <fmt/format.h>

namespace tandem::dist {
namespace {

using Clock = std::chrono::steady_clock;

ncclDataType_t nccl_type(DType dt) {
  switch (dt) {
    case DType::f32: return ncclFloat32;
    case DType::f64: return ncclFloat64;
    case DType::f16: return ncclFloat16;
    case DType::bf16: return ncclBfloat16;
    case DType::i32: return ncclInt32;
    case DType::i64: return ncclInt64;
    case DType::u8: case DType::b8: return ncclUint8;  // bool: data movement only
  }
  return ncclUint8;
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::SUM: return ncclSum;
    case ReduceOp::AVG: return ncclAvg;
    case ReduceOp::PRODUCT: return ncclProd;
    case ReduceOp::MAX: return ncclMax;
    case ReduceOp::MIN: return ncclMin;
  }
  return ncclSum;
}

void check_cuda(cudaError_t rc, const char* what) {
  if (rc != cudaSuccess) throw CommError(fmt::format("nccl backend: {} failed: {}", what, cudaGetErrorString(rc)));
}

// One enqueued collective: `enqueue` issues its NCCL calls on the stream (progress thread).
struct Task {
  std::shared_ptr<Work> work;
  std::function<void(cudaStream_t)> enqueue;
  cudaEvent_t inputs_ready = nullptr;  // recorded on the legacy default stream at issue time
};

struct InFlight {
  std::shared_ptr<Work> work;
  cudaEvent_t done;
  Clock::time_point deadline;
};

// Sets the current device for a scope and restores the previous one.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    check_cuda(cudaSetDevice(device), "cudaSetDevice");
  }
  ~DeviceGuard() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

// One GPU per process, the same for every group it makes (a subgroup's rank is not the process's
// place on its node): the local rank the launcher gives (LOCAL_RANK of torchrun/tandem run,
// OMPI_COMM_WORLD_LOCAL_RANK of mpirun, SLURM_LOCALID of srun), else the global rank, else the
// first group's rank, modulo the visible devices. Chosen once per process.
int process_device(int group_rank, int devices) {
  static std::mutex mu;
  static int chosen = -1;
  std::lock_guard lock(mu);
  if (chosen < 0) {
    const LaunchEnv env = read_launch_env();
    const int r = env.local_rank >= 0 ? env.local_rank : env.rank >= 0 ? env.rank : group_rank;
    chosen = r % devices;
  }
  return chosen;
}

class NcclGroup final : public ProcessGroup {
 public:
  NcclGroup(std::shared_ptr<Store> store, int rank, int size, ProcessGroupOptions options)
      : ProcessGroup(rank, size, options) {
    TANDEM_CHECK(store != nullptr, ValueError, "nccl backend: needs a store to exchange the NCCL unique id, got none");
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
      throw CommError("nccl backend: no CUDA device is visible to this process; run on a GPU machine or use the shm/mpi backend");
    }
    device_ = process_device(rank, devices);
    // The caller's current device is left as it was (PyTorch's device guard): a group's GPU is
    // set on this thread only while the constructor needs it, and on the progress thread.
    DeviceGuard guard(device_);
    check_cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");

    // Rank 0 makes the unique id; the others read it from the store (within the store's timeout).
    ncclUniqueId id;
    if (rank == 0) {
      check_nccl(ncclGetUniqueId(&id), "ncclGetUniqueId");
      store->set("nccl/unique_id", Bytes(reinterpret_cast<uint8_t*>(&id), reinterpret_cast<uint8_t*>(&id) + sizeof(id)));
    } else {
      const Bytes b = store->get("nccl/unique_id");
      TANDEM_CHECK(b.size() == sizeof(id), CommError, "nccl backend: the store's nccl/unique_id has {} bytes, expected {}",
                   b.size(), sizeof(id));
      std::memcpy(&id, b.data(), sizeof(id));
    }
    // Nonblocking init so that a rank that never arrives becomes a Timeout, not a hang.
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    check_nccl(ncclCommInitRankConfig(&comm_, size, id, rank, &config), "ncclCommInitRankConfig");
    wait_ready(Clock::now() + timeout(), "ncclCommInitRankConfig (did every rank create the group?)");
    check_cuda(cudaMalloc(&scratch_, sizeof(float)), "cudaMalloc");
    progress_ = std::thread([this] { progress_loop(); });
  }

  ~NcclGroup() override {
    {
      std::lock_guard lock(mu_);
      stopped_ = true;
    }
    cv_.notify_all();
    if (progress_.joinable()) progress_.join();
    for (auto& t : queue_) {
      if (t.inputs_ready != nullptr) cudaEventDestroy(t.inputs_ready);
      t.work->finish(std::make_exception_ptr(CommError(fmt::format("{}: not run: the process group was destroyed", t.work->description()))));
    }
    if (comm_ != nullptr) {
      if (broken_) ncclCommAbort(comm_);
      else ncclCommDestroy(comm_);
    }
    if (scratch_ != nullptr) cudaFree(scratch_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  std::string backend_name() const override { return "nccl"; }
  int64_t next_sequence_number() const override {
    std::lock_guard lock(mu_);
    return seq_;
  }

  std::shared_ptr<Work> all_reduce(Buffer buf, ReduceOp op) override {
    check_buffer("all_reduce", buf);
    TANDEM_CHECK(buf.dtype != DType::b8, ValueError, "all_reduce: nccl backend cannot reduce bool buffers; use uint8");
    return issue(fmt::format("all_reduce #{} ({}, {}, {})", peek(), dtype_name(buf.dtype), buf.count, reduce_op_name(op)),
                 [=, this](cudaStream_t s) {
                   check_nccl(ncclAllReduce(buf.data, buf.data, static_cast<size_t>(buf.count), nccl_type(buf.dtype), nccl_op(op), comm_, s), "ncclAllReduce");
                 });
  }

  std::shared_ptr<Work> broadcast(Buffer buf, int root) override {
    check_buffer("broadcast", buf);
    check_rank("broadcast", root);
    return issue(fmt::format("broadcast #{} ({}, {}, root {})", peek(), dtype_name(buf.dtype), buf.count, root), [=, this](cudaStream_t s) {
      check_nccl(ncclBroadcast(buf.data, buf.data, static_cast<size_t>(buf.count), nccl_type(buf.dtype), root, comm_, s), "ncclBroadcast");
    });
  }

  std::shared_ptr<Work> reduce(Buffer buf, int root, ReduceOp op) override {
    check_buffer("reduce", buf);
    check_rank("reduce", root);
    TANDEM_CHECK(buf.dtype != DType::b8, ValueError, "reduce: nccl backend cannot reduce bool buffers; use uint8");
    return issue(fmt::format("reduce #{} ({}, {}, {}, root {})", peek(), dtype_name(buf.dtype), buf.count, reduce_op_name(op), root),
                 [=, this](cudaStream_t s) {
                   check_nccl(ncclReduce(buf.data, buf.data, static_cast<size_t>(buf.count), nccl_type(buf.dtype), nccl_op(op), root, comm_, s), "ncclReduce");
                 });
  }

  std::shared_ptr<Work> all_gather(Buffer out, Buffer in) override {
    check_buffer("all_gather", in);
    check_buffer("all_gather", out);
    check_pair("all_gather", out, in);
    TANDEM_CHECK(out.count == in.count * size(), ValueError,
                 "all_gather: the output needs world size {} x input count {} = {} elements, got {}", size(), in.count, in.count * size(), out.count);
    return issue(fmt::format("all_gather #{} ({}, {})", peek(), dtype_name(in.dtype), in.count), [=, this](cudaStream_t s) {
      check_nccl(ncclAllGather(in.data, out.data, static_cast<size_t>(in.count), nccl_type(in.dtype), comm_, s), "ncclAllGather");
    });
  }

  std::shared_ptr<Work> all_gather(std::vector<Buffer> outs, Buffer in) override {
    check_buffer("all_gather", in);
    TANDEM_CHECK(static_cast<int>(outs.size()) == size(), ValueError, "all_gather: expected one output buffer per rank ({}), got {}", size(), outs.size());
    for (auto& o : outs) {
      check_buffer("all_gather", o);
      check_pair("all_gather", o, in);
      TANDEM_CHECK(o.count == in.count, ValueError, "all_gather: every output buffer needs the input's {} elements, got {}", in.count, o.count);
    }
    // One broadcast per rank, fused into one NCCL group: no staging buffer.
    return issue(fmt::format("all_gather #{} ({}, {}, list)", peek(), dtype_name(in.dtype), in.count), [=, this](cudaStream_t s) {
      check_nccl(ncclGroupStart(), "ncclGroupStart");
      for (int r = 0; r < size(); ++r) {
        ncclBroadcast(r == rank() ? in.data : outs[r].data, outs[r].data, static_cast<size_t>(in.count), nccl_type(in.dtype), r, comm_, s);
      }
      check_nccl(ncclGroupEnd(), "ncclGroupEnd");
    });
  }

  std::shared_ptr<Work> reduce_scatter(Buffer out, Buffer in, ReduceOp op) override {
    check_buffer("reduce_scatter", in);
    check_buffer("reduce_scatter", out);
    check_pair("reduce_scatter", out, in);
    TANDEM_CHECK(in.dtype != DType::b8, ValueError, "reduce_scatter: nccl backend cannot reduce bool buffers; use uint8");
    TANDEM_CHECK(in.count == out.count * size(), ValueError,
                 "reduce_scatter: the input needs world size {} x output count {} = {} elements, got {}", size(), out.count, out.count * size(), in.count);
    return issue(fmt::format("reduce_scatter #{} ({}, {}, {})", peek(), dtype_name(in.dtype), out.count, reduce_op_name(op)),
                 [=, this](cudaStream_t s) {
                   check_nccl(ncclReduceScatter(in.data, out.data, static_cast<size_t>(out.count), nccl_type(in.dtype), nccl_op(op), comm_, s), "ncclReduceScatter");
                 });
  }

  std::shared_ptr<Work> gather(Buffer out, Buffer in, int root) override {
    check_buffer("gather", in);
    check_rank("gather", root);
    if (rank() == root) {
      check_buffer("gather", out);
      check_pair("gather", out, in);
      TANDEM_CHECK(out.count == in.count * size(), ValueError, "gather: the root's output needs {} elements, got {}", in.count * size(), out.count);
    }
    return issue(fmt::format("gather #{} ({}, {}, root {})", peek(), dtype_name(in.dtype), in.count, root), [=, this](cudaStream_t s) {
      const size_t bytes = in.nbytes();
      check_nccl(ncclGroupStart(), "ncclGroupStart");
      if (rank() == root) {
        for (int r = 0; r < size(); ++r) {
          char* dst = static_cast<char*>(out.data) + r * bytes;
          if (r == root) check_cuda(cudaMemcpyAsync(dst, in.data, bytes, cudaMemcpyDeviceToDevice, s), "cudaMemcpyAsync");
          else ncclRecv(dst, bytes, ncclUint8, r, comm_, s);
        }
      } else {
        ncclSend(in.data, bytes, ncclUint8, root, comm_, s);
      }
      check_nccl(ncclGroupEnd(), "ncclGroupEnd");
    });
  }

  std::shared_ptr<Work> scatter(Buffer out, Buffer in, int root) override {
    check_buffer("scatter", out);
    check_rank("scatter", root);
    if (rank() == root) {
      check_buffer("scatter", in);
      check_pair("scatter", out, in);
      TANDEM_CHECK(in.count == out.count * size(), ValueError, "scatter: the root's input needs {} elements, got {}", out.count * size(), in.count);
    }
    return issue(fmt::format("scatter #{} ({}, {}, root {})", peek(), dtype_name(out.dtype), out.count, root), [=, this](cudaStream_t s) {
      const size_t bytes = out.nbytes();
      check_nccl(ncclGroupStart(), "ncclGroupStart");
      if (rank() == root) {
        for (int r = 0; r < size(); ++r) {
          const char* src = static_cast<const char*>(in.data) + r * bytes;
          if (r == root) check_cuda(cudaMemcpyAsync(out.data, src, bytes, cudaMemcpyDeviceToDevice, s), "cudaMemcpyAsync");
          else ncclSend(src, bytes, ncclUint8, r, comm_, s);
        }
      } else {
        ncclRecv(out.data, bytes, ncclUint8, root, comm_, s);
      }
      check_nccl(ncclGroupEnd(), "ncclGroupEnd");
    });
  }

  std::shared_ptr<Work> all_to_all(Buffer out, Buffer in) override {
    check_buffer("all_to_all", in);
    check_buffer("all_to_all", out);
    check_pair("all_to_all", out, in);
    TANDEM_CHECK(in.count == out.count && in.count % size() == 0, ValueError,
                 "all_to_all: input and output need the same count, a multiple of the world size {}; got {} and {}", size(), in.count, out.count);
    return issue(fmt::format("all_to_all #{} ({}, {})", peek(), dtype_name(in.dtype), in.count), [=, this](cudaStream_t s) {
      const size_t block = in.nbytes() / static_cast<size_t>(size());
      check_nccl(ncclGroupStart(), "ncclGroupStart");
      for (int r = 0; r < size(); ++r) {
        ncclSend(static_cast<const char*>(in.data) + r * block, block, ncclUint8, r, comm_, s);
        ncclRecv(static_cast<char*>(out.data) + r * block, block, ncclUint8, r, comm_, s);
      }
      check_nccl(ncclGroupEnd(), "ncclGroupEnd");
    });
  }

  std::shared_ptr<Work> barrier() override {
    return issue(fmt::format("barrier #{}", peek()), [this](cudaStream_t s) {
      check_nccl(ncclAllReduce(scratch_, scratch_, 1, ncclFloat32, ncclSum, comm_, s), "ncclAllReduce (barrier)");
    });
  }

  // NCCL has no tags: sends and receives between two ranks match in issue order; `tag` must be 0.
  std::shared_ptr<Work> send(Buffer buf, int dst, int tag) override {
    check_buffer("send", buf);
    check_rank("send", dst);
    TANDEM_CHECK(tag == 0, ValueError, "send: the nccl backend has no message tags (got tag {}); pass 0", tag);
    return issue(fmt::format("send #{} ({}, {}, to {})", peek(), dtype_name(buf.dtype), buf.count, dst), [=, this](cudaStream_t s) {
      check_nccl(ncclSend(buf.data, buf.nbytes(), ncclUint8, dst, comm_, s), "ncclSend");
    });
  }
  std::shared_ptr<Work> recv(Buffer buf, int src, int tag) override {
    check_buffer("recv", buf);
    check_rank("recv", src);
    TANDEM_CHECK(tag == 0, ValueError, "recv: the nccl backend has no message tags (got tag {}); pass 0", tag);
    return issue(fmt::format("recv #{} ({}, {}, from {})", peek(), dtype_name(buf.dtype), buf.count, src), [=, this](cudaStream_t s) {
      check_nccl(ncclRecv(buf.data, buf.nbytes(), ncclUint8, src, comm_, s), "ncclRecv");
    });
  }

  // The contract is memory the caller reads and writes from the CPU (DDP's buckets, the model
  // averager's flat buffers, tandem bench): device memory there was a wild write, and host memory
  // is no NCCL buffer. Refused, naming what works.
  std::shared_ptr<void> allocate(size_t bytes) override {
    throw ValueError(fmt::format(
        "nccl backend: allocate({} bytes) is for CPU-side buffers (DDP's gradient buckets, the model averager), "
        "which NCCL cannot reduce; Tandem trains on CPU tensors, so use the shm, gloo or mpi backend for them. "
        "NCCL collectives take device buffers (Buffer with device cuda:N) you allocate with cudaMalloc",
        bytes));
  }

 private:
  void check_nccl(ncclResult_t rc, const char* what) const {
    if (rc == ncclSuccess || rc == ncclInProgress) return;
    throw CommError(fmt::format("nccl backend (rank {} of {}): {} failed: {}{}", rank(), size(), what, ncclGetErrorString(rc),
                                comm_ != nullptr ? fmt::format(" ({})", ncclGetLastError(comm_)) : std::string()));
  }
  void check_buffer(const char* op, const Buffer& b) const {
    TANDEM_CHECK(b.device.type == DeviceType::cuda, ValueError,
                 "nccl backend: {} needs CUDA buffers, got a CPU buffer; use the shm or mpi backend for host memory", op);
    TANDEM_CHECK(b.device.index == device_, ValueError, "nccl backend: {} got a buffer on cuda:{} but this group uses cuda:{}",
                 op, static_cast<int>(b.device.index), device_);
    TANDEM_CHECK(b.count >= 0, ValueError, "{}: negative element count {}", op, b.count);
    TANDEM_CHECK(b.count == 0 || b.data != nullptr, ValueError, "{}: null data pointer for {} elements", op, b.count);
  }
  void check_pair(const char* op, const Buffer& out, const Buffer& in) const {
    TANDEM_CHECK(out.dtype == in.dtype, ValueError, "{}: input and output dtypes differ ({} vs {})", op, dtype_name(in.dtype), dtype_name(out.dtype));
  }
  void check_rank(const char* op, int r) const {
    TANDEM_CHECK(r >= 0 && r < size(), ValueError, "{}: rank {} is outside the group of size {}", op, r, size());
  }

  // Polls a nonblocking communicator until its last call is no longer in progress.
  void wait_ready(Clock::time_point deadline, const char* what) {
    for (;;) {
      ncclResult_t state = ncclSuccess;
      check_nccl(ncclCommGetAsyncError(comm_, &state), "ncclCommGetAsyncError");
      if (state == ncclSuccess) return;
      if (state != ncclInProgress) check_nccl(state, what);
      if (Clock::now() > deadline) {
        ncclCommAbort(comm_);
        comm_ = nullptr;
        throw Timeout(fmt::format("nccl backend (rank {} of {}): {} timed out after {} ms", rank(), size(), what, timeout().count()));
      }
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }

  int64_t peek() const {
    std::lock_guard lock(mu_);
    return seq_;
  }

  std::shared_ptr<Work> issue(std::string description, std::function<void(cudaStream_t)> enqueue) {
    auto work = std::make_shared<Work>(std::move(description));
    work->set_default_wait(timeout() + std::chrono::seconds(60));
    {
      std::lock_guard lock(mu_);
      ++seq_;
      if (broken_) {
        work->finish(std::make_exception_ptr(CommError(fmt::format("{}: the nccl process group is unusable: {}", work->description(), broken_reason_))));
        return work;
      }
      // The group's stream does not synchronize with the default stream: make it wait for
      // whatever the caller queued there before issuing (copies into the buffers, kernels).
      // On this group's device, whatever device the calling thread is on (a new thread starts on
      // device 0): the event must follow the work queued on this GPU's default stream.
      DeviceGuard guard(device_);
      cudaEvent_t ready = nullptr;
      if (cudaEventCreateWithFlags(&ready, cudaEventDisableTiming) != cudaSuccess ||
          cudaEventRecord(ready, cudaStreamLegacy) != cudaSuccess) {
        if (ready != nullptr) cudaEventDestroy(ready);
        ready = nullptr;  // best effort: without it the caller must have synchronized
      }
      queue_.push_back(Task{work, std::move(enqueue), ready});
    }
    cv_.notify_all();
    return work;
  }

  void fail_all(std::deque<InFlight>& in_flight, const std::string& reason, std::exception_ptr first) {
    std::deque<Task> dropped;
    {
      std::lock_guard lock(mu_);
      broken_ = true;
      broken_reason_ = reason;
      dropped.swap(queue_);
    }
    bool head = true;
    for (auto& f : in_flight) {
      f.work->finish(head && first ? first : std::make_exception_ptr(CommError(fmt::format("{}: aborted: {}", f.work->description(), reason))));
      head = false;
      cudaEventDestroy(f.done);
    }
    in_flight.clear();
    for (auto& t : dropped) {
      if (t.inputs_ready != nullptr) cudaEventDestroy(t.inputs_ready);
      t.work->finish(std::make_exception_ptr(CommError(fmt::format("{}: not run: {}", t.work->description(), reason))));
    }
  }

  void progress_loop() {
    cudaSetDevice(device_);
    std::deque<InFlight> in_flight;
    for (;;) {
      std::deque<Task> batch;
      {
        std::unique_lock lock(mu_);
        if (in_flight.empty()) cv_.wait(lock, [&] { return stopped_ || !queue_.empty(); });
        if (stopped_) break;
        batch.swap(queue_);
      }
      // Enqueue everything issued so far, in order; each gets an event behind it.
      for (auto& t : batch) {
        if (t.inputs_ready != nullptr) {
          if (!broken_) cudaStreamWaitEvent(stream_, t.inputs_ready, 0);
          cudaEventDestroy(t.inputs_ready);  // released once the wait is enqueued
        }
        if (broken_) {
          t.work->finish(std::make_exception_ptr(CommError(fmt::format("{}: not run: {}", t.work->description(), broken_reason_))));
          continue;
        }
        try {
          t.enqueue(stream_);
          wait_ready(Clock::now() + timeout(), t.work->description().c_str());
          cudaEvent_t ev;
          check_cuda(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "cudaEventCreate");
          check_cuda(cudaEventRecord(ev, stream_), "cudaEventRecord");
          in_flight.push_back(InFlight{t.work, ev, Clock::now() + timeout()});
        } catch (...) {
          // This one fails with its own error; everything outstanding fails after it. The
          // communicator is aborted (as every other error path does), so that collectives
          // already on the GPU stop instead of spinning with nothing left to time them out.
          t.work->finish(std::current_exception());
          if (comm_ != nullptr) {
            ncclCommAbort(comm_);
            comm_ = nullptr;
          }
          fail_all(in_flight, fmt::format("{} could not be enqueued", t.work->description()), nullptr);
        }
      }
      // Complete in issue order.
      while (!in_flight.empty()) {
        InFlight& head = in_flight.front();
        const cudaError_t q = cudaEventQuery(head.done);
        if (q == cudaSuccess) {
          cudaEventDestroy(head.done);
          head.work->finish();
          in_flight.pop_front();
          continue;
        }
        ncclResult_t async = ncclSuccess;
        ncclCommGetAsyncError(comm_, &async);
        if (q != cudaErrorNotReady || (async != ncclSuccess && async != ncclInProgress)) {
          const std::string reason = fmt::format("{} failed on rank {} of {}: {}", head.work->description(), rank(), size(),
                                                 q != cudaErrorNotReady ? cudaGetErrorString(q) : ncclGetErrorString(async));
          ncclCommAbort(comm_);
          comm_ = nullptr;
          fail_all(in_flight, reason, std::make_exception_ptr(CommError(reason)));
        } else if (Clock::now() > head.deadline) {
          const std::string reason = fmt::format("{} timed out after {} ms on rank {} of {}; the communicator was aborted",
                                                 head.work->description(), timeout().count(), rank(), size());
          ncclCommAbort(comm_);
          comm_ = nullptr;
          fail_all(in_flight, reason, std::make_exception_ptr(Timeout(reason)));
        }
        break;
      }
      if (!in_flight.empty()) std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
    if (!in_flight.empty()) fail_all(in_flight, "the process group was destroyed", nullptr);
  }

  int device_ = 0;
  cudaStream_t stream_ = nullptr;
  ncclComm_t comm_ = nullptr;
  float* scratch_ = nullptr;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Task> queue_;
  int64_t seq_ = 0;
  bool stopped_ = false;
  bool broken_ = false;  // written by the progress thread (under mu_), read by it and the destructor
  std::string broken_reason_;
  std::thread progress_;
};

}  // namespace

std::shared_ptr<ProcessGroup> make_nccl_group(std::shared_ptr<Store> store, int rank, int size, ProcessGroupOptions options) {
  return std::make_shared<NcclGroup>(std::move(store), rank, size, options);
}

}  // namespace tandem::dist

#endif  // TANDEM_WITH_CUDA
