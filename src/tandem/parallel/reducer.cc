// The DDP reducer (see reducer.h for the design): buckets, hooks, ordered launches, finalize.
#include "tandem/parallel/reducer.h"

#include <algorithm>
#include <map>

#include <fmt/format.h>

#include "tandem/autograd/engine.h"
#include "tandem/autograd/grad_mode.h"
#include "tandem/autograd/node.h"
#include "tandem/core/error.h"
#include "tandem/dist/error.h"

namespace tandem::parallel {
namespace {

// The end of both errors for a used-parameter set that changed under static_graph.
constexpr const char* kStaticGraphChanged =
    "With static_graph the set of used parameters must not change during training; build DDP with "
    "find_unused_parameters=true (and static_graph=false) when it does";

std::string join_names(const std::vector<std::string>& names, size_t limit = 8) {
  std::string out;
  for (size_t i = 0; i < names.size() && i < limit; ++i) out += (i ? ", " : "") + names[i];
  if (names.size() > limit) out += fmt::format(" and {} more", names.size() - limit);
  return out;
}

// Every leaf TensorImpl reachable from `root` through the autograd graph.
std::vector<const TensorImpl*> reachable_leaves(const std::vector<Tensor>& roots) {
  std::vector<const TensorImpl*> leaves;
  std::vector<autograd::Node*> stack;
  std::vector<const autograd::Node*> seen;
  for (const Tensor& root : roots) {
    if (!root.defined() || !root.requires_grad()) continue;
    autograd::Edge start = autograd::gradient_edge(root);
    if (!start.valid()) continue;
    auto it = std::lower_bound(seen.begin(), seen.end(), start.fn.get());
    if (it != seen.end() && *it == start.fn.get()) continue;
    seen.insert(it, start.fn.get());
    stack.push_back(start.fn.get());
  }
  while (!stack.empty()) {
    autograd::Node* n = stack.back();
    stack.pop_back();
    if (auto* acc = dynamic_cast<autograd::AccumulateGrad*>(n)) {
      if (auto leaf = acc->leaf().lock()) leaves.push_back(leaf.get());
    }
    for (const autograd::Edge& e : n->next_edges()) {
      if (!e.valid()) continue;
      auto it = std::lower_bound(seen.begin(), seen.end(), e.fn.get());
      if (it != seen.end() && *it == e.fn.get()) continue;
      seen.insert(it, e.fn.get());
      stack.push_back(e.fn.get());
    }
  }
  return leaves;
}

// The fixed binary tree over leaves [l, r): split at the largest power of two below r - l. With
// k leaves per rank (k a power of two) every rank's block is a subtree, so the same tree is
// computed whatever the number of ranks. Evaluated chunk by chunk: out[0, m) = the tree of
// leaves[i] + off over [l, r), each node's sum a plain f32 add (left + right), in `tmp` (one
// chunk per tree level) while it is in L1; a null leaf reads as zeros.
constexpr int64_t kTreeChunk = 2048;

void tree_chunk(const std::vector<const float*>& leaves, size_t l, size_t r, int64_t off, int64_t m, float* out,
                float* tmp, const float* zeros) {
  if (r - l == 1) {
    const float* src = leaves[l] ? leaves[l] + off : zeros;
    std::copy(src, src + m, out);
    return;
  }
  size_t h = 1;
  while (h * 2 < r - l) h *= 2;
  tree_chunk(leaves, l, l + h, off, m, out, tmp + kTreeChunk, zeros);
  tree_chunk(leaves, l + h, r, off, m, tmp, tmp + kTreeChunk, zeros);
  for (int64_t i = 0; i < m; ++i) out[i] += tmp[i];
}

// out[i] = tree(leaves)[i] / divisor for i < n (divisor 1: the sum itself), in chunks. Keeps its
// scratch (a chunk per tree level and a chunk of zeros) across calls: one per finalize.
class TreeSum {
 public:
  explicit TreeSum(size_t max_leaves) {
    size_t depth = 1;
    while ((size_t{1} << (depth - 1)) < max_leaves) ++depth;
    tmp_.resize(static_cast<size_t>(kTreeChunk) * depth);
    zeros_.assign(static_cast<size_t>(kTreeChunk), 0.0f);
  }
  void operator()(const std::vector<const float*>& leaves, int64_t n, float* out, float divisor = 1.0f) {
    for (int64_t off = 0; off < n; off += kTreeChunk) {
      const int64_t m = std::min(kTreeChunk, n - off);
      tree_chunk(leaves, 0, leaves.size(), off, m, out + off, tmp_.data(), zeros_.data());
      if (divisor != 1.0f) {
        for (int64_t i = 0; i < m; ++i) out[off + i] /= divisor;
      }
    }
  }

 private:
  std::vector<float> tmp_, zeros_;
};

// Whether gradient `g` is (a tensor over) slot `s` itself: the same memory, not a copy.
bool lies_in(const Tensor& g, const Tensor& s) {
  return g.defined() && g.storage() == s.storage() && g.offset() == s.offset();
}

}  // namespace

// ---- construction ----

std::shared_ptr<Reducer> Reducer::create(std::vector<std::pair<std::string, Tensor>> params,
                                         std::shared_ptr<dist::ProcessGroup> group, ReducerOptions options) {
  std::shared_ptr<Reducer> r(new Reducer(std::move(params), std::move(group), options));
  r->install_hooks();
  return r;
}

Reducer::Reducer(std::vector<std::pair<std::string, Tensor>> params, std::shared_ptr<dist::ProcessGroup> group,
                 ReducerOptions options)
    : group_(std::move(group)), options_(options) {
  TANDEM_CHECK(group_ != nullptr, ValueError, "DistributedDataParallel needs a process group, got null");
  TANDEM_CHECK(options_.bucket_cap_mb > 0 && options_.first_bucket_mb > 0, ValueError,
               "bucket_cap_mb and first_bucket_mb must be positive, got {} and {}", options_.bucket_cap_mb,
               options_.first_bucket_mb);
  for (auto& [name, t] : params) {
    TANDEM_CHECK(t.is_contiguous(), ValueError, "DDP: parameter '{}' is not contiguous", name);
    params_.push_back(Param{name, t});
  }
  std::vector<int64_t> order(params_.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int64_t>(params_.size() - 1 - i);
  build_buckets(order);
  ready_.assign(params_.size(), 0);
  locally_used_.assign(params_.size(), 0);
  used_since_sync_.assign(params_.size(), 0);
}

Reducer::~Reducer() {
  clear_destinations();
  for (auto& p : params_) {
    if (p.hook >= 0) p.tensor.remove_hook(p.hook);
  }
  // A collective still in flight writes into our buckets: let it finish before they are freed.
  for (auto& b : buckets_) {
    if (b.launched && b.result.work) {
      try {
        b.result.work->wait();
      } catch (...) {
      }
    }
  }
}

void Reducer::install_hooks() {
  std::weak_ptr<Reducer> weak = weak_from_this();
  for (size_t i = 0; i < params_.size(); ++i) {
    params_[i].hook = params_[i].tensor.register_post_accumulate_grad_hook([weak, i](Tensor&) {
      if (auto self = weak.lock()) self->on_gradient_ready(static_cast<int64_t>(i));
    });
  }
}

void Reducer::build_buckets(const std::vector<int64_t>& order) {
  // Gradients that live in the old buckets (bucket views) move to the new ones below.
  std::vector<Tensor> old_grads(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) old_grads[i] = params_[i].tensor.grad();

  std::vector<Bucket> buckets;
  std::map<DType, int64_t> open;     // dtype -> index of its bucket being filled
  std::map<DType, bool> had_first;   // dtype -> its first (small) bucket is done
  const double mb = 1024.0 * 1024.0;
  for (int64_t p : order) {
    const DType dt = params_[p].tensor.dtype();
    auto it = open.find(dt);
    if (it == open.end()) {
      buckets.emplace_back();
      buckets.back().dtype = dt;
      it = open.emplace(dt, static_cast<int64_t>(buckets.size() - 1)).first;
    }
    Bucket& b = buckets[it->second];
    b.params.push_back(p);
    b.numel += params_[p].tensor.numel();
    const double limit = (had_first[dt] ? options_.bucket_cap_mb : options_.first_bucket_mb) * mb;
    if (static_cast<double>(b.numel) * static_cast<double>(element_size(dt)) >= limit) {
      open.erase(it);
      had_first[dt] = true;
    }
  }
  for (int64_t bi = 0; bi < static_cast<int64_t>(buckets.size()); ++bi) {
    Bucket& b = buckets[bi];
    const size_t bytes = static_cast<size_t>(b.numel) * element_size(b.dtype);
    b.memory = group_->allocate(bytes);
    std::shared_ptr<void> keep = b.memory;
    b.flat = from_blob(b.memory.get(), {b.numel}, b.dtype, [keep](void*) {});
    b.flat.zero_();
    int64_t offset = 0;
    for (int64_t p : b.params) {
      params_[p].bucket = bi;
      params_[p].offset = offset;
      offset += params_[p].tensor.numel();
    }
  }
  buckets_ = std::move(buckets);
  timings_.assign(buckets_.size(), BucketTiming{});
  next_launch_ = 0;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!old_grads[i].defined()) continue;
    Tensor s = slot(static_cast<int64_t>(i));
    s.copy_(old_grads[i]);
    if (options_.gradient_as_bucket_view) params_[i].tensor.set_grad(s);
  }
}

Tensor Reducer::slot(int64_t param) const {
  const Param& p = params_[param];
  const Bucket& b = buckets_[p.bucket];
  return make_view(b.flat, p.tensor.shape(), contiguous_strides(p.tensor.shape()), b.flat.offset() + p.offset);
}

void Reducer::replace_bucket_memory(int64_t bi) {
  Bucket& b = buckets_[bi];
  // The previous memory is free again once the gradients handed over from it were dropped
  // (zero_grad(set_to_none)): then the bucket and the gradients take turns between two blocks.
  std::shared_ptr<void> next;
  if (b.spare && b.spare.use_count() == 1) {
    next = std::move(b.spare);
  } else {
    next = group_->allocate(static_cast<size_t>(b.numel) * element_size(b.dtype));
  }
  b.spare = std::move(b.memory);
  b.memory = std::move(next);
  std::shared_ptr<void> keep = b.memory;
  b.flat = from_blob(b.memory.get(), {b.numel}, b.dtype, [keep](void*) {});
}

void Reducer::register_comm_hook(CommHook hook) {
  TANDEM_CHECK(!hook_, ValueError, "register_comm_hook: a communication hook is already registered (only one allowed)");
  TANDEM_CHECK(!options_.deterministic, ValueError,
               "register_comm_hook: DDP in deterministic mode sums every gradient in a fixed tree of its own and runs "
               "no communication hook (the hook would be ignored); construct DDP without deterministic=true to use one");
  hook_ = std::move(hook);
}

std::vector<std::vector<int64_t>> Reducer::bucket_indices() const {
  std::vector<std::vector<int64_t>> out;
  for (const auto& b : buckets_) out.push_back(b.params);
  return out;
}

std::vector<int64_t> Reducer::bucket_sizes_bytes() const {
  std::vector<int64_t> out;
  for (const auto& b : buckets_) out.push_back(b.numel * static_cast<int64_t>(element_size(b.dtype)));
  return out;
}

double Reducer::now_s() const {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
}

// ---- iteration ----

void Reducer::clear_destinations() {
  if (!destinations_set_) return;
  for (auto& p : params_) autograd::set_grad_destination(p.tensor, Tensor());
  destinations_set_ = false;
}

void Reducer::drain_launched() {
  for (auto& b : buckets_) {
    if (!b.launched || !b.result.work) continue;
    try {
      b.result.work->wait();
    } catch (...) {  // the failure is reported where it is waited for in earnest, or was already
    }
  }
}

void Reducer::abort_iteration() {
  // A backward that threw before finalize (a node, a hook, a comm hook at launch): its launched
  // collectives read and write the buckets in place until they complete, and the next iteration
  // must start from nothing. The micro-batches of a deterministic step are dropped with it: the
  // step cannot be completed bit for bit.
  if (options_.deterministic) micro_grads_.clear();
  reset_iteration();
  expect_backward_ = false;
}

void Reducer::reset_iteration() {
  // Collectives of an iteration that ended early may still run on the buckets (shm's progress
  // thread): settle them before the buckets are reused or moved.
  drain_launched();
  clear_destinations();
  std::fill(ready_.begin(), ready_.end(), 0);
  std::fill(locally_used_.begin(), locally_used_.end(), 0);
  for (auto& b : buckets_) {
    b.pending = static_cast<int64_t>(b.params.size());
    b.launched = false;
    b.result = {};
  }
  next_launch_ = 0;
  finalize_queued_ = false;
  static_discovery_ = false;
  unused_.clear();
  // Only a completed synchronized iteration's order may shape the rebuild: one that threw (an
  // unused parameter, a hook error) must not leave a partial order behind to be appended to.
  if (!rebuilt_) ready_order_.clear();
  // World size 1 with the default hook: the average over one rank is the gradient itself, so the
  // collective is skipped and (unless grads are bucket views) gradients stay where autograd put
  // them — no copy into the bucket and back (PyTorch still calls a no-op all_reduce here).
  local_only_ = group_->size() == 1 && !hook_;
}

void Reducer::prepare_for_backward(bool sync, const std::vector<Tensor>& outputs) {
  reset_iteration();
  expect_backward_ = true;
  sync_ = sync;
  if (!sync || options_.deterministic) return;
  // A gradient that this backward creates (grad() none) is produced in its slot by the op that
  // computes it where the op can (autograd gradient destinations): no copy into the bucket.
  if (reads_slots()) {
    for (size_t i = 0; i < params_.size(); ++i) autograd::set_grad_destination(params_[i].tensor, slot(static_cast<int64_t>(i)));
    destinations_set_ = true;
  }
  if (options_.static_graph) {
    // The first synchronized iteration finds the unused parameters by the gradients that arrive
    // (finalize), as torch counts the hooks that fired: a loss that also uses tensors forward did
    // not return, or parameters outside forward, is fine. Later iterations take that set.
    if (static_known_) {
      unused_ = static_unused_;
    } else {
      static_discovery_ = true;
    }
  } else if (options_.find_unused_parameters) {
    std::vector<const TensorImpl*> leaves = reachable_leaves(outputs);
    std::sort(leaves.begin(), leaves.end());
    for (size_t i = 0; i < params_.size(); ++i) {
      if (!std::binary_search(leaves.begin(), leaves.end(), params_[i].tensor.impl_ptr().get())) {
        unused_.push_back(static_cast<int64_t>(i));
      }
    }
  }
}

void Reducer::on_gradient_ready(int64_t param) {
  if (!expect_backward_) return;  // a backward that no DDP forward armed: not ours to reduce
  if (!finalize_queued_) {
    finalize_queued_ = true;
    start_ = std::chrono::steady_clock::now();
    std::weak_ptr<Reducer> weak = weak_from_this();
    autograd::queue_callback(
        [weak] {
          if (auto self = weak.lock()) {
            if (self->options_.deterministic) {
              self->finalize_deterministic();
            } else {
              self->finalize();
            }
          }
        },
        [weak] {
          if (auto self = weak.lock()) self->abort_iteration();
        });
    if (sync_ && !options_.deterministic) {
      // Unused in this pass, but a parameter may hold a gradient accumulated in earlier no_sync
      // passes: that one is reduced like any other (PyTorch copies a defined grad too), else zeros.
      // (World size 1 without bucket views reads no slot: grad() already is the result.)
      for (int64_t p : unused_) {
        if (reads_slots()) grad_into_slot(p);
        mark_ready(p);
      }
    }
  }
  if (options_.deterministic) return;
  if (!sync_) {  // no_sync: the gradient accumulates locally, to be reduced at the next synced pass
    used_since_sync_[param] = 1;
    return;
  }
  // Checked here, before the gradient goes into its slot (that bucket's all-reduce may be
  // running), and only here: the unused parameters marked above are distinct and not yet ready.
  if (ready_[param]) throw_ready_twice(param);
  if (reads_slots()) grad_into_slot(param);
  locally_used_[param] = 1;
  mark_ready(param);
}

void Reducer::throw_ready_twice(int64_t param) const {
  const std::string& name = params_[param].name;
  const bool static_unused =
      options_.static_graph && static_known_ &&
      std::find(static_unused_.begin(), static_unused_.end(), param) != static_unused_.end();
  if (static_unused) {
    throw AutogradError(fmt::format(
        "DDP(static_graph=true): parameter '{}' got no gradient in the first synchronized iteration, so it counts "
        "as unused in every iteration, but this backward used it. {}",
        name, kStaticGraphChanged));
  }
  throw AutogradError(fmt::format(
      "DDP: parameter '{}' got its gradient twice in one backward pass. A parameter may take part in only one "
      "backward per forward (reentrant backward, or a parameter marked unused that was used); wrap extra backward "
      "passes in no_sync()",
      name));
}

void Reducer::grad_into_slot(int64_t param) {
  Param& p = params_[param];
  Tensor g = p.tensor.grad();
  Tensor s = slot(param);
  NoGradGuard no_grad;
  if (!g.defined()) {
    s.zero_();
  } else if (!lies_in(g, s)) {
    s.copy_(g);
    if (options_.gradient_as_bucket_view) p.tensor.set_grad(s);
  }
}

void Reducer::mark_ready(int64_t param) {
  ready_[param] = 1;
  if (!rebuilt_) ready_order_.push_back(param);
  Bucket& b = buckets_[params_[param].bucket];
  if (--b.pending == 0) {
    timings_[params_[param].bucket].ready_s = now_s();
    if (!options_.delay_allreduce && !static_discovery_) launch_ready_buckets();
  }
}

void Reducer::launch_ready_buckets() {
  while (next_launch_ < static_cast<int64_t>(buckets_.size()) && buckets_[next_launch_].pending == 0) {
    launch(next_launch_++);
  }
}

void Reducer::launch(int64_t bi) {
  Bucket& b = buckets_[bi];
  if (local_only_) {
    b.result = {dist::Work::completed(), nullptr};
    b.launched = true;
    timings_[bi].launch_s = now_s();
    return;
  }
  b.result = start_collective(bi, b.flat);
  b.launched = true;
  timings_[bi].launch_s = now_s();
}

HookResult Reducer::start_collective(int64_t bi, const Tensor& buffer) {
  GradBucket gb;
  gb.index = bi;
  gb.buffer = buffer;
  gb.is_last = bi + 1 == static_cast<int64_t>(buckets_.size());
  if (!hook_) return allreduce_hook(*group_, gb);
  // Only a hook reads the names and the per-parameter views.
  for (int64_t p : buckets_[bi].params) {
    const Param& param = params_[p];
    gb.parameter_names.push_back(param.name);
    const Shape& shape = param.tensor.shape();
    gb.gradients.push_back(make_view(buffer, shape, contiguous_strides(shape), buffer.offset() + param.offset));
  }
  HookResult r = hook_(*group_, gb);
  TANDEM_CHECK(r.work != nullptr, ValueError, "DDP communication hook returned no Work for bucket {}", bi);
  return r;
}

void Reducer::finalize() {
  backward_end_s_ = now_s();
  expect_backward_ = false;
  finalize_queued_ = false;
  clear_destinations();  // before the buckets may move (replace_bucket_memory): no stale offers
  if (!sync_) return;
  // Parameters that got a gradient in the no_sync passes of this step count as used here.
  std::vector<char> used_before(params_.size(), 0);
  used_before.swap(used_since_sync_);

  // Launching runs the communication hook, which may throw: the buckets already launched are
  // settled and the iteration forgotten before the error leaves.
  auto launch_remaining = [&] {
    try {
      launch_ready_buckets();
    } catch (...) {
      reset_iteration();
      throw;
    }
  };

  // static_graph's first synchronized iteration: a parameter whose gradient did not arrive is
  // this rank's unused one, now and in every later iteration (kept once the iteration succeeded).
  // Its slot gets what an unused parameter's gets (a gradient from no_sync passes, else zeros);
  // it goes first in the ready order, as the unused ones do when marked at the first hook.
  std::vector<int64_t> discovered;
  const bool discovering = static_discovery_;
  if (discovering) {
    const size_t before = ready_order_.size();
    for (size_t i = 0; i < params_.size(); ++i) {
      if (ready_[i]) continue;
      const auto p = static_cast<int64_t>(i);
      if (reads_slots()) grad_into_slot(p);
      discovered.push_back(p);
      mark_ready(p);
    }
    if (!rebuilt_) std::rotate(ready_order_.begin(), ready_order_.begin() + static_cast<std::ptrdiff_t>(before), ready_order_.end());
    static_discovery_ = false;
    launch_remaining();
  }
  std::vector<std::string> missing;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!ready_[i]) missing.push_back(params_[i].name);
  }
  if (!missing.empty()) {
    reset_iteration();  // settles what was launched
    if (options_.static_graph) {
      throw AutogradError(fmt::format(
          "DDP(static_graph=true): {} parameter(s) used in the first synchronized iteration received no gradient "
          "in this backward pass: {}. {}",
          missing.size(), join_names(missing), kStaticGraphChanged));
    }
    throw AutogradError(fmt::format(
        "DistributedDataParallel: {} parameter(s) received no gradient in this backward pass: {}. Every "
        "parameter must take part in computing the loss; if some are unused on purpose (or only on some "
        "iterations), construct DDP with find_unused_parameters=true",
        missing.size(), join_names(missing)));
  }
  if (options_.delay_allreduce) launch_remaining();

  // With bucket_done_ (DDP's fused optimizer) each bucket goes to grad() (hand_over) and to
  // bucket_done_ as soon as it completed, unless the parameters some rank used are only known
  // after the last one; otherwise all go after the last one (a failed collective leaves grad()
  // alone).
  const bool find_used = options_.find_unused_parameters || options_.static_graph;
  const bool per_bucket = bucket_done_ && !find_used;
  std::vector<uint8_t> globally_used(params_.size(), 1);
  // Join with divide_by_initial_world_size=false: the default hook averaged over the world; the
  // ranks still training are fewer.
  const double rescale = !hook_ && !local_only_ && join_divisor_ > 0 && join_divisor_ < group_->size()
                             ? static_cast<double>(group_->size()) / static_cast<double>(join_divisor_)
                             : 1.0;
  try {
    for (size_t bi = 0; bi < buckets_.size(); ++bi) {
      Bucket& b = buckets_[bi];
      b.result.work->wait();
      if (b.result.then) b.result.then();
      if (rescale != 1.0) b.flat.mul_(rescale);
      timings_[bi].done_s = now_s();
      if (per_bucket) {
        hand_over(static_cast<int64_t>(bi), globally_used);
        bucket_done_(b.params, bi + 1 == buckets_.size());
      }
    }
  } catch (const dist::CommError& e) {
    reset_iteration();  // settles what was launched
    // A peer that is gone or issues other collectives is often one that ran out of batches.
    dist::rethrow_with_hint(e,
                            "DistributedDataParallel: the gradient all-reduce after backward failed. If some rank ran "
                            "out of batches before the others (uneven inputs), run each rank's training loop inside "
                            "DistributedDataParallel::join; if another rank stopped with an error about a parameter "
                            "that received no gradient, that error is the cause");
  } catch (...) {
    reset_iteration();  // settles what was launched
    throw;
  }

  // Which parameters some rank used: a parameter unused everywhere keeps no gradient (as in PyTorch).
  if (find_used) {
    for (size_t i = 0; i < params_.size(); ++i) globally_used[i] = static_cast<uint8_t>(locally_used_[i] || used_before[i]);
    if (group_->size() > 1) {
      Tensor used = tensor(std::vector<double>(globally_used.begin(), globally_used.end()),
                           {static_cast<int64_t>(params_.size())}, kUInt8);
      try {
        group_->all_reduce(used, dist::ReduceOp::MAX)->wait();
      } catch (const dist::CommError& e) {
        reset_iteration();
        dist::rethrow_with_hint(e,
                                "DistributedDataParallel: the all-reduce of the used-parameter map after backward "
                                "failed. If some rank ran out of batches before the others (uneven inputs), run each "
                                "rank's training loop inside DistributedDataParallel::join");
      }
      std::copy_n(used.data_ptr<uint8_t>(), params_.size(), globally_used.begin());
    }
  }
  if (discovering) {
    static_unused_ = std::move(discovered);
    static_known_ = true;
  }
  // A fused optimizer that throws on some ranks must not keep them from the bucket rebuild, a
  // collective the others issue.
  std::exception_ptr step_error;
  if (!per_bucket) {
    for (int64_t bi = 0; bi < static_cast<int64_t>(buckets_.size()); ++bi) hand_over(bi, globally_used);
    try {
      every_bucket_done();
    } catch (...) {
      step_error = std::current_exception();
    }
  }

  if (!rebuilt_) rebuild_buckets();
  ++iteration_;
  if (step_error) std::rethrow_exception(step_error);
}

// The averaged values into grad(). Without bucket views, a gradient that nothing but its
// parameter holds (the usual case: zero_grad() set it to none and this backward created it) is
// replaced by its slot instead of copied into, and the bucket moves to other memory before the
// next iteration, so that grad() never aliases a live bucket: what a bucket view would give,
// without its aliasing, and one pass over the gradients less. A gradient held elsewhere too (a
// user's reference or view, or zero_grad(set_to_none=false) keeping it) is copied into, as in
// PyTorch.
void Reducer::hand_over(int64_t bi, const std::vector<uint8_t>& globally_used) {
  if (!reads_slots()) return;  // grad() already is the result
  NoGradGuard no_grad;
  Bucket& b = buckets_[bi];
  bool handed_over = false;
  for (int64_t i : b.params) {
    Param& p = params_[i];
    if (!globally_used[i]) continue;
    Tensor s = slot(i);
    Tensor g = p.tensor.grad();
    const bool in_slot = lies_in(g, s);
    if (options_.gradient_as_bucket_view) {
      if (!in_slot) p.tensor.set_grad(s);
    } else if (in_slot) {
      handed_over = true;  // produced in its slot (gradient destination): it keeps the memory
    } else if (g.defined() && !(g.impl_ptr().use_count() == 2 && g.storage().use_count() == 1)) {
      g.copy_(s);  // also referenced elsewhere: keep its identity
    } else {
      p.tensor.set_grad(s);
      handed_over = true;
    }
  }
  if (handed_over) replace_bucket_memory(bi);
}

void Reducer::every_bucket_done() {
  for (size_t bi = 0; bi < buckets_.size() && bucket_done_; ++bi) {
    bucket_done_(buckets_[bi].params, bi + 1 == buckets_.size());
  }
}

void Reducer::rebuild_buckets() {
  // Once, in the order gradients became ready on rank 0 (broadcast: same layout everywhere).
  std::vector<int64_t> order = ready_order_;
  std::vector<char> in(params_.size(), 0);
  for (int64_t p : order) in[p] = 1;
  for (int64_t i = static_cast<int64_t>(params_.size()) - 1; i >= 0; --i) {
    if (!in[i]) order.push_back(i);
  }
  Tensor t = tensor(order, {static_cast<int64_t>(order.size())});
  group_->broadcast(t, 0)->wait();
  const int64_t* o = t.data_ptr<int64_t>();
  build_buckets(std::vector<int64_t>(o, o + order.size()));
  rebuilt_ = true;
  ready_order_.clear();
}

// ---- join ----

void Reducer::set_join_divisor(int64_t ranks) {
  TANDEM_CHECK(ranks >= 0 && ranks <= group_->size(), ValueError,
               "DDP join: cannot average over {} ranks in a world of {}", ranks, group_->size());
  join_divisor_ = ranks;
}

void Reducer::shadow_backward() {
  if (group_->size() == 1) return;
  TANDEM_CHECK(!options_.deterministic, ValueError, "DDP join does not support the deterministic mode");
  // Every bucket is issued before any is waited for, as the training ranks launch them while
  // their backward runs; zeros stand for this rank's gradients. The zeros live until every
  // collective has completed: a backend may read and write them after start_collective returned
  // (shm's progress thread does for large buffers), and a freed block would be the next bucket's.
  std::vector<Tensor> zero_buckets;
  std::vector<HookResult> results;
  struct Settle {  // however this ends, no collective still runs on the zeros when they go
    std::vector<HookResult>& results;
    ~Settle() {
      for (auto& r : results) {
        try {
          if (r.work) r.work->wait();
        } catch (...) {
        }
      }
    }
  } settle{results};
  try {
    for (size_t bi = 0; bi < buckets_.size(); ++bi) {
      zero_buckets.push_back(zeros({buckets_[bi].numel}, buckets_[bi].dtype));
      results.push_back(start_collective(static_cast<int64_t>(bi), zero_buckets.back()));
    }
    for (auto& r : results) {
      r.work->wait();
      if (r.then) r.then();
    }
    if (options_.find_unused_parameters || options_.static_graph) {
      Tensor used = zeros({static_cast<int64_t>(params_.size())}, kUInt8);
      group_->all_reduce(used, dist::ReduceOp::MAX)->wait();
    }
    if (!rebuilt_) {
      ready_order_.clear();  // a joined rank 0 has no ready order of its own: registration order reversed
      rebuild_buckets();
    }
  } catch (const dist::CommError& e) {
    dist::rethrow_with_hint(e, kJoinLockstepHint);
  }
}

void Reducer::finalize_deterministic() {
  backward_end_s_ = now_s();
  expect_backward_ = false;
  finalize_queued_ = false;
  NoGradGuard no_grad;

  // Take this micro-batch's gradients (as f32) and clear them, so that the next micro-batch starts
  // from nothing instead of accumulating.
  std::vector<Tensor> mine(params_.size());
  int64_t total = 0;
  for (size_t i = 0; i < params_.size(); ++i) {
    Param& p = params_[i];
    total += p.tensor.numel();
    Tensor g = p.tensor.grad();
    if (!g.defined()) continue;
    mine[i] = g.dtype() == kFloat32 && g.is_contiguous() ? g : g.to(kFloat32).contiguous();
    p.tensor.set_grad(Tensor());
  }
  micro_grads_.push_back(std::move(mine));
  if (!sync_) return;

  const int64_t k = static_cast<int64_t>(micro_grads_.size());
  const int64_t world = group_->size();
  if (!det_local_.defined() || det_local_.numel() != total) {
    det_local_memory_ = group_->allocate(static_cast<size_t>(total) * sizeof(float));
    det_all_memory_ = group_->allocate(static_cast<size_t>(world * total) * sizeof(float));
    std::shared_ptr<void> keep_local = det_local_memory_, keep_all = det_all_memory_;
    det_local_ = from_blob(det_local_memory_.get(), {total}, kFloat32, [keep_local](void*) {});
    det_all_ = from_blob(det_all_memory_.get(), {world * total}, kFloat32, [keep_all](void*) {});
  }
  // This rank's sum over its micro-batches, parameter by parameter into the flat buffer.
  TreeSum tree_sum(static_cast<size_t>(std::max(k, world)));
  std::vector<const float*> leaves(static_cast<size_t>(k));
  float* local = det_local_.data_ptr<float>();
  int64_t off = 0;
  for (size_t i = 0; i < params_.size(); ++i) {
    for (int64_t j = 0; j < k; ++j) {
      const Tensor& g = micro_grads_[static_cast<size_t>(j)][i];
      leaves[static_cast<size_t>(j)] = g.defined() ? g.data_ptr<float>() : nullptr;
    }
    tree_sum(leaves, params_[i].tensor.numel(), local + off);
    off += params_[i].tensor.numel();
  }
  // Whether some micro-batch of this rank gave each parameter a gradient.
  const auto np = static_cast<int64_t>(params_.size());
  std::vector<int64_t> head(static_cast<size_t>(1 + np), 0);
  head[0] = k;
  for (const auto& micro : micro_grads_) {
    for (int64_t i = 0; i < np; ++i) head[static_cast<size_t>(1 + i)] |= micro[static_cast<size_t>(i)].defined() ? 1 : 0;
  }
  micro_grads_.clear();

  // Every rank must contribute the same number of micro-batches, or the tree would differ; with
  // it goes which parameters each rank used.
  Tensor ks = empty({world * (1 + np)}, kInt64);
  Tensor my_k = tensor(head, {1 + np});
  group_->all_gather(dist::as_buffer(ks), dist::as_buffer(my_k))->wait();
  const int64_t* heads = ks.data_ptr<int64_t>();
  for (int64_t r = 0; r < world; ++r) {
    TANDEM_CHECK(heads[r * (1 + np)] == k, ValueError,
                 "DDP deterministic mode: rank {} accumulated {} micro-batches in this step but rank {} accumulated "
                 "{}; every rank must run the same number of micro-batches per step",
                 group_->rank(), k, r, heads[r * (1 + np)]);
  }
  // A parameter no micro-batch of any rank used keeps no gradient (as the overlapped path leaves
  // it with find_unused_parameters), or is an error naming it: zeros would let momentum and weight
  // decay move it.
  std::vector<char> used(static_cast<size_t>(np), 0);
  std::vector<std::string> unused_names;
  for (int64_t i = 0; i < np; ++i) {
    for (int64_t r = 0; r < world; ++r) used[static_cast<size_t>(i)] |= heads[r * (1 + np) + 1 + i] != 0 ? 1 : 0;
    if (!used[static_cast<size_t>(i)]) unused_names.push_back(params_[static_cast<size_t>(i)].name);
  }
  if (!unused_names.empty() && !options_.find_unused_parameters && !options_.static_graph) {
    throw AutogradError(fmt::format(
        "DistributedDataParallel (deterministic): {} parameter(s) received no gradient in this step on any rank: {}. "
        "Every parameter must take part in computing the loss; if some are unused on purpose, construct DDP with "
        "find_unused_parameters=true",
        unused_names.size(), join_names(unused_names)));
  }
  group_->all_gather(dist::as_buffer(det_all_), dist::as_buffer(det_local_))->wait();
  // The tree over the ranks' sums (each a subtree of k leaves), divided by the number of
  // micro-batches, straight into each parameter's new gradient.
  const float count = static_cast<float>(k * world);
  const float* all = det_all_.data_ptr<float>();
  off = 0;
  std::vector<const float*> blocks(static_cast<size_t>(world));
  for (size_t i = 0; i < params_.size(); ++i) {
    Param& p = params_[i];
    const int64_t n = p.tensor.numel();
    if (used[i]) {
      for (int64_t r = 0; r < world; ++r) blocks[static_cast<size_t>(r)] = all + r * total + off;
      Tensor g = empty(p.tensor.shape(), kFloat32);
      tree_sum(blocks, n, g.data_ptr<float>(), count);
      p.tensor.set_grad(g.dtype() == p.tensor.dtype() ? g : g.to(p.tensor.dtype()));
    }
    off += n;
  }
  ++iteration_;
  every_bucket_done();
}

// ---- communication hooks ----

HookResult allreduce_hook(dist::ProcessGroup& group, GradBucket& bucket) {
  return {group.all_reduce(bucket.buffer, dist::ReduceOp::AVG), nullptr};
}

HookResult noop_hook(dist::ProcessGroup& /*group*/, GradBucket& bucket) {
  return {dist::Work::completed(fmt::format("noop_hook (bucket {})", bucket.index)), nullptr};
}

namespace {
// `hook` on a `wire` copy of an f32 bucket (its buffer and per-parameter views), the result cast
// back into the bucket after it; a bucket that is not f32 goes to `hook` as it is.
HookResult on_compressed_copy(const CommHook& hook, dist::ProcessGroup& group, GradBucket& bucket, DType wire) {
  if (bucket.buffer.dtype() != kFloat32) return hook(group, bucket);
  GradBucket low = bucket;
  low.buffer = bucket.buffer.to(wire);
  low.gradients.clear();
  for (const Tensor& g : bucket.gradients) {
    low.gradients.push_back(
        make_view(low.buffer, g.shape(), contiguous_strides(g.shape()), low.buffer.offset() + g.offset() - bucket.buffer.offset()));
  }
  HookResult inner = hook(group, low);
  Tensor out = bucket.buffer;
  std::function<void()> then = inner.then;
  return {inner.work, [then, low, out]() mutable {
            if (then) then();
            out.copy_(low.buffer);
          }};
}

CommHook compress_wrapper(CommHook hook, DType wire, const char* name) {
  TANDEM_CHECK(hook != nullptr, ValueError, "{}: the hook to wrap is empty", name);
  return [hook = std::move(hook), wire](dist::ProcessGroup& group, GradBucket& bucket) {
    return on_compressed_copy(hook, group, bucket, wire);
  };
}

const CommHook& plain_allreduce() {
  static const CommHook h = allreduce_hook;
  return h;
}
}  // namespace

CommHook fp16_compress_wrapper(CommHook hook) { return compress_wrapper(std::move(hook), kFloat16, "fp16_compress_wrapper"); }
CommHook bf16_compress_wrapper(CommHook hook) { return compress_wrapper(std::move(hook), kBFloat16, "bf16_compress_wrapper"); }

// The compress hooks are the wrappers around the plain average (as torch's are equivalent to).
HookResult fp16_compress_hook(dist::ProcessGroup& group, GradBucket& bucket) {
  return on_compressed_copy(plain_allreduce(), group, bucket, kFloat16);
}
HookResult bf16_compress_hook(dist::ProcessGroup& group, GradBucket& bucket) {
  return on_compressed_copy(plain_allreduce(), group, bucket, kBFloat16);
}

}  // namespace tandem::parallel
