/* A TVM-FFI function that does nothing: tools/host_ratio.py calls a native plan whose kernel is this,
 * so the plan's own C (fills, checks, stream, the call) is timed apart from the kernel's launch path. */
#include <tvm/ffi/c_api.h>

int __tvm_ffi_noop(void* self, const TVMFFIAny* args, int32_t num_args, TVMFFIAny* result) {
  (void)self;
  (void)args;
  (void)num_args;
  result->type_index = kTVMFFINone;
  result->v_int64 = 0;
  return 0;
}
