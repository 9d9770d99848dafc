// Host cost of one kernel launch on this machine: empty kernels, back-to-back launches, wall time.
#include <cuda.h>
#include <cuda_runtime.h>
#include <chrono>
#include <cstdio>
#include <algorithm>
#include <vector>

__global__ void empty1(int* a) {}
__global__ void empty13(int* a, int* b, int* c, int* d, int* e, int* f, int* g, int* h, float x, int y, int z, int w, int v) {}

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
  int dev;
  printf("cudaGetDevice:                            %.3f us\n", per_call_us([&] { cudaGetDevice(&dev); }));
  cudaStreamSynchronize(st);
  printf("launch error: %s\n", cudaGetErrorString(cudaGetLastError()));
  return 0;
}
