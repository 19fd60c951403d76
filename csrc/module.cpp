// An empty Python module: importing mixedprec._C loads the shared library, whose
// static initialisers register the operators with the dispatcher. No pybind, so
// one wheel serves every Python version (py_limited_api). The engine's sizes are
// exported so that tests can aim at its edges without restating them.
// torch 2.8 and later pass -DPy_LIMITED_API for py_limited_api extensions; 2.6 does
// not, and the module would be built against the full API yet named abi3.
#ifndef Py_LIMITED_API
#define Py_LIMITED_API 0x03090000
#endif
#include <Python.h>

#include "multi_tensor_plan.h"
#include "python_gil.h"

namespace {
// mixedprec::hold_python_gil (ops/kernel.h).
void run_holding_gil(void (*f)(void*), void* arg) {
  const PyGILState_STATE state = PyGILState_Ensure();
  f(arg);
  PyGILState_Release(state);
}
}  // namespace

extern "C" {
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr,
  };
  PyObject* module = PyModule_Create(&module_def);
  if (module == nullptr) return nullptr;
  mixedprec::hold_python_gil = &run_holding_gil;
  const long chunk = mixedprec::kChunkSize;
  const long max_blocks = mixedprec::kMaxBlocksPerLaunch;
  const long max_tensors = mixedprec::max_tensors_per_launch(1);
  if (PyModule_AddIntConstant(module, "CHUNK_SIZE", chunk) < 0 ||
      PyModule_AddIntConstant(module, "MAX_BLOCKS_PER_LAUNCH", max_blocks) < 0 ||
      PyModule_AddIntConstant(module, "MAX_TENSORS_PER_LAUNCH", max_tensors) < 0) {
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}
}
