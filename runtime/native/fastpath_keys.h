/* Part of fastpath.c's translation unit, included by it once (not a stand-alone header): the
 * one-call functions' shape keys, the memo of recent keys and the lookup of a shape's plan, which
 * run_qkv / run_kv call. Uses fastpath.c's tensor reader (as_dltensor, stream_of), PlanObject,
 * PlanType and nargs_is.
 */

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
  if (requires_grad(a[2])) Py_RETURN_NONE; /* q_out */
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
