// The arena's sub-allocator and the tensors over its blocks (hybrid_ep/backends/cuda/arena.py
// holds the rules: block sizes, call layouts, when a range is reused). Here because a direct
// dispatch takes one block per rank and makes its tensors on every call, and doing that in
// Python (a tensor over the block through the array interface, then a view per dtype and an
// as_strided per tensor) cost more host time than the rest of the call: one call here takes
// the blocks of every rank the engine drives (ArenaTaken), and makes each tensor with one
// DLPack hand-over after the launch.
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

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
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

// First fit over [0, capacity) bytes; offsets from the arena's base. The capacity grows as
// peer memory is mapped at the arena's end (grow) and shrinks when a free tail is retired
// (shrink); take may be held below a limit (the part every peer has mapped).
class ArenaRanges {
 public:
  explicit ArenaRanges(int64_t capacity) : capacity_(capacity) {
    if (capacity > 0) free_[0] = Range{capacity, 0, false};
  }

  // The offset of a new block of nbytes on `stream` ending at or below `limit` (-1: the
  // capacity), or -1 when no free range fits.
  int64_t take(int64_t nbytes, uint64_t stream, int64_t limit = -1) {
    std::lock_guard<std::mutex> lock(mutex_);
    const int64_t end = limit < 0 ? capacity_ : limit;
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      Range r = it->second;
      const int64_t offset = it->first;
      if (offset + nbytes > end || r.size < nbytes || (r.used && r.stream != stream)) continue;
      free_.erase(it);
      if (r.size > nbytes) free_[offset + nbytes] = Range{r.size - nbytes, r.stream, r.used};
      used_ += nbytes;
      return offset;
    }
    return -1;
  }

  // [capacity, new_capacity) added as a never-used range, merged with a free range ending at
  // the old capacity.
  void grow(int64_t new_capacity) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (new_capacity <= capacity_) return;
    auto it = free_.emplace(capacity_, Range{new_capacity - capacity_, 0, false}).first;
    capacity_ = new_capacity;
    if (it != free_.begin()) {
      auto prev = std::prev(it);
      if (prev->first + prev->second.size == it->first) merge(prev, it);
    }
  }

  // The capacity cut to new_capacity if [new_capacity, capacity) is free (of any stream);
  // false, nothing changed, otherwise.
  bool shrink(int64_t new_capacity) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (new_capacity >= capacity_) return new_capacity == capacity_;
    if (free_.empty()) return false;
    auto last = std::prev(free_.end());
    if (last->first + last->second.size != capacity_ || last->first > new_capacity) return false;
    if (last->first == new_capacity) free_.erase(last);
    else last->second.size = new_capacity - last->first;
    capacity_ = new_capacity;
    return true;
  }

  // The largest free range on `stream` that ends at or below `limit` (-1: the capacity), the
  // part of a range below the limit counting.
  int64_t largest_free_below(uint64_t stream, int64_t limit) const {
    std::lock_guard<std::mutex> lock(mutex_);
    const int64_t end = limit < 0 ? capacity_ : limit;
    int64_t best = 0;
    for (const auto& [offset, r] : free_) {
      if (r.used && r.stream != stream) continue;
      const int64_t size = std::min(r.size, end - offset);
      if (size > best) best = size;
    }
    return best;
  }

  // The free range that ends at the capacity, on `stream` (0 if none).
  int64_t tail_free(uint64_t stream) const {
    std::lock_guard<std::mutex> lock(mutex_);
    if (free_.empty()) return 0;
    const auto& [offset, r] = *std::prev(free_.end());
    if (offset + r.size != capacity_ || (r.used && r.stream != stream)) return 0;
    return r.size;
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
  int64_t capacity() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return capacity_;
  }

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

  int64_t capacity_;
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

// The tensors of one kind of block, for any number of rows: per tensor, its bytes per row,
// DLPack type and columns (0: a 1-D tensor of `rows` elements), or none (an absent tensor: no
// bytes, a None tensor and a 0 address, so that every kind of call of one layout has its
// tensors at the same positions: a dispatch's rows, scales, probs, the scales absent without
// fp8). Each tensor starts on the next `align` boundary of the block, the rule of arena.py's
// _block_places (which sizes the blocks for memory plans without the extension;
// tests/model/test_arena.py holds the two equal). Built once per kind of call (arena.py caches
// it per hidden and dtype), so a call of any output size converts no lists.
struct ArenaLayout {
  struct View {
    int64_t row_bytes;
    dlpack::DataType dtype;
    int64_t cols;
    bool present;
  };
  using Spec = std::optional<std::tuple<int64_t, int, int, int64_t>>;
  std::vector<View> views;
  int64_t align;

  ArenaLayout(const std::vector<Spec>& specs, int64_t align_bytes) : align(align_bytes) {
    if (align <= 0) throw py::value_error("arena layout: align must be > 0");
    if (specs.empty() || specs.size() > kMaxViews) throw py::value_error("arena layout: 1 to 3 tensors per block");
    bool any = false;
    for (const Spec& spec : specs) {
      if (!spec) {
        views.push_back(View{0, dlpack::DataType{0, 0, 0}, 0, false});
        continue;
      }
      const auto& [row_bytes, code, bits, cols] = *spec;
      if (row_bytes < 0 || cols < 0) throw py::value_error("arena layout: sizes must not be negative");
      views.push_back(
          View{row_bytes, dlpack::DataType{static_cast<uint8_t>(code), static_cast<uint8_t>(bits), 1}, cols, true});
      any = true;
    }
    if (!any) throw py::value_error("arena layout: 1 to 3 tensors per block");
  }

  static constexpr size_t kMaxViews = 3;

  int64_t aligned(int64_t bytes) const { return (std::max<int64_t>(bytes, 1) + align - 1) / align * align; }

  // The byte offset of each tensor in a block of `rows` rows (-1: absent); returns the block's
  // bytes.
  int64_t place(int64_t rows, int64_t* at) const {
    int64_t end = 0;
    for (size_t v = 0; v < views.size(); ++v) {
      if (!views[v].present) {
        at[v] = -1;
        continue;
      }
      at[v] = end;
      end += aligned(rows * views[v].row_bytes);
    }
    return end;
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

  // A block of nbytes below `limit` (-1: anywhere), or nullptr when no free range fits.
  std::shared_ptr<ArenaBlock> take(int64_t nbytes, uint64_t stream, int64_t limit = -1) {
    const int64_t offset = ranges_->take(nbytes, stream, limit);
    if (offset < 0) return nullptr;
    return std::shared_ptr<ArenaBlock>(new ArenaBlock{ranges_, offset, nbytes, stream, false});
  }

  // The tensors of `layout` with `rows` rows over `block` into out[0, views) (None for an
  // absent one); kept: the block never returns.
  void make_tensors(const std::shared_ptr<ArenaBlock>& block, const ArenaLayout& layout, int64_t rows, bool kept,
                    py::object* out) const {
    if (kept) {
      block->kept = true;
      ranges_->keep(block->nbytes);
    }
    int64_t at[ArenaLayout::kMaxViews];
    layout.place(rows, at);
    for (size_t i = 0; i < layout.views.size(); ++i)
      out[i] = layout.views[i].present ? tensor(block, layout.views[i], rows, at[i]) : py::none();
  }

  // The same as a tuple.
  py::tuple tensors(const std::shared_ptr<ArenaBlock>& block, const ArenaLayout& layout, int64_t rows,
                    bool kept) const {
    py::object views[ArenaLayout::kMaxViews];
    make_tensors(block, layout, rows, kept, views);
    py::tuple out(layout.views.size());
    for (size_t i = 0; i < layout.views.size(); ++i) out[i] = std::move(views[i]);
    return out;
  }

  // One block of `layout` with `rows` rows and its tensors, or None when it does not fit.
  py::object block(const ArenaLayout& layout, int64_t rows, uint64_t stream, bool kept) {
    if (rows < 0) throw py::value_error("arena block: rows must be >= 0");
    int64_t at[ArenaLayout::kMaxViews];
    auto b = take(layout.place(rows, at), stream);
    if (!b) return py::none();
    return tensors(b, layout, rows, kept);
  }

  uint64_t base() const { return base_; }
  const std::shared_ptr<ArenaRanges>& ranges() const { return ranges_; }

 private:
  py::object tensor(const std::shared_ptr<ArenaBlock>& block, const ArenaLayout::View& view, int64_t rows,
                    int64_t at) const {
    auto* v = new ArenaView();
    v->block = block;
    v->shape[0] = rows;
    v->shape[1] = view.cols;
    dlpack::Tensor& t = v->managed.dl_tensor;
    t.data = reinterpret_cast<void*>(base_ + static_cast<uint64_t>(block->offset + at));
    t.device = device_;
    t.ndim = view.cols > 0 ? 2 : 1;
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

// One block per arena, taken before a launch; the tensors are made after it (tensors()), so
// that between a dynamic dispatch's host read and its launch only the ranges are taken. A
// block nothing made a tensor of returns when this object dies.
class __attribute__((visibility("hidden"))) ArenaTaken {
 public:
  // rows[i] rows of `layout` on arenas[i]. The index of the first arena that could not hold
  // its block is `failed` (then no block stays taken); -1 when every arena holds its block.
  ArenaTaken(const std::vector<py::object>& arenas, py::object layout, const std::vector<int64_t>& rows,
             uint64_t stream, bool kept, const std::vector<int64_t>& limits = {})
      : arenas_(arenas), layout_(std::move(layout)), rows_(rows), kept_(kept) {
    if (!limits.empty() && limits.size() != arenas.size()) throw py::value_error("arena_take: one limit per arena");
    if (arenas.size() != rows.size()) throw py::value_error("arena_take: one row count per arena");
    const auto* l = layout_.cast<const ArenaLayout*>();
    int64_t at[ArenaLayout::kMaxViews];
    blocks_.reserve(arenas.size());
    for (size_t i = 0; i < arenas.size(); ++i) {
      if (rows[i] < 0) throw py::value_error("arena_take: rows must be >= 0");
      auto b = arenas[i].cast<Arena*>()->take(l->place(rows[i], at), stream, limits.empty() ? -1 : limits[i]);
      if (!b) {
        failed_ = static_cast<int64_t>(i);
        blocks_.clear();  // the blocks taken so far return here
        return;
      }
      blocks_.push_back(std::move(b));
    }
  }

  int64_t failed() const { return failed_; }

  // Per arena, the address of each tensor of the layout (0: absent; an empty list when failed).
  py::list addresses() const {
    const auto* l = layout_.cast<const ArenaLayout*>();
    uint64_t at[ArenaLayout::kMaxViews];
    py::list out(blocks_.size());
    for (size_t i = 0; i < blocks_.size(); ++i) {
      place(i, *l, at);
      py::tuple addr(l->views.size());
      for (size_t v = 0; v < l->views.size(); ++v) addr[v] = py::int_(at[v]);
      out[i] = addr;
    }
    return out;
  }

  // Per arena, its rows and the address of each tensor of the layout (`at` holds
  // ArenaLayout::kMaxViews; 0 where absent and past the layout's tensors). Throws when failed.
  int64_t block_addresses(size_t i, uint64_t* at) const {
    if (failed_ >= 0 || made_ || i >= blocks_.size()) throw py::value_error("arena_take: no such block");
    place(i, *layout_.cast<const ArenaLayout*>(), at);
    return rows_[i];
  }

  size_t size() const { return blocks_.size(); }
  const ArenaLayout& layout() const { return *layout_.cast<const ArenaLayout*>(); }

  // Per arena, make(views): the object made of the layout's tensors (`views` holds one per
  // tensor of the layout, None where absent); from then on the tensors alone hold the blocks.
  template <typename Make>
  py::list tensors_as(Make&& make) {
    if (failed_ >= 0 || made_) throw py::value_error("arena_take: no blocks to make tensors of");
    const auto* l = layout_.cast<const ArenaLayout*>();
    py::list out(blocks_.size());
    py::object views[ArenaLayout::kMaxViews];
    for (size_t i = 0; i < blocks_.size(); ++i) {
      arenas_[i].cast<const Arena*>()->make_tensors(blocks_[i], *l, rows_[i], kept_, views);
      out[i] = make(views);
    }
    blocks_.clear();
    made_ = true;
    return out;
  }

  // Per arena, the tuple of the layout's tensors.
  py::list tensors() {
    const size_t n = layout().views.size();
    return tensors_as([n](py::object* views) {
      py::tuple t(n);
      for (size_t v = 0; v < n; ++v) t[v] = std::move(views[v]);
      return t;
    });
  }

 private:
  // Block i's address of each tensor of l into at[0, kMaxViews) (0: absent or past l's tensors).
  void place(size_t i, const ArenaLayout& l, uint64_t* at) const {
    int64_t offsets[ArenaLayout::kMaxViews];
    l.place(rows_[i], offsets);
    const uint64_t start = arenas_[i].cast<const Arena*>()->base() + static_cast<uint64_t>(blocks_[i]->offset);
    for (size_t v = 0; v < ArenaLayout::kMaxViews; ++v)
      at[v] = v < l.views.size() && offsets[v] >= 0 ? start + static_cast<uint64_t>(offsets[v]) : 0;
  }

  std::vector<py::object> arenas_;
  py::object layout_;
  std::vector<int64_t> rows_;
  std::vector<std::shared_ptr<ArenaBlock>> blocks_;
  bool kept_, made_ = false;
  int64_t failed_ = -1;
};

inline void bind_arena(py::module_& m) {
  py::class_<ArenaLayout>(m, "ArenaLayout", py::module_local())
      .def(py::init<const std::vector<ArenaLayout::Spec>&, int64_t>(), py::arg("views"), py::arg("align"),
           "views: per tensor (bytes per row, DLPack code, bits, columns or 0 for 1-D), or None: absent")
      .def("nbytes", [](const ArenaLayout& l, int64_t rows) {
        int64_t at[ArenaLayout::kMaxViews];
        return l.place(rows, at);
      });
  py::class_<Arena>(m, "Arena", py::module_local())
      .def(py::init<uint64_t, int64_t, int32_t, int32_t, py::object>(), py::arg("base"), py::arg("capacity"),
           py::arg("device_type"), py::arg("device_id"), py::arg("to_tensor"))
      .def("block", &Arena::block, py::arg("layout"), py::arg("rows"), py::arg("stream"), py::arg("kept"),
           "one block of layout with rows rows and its tensors, or None when no free range fits")
      .def("largest_free", [](const Arena& a, uint64_t stream) { return a.ranges()->largest_free(stream); })
      .def(
          "largest_free_below",
          [](const Arena& a, uint64_t stream, int64_t limit) { return a.ranges()->largest_free_below(stream, limit); },
          py::arg("stream"), py::arg("limit"))
      .def("tail_free", [](const Arena& a, uint64_t stream) { return a.ranges()->tail_free(stream); })
      .def(
          "grow", [](Arena& a, int64_t capacity) { a.ranges()->grow(capacity); }, py::arg("capacity"),
          "more memory mapped at the end: the capacity raised to `capacity`")
      .def(
          "shrink", [](Arena& a, int64_t capacity) { return a.ranges()->shrink(capacity); }, py::arg("capacity"),
          "the free tail past `capacity` retired (True), or nothing when it is not free (False)")
      .def_property_readonly("used", [](const Arena& a) { return a.ranges()->used(); })
      .def_property_readonly("kept", [](const Arena& a) { return a.ranges()->kept(); })
      .def_property_readonly("capacity", [](const Arena& a) { return a.ranges()->capacity(); })
      .def_property_readonly("base", &Arena::base);
  py::class_<ArenaTaken>(m, "ArenaTaken", py::module_local())
      .def(py::init<const std::vector<py::object>&, py::object, const std::vector<int64_t>&, uint64_t, bool,
                    const std::vector<int64_t>&>(),
           py::arg("arenas"), py::arg("layout"), py::arg("rows"), py::arg("stream"), py::arg("kept"),
           py::arg("limits") = std::vector<int64_t>{},
           "one block per arena (ext.Arena) of layout (ext.ArenaLayout) and its rows, each below its limit (none: "
           "anywhere); failed: the first that can not")
      .def_property_readonly("failed", &ArenaTaken::failed)
      .def("addresses", &ArenaTaken::addresses)
      .def("tensors", &ArenaTaken::tensors);
}

}  // namespace hybrid_ep::bindings
