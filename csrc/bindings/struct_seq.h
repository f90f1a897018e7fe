// A struct sequence type, the C API's named tuple (as os.stat_result), named <module>.<name>,
// for what crosses between Python and the extension on every call (bindings/seam.h). One
// table of fields (name, doc, the C++ member it fills) makes the Python type and reads it
// back, so the two languages share field names, never an order:
// - Python builds one by name, Type(num_tokens=T, topk=K, ...), one C call (the type's own
//   vectorcall matches the keywords to the fields; a missing or unknown field is a TypeError
//   naming it), and reads it by name (.rows) at a tuple item's cost;
// - C++ makes one from its items in the table's order (make) and reads one into its struct
//   (StructSeq::read), each field into the member the table names.
// A pybind11 class would cost an instance's allocation and registration per object and a call
// per field read (about 0.2 us).
#pragma once
#include <pybind11/pybind11.h>

#include <limits>
#include <string>
#include <type_traits>
#include <vector>

namespace hybrid_ep::bindings {

namespace py = pybind11;

template <typename Int>
constexpr const char* int_name() {
  if constexpr (std::is_same_v<Int, int32_t>) return "int32";
  else if constexpr (std::is_same_v<Int, int64_t>) return "int64";
  else return "uint64";
}

// The Python type of a struct sequence, built from its fields' names and docs.
class __attribute__((visibility("hidden"))) StructSeqType {
 public:
  StructSeqType(const py::module_& m, const char* name, const char* doc, std::vector<PyStructSequence_Field> fields)
      : fields_(new PyStructSequence_Field[fields.size() + 1]), size_(static_cast<Py_ssize_t>(fields.size())) {
    for (Py_ssize_t i = 0; i < size_; ++i) {
      fields_[i] = fields[i];
      names_.push_back(PyUnicode_InternFromString(fields[i].name));  // kept for good, as the type
    }
    fields_[size_] = {nullptr, nullptr};
    // The type's name and fields live as long as the type: for good.
    const auto* full = new std::string(m.attr("__name__").cast<std::string>() + "." + name);
    PyStructSequence_Desc desc{full->c_str(), doc, fields_, static_cast<int>(size_)};
    PyTypeObject* t = PyStructSequence_NewType(&desc);
    if (t == nullptr) throw py::error_already_set();
    type_ = py::reinterpret_steal<py::object>(reinterpret_cast<PyObject*>(t));
    by_name_types().push_back({t, this});
    t->tp_vectorcall = &by_name;  // Type(field=value, ...)
  }

  StructSeqType(const StructSeqType&) = delete;  // the module's vectorcall finds it by address
  StructSeqType& operator=(const StructSeqType&) = delete;

  const py::object& type() const { return type_; }
  const char* name() const { return reinterpret_cast<PyTypeObject*>(type_.ptr())->tp_name; }

  // One of items[0, size) in the fields' order (the references move into it).
  py::object make(py::object* items) const {
    PyObject* t = PyStructSequence_New(reinterpret_cast<PyTypeObject*>(type_.ptr()));
    if (t == nullptr) throw py::error_already_set();
    for (Py_ssize_t i = 0; i < size_; ++i) PyStructSequence_SetItem(t, i, items[i].release().ptr());
    return py::reinterpret_steal<py::object>(t);
  }

  // `o` if it is one of this type; else a TypeError naming `what`, item `index` of it where
  // index >= 0 (e.g. "inputs[1]").
  PyObject* instance(PyObject* o, const char* what, Py_ssize_t index) const {
    if (Py_TYPE(o) != reinterpret_cast<PyTypeObject*>(type_.ptr())) {
      const std::string where = index < 0 ? what : std::string(what) + "[" + std::to_string(index) + "]";
      throw py::type_error(where + ": a " + name() + " (" + field_names() + "), got " + Py_TYPE(o)->tp_name);
    }
    return o;
  }
  bool is_instance(PyObject* o) const { return Py_TYPE(o) == reinterpret_cast<PyTypeObject*>(type_.ptr()); }

  // Field i of instance `o` as an Int: a TypeError (not an int: a tensor is not its address)
  // or an OverflowError (out of Int's range) naming the struct and field otherwise.
  template <typename Int>
  Int integer(PyObject* o, Py_ssize_t i) const {
    static_assert(sizeof(Int) <= sizeof(long), "read through PyLong_AsLong / PyLong_AsUnsignedLong");
    PyObject* v = PyStructSequence_GET_ITEM(o, i);
    if (!PyLong_Check(v)) throw py::type_error(field(i) + ": an int, got " + Py_TYPE(v)->tp_name);
    bool ok;
    Int value;
    if constexpr (std::is_signed_v<Int>) {
      const long x = PyLong_AsLong(v);
      ok = !(x == -1 && PyErr_Occurred()) && x >= std::numeric_limits<Int>::min() &&
           x <= std::numeric_limits<Int>::max();
      value = static_cast<Int>(x);
    } else {
      const unsigned long x = PyLong_AsUnsignedLong(v);
      ok = !(x == static_cast<unsigned long>(-1) && PyErr_Occurred()) && x <= std::numeric_limits<Int>::max();
      value = static_cast<Int>(x);
    }
    if (!ok) {
      PyErr_Clear();
      const std::string text =
          field(i) + ": " + py::repr(v).cast<std::string>() + " is out of range of " + int_name<Int>();
      PyErr_SetString(PyExc_OverflowError, text.c_str());
      throw py::error_already_set();
    }
    return value;
  }

  // "<module>.<name>.<field i>", for messages.
  std::string field(Py_ssize_t i) const { return std::string(name()) + "." + fields_[i].name; }

 private:
  std::string field_names() const {
    std::string s;
    for (Py_ssize_t i = 0; i < size_; ++i) s += (i ? ", " : "") + std::string(fields_[i].name);
    return s;
  }

  // Every type of the module (kept for good), for its vectorcall to find its fields.
  static std::vector<std::pair<PyTypeObject*, const StructSeqType*>>& by_name_types() {
    static std::vector<std::pair<PyTypeObject*, const StructSeqType*>> types;
    return types;
  }

  // Calling the type: every field by name, none by position.
  static PyObject* by_name(PyObject* type, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
    const StructSeqType* self = nullptr;
    for (const auto& [t, s] : by_name_types())
      if (reinterpret_cast<PyObject*>(t) == type) self = s;
    if (self == nullptr) {
      PyErr_SetString(PyExc_SystemError, "hybrid_ep: a struct sequence type that is not registered");
      return nullptr;
    }
    return self->from_keywords(args, PyVectorcall_NARGS(nargsf), kwnames);
  }

  PyObject* from_keywords(PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) const {
    const Py_ssize_t nkw = kwnames == nullptr ? 0 : PyTuple_GET_SIZE(kwnames);
    if (nargs != 0 || nkw != size_) {
      const std::string text = std::string(name()) + "() takes its fields by name: " + field_names();
      PyErr_SetString(PyExc_TypeError, text.c_str());
      return nullptr;
    }
    PyObject* t = PyStructSequence_New(reinterpret_cast<PyTypeObject*>(type_.ptr()));
    if (t == nullptr) return nullptr;
    for (Py_ssize_t j = 0; j < nkw; ++j) {
      PyObject* kw = PyTuple_GET_ITEM(kwnames, j);
      Py_ssize_t i = 0;
      while (i < size_ && names_[i] != kw && PyUnicode_Compare(names_[i], kw) != 0) ++i;
      if (i == size_ || PyStructSequence_GET_ITEM(t, i) != nullptr) {
        Py_DECREF(t);
        const std::string text =
            std::string(name()) + "() has no field " + PyUnicode_AsUTF8(kw) + " (its fields: " + field_names() + ")";
        PyErr_SetString(PyExc_TypeError, text.c_str());
        return nullptr;
      }
      Py_INCREF(args[j]);
      PyStructSequence_SetItem(t, i, args[j]);
    }
    return t;
  }

  py::object type_;
  PyStructSequence_Field* fields_;  // the type's, for good
  std::vector<PyObject*> names_;    // interned, for good
  Py_ssize_t size_ = 0;
};

// A struct sequence whose fields fill the members of the C++ struct S: each field's name, doc
// and reader (the member it fills), in one table.
template <typename S>
struct SeqField {
  const char* name;
  const char* doc;
  void (*read)(const StructSeqType& type, PyObject* o, Py_ssize_t i, S& into);  // null: made in C++ only
};

template <typename S>
class __attribute__((visibility("hidden"))) StructSeq {
 public:
  StructSeq(const py::module_& m, const char* name, const char* doc, std::vector<SeqField<S>> fields)
      : type(m, name, doc, docs_of(fields)), fields_(std::move(fields)) {}

  // `o` (named `what`, item `index` of it where index >= 0, in errors) read into S, field by field.
  S read(PyObject* o, const char* what, Py_ssize_t index = -1) const {
    type.instance(o, what, index);
    S s{};
    for (size_t i = 0; i < fields_.size(); ++i) fields_[i].read(type, o, static_cast<Py_ssize_t>(i), s);
    return s;
  }

  const StructSeqType type;

 private:
  static std::vector<PyStructSequence_Field> docs_of(const std::vector<SeqField<S>>& fields) {
    std::vector<PyStructSequence_Field> out;
    for (const SeqField<S>& f : fields) out.push_back({f.name, f.doc});
    return out;
  }

  std::vector<SeqField<S>> fields_;
};

// The field of S filling integer `member`: SEQ_INT(DispatchInputs, num_tokens, "T, the rank's tokens").
#define HYBRID_EP_SEQ_INT(S, member, doc)                                                              \
  ::hybrid_ep::bindings::SeqField<S> {                                                                 \
    #member, doc, [](const ::hybrid_ep::bindings::StructSeqType& t, PyObject* o, Py_ssize_t i, S& s) { \
      s.member = t.integer<decltype(S::member)>(o, i);                                                 \
    }                                                                                                  \
  }

}  // namespace hybrid_ep::bindings
