/* attn_prologue's CPython fast-path module: plans (fastpath.h) built from Python, called per step.
 *
 * Torch tensors are read through torch's DLPack exchange API (`torch.Tensor.__dlpack_c_exchange_api__`):
 * a DLTensor filled in place, no allocation, and the current stream of the tensors' device. Nothing
 * here links against torch, so one build serves every torch that has the API. Each method returns
 * False when it launched nothing (a check refused the call): the caller then takes the Python path.
 *
 * One translation unit in three files: this one (the tensor reader, the per-call methods, the Plan
 * type and the module), fastpath_plans.h (the plan constructors) and fastpath_keys.h (the one-call
 * functions' shape keys and plan lookup), both included here once.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "fastpath.h"

static const DLPackExchangeAPI* g_api = NULL;
static PyTypeObject* g_tensor_type = NULL;
/* A faster reader of torch tensors, once the C++ torch-op library is loaded (its
 * ap_dltensor_from_pyobject: the tensor read in place). 1: read; 0: not a tensor it reads (a
 * subclass: ask the exchange API); -1: a tensor whose stored bits are not what a kernel may read
 * (a lazy negation or conjugation, which the exchange API would hand over as plain bits). */
typedef int (*ap_unpacker)(PyObject*, DLTensor*);
static ap_unpacker g_unpack = NULL;

typedef struct {
  PyObject_HEAD
  ap_plan plan;
  PyObject* keep;                              /* what the plan's pointers and handles rely on */
  PyObject* views[AP_MAX_MICRO_BATCHES];       /* bound qkv: per micro-batch, {n: q_out view} */
} PlanObject;

static PyTypeObject PlanType; /* defined after the methods (below) */

/* torch.Tensor.is_neg: the exchange API hands a lazily negated view over as its stored bits. */
static PyObject* g_is_neg = NULL;
static PyObject* g_requires_grad = NULL; /* "requires_grad", interned */

/* Does q_out require grad? The kernel's write would be invisible to autograd (the Python path refuses
 * it, naming the fix). An attribute read of a flag, not a method call. */
static int requires_grad(PyObject* o) {
  PyObject* r = PyObject_GetAttr(o, g_requires_grad);
  if (r == NULL) {
    PyErr_Clear();
    return 1;
  }
  Py_DECREF(r);
  return r != Py_False;
}

static int as_dltensor(PyObject* o, DLTensor* out) {
  if (g_api == NULL || !PyObject_TypeCheck(o, g_tensor_type)) return 0;
  if (g_unpack != NULL) {
    int read = g_unpack(o, out);
    if (read != 0) return read > 0;
  }
  if (g_api->dltensor_from_py_object_no_sync((void*)o, out) != 0) {
    PyErr_Clear();
    return 0;
  }
  /* Stored bits that are not the values: a conjugation bit lives on complex tensors only (no kernel
   * takes one: refused by dtype here), a negation bit is asked of torch (the unpacker reads both). */
  if (out->dtype.code == kDLComplex) return 0;
  PyObject* neg = PyObject_Vectorcall(g_is_neg, &o, 1, NULL);
  if (neg == NULL) {
    PyErr_Clear();
    return 0;
  }
  Py_DECREF(neg);
  return neg == Py_False;
}

static void* stream_of(const DLTensor* t) {
  void* stream = NULL;
  if (t->device.device_type != kDLCPU && g_api->current_work_stream != NULL &&
      g_api->current_work_stream((DLDeviceType)t->device.device_type, t->device.device_id, &stream) != 0) {
    PyErr_Clear();
    return NULL;
  }
  return stream;
}

#include "fastpath_plans.h"

/* ---- per call ------------------------------------------------------------------------------- */

#define TENSOR(i, name)                   \
  DLTensor name;                          \
  if (!as_dltensor(args[i], &name)) Py_RETURN_FALSE;

#define OPTIONAL_TENSOR(i, name, ptr)     \
  DLTensor name;                          \
  DLTensor* ptr = NULL;                   \
  if (args[i] != Py_None) {               \
    if (!as_dltensor(args[i], &name)) Py_RETURN_FALSE; \
    ptr = &name;                          \
  }

static int nargs_is(Py_ssize_t nargs, Py_ssize_t want, const char* name) {
  if (nargs == want) return 1;
  PyErr_Format(PyExc_TypeError, "%s takes %zd arguments, got %zd", name, want, nargs);
  return 0;
}

/* qkv(q_in, kv, q_out, k_cache, slot_mapping, positions, cos_sin_cache, kv_scale, q_scale) -> bool */
static PyObject* plan_qkv(PlanObject* self, PyObject* const* args, Py_ssize_t nargs) {
  if (!nargs_is(nargs, 9, "qkv")) return NULL;
  if (requires_grad(args[2])) Py_RETURN_FALSE;
  TENSOR(0, q_in) TENSOR(1, kv) TENSOR(2, q_out) TENSOR(3, k_cache) TENSOR(4, slots) TENSOR(5, positions)
  TENSOR(6, cos_sin) OPTIONAL_TENSOR(7, kv_scale, kv_scale_p) OPTIONAL_TENSOR(8, q_scale, q_scale_p)
  int ok = ap_one_call_qkv(&self->plan, &q_in, &kv, &q_out, &k_cache, &slots, &positions, &cos_sin, kv_scale_p,
                           q_scale_p, stream_of(&q_in));
  return PyBool_FromLong(ok);
}

/* kv(kv, norm_weight, k_cache, slot_mapping, positions, cos_sin_cache, kv_scale) -> bool */
static PyObject* plan_kv(PlanObject* self, PyObject* const* args, Py_ssize_t nargs) {
  if (!nargs_is(nargs, 7, "kv")) return NULL;
  TENSOR(0, kv) OPTIONAL_TENSOR(1, norm, norm_p) TENSOR(2, k_cache) TENSOR(3, slots) TENSOR(4, positions)
  TENSOR(5, cos_sin) OPTIONAL_TENSOR(6, kv_scale, kv_scale_p)
  int ok = ap_one_call_kv(&self->plan, &kv, norm_p, &k_cache, &slots, &positions, &cos_sin, kv_scale_p,
                          stream_of(&kv));
  return PyBool_FromLong(ok);
}

/* bound_qkv(q_in, kv, k_cache, slot_mapping, positions, cos_sin_cache, micro_batch) -> the q_out
 * view for this token count (q_in in place), True when launched but no view is cached yet, False
 * when nothing was launched. */
static PyObject* plan_bound_qkv(PlanObject* self, PyObject* const* args, Py_ssize_t nargs) {
  if (!nargs_is(nargs, 7, "bound_qkv")) return NULL;
  TENSOR(0, q_in) TENSOR(1, kv) TENSOR(2, k_cache) TENSOR(3, slots) TENSOR(4, positions) TENSOR(5, cos_sin)
  long long mb = 0;
  if (!self->plan.in_place) {
    if (!PyLong_CheckExact(args[6])) Py_RETURN_FALSE;
    mb = PyLong_AsLongLong(args[6]);
    if (mb == -1 && PyErr_Occurred()) {
      PyErr_Clear();
      Py_RETURN_FALSE;
    }
  }
  if (!ap_bound_qkv(&self->plan, &q_in, &kv, &k_cache, args[2], &slots, &positions, &cos_sin, args[5], mb,
                    stream_of(&q_in)))
    Py_RETURN_FALSE;
  if (self->plan.in_place) return Py_NewRef(args[0]);
  PyObject* key = PyLong_FromLongLong(q_in.shape[0]);
  if (key == NULL) return NULL;
  PyObject* view = PyDict_GetItemWithError(self->views[mb], key);
  Py_DECREF(key);
  if (view != NULL) return Py_NewRef(view);
  if (PyErr_Occurred()) return NULL;
  Py_RETURN_TRUE;
}

/* bound_kv(kv, k_cache, slot_mapping, positions, cos_sin_cache) -> bool */
static PyObject* plan_bound_kv(PlanObject* self, PyObject* const* args, Py_ssize_t nargs) {
  if (!nargs_is(nargs, 5, "bound_kv")) return NULL;
  TENSOR(0, kv) TENSOR(1, k_cache) TENSOR(2, slots) TENSOR(3, positions) TENSOR(4, cos_sin)
  int ok = ap_bound_kv(&self->plan, &kv, &k_cache, args[1], &slots, &positions, &cos_sin, stream_of(&kv));
  return PyBool_FromLong(ok);
}

#include "fastpath_keys.h"

static void plan_dealloc(PlanObject* self) {
  Py_XDECREF(self->keep);
  PyObject_Free(self);
}

static PyObject* plan_address(PlanObject* self, PyObject* unused) {
  return PyLong_FromVoidPtr(&self->plan); /* for the C++ torch op: the plan it calls */
}

static PyMethodDef plan_methods[] = {
    {"qkv", (PyCFunction)(void (*)(void))plan_qkv, METH_FASTCALL, "one-call qnorm_rope_kv_insert"},
    {"kv", (PyCFunction)(void (*)(void))plan_kv, METH_FASTCALL, "one-call kv_rope_insert"},
    {"bound_qkv", (PyCFunction)(void (*)(void))plan_bound_qkv, METH_FASTCALL, "BoundOp call"},
    {"bound_kv", (PyCFunction)(void (*)(void))plan_bound_kv, METH_FASTCALL, "BoundKvOp call"},
    {"address", (PyCFunction)plan_address, METH_NOARGS, "the C plan's address"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject PlanType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "attn_prologue_fastpath.Plan",
    .tp_basicsize = sizeof(PlanObject),
    .tp_dealloc = (destructor)plan_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A shape's kernels and checks (fastpath.h)",
    .tp_methods = plan_methods,
};

/* init(exchange_api_capsule, tensor_type): torch's DLPack exchange API and torch.Tensor. */
static PyObject* init(PyObject* mod, PyObject* args) {
  PyObject *capsule, *type;
  if (!PyArg_ParseTuple(args, "OO!", &capsule, &PyType_Type, &type)) return NULL;
  const DLPackExchangeAPI* api = (const DLPackExchangeAPI*)PyCapsule_GetPointer(capsule, "dlpack_exchange_api");
  if (api == NULL) return NULL;
  if (api->header.version.major != DLPACK_MAJOR_VERSION || api->dltensor_from_py_object_no_sync == NULL) {
    PyErr_Format(PyExc_RuntimeError, "torch's DLPack exchange API is version %u (built for %d) or lacks "
                 "dltensor_from_py_object_no_sync", api->header.version.major, DLPACK_MAJOR_VERSION);
    return NULL;
  }
  PyObject* is_neg = PyObject_GetAttrString(type, "is_neg");
  if (is_neg == NULL) return NULL;
  if (g_requires_grad == NULL && (g_requires_grad = PyUnicode_InternFromString("requires_grad")) == NULL) {
    Py_DECREF(is_neg);
    return NULL;
  }
  Py_XDECREF(g_is_neg);
  g_is_neg = is_neg;
  Py_INCREF(type);
  Py_XDECREF((PyObject*)g_tensor_type);
  g_tensor_type = (PyTypeObject*)type;
  g_api = api;
  Py_RETURN_NONE;
}

static PyObject* buckets(PyObject* mod, PyObject* unused) { return PyLong_FromLong(AP_BUCKETS); }

/* set_unpacker(address): the C++ torch-op library's ap_dltensor_from_pyobject (0: none again). */
static PyObject* set_unpacker(PyObject* mod, PyObject* address) {
  void* p = PyLong_AsVoidPtr(address);
  if (p == NULL && PyErr_Occurred()) return NULL;
  g_unpack = (ap_unpacker)p;
  Py_RETURN_NONE;
}

/* dltensor(t, reader) -> (data, device_type, device_id, (code, bits, lanes), shape, strides,
 * byte_offset): what a plan sees of t; None if unread. reader: "unpacker" or "exchange" alone, or
 * "plan" (what a plan call reads: the unpacker, then the exchange API for what it leaves). */
static PyObject* dltensor(PyObject* mod, PyObject* args) {
  PyObject* o;
  const char* reader;
  if (!PyArg_ParseTuple(args, "Os", &o, &reader)) return NULL;
  DLTensor t;
  ap_unpacker saved = g_unpack;
  int ok;
  if (strcmp(reader, "unpacker") == 0) {
    ok = g_unpack != NULL && PyObject_TypeCheck(o, g_tensor_type) && g_unpack(o, &t) > 0;
  } else if (strcmp(reader, "exchange") == 0) {
    g_unpack = NULL;
    ok = as_dltensor(o, &t);
    g_unpack = saved;
  } else if (strcmp(reader, "plan") == 0) {
    ok = as_dltensor(o, &t);
  } else {
    PyErr_Format(PyExc_ValueError, "reader must be unpacker, exchange or plan, got %s", reader);
    return NULL;
  }
  if (!ok) Py_RETURN_NONE;
  PyObject* shape = PyTuple_New(t.ndim);
  PyObject* strides = PyTuple_New(t.ndim);
  if (shape == NULL || strides == NULL) {
    Py_XDECREF(shape);
    Py_XDECREF(strides);
    return NULL;
  }
  for (int i = 0; i < t.ndim; ++i) {
    PyTuple_SET_ITEM(shape, i, PyLong_FromLongLong(t.shape[i]));
    PyTuple_SET_ITEM(strides, i, PyLong_FromLongLong(t.strides != NULL ? t.strides[i] : 0));
  }
  return Py_BuildValue("(KiiiiiNNK)", (unsigned long long)(uintptr_t)t.data, (int)t.device.device_type,
                       (int)t.device.device_id, (int)t.dtype.code, (int)t.dtype.bits, (int)t.dtype.lanes, shape,
                       strides, (unsigned long long)t.byte_offset);
}

static PyMethodDef module_methods[] = {
    {"init", init, METH_VARARGS, "init(torch.Tensor.__dlpack_c_exchange_api__, torch.Tensor)"},
    {"buckets", buckets, METH_NOARGS, "how many token-count buckets a plan takes"},
    {"set_unpacker", set_unpacker, METH_O, "set_unpacker(address of ap_dltensor_from_pyobject, or 0)"},
    {"dltensor", dltensor, METH_VARARGS, "dltensor(t, reader): what a plan sees of t"},
    {"qkv_key", (PyCFunction)(void (*)(void))qkv_key, METH_FASTCALL, "a one-call qkv shape's key"},
    {"kv_key", (PyCFunction)(void (*)(void))kv_key, METH_FASTCALL, "a one-call kv shape's key"},
    {"run_qkv", (PyCFunction)(void (*)(void))run_qkv, METH_FASTCALL, "ops.qnorm_rope_kv_insert's fast path"},
    {"run_kv", (PyCFunction)(void (*)(void))run_kv, METH_FASTCALL, "ops.kv_rope_insert's fast path"},
    {"one_call_qkv_plan", one_call_qkv_plan, METH_VARARGS, "(calls, need, needs_kv_scale, q8)"},
    {"one_call_kv_plan", one_call_kv_plan, METH_VARARGS, "(calls, need, needs_kv_scale, has_norm)"},
    {"bound_qkv_plan", bound_qkv_plan, METH_VARARGS, "see fastpath_plans.h"},
    {"bound_kv_plan", bound_kv_plan, METH_VARARGS, "see fastpath_plans.h"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "attn_prologue_fastpath", NULL, -1, module_methods};

PyMODINIT_FUNC PyInit_attn_prologue_fastpath(void) {
  if (PyType_Ready(&PlanType) < 0) return NULL;
  PyObject* m = PyModule_Create(&module_def);
  if (m == NULL) return NULL;
  Py_INCREF(&PlanType);
  if (PyModule_AddObject(m, "Plan", (PyObject*)&PlanType) < 0) {
    Py_DECREF(&PlanType);
    Py_DECREF(m);
    return NULL;
  }
  return m;
}
