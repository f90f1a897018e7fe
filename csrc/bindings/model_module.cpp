// hybrid_ep._model: the kernels on the CPU model of the device layer (csrc/device/model/),
// with the same names as hybrid_ep._C, so the engine and the single-GPU emulation drive it
// unchanged on CPU tensors. Registered buffers are host memory a peer process opens by its
// handle, as CUDA IPC opens device memory; the error record is host memory too.
//
// Every call into the model's state waits for its lock, which a launch on another thread holds
// while it runs (runtime.h, threads): those calls are made without the GIL, so that this
// process's other Python threads (peer memory's chunk server, which a peer's kernel may wait
// for) run meanwhile.
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <new>

#include "bindings/common.h"
#include "bindings/model_memfd.h"
#include "bindings/model_peer_memory.h"
#include "bindings/peer_memory_bindings.h"
#include "device/model/builtins.h"
#include "device/model/runtime.h"
#include "device/model/selftest.h"
#include "device/model/timing.h"
#include "device/model/timing_selftest.h"

namespace py = pybind11;
using namespace hybrid_ep;

namespace {

using WithoutGil = py::call_guard<py::gil_scoped_release>;

// f() without the GIL where this thread holds it (a destructor may run where it does not).
template <typename F>
void without_gil(F&& f) {
  if (PyGILState_Check()) {
    py::gil_scoped_release unlocked;
    f();
  } else {
    f();
  }
}

class ErrorRecordHost {
 public:
  ErrorRecordHost() {
    clear();
    without_gil([this] { model::add_allocation(device_ptr(), sizeof(ErrorRecord)); });
  }
  ~ErrorRecordHost() {
    without_gil([this] { model::remove_allocation(device_ptr()); });
  }
  // The host's address of the record (its first word is the phase, 0 while no kernel
  // failed): the engine polls that word per call without a call into this module.
  uint64_t host_ptr() const { return reinterpret_cast<uint64_t>(&record_); }
  uint64_t device_ptr() const { return reinterpret_cast<uint64_t>(&record_); }
  void clear() { std::memset(&record_, 0, sizeof(record_)); }
  py::object read() const { return bindings::error_record_dict(&record_); }

 private:
  ErrorRecord record_{};
};

// Registered buffers of the model: zeroed, 4 KiB-aligned host memory, a memfd mapped shared, with
// a guard page after each so that an access past its end is a fault the model reports. A memfd's
// pages cost memory only once the kernels touch them (a payload-free timing run,
// model::set_payload, never touches the rows). Each buffer's handle (model_memfd.h) opens it in
// a peer process at that process's own address (open_peer), as a CUDA IPC handle does; the owner
// keeps the memfd's descriptor until it frees the buffer. Both handle kinds are the same here.
class RegisteredMemory {
 public:
  static constexpr size_t kPage = 4096;

  static py::tuple allocate(size_t bytes, int /*kind*/, int /*device*/) {
    const size_t size = std::max<size_t>((bytes + kPage - 1) / kPage * kPage, kPage);
    uint64_t ptr = 0;
    std::string handle;
    without_gil([&] {
      const int fd = bindings::memfd::create(kName, size, "registered buffer");
      try {
        ptr = map(fd, size, "registered buffer");
        handle = bindings::memfd::handle(fd, kMagic, kName);
      } catch (...) {
        ::close(fd);
        throw;
      }
      std::lock_guard<std::mutex> guard(lock());
      owned()[ptr] = fd;
    });
    return py::make_tuple(ptr, size, py::bytes(handle));
  }

  static void free(uint64_t ptr, size_t bytes, int /*kind*/) {
    int fd = -1;
    {
      std::lock_guard<std::mutex> guard(lock());
      auto it = owned().find(ptr);
      if (it == owned().end()) throw std::invalid_argument("hybrid_ep: free_registered: not a registered buffer");
      fd = it->second;
      owned().erase(it);
    }
    unmap(ptr, bytes);
    ::close(fd);
  }

  // A peer's buffer of `bytes` from its handle, at this process's own address: refused as
  // cudaIpcOpenMemHandle refuses a handle it cannot open, and where the buffer is smaller than
  // `bytes`; nothing stays open or mapped when it is refused.
  static uint64_t open_peer(const py::bytes& handle, size_t bytes, int /*kind*/, int /*device*/) {
    const std::string raw(handle);
    uint64_t ptr = 0;
    without_gil([&] {
      const int fd = bindings::memfd::open(raw, kMagic, kName, "cudaIpcOpenMemHandle");
      try {
        const size_t size = bindings::memfd::size(fd, "cudaIpcOpenMemHandle");
        if (size < bytes)
          throw std::invalid_argument("hybrid_ep: cudaIpcOpenMemHandle: the peer's registered buffer has " +
                                      std::to_string(size) + " bytes, fewer than the " + std::to_string(bytes) +
                                      " asked for");
        ptr = map(fd, bytes, "cudaIpcOpenMemHandle");
      } catch (...) {
        ::close(fd);
        throw;
      }
      ::close(fd);  // the mapping keeps the memory
    });
    return ptr;
  }

  static void close_peer(uint64_t ptr, size_t bytes, int /*kind*/) { unmap(ptr, bytes); }

 private:
  static constexpr const char* kName = "hybrid_ep_registered.";
  static constexpr char kMagic[8] = {'h', 'e', 'p', 'r', 'e', 'g', 'i', '1'};

  // `size` bytes of the memfd and an inaccessible guard page after them, one model allocation.
  static uint64_t map(int fd, size_t size, const std::string& what) {
    void* p = mmap(nullptr, size + kPage, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) throw bindings::memfd::failed(what + ": mmap (reservation)");
    if (mmap(p, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0) == MAP_FAILED) {
      const auto error = bindings::memfd::failed(what + ": mmap");
      munmap(p, size + kPage);
      throw error;
    }
    const auto ptr = reinterpret_cast<uint64_t>(p);
    model::add_allocation(ptr, size);
    return ptr;
  }

  static void unmap(uint64_t ptr, size_t bytes) {
    without_gil([&] {
      model::remove_allocation(ptr);
      munmap(reinterpret_cast<void*>(ptr), bytes + kPage);
    });
  }

  static std::map<uint64_t, int>& owned() {  // buffer -> its memfd's descriptor
    static std::map<uint64_t, int> m;
    return m;
  }
  static std::mutex& lock() {
    static std::mutex m;
    return m;
  }
};

py::dict report_dict(const model::timing::Report& r) {
  auto pairs = [](const std::vector<std::pair<std::string, double>>& v) {
    py::list out;
    for (const auto& [what, ns] : v) out.append(py::make_tuple(what, ns));
    return out;
  };
  py::list roles;
  for (const auto& role : r.roles) {
    py::dict d;
    d["warp"] = role.warp;
    d["busy_ns"] = role.busy_ns;
    d["end_ns"] = role.end_ns;
    d["waits"] = pairs(role.waits);
    py::list paths;  // the warp's lanes grouped by the sites they passed (timing.h, RoleTime::Path)
    for (const auto& p : role.paths)
      paths.append(py::dict(py::arg("lanes") = p.lanes, py::arg("blocks") = p.blocks, py::arg("busy_ns") = p.busy_ns,
                            py::arg("end_ns") = p.end_ns, py::arg("waits") = pairs(p.waits)));
    d["paths"] = paths;
    roles.append(d);
  }
  py::dict d;
  d["kernel"] = r.kernel;
  d["table"] = r.table;
  d["blocks"] = r.blocks;
  d["threads"] = r.threads;
  d["time_ns"] = r.time_ns;
  d["roles"] = roles;
  d["critical_path"] = pairs(r.critical_path);
  d["block_end_ns"] = r.block_end_ns;
  d["engine_busy_ns"] = r.engine_busy_ns;
  d["copies"] = r.copies;
  d["copy_bytes"] = r.copy_bytes;
  py::dict plain;  // the hot loops' plain accesses (dev::ld / dev::st) by memory class
  const char* classes[2] = {"shared", "global"};
  for (int k = 0; k < 2; ++k) {
    const auto& a = r.plain[k];
    plain[classes[k]] = py::dict(py::arg("loads") = a.loads, py::arg("stores") = a.stores,
                                 py::arg("load_bytes") = a.load_bytes, py::arg("store_bytes") = a.store_bytes);
  }
  d["plain"] = plain;
  d["chains"] = r.chains;
  d["instructions"] = r.instructions;  // warp instructions issued: plain code, spinning
  d["spin_instructions"] = r.spin_instructions;
  py::dict reads;  // global reads by traffic class: bytes, and of them served from L2
  const char* kinds[3] = {"written", "reread", "stream"};
  for (int k = 0; k < 3; ++k)
    reads[kinds[k]] = py::dict(py::arg("bytes") = r.reads[k].bytes, py::arg("l2_bytes") = r.reads[k].l2_bytes);
  d["reads"] = reads;
  d["hbm_bytes"] = r.hbm_bytes;
  d["nic_bytes"] = r.nic_bytes;
  return d;
}

// None: timing off; {name: value}: one cost table; a list of them: one clock set per table.
void set_timing(const py::object& costs) {
  std::vector<model::timing::Costs> tables;
  if (!costs.is_none()) {
    const bool one = py::isinstance<py::dict>(costs);
    for (const py::handle table : one ? py::list(py::make_tuple(costs)) : costs.cast<py::list>()) {
      model::timing::Costs c;
      std::string message;
      if (!model::timing::costs_from(table.cast<std::map<std::string, double>>(), c, message))
        throw py::value_error(message);
      tables.push_back(c);
    }
  }
  py::gil_scoped_release unlocked;
  model::timing::configure(std::move(tables));
}

// A launch's ranks past the inline ones: a block of host memory, the model's device memory, per
// launch; the model's launches run inside the call, so the copy is made at once. Counted, so a
// test sees each launch take its own block and give it back.
std::atomic<uint64_t> g_more_ranks_made{0}, g_more_ranks_live{0};
std::shared_ptr<void> copy_on_host(const void* src, size_t bytes, uint64_t /*stream*/) {
  void* block = ::operator new(bytes);
  std::memcpy(block, src, bytes);
  ++g_more_ranks_made;
  ++g_more_ranks_live;
  return std::shared_ptr<void>(block, [](void* q) {
    --g_more_ranks_live;
    ::operator delete(q);
  });
}

}  // namespace

PYBIND11_MODULE(_model, m) {
  m.doc() = "hybrid-ep kernels on the CPU model of the device layer";
  bindings::more_ranks_copy() = bindings::MoreRanksCopy{&copy_on_host};
  bindings::bind_common(m);
  m.attr("IS_MODEL") = true;
  m.def("device_properties",
        [](int) { return py::make_tuple(model::kDeviceSms, static_cast<int64_t>(model::kSmemPerBlockOptin)); });

  py::class_<ErrorRecordHost>(m, "ErrorRecord", py::module_local())
      .def(py::init<>())
      .def_property_readonly("device_ptr", &ErrorRecordHost::device_ptr)
      .def_property_readonly("host_ptr", &ErrorRecordHost::host_ptr)
      .def("read", &ErrorRecordHost::read)
      .def("clear", &ErrorRecordHost::clear);

  m.def("allocate_registered", &RegisteredMemory::allocate, py::arg("nbytes"), py::arg("kind"), py::arg("device"),
        "a zeroed registered buffer: (address, bytes, handle), the handle for a peer process's open_peer");
  m.def("free_registered", &RegisteredMemory::free, py::arg("ptr"), py::arg("nbytes"), py::arg("kind"));
  m.def("open_peer", &RegisteredMemory::open_peer, py::arg("handle"), py::arg("nbytes"), py::arg("kind"),
        py::arg("device"), "a peer process's registered buffer from its handle, at this process's own address");
  m.def("close_peer", &RegisteredMemory::close_peer, py::arg("ptr"), py::arg("nbytes"), py::arg("kind"));
  m.def(
      "allocations",
      [] {
        std::vector<std::pair<uint64_t, uint64_t>> all;
        {
          py::gil_scoped_release unlocked;
          all = model::allocations();
        }
        return all;
      },
      "[(address, bytes)] of the model's persistent allocations now: registered buffers opened or owned, error "
      "records, mapped peer memory (a test counts what a setup left behind)");
  m.def(
      "more_ranks_blocks",
      [] { return py::dict(py::arg("made") = g_more_ranks_made.load(), py::arg("live") = g_more_ranks_live.load()); },
      "the blocks launches past the inline ranks copied their other ranks to: made so far, live now (one per "
      "launch, given back when it ends)");
  m.def("fabric_probe", [](int) { return std::string("the CPU model has no fabric handles"); });
  bindings::bind_peer_memory<bindings::ModelPeerMemory>(m);
  m.def("note_launch_tensors", &model::declare_allocations,
        "[(data_ptr, bytes)] of the tensors this thread's next launches read and write: a bulk copy outside them "
        "and the registered buffers is an error");
  m.def("set_seed", &model::set_seed, WithoutGil(),
        "seed of the schedule and of the bulk-copy delays (reproducible runs)");
  m.def("seed", &model::seed, WithoutGil());
  m.def("set_payload", &model::set_payload, py::arg("moves"), WithoutGil(),
        "payload-free mode with False, for timing runs at shapes too large for this machine: bulk copies are "
        "checked, scheduled and timed as always but move no bytes, so the rows they carry stay untouched and the "
        "results are not the kernels' (never check them); True, the default, moves every byte");
  m.def("payload", &model::payload, WithoutGil(), "False in payload-free mode (set_payload)");
  m.def("set_posted_puts", &model::set_posted_puts, py::arg("on"), WithoutGil(),
        "posted puts with True: the loopback transport's puts and signals land at once, one op each, and the "
        "timing model prices them as a cluster's NIC does (the nic_* constants), not as the single-GPU "
        "emulation's copy by the warp's lanes; from the next launch");
  m.def("posted_puts", &model::posted_puts, WithoutGil(), "True while puts are posted (set_posted_puts)");
  m.def(
      "set_weakening",
      [](const std::string& name, bool on) {
        for (int i = 0; i < static_cast<int>(model::Weak::kCount); ++i)
          if (name == model::weak_name(static_cast<model::Weak>(i)))
            return model::set_weak(static_cast<model::Weak>(i), on);
        throw py::value_error("set_weakening: no weakening named '" + name + "' (weakenings() lists them)");
      },
      py::arg("name"), py::arg("on"), WithoutGil(),
      "turn one of the model's weakenings on or off (each is on by default; docs/dev/cpu_model.md): remote_late "
      "(the loopback transport's puts and signals land late and out of order), torn_copies (bulk copies land in "
      "pieces)");
  m.def(
      "weakenings",
      [] {
        bool on[static_cast<int>(model::Weak::kCount)];
        {
          py::gil_scoped_release unlocked;
          for (int i = 0; i < static_cast<int>(model::Weak::kCount); ++i)
            on[i] = model::weak(static_cast<model::Weak>(i));
        }
        py::dict d;
        for (int i = 0; i < static_cast<int>(model::Weak::kCount); ++i)
          d[model::weak_name(static_cast<model::Weak>(i))] = on[i];
        return d;
      },
      "{name: on} of the model's weakenings");
  m.def(
      "round_to_16bit",
      [](const std::vector<float>& values, const std::string& kind) {
        std::vector<uint16_t> out;
        for (float v : values) {
          if (kind == "bfloat16") out.push_back(model::float_to_bf16_rn(v));
          else if (kind == "float16") out.push_back(model::float_to_half_rn(v));
          else throw std::invalid_argument("kind must be bfloat16 or float16");
        }
        return out;
      },
      "the model's float -> 16-bit conversion (round to nearest even), as bit patterns");
  m.def("inject_abort", &model::inject_abort, py::arg("flag"), py::arg("round"), py::arg("kernel"),
        "in the next launch of `kernel` (count, dispatch_receive, dispatch_direct, combine_receive, combine_direct), "
        "raise the int abort flag at `flag` when scheduling round `round` begins");
  m.def("hold_at", &model::hold_at, py::arg("key"), py::arg("kernel"),
        "in the next launch of `kernel`, hold every thread that reaches dev::hold_point(key) until no other thread "
        "can run (the loopback transport's puts hold at key = the putting rank, block b's bulk stores at "
        "STORES_OF_BLOCK + b, its threads' start at START_OF_BLOCK + b)");
  m.attr("STORES_OF_BLOCK") = model::kStoresOfBlock;
  m.attr("START_OF_BLOCK") = model::kStartOfBlock;
  m.def("selftest_names", &model::selftest_names);
  m.def(
      "run_selftest",
      [](const std::string& name) {
        model::SelftestResult r;
        {
          py::gil_scoped_release unlocked;
          r = model::run_selftest(name);
        }
        return py::make_tuple(r.error.empty() ? py::none() : py::object(py::str(r.error)), r.out);
      },
      "run one self-test kernel of the model: (the model's error or None, what the kernel wrote)");
  m.def("set_timing", &set_timing, py::arg("costs"),
        "timing on for the next launches with these constants ({name: value}, every one of timing_costs()), or "
        "with several such tables at once (a list: one report per launch and table), or off with None: the "
        "schedule, the checks and the results are the same either way");
  m.def("timing_costs", &model::timing::cost_fields, "(name, meaning) of every timing constant");
  m.def(
      "timing_reports",
      [] {
        std::vector<model::timing::Report> reports;
        {
          py::gil_scoped_release unlocked;
          reports = model::timing::take_reports();
        }
        py::list out;
        for (const auto& r : reports) out.append(report_dict(r));
        return out;
      },
      "the timing report of every launch since the last call (kernel, time_ns, roles, critical_path, ...)");
  m.def(
      "calendar_fit",
      [](const std::vector<std::pair<double, double>>& placed, double t0, double duration) {
        model::timing::Calendar engine, none;
        for (const auto& [a, b] : placed) engine.insert(a, b);
        model::timing::Calendar::Pieces pieces;
        const double end = engine.fit(t0, duration, none, pieces);
        return py::make_tuple(end, pieces);
      },
      py::arg("placed"), py::arg("t0"), py::arg("duration"),
      "a copy engine's calendar: the pieces `placed` in order, then where a transfer of `duration` from t0 "
      "goes (its end, its pieces); for tests of the timing model");
  m.def("timing_selftest_names", &model::timing_selftest_names);
  m.def(
      "run_timing_selftest",
      [](const std::string& name, int blocks, int n, uint32_t bytes, int threads) {
        std::string error;
        {
          py::gil_scoped_release unlocked;
          error = model::run_timing_selftest(name, blocks, n, bytes, threads);
        }
        return error.empty() ? py::none() : py::object(py::str(error));
      },
      py::arg("name"), py::arg("blocks"), py::arg("n"), py::arg("bytes"), py::arg("threads") = 64,
      "run a kernel whose time the timing model must predict exactly (the model's error or None)");
  m.def("stats", [] {
    model::Stats s;
    {
      py::gil_scoped_release unlocked;
      s = model::stats();
    }
    py::dict d;
    d["launches"] = s.launches;
    d["rounds"] = s.rounds;
    d["switches"] = s.switches;
    d["copies"] = s.copies;
    d["idle_rounds"] = s.idle_rounds;
    d["virtual_ns"] = s.virtual_ns;
    d["remote_ops"] = s.remote_ops;
    d["remote_carried"] = s.remote_carried;
    d["remote_reordered"] = s.remote_reordered;
    d["torn_copies"] = s.torn_copies;
    return d;
  });
}
