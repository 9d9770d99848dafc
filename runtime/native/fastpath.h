/* The per-call hot path of the one-call functions, the bound ops and the torch ops, in C.
 *
 * Python builds a plan once per shape (after the full validation in validate.py accepted a call):
 * per token-count bucket, the compiled kernel's TVM-FFI function and the arguments after the
 * caller's tensors. Per call, this code does what the Python fast paths in ops.py and api.py do,
 * check for check: the cheap checks the compiled function cannot do, the overlap check on byte
 * ranges, the bucket, and one call into the kernel with the tensors passed as DLTensor pointers (no
 * allocation) and the current stream set as TVM-FFI's environment stream. When a check refuses, or
 * the kernel's own argument checks do (they run before it launches), nothing is written and the
 * caller takes the Python path, whose full validation raises the typed error naming the argument.
 *
 * Shared by fastpath.c (the CPython module) and torch_ops.cpp (the C++ torch op): one spelling of
 * the checks. Every function here is static: each includer gets its own copy.
 */
#ifndef ATTN_PROLOGUE_FASTPATH_H_
#define ATTN_PROLOGUE_FASTPATH_H_

#include <stdint.h>
#include <string.h>

#include <dlpack/dlpack.h>
#include <tvm/ffi/c_api.h>
#include <tvm/ffi/extra/c_env_api.h>

#ifdef __cplusplus
extern "C" {
#endif

#define AP_BUCKETS 16    /* dispatch.MAX_BUCKET_LOG2 + 1: checked when a plan is made */
#define AP_MAX_TAIL 24   /* arguments after the caller's tensors */
#define AP_MAX_TAIL_TENSORS 4
#define AP_MAX_LEAD 10   /* the caller's tensors and scales */
#define AP_MAX_MICRO_BATCHES 8
#define AP_MAX_FIXED 4

typedef struct {
  uintptr_t start, end;
} ap_range;

typedef struct {
  TVMFFIObjectHandle fn; /* the kernel's TVM-FFI function (a reference is held by the plan's owner) */
  int32_t n_tail;
  TVMFFIAny tail[AP_MAX_TAIL];
  DLTensor tail_tensors[AP_MAX_TAIL_TENSORS]; /* what tail's tensor entries point at */
} ap_call;

enum ap_kind { AP_ONE_CALL_QKV = 1, AP_ONE_CALL_KV = 2, AP_BOUND_QKV = 3, AP_BOUND_KV = 4 };

typedef struct {
  int32_t kind;
  ap_call calls[AP_BUCKETS];
  /* one-call plans */
  int64_t need;           /* bytes of one cache page the format needs: block_size x bytes per token */
  int32_t needs_kv_scale; /* the format takes a kv_scale tensor */
  int32_t q8;             /* FP8 q_out (passed to the kernel as uint8) */
  int32_t has_norm;       /* kv plans: the indexer-key writer (norm_weight is a leading tensor) */
  /* bound plans: the state the last full check accepted */
  int64_t h, capacity, q_row, kv_row, head_dim, rope_dim;
  int32_t in_place, n_micro_batches, slot_bits;
  uintptr_t k_cache_ptr;        /* the accepted k_cache's data pointer and byte range */
  ap_range k_range;
  const void* k_cache_obj;      /* identities: compared, never dereferenced */
  const void* cos_sin_cache_obj;
  DLTensor out[AP_MAX_MICRO_BATCHES]; /* each micro-batch's scratch buffer as the kernel's q_out */
  ap_range written[AP_MAX_MICRO_BATCHES];
  int32_t n_fixed;
  ap_range fixed[AP_MAX_FIXED]; /* inputs fixed at bind: cos_sin_cache, scales, norm weight */
  DLTensor lead_fixed[2];       /* bound kv: norm_weight, kv_scale as passed to the kernel */
  int32_t n_lead_fixed;
} ap_plan;

static inline int64_t ap_stride0(const DLTensor* t) {
  if (t->strides != NULL) return t->strides[0];
  int64_t s = 1;
  for (int i = 1; i < t->ndim; ++i) s *= t->shape[i];
  return s;
}

static inline int64_t ap_numel(const DLTensor* t) {
  int64_t n = 1;
  for (int i = 0; i < t->ndim; ++i) n *= t->shape[i];
  return n;
}

static inline uintptr_t ap_ptr(const DLTensor* t) { return (uintptr_t)t->data + (uintptr_t)t->byte_offset; }

static inline int64_t ap_nbytes(const DLTensor* t) {
  return ap_numel(t) * ((t->dtype.bits * t->dtype.lanes + 7) / 8);
}

static inline int ap_is_uint8(const DLTensor* t) {
  return t->dtype.code == kDLUInt && t->dtype.bits == 8 && t->dtype.lanes == 1;
}

static inline int ap_is_e4m3(const DLTensor* t) {
  return t->dtype.code == kDLFloat8_e4m3fn && t->dtype.bits == 8 && t->dtype.lanes == 1;
}

static inline int ap_is_int(const DLTensor* t, int bits) {
  return t->dtype.code == kDLInt && t->dtype.bits == bits && t->dtype.lanes == 1;
}

/* A [max_pos, R] table with rows (a table without any would make every position out of range). */
static inline int ap_has_rows(const DLTensor* cos_sin) { return cos_sin->ndim == 2 && cos_sin->shape[0] > 0; }

static inline int ap_bucket(int64_t rows) { /* bucket_index: bit length of rows - 1, capped */
  int b = 0;
  for (uint64_t v = (uint64_t)(rows - 1); v != 0; v >>= 1) ++b;
  return b < AP_BUCKETS - 1 ? b : AP_BUCKETS - 1;
}

/* overlap.disjoint: [w0, w1) and [v0, v1) (the second written buffer, or (0, 0)) intersect
 * neither each other nor any input range (inputs may overlap each other: they are only read). */
static inline int ap_disjoint(uintptr_t w0, uintptr_t w1, uintptr_t v0, uintptr_t v1, const ap_range* in,
                              int n_in) {
  if (w0 < v1 && v0 < w1) return 0;
  for (int i = 0; i < n_in; ++i) {
    if ((in[i].start < w1 && w0 < in[i].end) || (in[i].start < v1 && v0 < in[i].end)) return 0;
  }
  return 1;
}

static inline ap_range ap_span(uintptr_t start, int64_t bytes) {
  ap_range r = {start, start + (uintptr_t)bytes};
  return r;
}

/* ops.span: `rows` rows `stride` bytes apart, each `row` bytes (empty for no rows). */
static inline ap_range ap_rows(uintptr_t start, int64_t rows, int64_t stride, int64_t row) {
  return ap_span(start, rows > 0 ? (rows - 1) * stride + row : 0);
}

/* Clear TVM-FFI's raised error (the Python path that follows raises its own, naming the argument); 0. */
static inline int ap_drop_error(void) {
  TVMFFIObjectHandle err = NULL;
  TVMFFIErrorMoveFromRaised(&err);
  if (err != NULL) TVMFFIObjectDecRef(err);
  return 0;
}

/* One kernel call: the caller's leading arguments in args[0, n_lead), the bucket's tail after them,
 * the stream set as the environment stream of the tensors' device for the call. 1: launched;
 * 0: the kernel refused its arguments (nothing launched; the error is dropped: the Python path that
 * follows raises it with the argument named). */
static inline int ap_launch(const ap_call* call, TVMFFIAny* args, int n_lead, const DLTensor* on,
                            void* stream) {
  memcpy(args + n_lead, call->tail, sizeof(TVMFFIAny) * (size_t)call->n_tail);
  int32_t dev_type = on->device.device_type, dev_id = on->device.device_id;
  TVMFFIStreamHandle previous = NULL;
  if (TVMFFIEnvSetStream(dev_type, dev_id, stream, &previous) != 0) return ap_drop_error();
  TVMFFIAny result;
  result.type_index = kTVMFFINone;
  result.zero_padding = 0;
  result.v_int64 = 0;
  int rc = TVMFFIFunctionCall(call->fn, args, n_lead + call->n_tail, &result);
  TVMFFIEnvSetStream(dev_type, dev_id, previous, NULL);
  if (rc != 0) return ap_drop_error();
  if (result.type_index >= kTVMFFIStaticObjectBegin && result.v_obj != NULL) TVMFFIObjectDecRef(result.v_obj);
  return 1;
}

static inline void ap_set_tensor(TVMFFIAny* a, DLTensor* t) {
  a->type_index = kTVMFFIDLTensorPtr;
  a->zero_padding = 0;
  a->v_int64 = 0;
  a->v_ptr = t;
}

/* ops.qnorm_rope_kv_insert's per-call checks (the cheap ones, ops.qkv_disjoint) and launch. kv_scale and q_scale
 * may be NULL. q_out of an FP8 plan is relabelled uint8 (the kernel's view of it). 1: done. */
static inline int ap_one_call_qkv(const ap_plan* p, DLTensor* q_in, DLTensor* kv, DLTensor* q_out,
                                  DLTensor* k_cache, DLTensor* slots, DLTensor* positions,
                                  DLTensor* cos_sin, DLTensor* kv_scale, DLTensor* q_scale, void* stream) {
  if (p->kind != AP_ONE_CALL_QKV || q_in->ndim != 3 || q_out->ndim != 3 || k_cache->ndim != 2 ||
      slots->ndim < 1 || kv->ndim < 1)
    return 0;
  int64_t n = q_in->shape[0], h = q_in->shape[1], d = q_in->shape[2];
  int64_t n_out = q_out->shape[0], pp = q_out->shape[1], m = slots->shape[0];
  int64_t kb = k_cache->shape[0], kw = k_cache->shape[1];
  if (m > n || n_out < n || pp < h || kb < 1 || kw < p->need || !ap_is_uint8(k_cache) || !ap_has_rows(cos_sin) ||
      (kv_scale != NULL) != (p->needs_kv_scale != 0) || (q_scale != NULL) != (p->q8 != 0))
    return 0;
  int64_t s_qo = ap_stride0(q_out), s_kc = ap_stride0(k_cache);
  if ((n_out > 1 && s_qo < pp * d) || (kb > 1 && s_kc < p->need)) return 0; /* rows, pages apart */
  DLTensor q_out_view = *q_out;
  if (p->q8) {
    if (!ap_is_e4m3(q_out)) return 0;
    q_out_view.dtype.code = kDLUInt;
  }
  uintptr_t qo = ap_ptr(q_out), kc = ap_ptr(k_cache);
  uintptr_t qi = ap_ptr(q_in);
  int64_t s_qi = ap_stride0(q_in);
  ap_range in[7];
  int n_in = 0;
  in[n_in++] = ap_rows(ap_ptr(kv), n, 2 * ap_stride0(kv), 2 * d);
  in[n_in++] = ap_span(ap_ptr(slots), ap_nbytes(slots));
  in[n_in++] = ap_span(ap_ptr(positions), 8 * n);
  in[n_in++] = ap_span(ap_ptr(cos_sin), ap_nbytes(cos_sin));
  if (!(pp == h && qi == qo && s_qi == s_qo)) in[n_in++] = ap_rows(qi, n, 2 * s_qi, 2 * h * d);
  if (kv_scale != NULL) in[n_in++] = ap_span(ap_ptr(kv_scale), 4);
  if (q_scale != NULL) in[n_in++] = ap_span(ap_ptr(q_scale), 4);
  const int64_t es = p->q8 ? 1 : 2;
  const ap_range q = ap_rows(qo, n_out, s_qo * es, pp * d * es), kr = ap_rows(kc, kb, s_kc, kw);
  if (!ap_disjoint(q.start, q.end, kr.start, kr.end, in, n_in)) return 0;
  if (n == 0) return 1;
  TVMFFIAny args[AP_MAX_LEAD + AP_MAX_TAIL];
  int k = 0;
  DLTensor* lead[9] = {q_in, kv, &q_out_view, k_cache, slots, positions, cos_sin, kv_scale, q_scale};
  for (int i = 0; i < 9; ++i)
    if (lead[i] != NULL) ap_set_tensor(&args[k++], lead[i]);
  return ap_launch(&p->calls[ap_bucket(n)], args, k, q_in, stream);
}

/* ops.kv_rope_insert's per-call checks (ops.kv_disjoint) and launch. norm_weight is NULL unless
 * the plan is the indexer-key writer's; kv_scale NULL unless the format takes one. 1: done. */
static inline int ap_one_call_kv(const ap_plan* p, DLTensor* kv, DLTensor* norm_weight, DLTensor* k_cache,
                                 DLTensor* slots, DLTensor* positions, DLTensor* cos_sin, DLTensor* kv_scale,
                                 void* stream) {
  if (p->kind != AP_ONE_CALL_KV || kv->ndim != 2 || k_cache->ndim != 2 || slots->ndim < 1 ||
      positions->ndim < 1 || (norm_weight != NULL) != (p->has_norm != 0) ||
      (kv_scale != NULL) != (p->needs_kv_scale != 0))
    return 0;
  int64_t m = kv->shape[0], d = kv->shape[1], ms = slots->shape[0], n_pos = positions->shape[0];
  int64_t kb = k_cache->shape[0], kw = k_cache->shape[1];
  if (ms > m || ms > n_pos || kb < 1 || kw < p->need || !ap_is_uint8(k_cache) || !ap_has_rows(cos_sin)) return 0;
  int64_t s_kc = ap_stride0(k_cache);
  if (kb > 1 && s_kc < p->need) return 0; /* pages apart */
  uintptr_t kc = ap_ptr(k_cache);
  ap_range in[6];
  int n_in = 0;
  in[n_in++] = ap_rows(ap_ptr(kv), m, 2 * ap_stride0(kv), 2 * d);
  in[n_in++] = ap_span(ap_ptr(slots), ap_nbytes(slots));
  in[n_in++] = ap_span(ap_ptr(positions), 8 * n_pos);
  in[n_in++] = ap_span(ap_ptr(cos_sin), ap_nbytes(cos_sin));
  if (norm_weight != NULL) in[n_in++] = ap_span(ap_ptr(norm_weight), 2 * d);
  if (kv_scale != NULL) in[n_in++] = ap_span(ap_ptr(kv_scale), 4);
  const ap_range kr = ap_rows(kc, kb, s_kc, kw);
  if (!ap_disjoint(kr.start, kr.end, 0, 0, in, n_in)) return 0;
  if (ms == 0) return 1;
  TVMFFIAny args[AP_MAX_LEAD + AP_MAX_TAIL];
  int k = 0;
  DLTensor* lead[7] = {kv, norm_weight, k_cache, slots, positions, cos_sin, kv_scale};
  for (int i = 0; i < 7; ++i)
    if (lead[i] != NULL) ap_set_tensor(&args[k++], lead[i]);
  return ap_launch(&p->calls[ap_bucket(ms)], args, k, kv, stream);
}

/* BoundOp.__call__'s per-call checks (M <= N, N fits the scratch, the bound heads, the k_cache,
 * cos_sin_cache and slot-id width of the last full check, BoundOp._disjoint) and launch.
 * k_cache_obj / cos_sin_obj: the caller's objects (identity only). 1: launched; 0: refused. */
static inline int ap_bound_qkv(const ap_plan* p, DLTensor* q_in, DLTensor* kv, DLTensor* k_cache,
                               const void* k_cache_obj, DLTensor* slots, DLTensor* positions,
                               DLTensor* cos_sin, const void* cos_sin_obj, int64_t micro_batch, void* stream) {
  if (p->kind != AP_BOUND_QKV || q_in->ndim != 3 || slots->ndim < 1 || kv->ndim < 1) return 0;
  int64_t n = q_in->shape[0], m = slots->shape[0];
  if (m > n || n > p->capacity || n < 1 || q_in->shape[1] != p->h || k_cache_obj != p->k_cache_obj ||
      cos_sin_obj != p->cos_sin_cache_obj || !ap_is_int(slots, p->slot_bits) ||
      ap_ptr(k_cache) != p->k_cache_ptr)
    return 0;
  if (!p->in_place && (micro_batch < 0 || micro_batch >= p->n_micro_batches)) return 0;
  uintptr_t qi = ap_ptr(q_in);
  uintptr_t q_end = qi + (uintptr_t)((n - 1) * 2 * ap_stride0(q_in) + p->q_row);
  ap_range in[3 + AP_MAX_FIXED + 1];
  int n_in = 0;
  in[n_in++] = ap_span(ap_ptr(kv), (n - 1) * 2 * ap_stride0(kv) + p->kv_row);
  in[n_in++] = ap_span(ap_ptr(slots), ap_nbytes(slots));
  in[n_in++] = ap_span(ap_ptr(positions), 8 * n);
  DLTensor* out;
  if (p->in_place) {
    for (int i = 0; i < p->n_fixed; ++i) in[n_in++] = p->fixed[i];
    if (!ap_disjoint(qi, q_end, p->k_range.start, p->k_range.end, in, n_in)) return 0;
    out = q_in;
  } else {
    in[n_in++] = ap_span(qi, (int64_t)(q_end - qi));
    const ap_range w = p->written[micro_batch];
    if (!ap_disjoint(w.start, w.end, p->k_range.start, p->k_range.end, in, n_in)) return 0;
    out = (DLTensor*)&p->out[micro_batch];
  }
  TVMFFIAny args[AP_MAX_LEAD + AP_MAX_TAIL];
  DLTensor* lead[7] = {q_in, kv, out, k_cache, slots, positions, cos_sin};
  for (int i = 0; i < 7; ++i) ap_set_tensor(&args[i], lead[i]);
  return ap_launch(&p->calls[ap_bucket(n)], args, 7, q_in, stream);
}

/* BoundKvOp.__call__'s per-call checks (M <= rows of kv and of positions, the k_cache and slot-id
 * width of the last full check, a cos_sin_cache with rows and the bound R, the overlap check of ops.kv_disjoint with the bound norm weight and
 * scale) and launch. 1: done (M == 0 launches nothing); 0: refused. */
static inline int ap_bound_kv(const ap_plan* p, DLTensor* kv, DLTensor* k_cache, const void* k_cache_obj,
                              DLTensor* slots, DLTensor* positions, DLTensor* cos_sin, void* stream) {
  if (p->kind != AP_BOUND_KV || kv->ndim != 2 || slots->ndim < 1 || positions->ndim < 1) return 0;
  int64_t m = kv->shape[0], ms = slots->shape[0], n_pos = positions->shape[0];
  if (ms > m || ms > n_pos || k_cache_obj != p->k_cache_obj || !ap_is_int(slots, p->slot_bits) ||
      ap_ptr(k_cache) != p->k_cache_ptr || !ap_has_rows(cos_sin) || cos_sin->shape[1] != p->rope_dim)
    return 0;
  ap_range in[4 + AP_MAX_FIXED];
  int n_in = 0;
  in[n_in++] = ap_rows(ap_ptr(kv), m, 2 * ap_stride0(kv), 2 * kv->shape[1]);
  in[n_in++] = ap_span(ap_ptr(slots), ap_nbytes(slots));
  in[n_in++] = ap_span(ap_ptr(positions), 8 * n_pos);
  in[n_in++] = ap_span(ap_ptr(cos_sin), ap_nbytes(cos_sin));
  for (int i = 0; i < p->n_fixed; ++i) in[n_in++] = p->fixed[i];
  if (!ap_disjoint(p->k_range.start, p->k_range.end, 0, 0, in, n_in)) return 0;
  if (ms == 0) return 1;
  TVMFFIAny args[AP_MAX_LEAD + AP_MAX_TAIL];
  int k = 0;
  ap_set_tensor(&args[k++], kv);
  if (p->has_norm) ap_set_tensor(&args[k++], (DLTensor*)&p->lead_fixed[0]);
  DLTensor* lead[4] = {k_cache, slots, positions, cos_sin};
  for (int i = 0; i < 4; ++i) ap_set_tensor(&args[k++], lead[i]);
  if (p->needs_kv_scale) ap_set_tensor(&args[k++], (DLTensor*)&p->lead_fixed[1]);
  return ap_launch(&p->calls[ap_bucket(ms)], args, k, kv, stream);
}

#ifdef __cplusplus
}
#endif
#endif /* ATTN_PROLOGUE_FASTPATH_H_ */
