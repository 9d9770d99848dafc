/* Part of fastpath.c's translation unit, included by it once (not a stand-alone header): the
 * plan constructors the module exports, which turn what Python built once per shape into an ap_plan
 * (fastpath.h). Uses fastpath.c's tensor reader (as_dltensor), PlanObject and PlanType.
 */

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
