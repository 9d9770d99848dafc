// The CUDA kernels of torch.ops.attn_prologue.{qnorm_rope_kv_insert,kv_rope_insert} in C++, so the
// dispatcher reaches compiled code: per call, a key from the arguments (what ops.py's one-call key
// holds), the shape's plan (fastpath.h: the same checks and kernel call as the one-call functions),
// and on a miss or a refused call the Python path through `attn_prologue::*_slow` (torch_op.py),
// which validates (raising the typed error), launches, and hands back the plan to cache.
//
// Built against the torch that loads it (the C++ ABI is torch's); links nothing of CUDA: the
// current stream comes through c10's device-guard interface. Registered for the CUDA key only: a
// kernel at AutogradCUDA would run before the Python key, so torch.compile's fake tensors would reach
// it (torch_op.py registers the Autograd keys as fallthroughs instead: the ops are not differentiable).
//
// Also exported: `ap_dltensor_from_pyobject`, the fast-path module's tensor reader once this library
// is loaded (torch's DLPack exchange API casts through pybind11 and takes the GIL per tensor: about
// half of that module's per-call time, measured with perf on CPU tensors).
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/library.h>

#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>

#include "fastpath.h"

namespace {

DLDataType dl_dtype(c10::ScalarType t) {
  switch (t) {
    case c10::ScalarType::BFloat16: return {kDLBfloat, 16, 1};
    case c10::ScalarType::Half: return {kDLFloat, 16, 1};
    case c10::ScalarType::Float: return {kDLFloat, 32, 1};
    case c10::ScalarType::Byte: return {kDLUInt, 8, 1};
    case c10::ScalarType::Char: return {kDLInt, 8, 1};
    case c10::ScalarType::Int: return {kDLInt, 32, 1};
    case c10::ScalarType::Long: return {kDLInt, 64, 1};
    case c10::ScalarType::Float8_e4m3fn: return {kDLFloat8_e4m3fn, 8, 1};
    default: return {kDLOpaqueHandle, 0, 0};  // refused by every check and kernel
  }
}

// The tensor as a DLTensor pointing at its own sizes and strides (valid while it lives: the call).
// false for what the kernels cannot read as stored bits: no storage, another device, a lazy
// negation or conjugation.
bool fill(const at::Tensor& t, DLTensor* out) {
  if (!t.defined() || !t.has_storage() || !(t.is_cuda() || t.is_cpu()) || t.is_neg() || t.is_conj()) return false;
  out->data = const_cast<void*>(t.const_data_ptr());
  out->device.device_type = t.is_cuda() ? kDLCUDA : kDLCPU;
  out->device.device_id = t.is_cuda() ? t.get_device() : 0;
  out->ndim = static_cast<int32_t>(t.dim());
  out->dtype = dl_dtype(t.scalar_type());
  out->shape = const_cast<int64_t*>(t.sizes().data());
  out->strides = const_cast<int64_t*>(t.strides().data());
  out->byte_offset = 0;
  return true;
}

void* current_stream(const at::Tensor& t) {
  const c10::Device device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(t.get_device()));
  return c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(device).native_handle();
}

// Plans by key; a plan is owned (and kept alive for the process) by the Python side. Each thread
// remembers its last hit (a serving loop calls one shape per layer): compared bytewise, no lock.
class PlanCache {
 public:
  const ap_plan* find(const std::string& key) {
    thread_local const PlanCache* last_cache = nullptr;
    thread_local std::string last_key;
    thread_local const ap_plan* last_plan = nullptr;
    if (last_cache == this && last_key == key) return last_plan;
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = plans_.find(key);
    if (it == plans_.end()) return nullptr;
    last_cache = this, last_key = key, last_plan = it->second;  // a found key's plan never changes
    return it->second;
  }
  void put(const std::string& key, int64_t address) {
    if (address == 0) return;
    std::lock_guard<std::mutex> lock(mutex_);
    plans_[key] = reinterpret_cast<const ap_plan*>(address);
  }

 private:
  std::mutex mutex_;
  std::unordered_map<std::string, const ap_plan*> plans_;
};

template <class T>
void put_bytes(std::string& key, const T& v) {
  key.append(reinterpret_cast<const char*>(&v), sizeof(v));
}

void put_text(std::string& key, c10::string_view s) {
  put_bytes(key, s.size());
  key.append(s.data(), s.size());
}

void qkv_cuda(const at::Tensor& q_in, const at::Tensor& kv, at::Tensor& q_out, at::Tensor& k_cache,
              const at::Tensor& slots, const at::Tensor& positions, const at::Tensor& cos_sin, double eps,
              int64_t block_size, c10::string_view cache_format, const std::optional<at::Tensor>& kv_scale,
              const std::optional<at::Tensor>& q_scale, c10::string_view numerics, bool apply_q_norm,
              bool apply_q_rope, c10::string_view q_layout) {
  static PlanCache plans;
  static auto slow = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("attn_prologue::qnorm_rope_kv_insert_slow", "")
                         .typed<int64_t(const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&,
                                        const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                                        c10::SymInt, c10::string_view, const std::optional<at::Tensor>&,
                                        const std::optional<at::Tensor>&, c10::string_view, bool, bool,
                                        c10::string_view)>();
  thread_local std::string key;  // reused: no allocation per call
  key.clear();
  if (q_in.dim() == 3 && q_out.dim() == 3 && cos_sin.dim() == 2) {  // ops.py's one-call key
    put_bytes(key, q_in.get_device());
    put_bytes(key, q_in.scalar_type());
    put_text(key, cache_format);
    put_bytes(key, q_in.size(2));
    put_bytes(key, q_in.size(1));
    put_bytes(key, q_out.size(1));  // the heads written (the torch op always writes the pads)
    put_bytes(key, cos_sin.size(1));
    put_bytes(key, kv_scale.has_value());
    put_bytes(key, q_scale.has_value());
    put_bytes(key, eps);
    put_bytes(key, block_size);
    put_text(key, numerics);
    put_bytes(key, apply_q_norm);
    put_bytes(key, apply_q_rope);
    put_text(key, q_layout);
    put_bytes(key, slots.scalar_type());
    if (const ap_plan* plan = plans.find(key)) {
      DLTensor t[9];
      if (fill(q_in, &t[0]) && fill(kv, &t[1]) && fill(q_out, &t[2]) && fill(k_cache, &t[3]) &&
          fill(slots, &t[4]) && fill(positions, &t[5]) && fill(cos_sin, &t[6]) &&
          (!kv_scale || fill(*kv_scale, &t[7])) && (!q_scale || fill(*q_scale, &t[8])) &&
          ap_one_call_qkv(plan, &t[0], &t[1], &t[2], &t[3], &t[4], &t[5], &t[6], kv_scale ? &t[7] : nullptr,
                          q_scale ? &t[8] : nullptr, current_stream(q_in)))
        return;
    }
  }
  const std::string miss = key;  // the thread's buffer may be reused if the slow path re-enters
  const int64_t address = slow.call(q_in, kv, q_out, k_cache, slots, positions, cos_sin, eps, c10::SymInt(block_size),
                                    cache_format, kv_scale, q_scale, numerics, apply_q_norm, apply_q_rope, q_layout);
  if (!miss.empty()) plans.put(miss, address);
}

void kv_cuda(const at::Tensor& kv, at::Tensor& k_cache, const at::Tensor& slots, const at::Tensor& positions,
             const at::Tensor& cos_sin, int64_t block_size, c10::string_view cache_format,
             const std::optional<at::Tensor>& norm_weight, double eps, const std::optional<at::Tensor>& kv_scale,
             c10::string_view numerics, int64_t compress_ratio) {
  static PlanCache plans;
  static auto slow = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("attn_prologue::kv_rope_insert_slow", "")
                         .typed<int64_t(const at::Tensor&, at::Tensor&, const at::Tensor&, const at::Tensor&,
                                        const at::Tensor&, c10::SymInt, c10::string_view,
                                        const std::optional<at::Tensor>&, double,
                                        const std::optional<at::Tensor>&, c10::string_view, int64_t)>();
  thread_local std::string key;
  key.clear();
  if (kv.dim() == 2 && cos_sin.dim() == 2) {
    put_bytes(key, kv.get_device());
    put_bytes(key, kv.scalar_type());
    put_text(key, cache_format);
    put_bytes(key, kv.size(1));
    put_bytes(key, cos_sin.size(1));
    put_bytes(key, norm_weight.has_value());
    put_bytes(key, kv_scale.has_value());
    put_bytes(key, eps);
    put_bytes(key, block_size);
    put_text(key, numerics);
    put_bytes(key, compress_ratio);
    put_bytes(key, slots.scalar_type());
    if (const ap_plan* plan = plans.find(key)) {
      DLTensor t[7];
      if (fill(kv, &t[0]) && (!norm_weight || fill(*norm_weight, &t[1])) && fill(k_cache, &t[2]) &&
          fill(slots, &t[3]) && fill(positions, &t[4]) && fill(cos_sin, &t[5]) &&
          (!kv_scale || fill(*kv_scale, &t[6])) &&
          ap_one_call_kv(plan, &t[0], norm_weight ? &t[1] : nullptr, &t[2], &t[3], &t[4], &t[5],
                         kv_scale ? &t[6] : nullptr, current_stream(kv)))
        return;
    }
  }
  const std::string miss = key;  // the thread's buffer may be reused if the slow path re-enters
  const int64_t address = slow.call(kv, k_cache, slots, positions, cos_sin, c10::SymInt(block_size), cache_format,
                                    norm_weight, eps, kv_scale, numerics, compress_ratio);
  if (!miss.empty()) plans.put(miss, address);
}

}  // namespace

// fastpath.c's tensor reader (ap_unpacker): an exact torch.Tensor or Parameter read in place, no
// reference taken (the caller holds the object for the call). 0: not read here (a subclass, or what
// fill refuses); the module then asks torch's DLPack exchange API, as without this library.
extern "C" __attribute__((visibility("default"))) int ap_dltensor_from_pyobject(PyObject* o, DLTensor* out) {
  return THPVariable_CheckExact(o) && fill(THPVariable_Unpack(o), out);
}

TORCH_LIBRARY_IMPL(attn_prologue, CUDA, m) {
  m.impl("qnorm_rope_kv_insert", &qkv_cuda);
  m.impl("kv_rope_insert", &kv_cuda);
}

