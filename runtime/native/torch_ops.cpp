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
// Boxed kernels: the arguments are read off the dispatcher's stack as torch.ops built it, not unboxed
// into 16 C++ parameters (over an empty kernel on the 2-core CPU VM, tools/native_cpu_cost.py: 0-0.3 us
// less per call, within that machine's noise).
//
// Also exported: `ap_dltensor_from_pyobject`, the fast-path module's tensor reader once this library
// is loaded (torch's DLPack exchange API casts through pybind11 and takes the GIL per tensor: a no-op
// plan call on CPU tensors takes 2.2-2.6x as long through it, tools/native_cpu_cost.py).
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
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

// The current stream of a CUDA tensor's device; none for a CPU tensor (reached only by redispatching
// to the CUDA key directly, as the CPU tests do).
void* current_stream(const at::Tensor& t) {
  if (!t.is_cuda()) return nullptr;
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

// The op's n arguments on the stack, in the schema's order (a boxed kernel: the dispatcher hands the
// arguments as the caller's interpreter stack built them, with no unboxing into C++ parameters).
struct Args {
  const torch::jit::Stack& stack;
  size_t n;
  const c10::IValue& operator[](size_t i) const { return stack[stack.size() - n + i]; }
  const at::Tensor* optional_tensor(size_t i) const { return (*this)[i].isNone() ? nullptr : &(*this)[i].toTensor(); }
};

// The shape's plan launched (the arguments dropped, as a kernel returning () leaves the stack), or the
// Python slow path called on the same stack (it validates, raises or launches, and hands back the
// plan's address, cached under key). key is empty when the arguments cannot have a plan.
template <class Launch>
void run(PlanCache& plans, const char* slow_name, torch::jit::Stack* stack, size_t n, const std::string& key,
         Launch launch) {
  if (!key.empty()) {
    const ap_plan* plan = plans.find(key);
    if (plan != nullptr && launch(plan)) {
      torch::jit::drop(*stack, n);
      return;
    }
  }
  const std::string miss = key;  // the thread's key buffer may be reused if the slow path re-enters
  c10::Dispatcher::singleton().findSchemaOrThrow(slow_name, "").callBoxed(stack);  // same arguments, -> int
  const int64_t address = stack->back().toInt();
  stack->pop_back();
  if (!miss.empty()) plans.put(miss, address);
}

// qnorm_rope_kv_insert(q_in, kv, q_out, k_cache, slot_mapping, positions, cos_sin_cache, eps,
// block_size, cache_format, kv_scale, q_scale, numerics, apply_q_norm, apply_q_rope, q_layout)
void qkv_cuda(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  static PlanCache plans;
  const Args a{*stack, 16};
  const at::Tensor &q_in = a[0].toTensor(), &q_out = a[2].toTensor(), &cos_sin = a[6].toTensor();
  const at::Tensor *kv_scale = a.optional_tensor(10), *q_scale = a.optional_tensor(11);
  thread_local std::string key;  // reused: no allocation per call
  key.clear();
  if (q_in.dim() == 3 && q_out.dim() == 3 && cos_sin.dim() == 2 && a[8].isInt()) {  // ops.py's one-call key
    put_bytes(key, q_in.get_device());
    put_bytes(key, q_in.scalar_type());
    put_text(key, a[9].toStringView());  // cache_format
    put_bytes(key, q_in.size(2));
    put_bytes(key, q_in.size(1));
    put_bytes(key, q_out.size(1));  // the heads written (the torch op always writes the pads)
    put_bytes(key, cos_sin.size(1));
    put_bytes(key, kv_scale != nullptr);
    put_bytes(key, q_scale != nullptr);
    put_bytes(key, a[7].toDouble());  // eps
    put_bytes(key, a[8].toInt());     // block_size
    put_text(key, a[12].toStringView());  // numerics
    put_bytes(key, a[13].toBool());
    put_bytes(key, a[14].toBool());
    put_text(key, a[15].toStringView());  // q_layout
    put_bytes(key, a[4].toTensor().scalar_type());
  }
  run(plans, "attn_prologue::qnorm_rope_kv_insert_slow", stack, 16, key, [&](const ap_plan* plan) {
    if (q_out.requires_grad()) return false;  // autograd would not see the write: the slow path says so
    DLTensor t[9];
    for (int i = 0; i < 7; ++i)
      if (!fill(a[i].toTensor(), &t[i])) return false;
    return (!kv_scale || fill(*kv_scale, &t[7])) && (!q_scale || fill(*q_scale, &t[8])) &&
           ap_one_call_qkv(plan, &t[0], &t[1], &t[2], &t[3], &t[4], &t[5], &t[6], kv_scale ? &t[7] : nullptr,
                           q_scale ? &t[8] : nullptr, current_stream(q_in)) != 0;
  });
}

// kv_rope_insert(kv, k_cache, slot_mapping, positions, cos_sin_cache, block_size, cache_format,
// norm_weight, eps, kv_scale, numerics, compress_ratio)
void kv_cuda(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  static PlanCache plans;
  const Args a{*stack, 12};
  const at::Tensor &kv = a[0].toTensor(), &cos_sin = a[4].toTensor();
  const at::Tensor *norm_weight = a.optional_tensor(7), *kv_scale = a.optional_tensor(9);
  thread_local std::string key;
  key.clear();
  if (kv.dim() == 2 && cos_sin.dim() == 2 && a[5].isInt()) {
    put_bytes(key, kv.get_device());
    put_bytes(key, kv.scalar_type());
    put_text(key, a[6].toStringView());  // cache_format
    put_bytes(key, kv.size(1));
    put_bytes(key, cos_sin.size(1));
    put_bytes(key, norm_weight != nullptr);
    put_bytes(key, kv_scale != nullptr);
    put_bytes(key, a[8].toDouble());  // eps
    put_bytes(key, a[5].toInt());     // block_size
    put_text(key, a[10].toStringView());  // numerics
    put_bytes(key, a[11].toInt());        // compress_ratio
    put_bytes(key, a[2].toTensor().scalar_type());
  }
  run(plans, "attn_prologue::kv_rope_insert_slow", stack, 12, key, [&](const ap_plan* plan) {
    DLTensor t[7];
    const int lead[5] = {0, 2, 3, 4, 5};  // kv, k_cache, slots, positions, cos_sin in t[]
    for (int i = 0; i < 5; ++i)
      if (!fill(a[i].toTensor(), &t[lead[i]])) return false;
    return (!norm_weight || fill(*norm_weight, &t[1])) && (!kv_scale || fill(*kv_scale, &t[6])) &&
           ap_one_call_kv(plan, &t[0], norm_weight ? &t[1] : nullptr, &t[2], &t[3], &t[4], &t[5],
                          kv_scale ? &t[6] : nullptr, current_stream(kv)) != 0;
  });
}

}  // namespace

// fastpath.c's tensor reader (ap_unpacker): an exact torch.Tensor or Parameter read in place, no
// reference taken (the caller holds the object for the call). 1: read; 0: not read here (a subclass:
// the module then asks torch's DLPack exchange API, as without this library); -1: a tensor fill
// refuses (a lazy negation or conjugation, which the exchange API would pass on as its stored bits):
// the call takes the Python path, whose validation names it.
extern "C" __attribute__((visibility("default"))) int ap_dltensor_from_pyobject(PyObject* o, DLTensor* out) {
  if (!THPVariable_CheckExact(o)) return 0;
  return fill(THPVariable_Unpack(o), out) ? 1 : -1;
}

TORCH_LIBRARY_IMPL(attn_prologue, CUDA, m) {
  m.impl("qnorm_rope_kv_insert", torch::CppFunction::makeFromBoxedFunction<&qkv_cuda>());
  m.impl("kv_rope_insert", torch::CppFunction::makeFromBoxedFunction<&kv_cuda>());
}

