// hybrid_ep._model: the kernels on the CPU model of the device layer (csrc/device/model/),
// with the same names as hybrid_ep._C, so the engine and the single-GPU emulation drive it
// unchanged on CPU tensors. Registered buffers are host memory; the error record too.
#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <new>

#include "bindings/common.h"
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

class ErrorRecordHost {
 public:
  ErrorRecordHost() {
    clear();
    model::add_allocation(device_ptr(), sizeof(ErrorRecord));
  }
  ~ErrorRecordHost() { model::remove_allocation(device_ptr()); }
  // The host's address of the record (its first word is the phase, 0 while no kernel
  // failed): the engine polls that word per call without a call into this module.
  uint64_t host_ptr() const { return reinterpret_cast<uint64_t>(&record_); }
  uint64_t device_ptr() const { return reinterpret_cast<uint64_t>(&record_); }
  void clear() { std::memset(&record_, 0, sizeof(record_)); }
  py::object read() const { return bindings::error_record_dict(&record_); }

 private:
  ErrorRecord record_{};
};

// Registered buffers of the model: zeroed, 4 KiB-aligned host memory. Anonymous mappings are
// zero without being written, so a page costs memory only once the kernels touch it (a
// payload-free timing run, model::set_payload, never touches the rows); a guard page after each
// makes an access past its end a fault the model reports.
constexpr size_t kPage = 4096;

py::tuple allocate_registered(size_t bytes, int /*kind*/, int /*device*/) {
  const size_t size = std::max<size_t>((bytes + kPage - 1) / kPage * kPage, kPage);
  void* p = mmap(nullptr, size + kPage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) throw std::bad_alloc();
  mprotect(static_cast<char*>(p) + size, kPage, PROT_NONE);
  model::add_allocation(reinterpret_cast<uint64_t>(p), size);
  return py::make_tuple(reinterpret_cast<uint64_t>(p), size, py::bytes(""));
}

void free_registered(uint64_t ptr, size_t bytes, int /*kind*/) {
  model::remove_allocation(ptr);
  munmap(reinterpret_cast<void*>(ptr), bytes + kPage);
}

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
  model::timing::configure(std::move(tables));
}

// A launch's ranks past the inline ones: host memory, the model's device memory; the model's
// launches run inside the call, so the copy is made at once.
const bindings::RankStaging kModelRankStaging{
    [](size_t bytes) { return std::shared_ptr<void>(::operator new(bytes), [](void* q) { ::operator delete(q); }); },
    [](void* dst, const void* src, size_t bytes, uint64_t) { std::memcpy(dst, src, bytes); }};

}  // namespace

PYBIND11_MODULE(_model, m) {
  m.doc() = "hybrid-ep kernels on the CPU model of the device layer";
  bindings::rank_staging() = kModelRankStaging;
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

  m.def("allocate_registered", &allocate_registered);
  m.def("free_registered", &free_registered);
  m.def("fabric_probe", [](int) { return std::string("the CPU model has no fabric handles"); });
  bindings::bind_peer_memory<bindings::ModelPeerMemory>(m);
  m.def("note_launch_tensors", &model::declare_allocations,
        "[(data_ptr, bytes)] of the tensors the next launches read and write: a bulk copy outside them and "
        "the registered buffers is an error");
  m.def("set_seed", &model::set_seed, "seed of the schedule and of the bulk-copy delays (reproducible runs)");
  m.def("seed", &model::seed);
  m.def("set_payload", &model::set_payload, py::arg("moves"),
        "payload-free mode with False, for timing runs at shapes too large for this machine: bulk copies are "
        "checked, scheduled and timed as always but move no bytes, so the rows they carry stay untouched and the "
        "results are not the kernels' (never check them); True, the default, moves every byte");
  m.def("payload", &model::payload, "False in payload-free mode (set_payload)");
  m.def("set_posted_puts", &model::set_posted_puts, py::arg("on"),
        "posted puts with True: the loopback transport's puts and signals land at once, one op each, and the "
        "timing model prices them as a cluster's NIC does (the nic_* constants), not as the single-GPU "
        "emulation's copy by the warp's lanes; from the next launch");
  m.def("posted_puts", &model::posted_puts, "True while puts are posted (set_posted_puts)");
  m.def(
      "set_weakening",
      [](const std::string& name, bool on) {
        for (int i = 0; i < static_cast<int>(model::Weak::kCount); ++i)
          if (name == model::weak_name(static_cast<model::Weak>(i)))
            return model::set_weak(static_cast<model::Weak>(i), on);
        throw py::value_error("set_weakening: no weakening named '" + name + "' (weakenings() lists them)");
      },
      py::arg("name"), py::arg("on"),
      "turn one of the model's weakenings on or off (each is on by default; docs/dev/cpu_model.md): remote_late "
      "(the loopback transport's puts and signals land late and out of order), torn_copies (bulk copies land in "
      "pieces)");
  m.def(
      "weakenings",
      [] {
        py::dict d;
        for (int i = 0; i < static_cast<int>(model::Weak::kCount); ++i)
          d[model::weak_name(static_cast<model::Weak>(i))] = model::weak(static_cast<model::Weak>(i));
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
        model::SelftestResult r = model::run_selftest(name);
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
        py::list out;
        for (const auto& r : model::timing::take_reports()) out.append(report_dict(r));
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
        const std::string error = model::run_timing_selftest(name, blocks, n, bytes, threads);
        return error.empty() ? py::none() : py::object(py::str(error));
      },
      py::arg("name"), py::arg("blocks"), py::arg("n"), py::arg("bytes"), py::arg("threads") = 64,
      "run a kernel whose time the timing model must predict exactly (the model's error or None)");
  m.def("stats", [] {
    const model::Stats s = model::stats();
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
