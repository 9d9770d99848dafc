// Host cost of one kernel launch on this machine: empty kernels, back-to-back launches, wall time.
#include <cuda.h>
#include <cuda_runtime.h>
#include <chrono>
#include <cstdio>
#include <algorithm>
#include <vector>

__global__ void empty1(int* a) {}
__global__ void empty13(int* a, int* b, int* c, int* d, int* e, int* f, int* g, int* h, float x, int y, int z, int w, int v) {}
// The parameter list of a generated qkv kernel (its PTX .entry): tensors as {pointer, dynamic shape,
// dynamic stride} structs, then the scalars and the launch's schedule.
struct T3 { void* p; int s0, s1; long long st; };
struct T2 { void* p; int s0; long long st; };
struct T1 { void* p; int s0; };
__global__ void dsl_like(T3 q_in, T2 kv, T3 q_out, T3 k_cache, T1 slots, T1 pos, T1 cs, void* errors, float eps,
                         int a, int b, int c, int d, int e, int f, int g, int h, int i, int j, int k, int l, int m) {}

template <class F> double per_call_us(F f, int n = 20000) {
  for (int i = 0; i < 500; i++) f();
  cudaDeviceSynchronize();
  std::vector<double> s;
  for (int k = 0; k < 7; k++) {
    auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < n; i++) f();
    auto t1 = std::chrono::steady_clock::now();
    s.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count() / n);
    cudaDeviceSynchronize();
  }
  std::sort(s.begin(), s.end());
  return s[s.size() / 2];
}

int main() {
  int* p; cudaMalloc(&p, 1024);
  cudaStream_t st; cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking);
  float x = 1; int y = 2;
  printf("cudaLaunchKernel <<<>>> 1 arg:            %.2f us\n", per_call_us([&] { empty1<<<1, 32, 0, st>>>(p); }));
  printf("cudaLaunchKernel <<<>>> 13 args:          %.2f us\n", per_call_us([&] { empty13<<<1, 32, 0, st>>>(p, p, p, p, p, p, p, p, x, y, y, y, y); }));
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(1); cfg.blockDim = dim3(128); cfg.stream = st;
  printf("cudaLaunchKernelEx 13 args, no attrs:     %.2f us\n", per_call_us([&] { cudaLaunchKernelEx(&cfg, empty13, p, p, p, p, p, p, p, p, x, y, y, y, y); }));
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr; cfg.numAttrs = 1;
  printf("cudaLaunchKernelEx 13 args, PDL attr:     %.2f us\n", per_call_us([&] { cudaLaunchKernelEx(&cfg, empty13, p, p, p, p, p, p, p, p, x, y, y, y, y); }));
  cudaFunction_t fn; cudaGetFuncBySymbol(&fn, (const void*)empty13);
  void* args[13] = {&p, &p, &p, &p, &p, &p, &p, &p, &x, &y, &y, &y, &y};
  typedef CUresult (*LaunchFn)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream, void**, void**);
  LaunchFn launch = nullptr; cudaDriverEntryPointQueryResult q;
  cudaGetDriverEntryPoint("cuLaunchKernel", (void**)&launch, cudaEnableDefault, &q);
  if (launch) printf("cuLaunchKernel 13 args:                   %.2f us\n", per_call_us([&] { launch((CUfunction)fn, 1, 1, 1, 128, 1, 1, 0, (CUstream)st, args, nullptr); }));
  T3 t3 = {p, 1, 64, 512}; T2 t2 = {p, 1, 512}; T1 t1 = {p, 1};
  cudaLaunchAttribute two[2];
  two[0] = attr[0];
  two[1].id = cudaLaunchAttributeCooperative;
  two[1].val.cooperative = 0;
  cudaLaunchConfig_t dsl = {};
  dsl.gridDim = dim3(16); dsl.blockDim = dim3(128); dsl.stream = st; dsl.attrs = two; dsl.numAttrs = 2;
  auto launch_dsl = [&](const void* f) {
    void* a[22] = {&t3, &t2, &t3, &t3, &t1, &t1, &t1, &p, &x, &y, &y, &y, &y, &y, &y, &y, &y, &y, &y, &y, &y, &y};
    return cudaLaunchKernelExC(&dsl, f, a);
  };
  printf("cudaLaunchKernelExC, the DSL's 22 params and 2 attrs, function:  %.2f us\n", per_call_us([&] { launch_dsl((const void*)dsl_like); }));
  cudaKernel_t kernel;
  if (cudaGetKernel(&kernel, dsl_like) == cudaSuccess)
    printf("cudaLaunchKernelExC, the DSL's 22 params and 2 attrs, cudaKernel_t: %.2f us\n", per_call_us([&] { launch_dsl((const void*)kernel); }));
  int dev;
  printf("cudaGetDevice:                            %.3f us\n", per_call_us([&] { cudaGetDevice(&dev); }));
  cudaStreamSynchronize(st);
  printf("launch error: %s\n", cudaGetErrorString(cudaGetLastError()));
  return 0;
}
