// The one hook from the op kernels to Python (ops/kernel.h): runs f(arg) holding the
// GIL. module.cpp, the one unit that includes Python.h, sets it when Python imports
// the extension; it is null where no Python runs (the C++ tests), and no tensor then
// has a Python object. Defined in ops.cpp.
#pragma once

namespace mixedprec {
extern void (*hold_python_gil)(void (*f)(void*), void* arg);
}  // namespace mixedprec
