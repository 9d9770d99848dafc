/* attn_prologue's CPython fast-path module: plans (fastpath.h) built from Python, called per step.
 *
 * Torch tensors are read through torch's DLPack exchange API (`torch.Tensor.__dlpack_c_exchange_api__`):
 * a DLTensor filled in place, no allocation, and the current stream of the tensors' device. Nothing
 * here links against torch, so one build serves every torch that has the API. Each method returns
 * False when it launched nothing (a check refused the call): the caller then takes the Python path.
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
  return 1;
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

/* ---- building a plan ------------------------------------------------------------------------ */

static int keep(PlanObject* self, PyObject* o) { return PyList_Append(self->keep, o); }

/* calls: AP_BUCKETS pairs (TVM-FFI function, tail tuple of ints, floats and tensors). */
static int fill_calls(PlanObject* self, PyObject* calls) {
  PyObject* seq = PySequence_Fast(calls, "calls must be a sequence of (function, tail) pairs");
  if (seq == NULL) return -1;
  if (PySequence_Fast_GET_SIZE(seq) != AP_BUCKETS) {
    PyErr_Format(PyExc_ValueError, "a plan takes %d buckets, got %zd", AP_BUCKETS, PySequence_Fast_GET_SIZE(seq));
    Py_DECREF(seq);
    return -1;
  }
  for (int b = 0; b < AP_BUCKETS; ++b) {
    PyObject *fn, *tail;
    if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, b), "OO!", &fn, &PyTuple_Type, &tail)) goto fail;
    ap_call* call = &self->plan.calls[b];
    PyObject* handle = PyObject_CallMethod(fn, "__chandle__", NULL);
    if (handle == NULL) goto fail;
    call->fn = PyLong_AsVoidPtr(handle);
    Py_DECREF(handle);
    if (PyErr_Occurred() || keep(self, fn) < 0 || keep(self, tail) < 0) goto fail;
    Py_ssize_t n = PyTuple_GET_SIZE(tail);
    if (n > AP_MAX_TAIL) {
      PyErr_Format(PyExc_ValueError, "a kernel call takes at most %d trailing arguments, got %zd", AP_MAX_TAIL, n);
      goto fail;
    }
    int n_tensors = 0;
    for (Py_ssize_t i = 0; i < n; ++i) {
      PyObject* v = PyTuple_GET_ITEM(tail, i);
      TVMFFIAny* a = &call->tail[i];
      memset(a, 0, sizeof(*a));
      if (PyBool_Check(v) || PyLong_Check(v)) {
        a->type_index = kTVMFFIInt;
        a->v_int64 = PyLong_AsLongLong(v);
        if (PyErr_Occurred()) goto fail;
      } else if (PyFloat_Check(v)) {
        a->type_index = kTVMFFIFloat;
        a->v_float64 = PyFloat_AS_DOUBLE(v);
      } else if (n_tensors < AP_MAX_TAIL_TENSORS && as_dltensor(v, &call->tail_tensors[n_tensors])) {
        ap_set_tensor(a, &call->tail_tensors[n_tensors++]);
      } else {
        PyErr_Format(PyExc_TypeError, "trailing argument %zd: cannot pass a %s", i, Py_TYPE(v)->tp_name);
        goto fail;
      }
    }
    call->n_tail = (int32_t)n;
  }
  Py_DECREF(seq);
  return 0;
fail:
  Py_DECREF(seq);
  return -1;
}

static PyTypeObject PlanType;

static PlanObject* new_plan(int kind, PyObject* calls) {
  if (g_api == NULL) {
    PyErr_SetString(PyExc_RuntimeError, "fastpath.init() was not called");
    return NULL;
  }
  PlanObject* self = PyObject_New(PlanObject, &PlanType);
  if (self == NULL) return NULL;
  memset(&self->plan, 0, sizeof(self->plan));
  for (int i = 0; i < AP_MAX_MICRO_BATCHES; ++i) self->views[i] = NULL;
  self->keep = PyList_New(0);
  self->plan.kind = kind;
  if (self->keep == NULL || fill_calls(self, calls) < 0) {
    Py_DECREF(self);
    return NULL;
  }
  return self;
}

static int parse_ranges(PyObject* ranges, ap_range* out, int max, int32_t* n_out) {
  PyObject* seq = PySequence_Fast(ranges, "ranges must be a sequence of (start, end) pairs");
  if (seq == NULL) return -1;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  if (n > max) {
    PyErr_Format(PyExc_ValueError, "at most %d fixed ranges, got %zd", max, n);
    Py_DECREF(seq);
    return -1;
  }
  for (Py_ssize_t i = 0; i < n; ++i) {
    unsigned long long a, b;
    if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "KK", &a, &b)) {
      Py_DECREF(seq);
      return -1;
    }
    out[i].start = (uintptr_t)a;
    out[i].end = (uintptr_t)b;
  }
  *n_out = (int32_t)n;
  Py_DECREF(seq);
  return 0;
}

/* (calls, need, needs_kv_scale, flag): flag is q8 for qkv plans, has_norm for kv plans. */
static PyObject* one_call_plan(PyObject* args, int kind) {
  PyObject* calls;
  long long need;
  int needs_kv_scale, flag;
  if (!PyArg_ParseTuple(args, "OLpp", &calls, &need, &needs_kv_scale, &flag)) return NULL;
  PlanObject* self = new_plan(kind, calls);
  if (self == NULL) return NULL;
  self->plan.need = need;
  self->plan.needs_kv_scale = needs_kv_scale;
  if (kind == AP_ONE_CALL_QKV)
    self->plan.q8 = flag;
  else
    self->plan.has_norm = flag;
  return (PyObject*)self;
}

static PyObject* one_call_qkv_plan(PyObject* mod, PyObject* args) { return one_call_plan(args, AP_ONE_CALL_QKV); }

static PyObject* one_call_kv_plan(PyObject* mod, PyObject* args) { return one_call_plan(args, AP_ONE_CALL_KV); }

/* bound_qkv_plan(calls, h, capacity, in_place, q_row, kv_row, slot_bits, k_cache, (k0, k1),
 *                cos_sin_cache, outs, fixed): outs one (buffer, views, (w0, w1)) per micro-batch. */
static PyObject* bound_qkv_plan(PyObject* mod, PyObject* args) {
  PyObject *calls, *k_cache, *cos_sin, *outs, *fixed;
  long long h, capacity, q_row, kv_row;
  int in_place, slot_bits;
  unsigned long long k0, k1;
  if (!PyArg_ParseTuple(args, "OLLpLLiO(KK)OOO", &calls, &h, &capacity, &in_place, &q_row, &kv_row, &slot_bits,
                        &k_cache, &k0, &k1, &cos_sin, &outs, &fixed))
    return NULL;
  PlanObject* self = new_plan(AP_BOUND_QKV, calls);
  if (self == NULL) return NULL;
  ap_plan* p = &self->plan;
  p->h = h;
  p->capacity = capacity;
  p->in_place = in_place;
  p->q_row = q_row;
  p->kv_row = kv_row;
  p->slot_bits = slot_bits;
  p->k_cache_obj = k_cache;
  p->cos_sin_cache_obj = cos_sin;
  p->k_cache_ptr = (uintptr_t)k0;
  p->k_range.start = (uintptr_t)k0;
  p->k_range.end = (uintptr_t)k1;
  if (keep(self, k_cache) < 0 || keep(self, cos_sin) < 0 || keep(self, outs) < 0 ||
      parse_ranges(fixed, p->fixed, AP_MAX_FIXED, &p->n_fixed) < 0)
    goto fail;
  PyObject* seq = PySequence_Fast(outs, "outs must be a sequence");
  if (seq == NULL) goto fail;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  if (n > AP_MAX_MICRO_BATCHES) {
    PyErr_Format(PyExc_ValueError, "at most %d micro-batches, got %zd", AP_MAX_MICRO_BATCHES, n);
    Py_DECREF(seq);
    goto fail;
  }
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject *buffer, *views;
    unsigned long long w0, w1;
    if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "OO!(KK)", &buffer, &PyDict_Type, &views, &w0, &w1) ||
        !as_dltensor(buffer, &p->out[i])) {
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "a micro-batch buffer must be a tensor");
      Py_DECREF(seq);
      goto fail;
    }
    p->written[i].start = (uintptr_t)w0;
    p->written[i].end = (uintptr_t)w1;
    self->views[i] = views; /* kept alive by outs */
  }
  p->n_micro_batches = (int32_t)n;
  Py_DECREF(seq);
  return (PyObject*)self;
fail:
  Py_DECREF(self);
  return NULL;
}

/* bound_kv_plan(calls, slot_bits, rope_dim, k_cache, (k0, k1), norm_weight, kv_scale, fixed) */
static PyObject* bound_kv_plan(PyObject* mod, PyObject* args) {
  PyObject *calls, *k_cache, *norm, *scale, *fixed;
  int slot_bits;
  long long rope_dim;
  unsigned long long k0, k1;
  if (!PyArg_ParseTuple(args, "OiLO(KK)OOO", &calls, &slot_bits, &rope_dim, &k_cache, &k0, &k1, &norm, &scale,
                        &fixed))
    return NULL;
  PlanObject* self = new_plan(AP_BOUND_KV, calls);
  if (self == NULL) return NULL;
  ap_plan* p = &self->plan;
  p->slot_bits = slot_bits;
  p->rope_dim = rope_dim;
  p->k_cache_obj = k_cache;
  p->k_cache_ptr = (uintptr_t)k0;
  p->k_range.start = (uintptr_t)k0;
  p->k_range.end = (uintptr_t)k1;
  p->has_norm = norm != Py_None;
  p->needs_kv_scale = scale != Py_None;
  if (keep(self, k_cache) < 0 || keep(self, norm) < 0 || keep(self, scale) < 0 ||
      parse_ranges(fixed, p->fixed, AP_MAX_FIXED, &p->n_fixed) < 0)
    goto fail;
  if ((p->has_norm && !as_dltensor(norm, &p->lead_fixed[0])) ||
      (p->needs_kv_scale && !as_dltensor(scale, &p->lead_fixed[1]))) {
    PyErr_SetString(PyExc_TypeError, "norm_weight and kv_scale must be tensors or None");
    goto fail;
  }
  return (PyObject*)self;
fail:
  Py_DECREF(self);
  return NULL;
}

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

/* ---- the one-call functions' key and plan lookup (ops.py) ------------------------------------
 * The key of a one-call shape: the tensors' facts the compiled variant depends on (as integers) and
 * the caller's scalar arguments as given (compared by value, as Python compares a tuple). ops.py
 * keys rt.calls with qkv_key / kv_key whenever this module is loaded, so run_qkv / run_kv find what
 * it stored. A few recent keys are also remembered with their shape, compared by the identity of
 * their objects (the same literals and attributes every step): a hit skips building and hashing the
 * tuple. That is sound because rt.calls only grows: a key's shape is never replaced. */

#define AP_KEY_FACTS 10
#define AP_KEY_OBJECTS 11
#define AP_MEMO 4

typedef struct {
  int n_facts, n_obj;
  int64_t facts[AP_KEY_FACTS];
  PyObject* obj[AP_KEY_OBJECTS]; /* borrowed from the call's arguments */
} ap_key;

static int64_t device_code(const DLTensor* t) { return (int64_t)t->device.device_type << 16 | t->device.device_id; }

static int64_t dtype_code(const DLTensor* t) {
  return (int64_t)t->dtype.code << 16 | (int64_t)t->dtype.bits << 8 | t->dtype.lanes;
}

/* The exact types of eps and block_size: True == 1 and 16.0 == 16 as Python compares them, but a bool or
 * float block_size (or a bool eps) is refused by the validation, so it must not find a shape of theirs. */
static int64_t scalar_kinds(PyObject* eps, PyObject* block_size) {
  return (int64_t)PyFloat_CheckExact(eps) | (int64_t)PyLong_CheckExact(eps) << 1 |
         (int64_t)PyLong_CheckExact(block_size) << 2;
}

/* args: q_in, kv, q_out, k_cache, slot_mapping, positions, cos_sin_cache, eps, block_size,
 * cache_format, kv_scale, q_scale, write_pad_heads, checked, numerics, apply_q_norm, apply_q_rope,
 * q_layout, config, conversions (ops.qnorm_rope_kv_insert's order). 0: no key (not a cached shape's). */
#define QKV_KEY_ARGS 20
static int qkv_key_of(PyObject* const* a, const DLTensor* q_in, const DLTensor* q_out, const DLTensor* cos_sin,
                      const DLTensor* slots, ap_key* k) {
  if (q_in->ndim != 3 || q_out->ndim != 3 || cos_sin->ndim != 2) return 0;
  int pads = PyObject_IsTrue(a[12]);
  if (pads < 0) {
    PyErr_Clear();
    return 0;
  }
  const int64_t facts[] = {device_code(q_in), dtype_code(q_in), q_in->shape[2], q_in->shape[1],
                           pads ? q_out->shape[1] : q_in->shape[1], /* the heads written */
                           cos_sin->shape[1], a[10] != Py_None, a[11] != Py_None, dtype_code(slots),
                           scalar_kinds(a[7], a[8])};
  PyObject* const objs[] = {a[7], a[8], a[9], a[13], a[14], a[15], a[16], a[17], a[18], a[19]};
  k->n_facts = sizeof(facts) / sizeof(facts[0]);
  k->n_obj = sizeof(objs) / sizeof(objs[0]);
  memcpy(k->facts, facts, sizeof(facts));
  memcpy(k->obj, objs, sizeof(objs));
  return 1;
}

/* args: kv, k_cache, slot_mapping, positions, cos_sin_cache, block_size, cache_format, norm_weight,
 * eps, kv_scale, checked, numerics, compress_ratio, config, conversions (ops.kv_rope_insert's order). */
#define KV_KEY_ARGS 15
static int kv_key_of(PyObject* const* a, const DLTensor* kv, const DLTensor* cos_sin, const DLTensor* slots,
                     ap_key* k) {
  if (kv->ndim != 2 || cos_sin->ndim != 2) return 0;
  const int64_t facts[] = {device_code(kv), dtype_code(kv), kv->shape[1], cos_sin->shape[1],
                           a[7] != Py_None, a[9] != Py_None, dtype_code(slots), scalar_kinds(a[8], a[5])};
  PyObject* const objs[] = {a[5], a[6], a[8], a[10], a[11], a[12], a[13], a[14]};
  k->n_facts = sizeof(facts) / sizeof(facts[0]);
  k->n_obj = sizeof(objs) / sizeof(objs[0]);
  memcpy(k->facts, facts, sizeof(facts));
  memcpy(k->obj, objs, sizeof(objs));
  return 1;
}

static PyObject* key_tuple(const ap_key* k) {
  PyObject* t = PyTuple_New(k->n_facts + k->n_obj);
  if (t == NULL) return NULL;
  for (int i = 0; i < k->n_facts; ++i) {
    PyObject* v = PyLong_FromLongLong(k->facts[i]);
    if (v == NULL) {
      Py_DECREF(t);
      return NULL;
    }
    PyTuple_SET_ITEM(t, i, v);
  }
  for (int i = 0; i < k->n_obj; ++i) PyTuple_SET_ITEM(t, k->n_facts + i, Py_NewRef(k->obj[i]));
  return t;
}

typedef struct {
  PyObject* calls; /* these hold references: the remembered key's objects stay what they were */
  PyObject* shape;
  const ap_plan* plan;
  ap_key key;
} ap_memo;

enum { MEMO_QKV = 0, MEMO_KV = 1 };
static ap_memo g_memo[2][AP_MEMO];
static int g_memo_next[2];

static const ap_plan* memo_find(int op, PyObject* calls, const ap_key* k, PyObject** shape) {
  for (int i = 0; i < AP_MEMO; ++i) {
    const ap_memo* m = &g_memo[op][i];
    if (m->calls != calls || m->key.n_facts != k->n_facts ||
        memcmp(m->key.facts, k->facts, sizeof(int64_t) * (size_t)k->n_facts) != 0 ||
        memcmp(m->key.obj, k->obj, sizeof(PyObject*) * (size_t)k->n_obj) != 0)
      continue;
    *shape = m->shape;
    return m->plan;
  }
  return NULL;
}

static void memo_put(int op, PyObject* calls, const ap_key* k, PyObject* shape, const ap_plan* plan) {
  ap_memo* m = &g_memo[op][g_memo_next[op]];
  g_memo_next[op] = (g_memo_next[op] + 1) % AP_MEMO;
  PyObject* old[2 + AP_KEY_OBJECTS] = {m->calls, m->shape};
  memcpy(old + 2, m->key.obj, sizeof(m->key.obj));
  m->calls = Py_NewRef(calls);
  m->shape = Py_NewRef(shape);
  m->plan = plan;
  m->key = *k;
  for (int i = 0; i < k->n_obj; ++i) Py_INCREF(k->obj[i]);
  for (int i = k->n_obj; i < AP_KEY_OBJECTS; ++i) m->key.obj[i] = NULL;
  for (int i = 0; i < 2 + AP_KEY_OBJECTS; ++i) Py_XDECREF(old[i]); /* last: may run arbitrary code */
}

/* The cached shape's plan for key k in calls, or NULL (shape: borrowed, valid while calls holds it). */
static const ap_plan* lookup(int op, PyObject* calls, const ap_key* k, PyObject** shape_out) {
  *shape_out = NULL;
  if (!PyDict_Check(calls)) return NULL;
  const ap_plan* p = memo_find(op, calls, k, shape_out);
  if (p != NULL) return p;
  PyObject* key = key_tuple(k);
  if (key == NULL) return NULL;
  PyObject* shape = PyDict_GetItemWithError(calls, key); /* borrowed */
  Py_DECREF(key);
  if (shape == NULL) return NULL;
  static PyObject* name = NULL;
  if (name == NULL && (name = PyUnicode_InternFromString("native")) == NULL) return NULL;
  PyObject* plan = PyObject_GetAttr(shape, name);
  if (plan == NULL) return NULL;
  if (Py_TYPE(plan) == &PlanType) p = &((PlanObject*)plan)->plan; /* kept alive by the shape */
  Py_DECREF(plan);
  if (p != NULL) {
    *shape_out = shape;
    memo_put(op, calls, k, shape, p);
  }
  return p;
}

/* The key, or None when an argument is not what a cached shape could have (the Python path decides). */
static PyObject* qkv_key(PyObject* mod, PyObject* const* a, Py_ssize_t nargs) {
  if (!nargs_is(nargs, QKV_KEY_ARGS, "qkv_key")) return NULL;
  DLTensor q_in, q_out, cos_sin, slots;
  ap_key k;
  if (as_dltensor(a[0], &q_in) && as_dltensor(a[2], &q_out) && as_dltensor(a[6], &cos_sin) &&
      as_dltensor(a[4], &slots) && qkv_key_of(a, &q_in, &q_out, &cos_sin, &slots, &k))
    return key_tuple(&k);
  Py_RETURN_NONE;
}

static PyObject* kv_key(PyObject* mod, PyObject* const* a, Py_ssize_t nargs) {
  if (!nargs_is(nargs, KV_KEY_ARGS, "kv_key")) return NULL;
  DLTensor kv, cos_sin, slots;
  ap_key k;
  if (as_dltensor(a[0], &kv) && as_dltensor(a[4], &cos_sin) && as_dltensor(a[2], &slots) &&
      kv_key_of(a, &kv, &cos_sin, &slots, &k))
    return key_tuple(&k);
  Py_RETURN_NONE;
}

/* run_qkv(calls, <qkv_key's arguments>): the shape's ShapeCalls when the call ran (or had nothing to
 * do), None when nothing was launched (not cached, or refused: the Python path takes it). */
static PyObject* run_qkv(PyObject* mod, PyObject* const* args, Py_ssize_t nargs) {
  if (!nargs_is(nargs, 1 + QKV_KEY_ARGS, "run_qkv")) return NULL;
  PyObject* const* a = args + 1;
  DLTensor t[9];
  DLTensor *kv_scale = NULL, *q_scale = NULL;
  for (int i = 0; i < 7; ++i)
    if (!as_dltensor(a[i], &t[i])) Py_RETURN_NONE;
  if (a[10] != Py_None) {
    if (!as_dltensor(a[10], &t[7])) Py_RETURN_NONE;
    kv_scale = &t[7];
  }
  if (a[11] != Py_None) {
    if (!as_dltensor(a[11], &t[8])) Py_RETURN_NONE;
    q_scale = &t[8];
  }
  ap_key k;
  if (!qkv_key_of(a, &t[0], &t[2], &t[6], &t[4], &k)) Py_RETURN_NONE;
  PyObject* shape;
  const ap_plan* p = lookup(MEMO_QKV, args[0], &k, &shape);
  if (PyErr_Occurred()) return NULL;
  if (p != NULL && ap_one_call_qkv(p, &t[0], &t[1], &t[2], &t[3], &t[4], &t[5], &t[6], kv_scale, q_scale,
                                   stream_of(&t[0])))
    return Py_NewRef(shape);
  Py_RETURN_NONE;
}

static PyObject* run_kv(PyObject* mod, PyObject* const* args, Py_ssize_t nargs) {
  if (!nargs_is(nargs, 1 + KV_KEY_ARGS, "run_kv")) return NULL;
  PyObject* const* a = args + 1;
  DLTensor kv, k_cache, slots, positions, cos_sin, norm, scale;
  DLTensor *norm_p = NULL, *scale_p = NULL;
  if (!as_dltensor(a[0], &kv) || !as_dltensor(a[1], &k_cache) || !as_dltensor(a[2], &slots) ||
      !as_dltensor(a[3], &positions) || !as_dltensor(a[4], &cos_sin))
    Py_RETURN_NONE;
  if (a[7] != Py_None) {
    if (!as_dltensor(a[7], &norm)) Py_RETURN_NONE;
    norm_p = &norm;
  }
  if (a[9] != Py_None) {
    if (!as_dltensor(a[9], &scale)) Py_RETURN_NONE;
    scale_p = &scale;
  }
  ap_key k;
  if (!kv_key_of(a, &kv, &cos_sin, &slots, &k)) Py_RETURN_NONE;
  PyObject* shape;
  const ap_plan* p = lookup(MEMO_KV, args[0], &k, &shape);
  if (PyErr_Occurred()) return NULL;
  if (p != NULL && ap_one_call_kv(p, &kv, norm_p, &k_cache, &slots, &positions, &cos_sin, scale_p, stream_of(&kv)))
    return Py_NewRef(shape);
  Py_RETURN_NONE;
}

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
    {"bound_qkv_plan", bound_qkv_plan, METH_VARARGS, "see fastpath.c"},
    {"bound_kv_plan", bound_kv_plan, METH_VARARGS, "see fastpath.c"},
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
