// ShmAllReduce: the sum over the ranks of one host, in place, through a file they all map
// (tokenmill/distributed/shm.py creates it on /dev/shm). Called from Python between layers, or
// from C++ by DecoderStack (decoder_step.h) inside the fused step, without the GIL.
//
// Layout of the shared buffer (every line 64 bytes, so no two ranks write one cache line):
//
//     line 0        magic, world, slot_bytes             written by rank 0's constructor
//     line 1        abort: 0, or 1 + the rank that gave up
//     line 2 + r    rank r's sequence number (the last call it published); per parity its
//                   call's chunk (bytes << 8 | dtype), to catch ranks that disagree on the
//                   tensor (per parity: a peer may be a call ahead when this rank reads it);
//                   its process id, to tell a peer that has exited from a slow one
//     (to 4 KiB)
//     slots         [2][world][slot_bytes]: per call parity, each rank's chunk of the tensor
//
// One call (a tensor larger than a slot is several, a chunk each), the s-th of this object:
//   1. copy my chunk into slot[s % 2][rank];
//   2. publish: seq[rank] = s (a release store: the copy is visible to whoever reads s);
//   3. wait until every seq[q] >= s (acquire loads);
//   4. sum slot[s % 2][0] + slot[s % 2][1] + ... element by element in float32, in rank order,
//      into my tensor (bf16: rounded once, at the end).
// Every rank sums the same bytes in the same order with the same code, so all get the same
// bits. One wait per call suffices because the slots alternate: rank r writes slot[s % 2] again
// at call s + 2 only after finishing call s + 1, whose wait saw every q publish s + 1, which q
// does after its own reads of slot[s % 2] in call s (program order, then q's release store and
// r's acquire load of seq[q]). So no rank overwrites a slot a peer may still read.
//
// Waiting: spin (pause) for a few microseconds, where each rank has its own core; then
// sched_yield, which hands the core to a peer that shares it; then sleeps growing to 1 ms, so
// that more ranks than cores still progress. A peer missing for timeout_s, or whose process
// has exited (checked every 50 ms once sleeping): the waiting rank raises, naming the ranks
// that did not arrive, and sets the abort word, so that the others raise at once instead of
// after their own timeouts. The object is unusable after that.
//
// One call at a time per object (the ranks' calls pair up by their order).
#pragma once

#include <ATen/Parallel.h>
#include <sched.h>
#include <signal.h>
#include <time.h>
#include <torch/csrc/utils/pybind.h>  // pybind11 and at::Tensor's caster
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>

#include "common.h"

namespace {

// A word of the shared header. Lock-free 8-byte atomics are plain memory on x86-64 and
// AArch64, so two processes mapping the same page agree on them.
using ShmWord = std::atomic<uint64_t>;
static_assert(ShmWord::is_always_lock_free && sizeof(ShmWord) == sizeof(uint64_t),
              "ShmAllReduce needs lock-free 64-bit atomics");

class ShmAllReduce {
 public:
  static constexpr uint64_t kMagic = 0x746d2d6172000001ULL;  // "tm-ar", layout 1
  static constexpr int64_t kLine = 64, kPage = 4096;

  static int64_t header_bytes(int64_t world) {
    return (kLine * (2 + world) + kPage - 1) / kPage * kPage;
  }
  // the buffer's size for slots of slot_bytes (rounded up to whole cache lines)
  static int64_t bytes_needed(int64_t world, int64_t slot_bytes) {
    TORCH_CHECK(world >= 1 && slot_bytes >= kLine, "ShmAllReduce: world >= 1, slots >= 64 B");
    return header_bytes(world) + 2 * world * ((slot_bytes + kLine - 1) / kLine * kLine);
  }

  // buffer: uint8, the shared mapping (torch.from_file(..., shared=True)); rank 0's object
  // first (it writes the header), then the others'. timeout_s: how long a call waits for a
  // peer before it raises.
  ShmAllReduce(at::Tensor buffer, int64_t rank, int64_t world, double timeout_s)
      : buffer_(std::move(buffer)), rank_(rank), world_(world), timeout_s_(timeout_s) {
    TORCH_CHECK(buffer_.device().is_cpu() && buffer_.scalar_type() == at::kByte &&
                    buffer_.is_contiguous(), "ShmAllReduce: a contiguous uint8 CPU buffer");
    TORCH_CHECK(world_ >= 1 && world_ < 256 && rank_ >= 0 && rank_ < world_,
                "ShmAllReduce: rank ", rank_, " of ", world_);
    TORCH_CHECK(timeout_s_ > 0, "ShmAllReduce: a positive timeout");
    const int64_t header = header_bytes(world_);
    slot_bytes_ = (buffer_.numel() - header) / (2 * world_) / kLine * kLine;
    TORCH_CHECK(slot_bytes_ >= kLine, "ShmAllReduce: a buffer of ", buffer_.numel(),
                " bytes holds no slots for ", world_, " ranks");
    base_ = buffer_.data_ptr<uint8_t>();
    TORCH_CHECK(reinterpret_cast<uintptr_t>(base_) % kLine == 0,
                "ShmAllReduce: the buffer must be cache-line aligned (a mapping is)");
    slots_ = base_ + header;
    if (rank_ == 0) init_header();
    else check_header();
    pid_of(rank_).store(static_cast<uint64_t>(getpid()), std::memory_order_relaxed);
  }

  int64_t rank() const { return rank_; }
  int64_t world() const { return world_; }
  int64_t slot_bytes() const { return slot_bytes_; }

  // t (contiguous float32 or bf16, CPU) = the sum of every rank's t, the same bits on all
  void all_reduce_(at::Tensor& t) {
    TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() &&
                    (t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16),
                "ShmAllReduce: a contiguous float32 or bf16 CPU tensor");
    TORCH_CHECK(!broken_, "ShmAllReduce: unusable after an earlier failure (", broken_why_,
                ")");
    const uint64_t by = abort_word().load(std::memory_order_acquire);
    TORCH_CHECK(by == 0, "ShmAllReduce: rank ", by - 1, " aborted the group");
    if (world_ == 1 || t.numel() == 0) return;
    const bool bf16 = t.scalar_type() == at::kBFloat16;
    const int64_t elem = t.element_size(), per_call = slot_bytes_ / elem;
    uint8_t* data = static_cast<uint8_t*>(t.data_ptr());
    for (int64_t from = 0; from < t.numel(); from += per_call) {
      const int64_t count = std::min(per_call, t.numel() - from);
      if (bf16)
        chunk(reinterpret_cast<at::BFloat16*>(data) + from, count, 2);
      else
        chunk(reinterpret_cast<float*>(data) + from, count, 1);
    }
  }

  // Make every rank's waiting call and all later ones raise: for a rank that fails elsewhere
  // and will not arrive. Safe from another thread while a call waits.
  void abort() { mark_aborted(); }

 private:
  ShmWord& word(int64_t line, int64_t i = 0) const {
    return *reinterpret_cast<ShmWord*>(base_ + line * kLine + i * sizeof(uint64_t));
  }
  ShmWord& abort_word() const { return word(1); }
  ShmWord& seq_of(int64_t r) const { return word(2 + r); }
  ShmWord& shape_of(int64_t r, uint64_t parity) const {
    return word(2 + r, 1 + static_cast<int64_t>(parity));
  }
  ShmWord& pid_of(int64_t r) const { return word(2 + r, 3); }
  uint8_t* slot(uint64_t parity, int64_t r) const {
    return slots_ + (static_cast<int64_t>(parity) * world_ + r) * slot_bytes_;
  }

  void init_header() {
    word(0, 1).store(static_cast<uint64_t>(world_), std::memory_order_relaxed);
    word(0, 2).store(static_cast<uint64_t>(slot_bytes_), std::memory_order_relaxed);
    abort_word().store(0, std::memory_order_relaxed);
    for (int64_t r = 0; r < world_; ++r) {
      seq_of(r).store(0, std::memory_order_relaxed);
      shape_of(r, 0).store(0, std::memory_order_relaxed);
      shape_of(r, 1).store(0, std::memory_order_relaxed);
      pid_of(r).store(0, std::memory_order_relaxed);
    }
    word(0).store(kMagic, std::memory_order_release);  // last: the header is whole
  }

  void check_header() const {
    TORCH_CHECK(word(0).load(std::memory_order_acquire) == kMagic,
                "ShmAllReduce: the buffer has no header (rank 0 constructs its object first)");
    TORCH_CHECK(word(0, 1).load(std::memory_order_relaxed) == static_cast<uint64_t>(world_) &&
                    word(0, 2).load(std::memory_order_relaxed) ==
                        static_cast<uint64_t>(slot_bytes_),
                "ShmAllReduce: rank 0 made the buffer for another world size or slot size");
  }

  // one call: count elements of T (a dtype code for the shape check) through the slots
  template <typename T>
  void chunk(T* data, int64_t count, uint64_t dtype) {
    const uint64_t s = ++seq_, parity = s & 1;
    const int64_t bytes = count * static_cast<int64_t>(sizeof(T));
    copy_in(slot(parity, rank_), data, bytes);
    shape_of(rank_, parity).store(static_cast<uint64_t>(bytes) << 8 | dtype,
                                  std::memory_order_relaxed);
    seq_of(rank_).store(s, std::memory_order_release);
    wait_for_all(s);
    check_shapes(parity);
    sum_slots(data, count, parity);
  }

  static void copy_in(uint8_t* dst, const void* src, int64_t bytes) {
    const uint8_t* from = static_cast<const uint8_t*>(src);
    at::parallel_for(0, bytes, 1 << 18, [&](int64_t begin, int64_t end) {
      std::memcpy(dst + begin, from + begin, static_cast<size_t>(end - begin));
    });
  }

  void check_shapes(uint64_t parity) {
    const uint64_t mine = shape_of(rank_, parity).load(std::memory_order_relaxed);
    for (int64_t r = 0; r < world_; ++r)
      if (shape_of(r, parity).load(std::memory_order_relaxed) != mine) {
        give_up("rank " + std::to_string(r) + " passed another size or dtype than rank " +
                std::to_string(rank_) + " at call " + std::to_string(seq_));
        TORCH_CHECK(false, "ShmAllReduce: ", broken_why_);
      }
  }

  // out[i] = slot 0 [i] + slot 1 [i] + ... in float32, then out's dtype
  template <typename T>
  void sum_slots(T* out, int64_t count, uint64_t parity) const {
    at::parallel_for(0, count, 1 << 14, [&](int64_t begin, int64_t end) {
      int64_t i = begin;
      for (; i + Vec::W <= end; i += Vec::W) {
        Vec acc = Vec::load(reinterpret_cast<const T*>(slot(parity, 0)) + i);
        for (int64_t r = 1; r < world_; ++r)
          acc = Vec::add(acc, Vec::load(reinterpret_cast<const T*>(slot(parity, r)) + i));
        store_as(acc, out + i);
      }
      for (; i < end; ++i) {
        float acc = static_cast<float>(reinterpret_cast<const T*>(slot(parity, 0))[i]);
        for (int64_t r = 1; r < world_; ++r)
          acc += static_cast<float>(reinterpret_cast<const T*>(slot(parity, r))[i]);
        out[i] = static_cast<T>(acc);
      }
    });
  }

  // until every rank has published call s; raises on a timeout, a peer's exit or another
  // rank's abort
  void wait_for_all(uint64_t s) {
    using clock = std::chrono::steady_clock;
    const clock::time_point start = clock::now();
    int64_t next = 0;  // ranks before it have arrived (arrivals only move forward)
    double checked = 0;  // when the peers' processes were last looked for
    for (int64_t spins = 0;; ++spins) {
      while (next < world_ && seq_of(next).load(std::memory_order_acquire) >= s) ++next;
      if (next == world_) return;
      if (spins % 64 != 63) {
        pause();
        continue;
      }
      const double waited = std::chrono::duration<double>(clock::now() - start).count();
      if (abort_word().load(std::memory_order_acquire) != 0 || waited > timeout_s_) {
        const std::string late = missing(s, false);
        if (late.empty()) return;  // they came after all
        fail(s, waited, late + " did not arrive");
      }
      if (waited - checked > 50e-3) {
        checked = waited;
        const std::string gone = missing(s, true);
        if (!gone.empty()) fail(s, waited, gone + " exited");
      }
      back_off(waited);
    }
  }

  // "rank(s) 1, 3": the ranks that have not published call s (exited: only those whose
  // process is gone, each with its process id), or ""
  std::string missing(uint64_t s, bool exited) const {
    std::string ranks;
    for (int64_t r = 0; r < world_; ++r) {
      if (seq_of(r).load(std::memory_order_acquire) >= s) continue;
      const pid_t pid = static_cast<pid_t>(pid_of(r).load(std::memory_order_relaxed));
      if (exited && !(pid > 0 && kill(pid, 0) != 0 && errno == ESRCH)) continue;
      ranks += (ranks.empty() ? "" : ", ") + std::to_string(r) +
               (exited ? " (process " + std::to_string(pid) + ")" : "");
    }
    return ranks.empty() ? ranks : "rank(s) " + ranks;
  }

  static void pause() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  }

  // spinning up to 10 us, yielding up to 2 ms, then sleeping 50 us more for every ms waited
  // (at most 1 ms at a time)
  static void back_off(double waited) {
    if (waited < 10e-6) return;
    if (waited < 2e-3) {
      sched_yield();
      return;
    }
    const long ns = std::min<long>(1000000, 50000 * static_cast<long>(waited * 1e3));
    const timespec nap{0, ns};
    nanosleep(&nap, nullptr);
  }

  [[noreturn]] void fail(uint64_t s, double waited, const std::string& what) {
    const uint64_t by = abort_word().load(std::memory_order_acquire);
    char secs[32];
    std::snprintf(secs, sizeof(secs), "%.1f", waited);
    const std::string why = what + " at call " + std::to_string(s) + " (rank " +
                            std::to_string(rank_) + " waited " + secs + " s" +
                            (by ? ", rank " + std::to_string(by - 1) + " gave up first" : "") +
                            ")";
    give_up(why);
    TORCH_CHECK(false, "ShmAllReduce: ", why);
  }

  void mark_aborted() {  // the first rank to give up is the one named
    uint64_t none = 0;
    abort_word().compare_exchange_strong(none, static_cast<uint64_t>(rank_) + 1,
                                         std::memory_order_acq_rel);
  }

  void give_up(const std::string& why) {
    mark_aborted();
    broken_ = true;
    broken_why_ = why;
  }

  at::Tensor buffer_;  // holds the mapping
  int64_t rank_, world_;
  double timeout_s_;
  int64_t slot_bytes_ = 0;
  uint8_t* base_ = nullptr;
  uint8_t* slots_ = nullptr;
  uint64_t seq_ = 0;
  bool broken_ = false;
  std::string broken_why_;
};

// The Python name: ShmAllReduce (tokenmill/distributed/shm.py wraps it).
inline void register_shm_allreduce(pybind11::module_& m) {
  using release = pybind11::call_guard<pybind11::gil_scoped_release>;
  namespace py = pybind11;
  py::class_<ShmAllReduce>(m, "ShmAllReduce",
                           "sum over the ranks of one host through a shared mapping")
      .def(py::init<at::Tensor, int64_t, int64_t, double>(), py::arg("buffer"),
           py::arg("rank"), py::arg("world"), py::arg("timeout_s") = 60.0)
      .def("all_reduce_", [](ShmAllReduce& self, at::Tensor t) {
             self.all_reduce_(t);
             return t;
           }, "t summed over the ranks in place (float32 or bf16); returns t", release())
      .def("abort", &ShmAllReduce::abort, "make every rank's waiting call raise")
      .def_property_readonly("rank", &ShmAllReduce::rank)
      .def_property_readonly("world", &ShmAllReduce::world)
      .def_property_readonly("slot_bytes", &ShmAllReduce::slot_bytes)
      .def_static("bytes_needed", &ShmAllReduce::bytes_needed,
                  "the buffer's size for world ranks and slots of slot_bytes");
}

}  // namespace
