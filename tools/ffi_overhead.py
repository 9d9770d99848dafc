"""Measure the host cost of calling a CuTe-DSL kernel through TVM-FFI, by argument kind.

Compiles tiny kernels (1 tensor, 8 tensors, 8 pointers + 8 ints) and times back-to-back calls.
Run on a GPU machine: python tools/ffi_overhead.py
"""

import cuda.bindings.driver as cuda
import cutlass.cute as cute
import torch
from attn_prologue.lab.timing import host_time_us
from cutlass import Int32, Int64
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream


@cute.kernel
def _touch(a: cute.Tensor):
    tidx, _, _ = cute.arch.thread_idx()
    if tidx == 0:
        a[0] = a[0] + 1


@cute.jit
def one(a: cute.Tensor, stream: cuda.CUstream):
    _touch(a).launch(grid=[1, 1, 1], block=[32, 1, 1], stream=stream)


@cute.jit
def eight(
    a: cute.Tensor,
    b: cute.Tensor,
    c: cute.Tensor,
    d: cute.Tensor,
    e: cute.Tensor,
    f: cute.Tensor,
    g: cute.Tensor,
    h: cute.Tensor,
    x: Int32,
    y: Int32,
    z: Int32,
    w: Int32,
    stream: cuda.CUstream,
):
    _touch(a).launch(grid=[1, 1, 1], block=[32, 1, 1], stream=stream)


@cute.kernel
def _touch_ptr(p: cute.Pointer):
    tidx, _, _ = cute.arch.thread_idx()
    if tidx == 0:
        t = cute.make_tensor(p, cute.make_layout(1))
        t[0] = t[0] + 1


@cute.jit
def eight_ptr(
    a: cute.Tensor,
    b: cute.Pointer,
    c: cute.Pointer,
    d: cute.Pointer,
    e: cute.Pointer,
    f: cute.Pointer,
    g: cute.Pointer,
    h: cute.Pointer,
    x: Int64,
    y: Int64,
    z: Int64,
    w: Int64,
    stream: cuda.CUstream,
):
    _touch_ptr(b).launch(grid=[1, 1, 1], block=[32, 1, 1], stream=stream)


def timed(call, n=3000):
    return host_time_us(call, n, warmup=200)


def main():
    print(
        "torch",
        torch.__version__,
        "native __dlpack_c_exchange_api__:",
        "__dlpack_c_exchange_api__" in torch.Tensor.__dict__,
    )
    import tvm_ffi  # noqa: F401

    print("after tvm_ffi import:", hasattr(torch.Tensor, "__dlpack_c_exchange_api__"))
    arch = "sm_{}{}a".format(*torch.cuda.get_device_capability())
    opt = f"--gpu-arch {arch} --enable-tvm-ffi"
    fake = lambda: make_fake_compact_tensor(Int32, (cute.sym_int32(),), assumed_align=16)  # noqa: E731
    st = make_fake_stream(use_tvm_ffi_env_stream=True)
    f1 = cute.compile(one, fake(), st, options=opt)
    f8 = cute.compile(
        eight, *[fake() for _ in range(8)], Int32(0), Int32(0), Int32(0), Int32(0), st, options=opt
    )
    ptr = lambda: cute.runtime.make_ptr(Int32, 0, cute.AddressSpace.gmem, assumed_align=16)  # noqa: E731
    fp = cute.compile(
        eight_ptr, fake(), *[ptr() for _ in range(7)], Int64(0), Int64(0), Int64(0), Int64(0), st, options=opt
    )
    ts = [torch.zeros(64, dtype=torch.int32, device="cuda") for _ in range(8)]
    print(f"1 tensor:               {timed(lambda: f1(ts[0])):.2f} us")
    print(f"8 tensors + 4 ints:     {timed(lambda: f8(*ts, 1, 2, 3, 4)):.2f} us")
    ptrs = [t.data_ptr() for t in ts[1:]]
    print(f"1 tensor + 7 pointers + 4 ints: {timed(lambda: fp(ts[0], *ptrs, 1, 2, 3, 4)):.2f} us")
    print(
        f"  + 7 data_ptr() calls:         {timed(lambda: fp(ts[0], *[t.data_ptr() for t in ts[1:]], 1, 2, 3, 4)):.2f} us"
    )
    x = torch.zeros(1, device="cuda")
    print(f"torch x.add_(1):        {timed(lambda: x.add_(1)):.2f} us")
    print(f"torch.cuda.current_stream(): {timed(lambda: torch.cuda.current_stream()):.2f} us")


if __name__ == "__main__":
    main()
