// The arena's sub-allocator and the tensors over its blocks (hybrid_ep/backends/cuda/arena.py
// holds the rules: block sizes, call layouts, when a range is reused). Here because a direct
// dispatch takes one block per rank and makes its tensors on every call, and doing that in
// Python (a tensor over the block through the array interface, then a view per dtype and an
// as_strided per tensor) cost more host time than the rest of the call: one call here takes
// the blocks of every rank the engine drives and makes each tensor with one DLPack hand-over.
//
// A tensor views its block through a DLPack managed tensor whose deleter drops its share of
// the block; the block returns its range when the last of its tensors dies, on whatever
// thread that happens (autograd's backward threads free tensors too), so the free list is
// guarded by a mutex and the deleters never touch Python. Free ranges remember the stream
// they were used on; only a block on the same stream takes them again (a never-used range
// serves any stream). Blocks taken while a CUDA graph is being captured ("kept") never return.
#pragma once
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <utility>
#include <vector>

namespace hybrid_ep::bindings {

namespace py = pybind11;

// The DLPack exchange structs (the unversioned DLManagedTensor of the DLPack ABI, which
// torch.from_dlpack takes from a capsule named "dltensor"), declared from the specification.
namespace dlpack {
struct Device {
  int32_t device_type;  // 1 CPU, 2 CUDA
  int32_t device_id;
};
struct DataType {
  uint8_t code;  // DLPack's type code (arena.py, DLPACK_DTYPES)
  uint8_t bits;
  uint16_t lanes;
};
struct Tensor {
  void* data;
  Device device;
  int32_t ndim;
  DataType dtype;
  int64_t* shape;
  int64_t* strides;  // null: compact row-major
  uint64_t byte_offset;
};
struct ManagedTensor {
  Tensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(ManagedTensor*);
};
inline constexpr const char* kCapsuleName = "dltensor";
inline constexpr const char* kUsedCapsuleName = "used_dltensor";
}  // namespace dlpack

// First fit over [0, capacity) bytes; offsets from the arena's base.
class ArenaRanges {
 public:
  explicit ArenaRanges(int64_t capacity) : capacity_(capacity) {
    if (capacity > 0) free_[0] = Range{capacity, 0, false};
  }

  // The offset of a new block of nbytes on `stream`, or -1 when no free range fits.
  int64_t take(int64_t nbytes, uint64_t stream) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      Range r = it->second;
      if (r.size < nbytes || (r.used && r.stream != stream)) continue;
      const int64_t offset = it->first;
      free_.erase(it);
      if (r.size > nbytes) free_[offset + nbytes] = Range{r.size - nbytes, r.stream, r.used};
      used_ += nbytes;
      return offset;
    }
    return -1;
  }

  // A block's range back, merged with its neighbours of the same stream or never used (which
  // then belong to this stream: conservative, never wrong).
  void release(int64_t offset, int64_t nbytes, uint64_t stream) {
    std::lock_guard<std::mutex> lock(mutex_);
    used_ -= nbytes;
    auto it = free_.emplace(offset, Range{nbytes, stream, true}).first;
    auto next = std::next(it);
    if (next != free_.end() && it->first + it->second.size == next->first) merge(it, next);
    if (it != free_.begin()) {
      auto prev = std::prev(it);
      if (prev->first + prev->second.size == it->first) merge(prev, it);
    }
  }

  // A taken block's bytes, kept for good.
  void keep(int64_t nbytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    kept_ += nbytes;
  }

  int64_t largest_free(uint64_t stream) const {
    std::lock_guard<std::mutex> lock(mutex_);
    int64_t best = 0;
    for (const auto& [offset, r] : free_)
      if ((!r.used || r.stream == stream) && r.size > best) best = r.size;
    return best;
  }

  int64_t used() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return used_;
  }
  int64_t kept() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return kept_;
  }
  int64_t capacity() const { return capacity_; }

 private:
  struct Range {
    int64_t size;
    uint64_t stream;
    bool used;  // false: never used, any stream may take it
  };

  // Merges b into a where their streams allow it.
  void merge(std::map<int64_t, Range>::iterator a, std::map<int64_t, Range>::iterator b) {
    Range &ra = a->second, &rb = b->second;
    if (ra.used && rb.used && ra.stream != rb.stream) return;
    ra = Range{ra.size + rb.size, ra.used ? ra.stream : rb.stream, ra.used || rb.used};
    free_.erase(b);
  }

  const int64_t capacity_;
  mutable std::mutex mutex_;
  std::map<int64_t, Range> free_;  // by offset
  int64_t used_ = 0;               // bytes in blocks that are taken (kept ones included)
  int64_t kept_ = 0;               // bytes taken for good by CUDA graph captures
};

// One block: its range returns when the last tensor over it drops its share.
struct ArenaBlock {
  std::shared_ptr<ArenaRanges> ranges;
  int64_t offset, nbytes;
  uint64_t stream;
  bool kept;
  ~ArenaBlock() {
    if (!kept) ranges->release(offset, nbytes, stream);
  }
};

// One tensor over a block: the managed tensor torch takes, its shape, and its share.
struct ArenaView {
  dlpack::ManagedTensor managed{};
  int64_t shape[2] = {0, 0};
  std::shared_ptr<ArenaBlock> block;
};

inline void delete_arena_view(dlpack::ManagedTensor* m) { delete static_cast<ArenaView*>(m->manager_ctx); }

// A capsule torch never took deletes its view.
inline void arena_capsule_destructor(PyObject* capsule) {
  if (!PyCapsule_IsValid(capsule, dlpack::kCapsuleName)) return;  // taken: torch owns it
  auto* m = static_cast<dlpack::ManagedTensor*>(PyCapsule_GetPointer(capsule, dlpack::kCapsuleName));
  if (m != nullptr) m->deleter(m);
}

// Where the tensors of one kind of block lie: its bytes and, per tensor, (byte offset in the
// block, DLPack type code, bits, shape of 1 or 2 dims). Built once per kind of call
// (arena.py caches them per rows, hidden and dtype), so a call converts no lists.
struct ArenaLayout {
  struct View {
    int64_t at;
    dlpack::DataType dtype;
    int32_t ndim;
    int64_t shape[2];
  };
  int64_t nbytes = 0;
  std::vector<View> views;

  ArenaLayout(int64_t bytes, const std::vector<std::tuple<int64_t, int, int, std::vector<int64_t>>>& specs)
      : nbytes(bytes) {
    for (const auto& [at, code, bits, shape] : specs) {
      if (shape.empty() || shape.size() > 2) throw py::value_error("an arena tensor has 1 or 2 dimensions");
      View v{at,
             dlpack::DataType{static_cast<uint8_t>(code), static_cast<uint8_t>(bits), 1},
             static_cast<int32_t>(shape.size()),
             {0, 0}};
      int64_t bytes_of = (bits + 7) / 8;
      for (size_t d = 0; d < shape.size(); ++d) {
        if (shape[d] < 0) throw py::value_error("an arena tensor's shape must not be negative");
        v.shape[d] = shape[d];
        bytes_of *= shape[d];
      }
      if (at < 0 || at + bytes_of > nbytes) throw py::value_error("an arena tensor must lie inside its block");
      views.push_back(v);
    }
  }
};

// The Python-facing arena: the ranges, where they lie, and the function that makes a torch
// tensor of a DLPack capsule (torch's from_dlpack, passed in: this module does not link torch).
// Hidden like pybind11's own types, since it holds a py::object.
class __attribute__((visibility("hidden"))) Arena {
 public:
  Arena(uint64_t base, int64_t capacity, int32_t device_type, int32_t device_id, py::object to_tensor)
      : ranges_(std::make_shared<ArenaRanges>(capacity < 0 ? 0 : capacity)), base_(base),
        device_{device_type, device_id}, to_tensor_(std::move(to_tensor)) {
    if (capacity < 0) throw py::value_error("arena capacity must be >= 0");
  }

  // A block of nbytes, or nullptr when no free range fits.
  std::shared_ptr<ArenaBlock> take(int64_t nbytes, uint64_t stream) {
    const int64_t offset = ranges_->take(nbytes, stream);
    if (offset < 0) return nullptr;
    return std::shared_ptr<ArenaBlock>(new ArenaBlock{ranges_, offset, nbytes, stream, false});
  }

  // The tensors of `layout` over `block`, as a tuple; kept: the block never returns.
  py::tuple tensors(const std::shared_ptr<ArenaBlock>& block, const ArenaLayout& layout, bool kept) const {
    if (kept) {
      block->kept = true;
      ranges_->keep(block->nbytes);
    }
    py::tuple out(layout.views.size());
    for (size_t i = 0; i < layout.views.size(); ++i) out[i] = tensor(block, layout.views[i]);
    return out;
  }

  // One block of `layout` with its tensors, or None when it does not fit.
  py::object block(const ArenaLayout& layout, uint64_t stream, bool kept) {
    auto b = take(layout.nbytes, stream);
    if (!b) return py::none();
    return tensors(b, layout, kept);
  }

  uint64_t base() const { return base_; }
  const std::shared_ptr<ArenaRanges>& ranges() const { return ranges_; }

 private:
  py::object tensor(const std::shared_ptr<ArenaBlock>& block, const ArenaLayout::View& view) const {
    auto* v = new ArenaView();
    v->block = block;
    v->shape[0] = view.shape[0];
    v->shape[1] = view.shape[1];
    dlpack::Tensor& t = v->managed.dl_tensor;
    t.data = reinterpret_cast<void*>(base_ + static_cast<uint64_t>(block->offset + view.at));
    t.device = device_;
    t.ndim = view.ndim;
    t.dtype = view.dtype;
    t.shape = v->shape;
    t.strides = nullptr;
    t.byte_offset = 0;
    v->managed.manager_ctx = v;
    v->managed.deleter = &delete_arena_view;
    PyObject* capsule = PyCapsule_New(&v->managed, dlpack::kCapsuleName, &arena_capsule_destructor);
    if (capsule == nullptr) {
      delete v;
      throw py::error_already_set();
    }
    return to_tensor_(py::reinterpret_steal<py::object>(capsule));
  }

  std::shared_ptr<ArenaRanges> ranges_;
  uint64_t base_;
  dlpack::Device device_;
  py::object to_tensor_;
};

// One block per arena, each of its layout with its tensors: a list of tuples, or the index of
// the first arena that could not hold its block (then no block stays taken, no tensor is made).
inline py::object arena_blocks(const std::vector<Arena*>& arenas, const std::vector<const ArenaLayout*>& layouts,
                               uint64_t stream, bool kept) {
  if (arenas.size() != layouts.size()) throw py::value_error("arena_blocks: one layout per arena");
  std::vector<std::shared_ptr<ArenaBlock>> blocks;
  blocks.reserve(arenas.size());
  for (size_t i = 0; i < arenas.size(); ++i) {
    auto b = arenas[i]->take(layouts[i]->nbytes, stream);
    if (!b) return py::int_(i);  // the blocks taken so far return here
    blocks.push_back(std::move(b));
  }
  py::list out(arenas.size());
  for (size_t i = 0; i < arenas.size(); ++i) out[i] = arenas[i]->tensors(blocks[i], *layouts[i], kept);
  return out;
}

inline void bind_arena(py::module_& m) {
  py::class_<ArenaLayout>(m, "ArenaLayout", py::module_local())
      .def(py::init<int64_t, const std::vector<std::tuple<int64_t, int, int, std::vector<int64_t>>>&>(),
           py::arg("nbytes"), py::arg("views"))
      .def_readonly("nbytes", &ArenaLayout::nbytes);
  py::class_<Arena>(m, "Arena", py::module_local())
      .def(py::init<uint64_t, int64_t, int32_t, int32_t, py::object>(), py::arg("base"), py::arg("capacity"),
           py::arg("device_type"), py::arg("device_id"), py::arg("to_tensor"))
      .def("block", &Arena::block, py::arg("layout"), py::arg("stream"), py::arg("kept"),
           "one block of layout with its tensors, or None when no free range fits")
      .def("largest_free", [](const Arena& a, uint64_t stream) { return a.ranges()->largest_free(stream); })
      .def_property_readonly("used", [](const Arena& a) { return a.ranges()->used(); })
      .def_property_readonly("kept", [](const Arena& a) { return a.ranges()->kept(); })
      .def_property_readonly("capacity", [](const Arena& a) { return a.ranges()->capacity(); })
      .def_property_readonly("base", &Arena::base);
  m.def("arena_blocks", &arena_blocks, py::arg("arenas"), py::arg("layouts"), py::arg("stream"), py::arg("kept"),
        "one block per arena with its layout's tensors, or the index of the first arena that can not hold its "
        "block");
}

}  // namespace hybrid_ep::bindings
