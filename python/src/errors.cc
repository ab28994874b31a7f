// The one absl::Status -> Python edge: a StatusError becomes an instance of
// the class kvcache/errors.py registered for its code (kvcache.Error for a
// code without one), with `code` (the code's name, e.g. "NOT_FOUND") and
// `retry_after_ms` (the node's hint for RESOURCE_EXHAUSTED, else None).
#include <nanobind/stl/string.h>

#include <map>
#include <string>

#include "absl/status/status.h"
#include "bind.h"
#include "kvcache/client.h"

namespace kvcache::python {
namespace {

// Class by code name; owned references kept for the interpreter's life
// (the module is never unloaded), so no destructor runs at exit.
std::map<std::string, PyObject*>& Classes() {
  static auto* classes = new std::map<std::string, PyObject*>();
  return *classes;
}

std::string CodeName(absl::StatusCode code) {
  return absl::StatusCodeToString(code);  // e.g. "NOT_FOUND"
}

void Raise(const absl::Status& status) {
  std::string code = CodeName(status.code());
  auto it = Classes().find(code);
  if (it == Classes().end()) it = Classes().find("");
  PyObject* cls = it == Classes().end() ? PyExc_RuntimeError : it->second;
  std::string message(status.message());
  PyObject* text = PyUnicode_DecodeUTF8(
      message.data(), static_cast<Py_ssize_t>(message.size()), "replace");
  if (text == nullptr) return;
  PyObject* exc = PyObject_CallFunctionObjArgs(cls, text, nullptr);
  Py_DECREF(text);
  if (exc == nullptr) return;  // the constructor's error stands
  PyObject* code_str = PyUnicode_FromString(code.c_str());
  PyObject_SetAttrString(exc, "code", code_str);
  Py_XDECREF(code_str);
  std::optional<int> retry = RetryAfterMs(status);
  PyObject* retry_obj = retry ? PyLong_FromLong(*retry) : Py_None;
  if (!retry) Py_INCREF(Py_None);
  PyObject_SetAttrString(exc, "retry_after_ms", retry_obj);
  Py_XDECREF(retry_obj);
  PyErr_SetObject(cls, exc);
  Py_DECREF(exc);
}

}  // namespace

void Throw(const absl::Status& status) { throw StatusError(status); }

void RegisterErrors(nb::module_& m) {
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const StatusError& e) {
      Raise(e.status());
    }
  });
  m.def(
      "_register_errors",
      [](nb::dict mapping) {
        for (auto [code, cls] : mapping) {
          std::string name = nb::cast<std::string>(code);
          PyObject*& slot = Classes()[name];
          Py_XDECREF(slot);
          Py_INCREF(cls.ptr());
          slot = cls.ptr();
        }
      },
      nb::arg("mapping"),
      "Internal: the exception class of each status code name ('' for the "
      "base class).");
}

}  // namespace kvcache::python
