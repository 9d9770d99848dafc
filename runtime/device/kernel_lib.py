"""Device-side building blocks shared by every generated kernel module.

Generated modules import this module, kernel_base (the methods every Kernel shares) and the DSL,
nothing else from the package. Everything here
is arch- and format-independent: what runs on the H200 through these functions is literally what
runs on SM100 and SM120. The arch-specific pieces (UE8M0 and E2M1 conversions) are rendered into
the generated modules that use them from templates/conversions/.

All helpers are plain Python functions traced inside a kernel: they unroll over compile-time
constants and never branch on run-time values (branches live in the kernels).

Lane mapping of one row of D 16-bit values: vector j (8 values, 16 bytes) belongs to lane
`j % LANES_PER_ROW` as its slot `j // LANES_PER_ROW`; a warp holds 32 / LANES_PER_ROW rows.
Every 128-bit access of a warp is therefore contiguous (coalesced).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint8, Uint32, Uint64

VEC = 8  # 16-bit values per 128-bit access
WARP = 32


# ---- addressing -------------------------------------------------------------------------------
def gmem_ptr(base_addr: Int64, byte_offset: Int64, dtype, align: int):
    """A global-memory pointer at base + byte_offset (64-bit arithmetic) with a known alignment."""
    return cute.make_ptr(dtype, base_addr + byte_offset, cute.AddressSpace.gmem, assumed_align=align)


def gmem_vector(base_addr: Int64, byte_offset: Int64, dtype, n: int, align: int):
    """An n-element global tensor view at base + byte_offset."""
    return cute.make_tensor(gmem_ptr(base_addr, byte_offset, dtype, align), cute.make_layout(n))


def base_address(tensor: cute.Tensor) -> Int64:
    return tensor.iterator.toint()


def load_atom(dtype, bits: int, non_coherent: bool, streaming: bool = False):
    """A 128/64/32-bit global load; `non_coherent` takes the read-only path (ld.global.nc),
    `streaming` marks data read once (ld.global.cs; the DSL allows no cache hint on .nc loads)."""
    if streaming:
        return cute.make_copy_atom(
            cute.nvgpu.CopyG2ROp(),
            dtype,
            num_bits_per_copy=bits,
            load_cache_mode=cute.nvgpu.LoadCacheMode.STREAMING,
        )
    if non_coherent:
        return cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), dtype, num_bits_per_copy=bits, invariant=True)
    return cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=bits)


def store_atom(dtype, bits: int, streaming: bool = False):
    if streaming:  # st.global.cs: written once, not read back by this kernel
        return cute.make_copy_atom(
            cute.nvgpu.CopyR2GOp(),
            dtype,
            num_bits_per_copy=bits,
            store_cache_mode=cute.nvgpu.StoreCacheMode.STREAMING,
        )
    return cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=bits)


def load_vector_into(
    frag: cute.Tensor,
    base_addr: Int64,
    byte_offset: Int64,
    dtype,
    non_coherent: bool,
    streaming: bool = False,
):
    """Copy one 128-bit vector from global memory into the register fragment `frag`."""
    n = cute.size(frag)
    src = gmem_vector(base_addr, byte_offset, dtype, n, 16)
    cute.copy(load_atom(dtype, 128, non_coherent, streaming), src, frag)


def store_vector(
    frag: cute.Tensor, base_addr: Int64, byte_offset: Int64, dtype, align: int, streaming: bool = False
):
    """Copy a register fragment to global memory in one access of size(frag) * width bits."""
    n = cute.size(frag)
    dst = gmem_vector(base_addr, byte_offset, dtype, n, align)
    cute.copy(store_atom(dtype, n * dtype.width, streaming), frag, dst)


def register_vector(values, dtype):
    """A register fragment holding a TensorSSA converted to dtype."""
    frag = cute.make_rmem_tensor(VEC, dtype)
    frag.store(values.to(dtype))
    return frag


def bf16_vector(values) -> cute.Tensor:
    """8 float32 -> 8 bf16 by cvt.rn.bf16x2.f32 in PTX: a row loaded as bf16 and stored unchanged is not
    folded back to its loaded bits, so a NaN is stored as the conversion's NaN whatever its payload."""
    frag = cute.make_rmem_tensor(VEC, cutlass.BFloat16)
    words = cute.recast_tensor(frag, Uint32)
    for i in range(VEC // 2):
        words[i] = cute.arch.inline_ptx(
            "cvt.rn.bf16x2.f32 {$w0}, {$r0}, {$r1};",  # the high half first
            write_only_types=[Uint32],
            read_only_args=[values[2 * i + 1], values[2 * i]],
        )
    return frag


def zero_vector(dtype):
    frag = cute.make_rmem_tensor(VEC, dtype)
    frag.fill(0)
    return frag


def zero_f32_vector(n: int):
    frag = cute.make_rmem_tensor(n, Float32)
    frag.fill(0.0)
    return frag


# ---- float min / max ----------------------------------------------------------------------------
# PTX max.f32 / min.f32 (one FMNMX): a NaN operand gives the other one, the rule the reference's
# amax follows. cute.math.max / min lower to a compare-select sequence four times as long.
def fmax(a: Float32, b: Float32) -> Float32:
    return cute.arch.inline_ptx(
        "max.f32 {$w0}, {$r0}, {$r1};", write_only_types=[Float32], read_only_args=[a, b]
    )


def fmin(a: Float32, b: Float32) -> Float32:
    return cute.arch.inline_ptx(
        "min.f32 {$w0}, {$r0}, {$r1};", write_only_types=[Float32], read_only_args=[a, b]
    )


# ---- reductions -------------------------------------------------------------------------------
def butterfly_sum(value: Float32, lanes: int) -> Float32:
    """Sum over groups of `lanes` adjacent lanes (xor 1, 2, 4, ...); every lane gets the total."""
    offset = 1
    while offset < lanes:
        value = value + cute.arch.shuffle_sync_bfly(value, offset)
        offset *= 2
    return value


def butterfly_max(value: Float32, lanes: int) -> Float32:
    """NaN-ignoring max (max.f32) over groups of `lanes` adjacent lanes."""
    offset = 1
    while offset < lanes:
        value = fmax(value, cute.arch.shuffle_sync_bfly(value, offset))
        offset *= 2
    return value


def sum_of_squares(rows, lanes: int, order_lanes: int = 0) -> Float32:
    """sum(x^2) of one row: a fused multiply-add chain over this lane's values in slot order,
    then a butterfly over the row's lanes (the reference's order="kernel" replays this).

    order_lanes > lanes: the same float32 operations as if the row were spread over order_lanes lanes
    (vector j on lane j % order_lanes), for a row held by fewer (vector j on lane j % lanes, slot
    j // lanes): this lane holds virtual lanes m * lanes + sub, m < order_lanes / lanes, each its own
    chain (slots m, m + k, m + 2k, ...); the butterfly's offsets below `lanes` are shuffles, the rest
    sums of this lane's virtual lanes (addition commutes exactly, so the pairs give the same bits)."""
    k = max(order_lanes // lanes, 1)
    accs = [Float32(0.0) for _ in range(k)]
    for s, x in enumerate(rows):
        for i in range(VEC):
            accs[s % k] = cute.math.fma(x[i], x[i], accs[s % k])
    accs = [butterfly_sum(a, lanes) for a in accs]
    step = 1
    while step < k:  # xor offsets lanes, 2 * lanes, ...: virtual lane m pairs with m ^ step
        accs = [accs[m] + accs[m ^ step] for m in range(k)]
        step *= 2
    return accs[0]


def rms_inverse(sum_sq: Float32, head_dim: int, eps: Float32) -> Float32:
    """1/sqrt(sum_sq / D + eps) with IEEE sqrt and IEEE division (no approximations)."""
    mean = sum_sq / Float32(head_dim) + eps
    return Float32(1.0) / cute.math.sqrt(mean)


def abs_max(x) -> Float32:
    """NaN-ignoring max |x_i| of one vector."""
    m = Float32(0.0)
    for i in range(VEC):
        m = fmax(m, cute.math.absf(x[i]))
    return m


# ---- RoPE -------------------------------------------------------------------------------------
def rope_rotate(frag: cute.Tensor, cos: cute.Tensor, sin: cute.Tensor, odd_cos=False):
    """GPT-J rotation of the VEC/2 interleaved pairs in `frag` (float32 registers) in place:
    even' = fma(e, c, -(o*s)), odd' = fma(e, s, o*c), or fma(o, c, e*s) where `odd_cos` is set
    (RopeOrder.ODD_COS, the odd term of Triton's and TensorRT-LLM's writers). A run-time Boolean
    selects the fma's operands (4 selects a pair): fewer registers than two copies of the rotation."""
    for i in range(VEC // 2):
        e = frag[2 * i]
        o = frag[2 * i + 1]
        c = cos[i]
        s = sin[i]
        frag[2 * i] = cute.math.fma(e, c, -(o * s))
        if isinstance(odd_cos, bool):
            frag[2 * i + 1] = cute.math.fma(o, c, e * s) if odd_cos else cute.math.fma(e, s, o * c)
        else:  # the same fma with its two products swapped
            a, b = cutlass.select_(odd_cos, o, e), cutlass.select_(odd_cos, c, s)
            p, q = cutlass.select_(odd_cos, e, o), cutlass.select_(odd_cos, s, c)
            frag[2 * i + 1] = cute.math.fma(a, b, p * q)


def fma_rn_zero(a: Float32, negative: bool, b: Float32) -> Float32:
    """a * (+-0.0) + b with one IEEE rounding (fma.rn.f32): never folded away, so a signed zero,
    a NaN or an Inf in `a` or `b` acts on the result as the rotation's arithmetic does."""
    zero = "0f80000000" if negative else "0f00000000"
    return cute.arch.inline_ptx(
        f"fma.rn.f32 {{$w0}}, {{$r0}}, {zero}, {{$r1}};", write_only_types=[Float32], read_only_args=[a, b]
    )


def rope_identity(frag: cute.Tensor):
    """NopeRotation.IDENTITY on the VEC/2 pairs in `frag`: the rotation with c = 1, s = 0, i.e.
    even' = e - o*0 and odd' = o + e*0 (both FMA orders give these: adding a zero is exact)."""
    for i in range(VEC // 2):
        e = frag[2 * i]
        o = frag[2 * i + 1]
        frag[2 * i] = fma_rn_zero(o, True, e)
        frag[2 * i + 1] = fma_rn_zero(e, False, o)


def load_cos_sin_into(
    cos: cute.Tensor,
    sin: cute.Tensor,
    cs_addr: Int64,
    position: Int64,
    pair: Int32,
    rope_dim: int,
    non_coherent: bool,
):
    """cos and sin of pairs [pair, pair + 4) at `position` (two 128-bit loads of float32; sin's address
    is cos's plus a constant, which the load takes as its immediate offset)."""
    at = cs_addr + position * Int64(rope_dim * 4) + Int64(pair) * 4
    load_vector_into(cos, at, Int64(0), Float32, non_coherent)
    load_vector_into(sin, at, Int64(rope_dim // 2 * 4), Float32, non_coherent)


# ---- division by a launch's constant ----------------------------------------------------------
def _select_int32(condition, a: int, b: int):
    return cutlass.select_(condition, Int32(a), Int32(b))


def division_magic(d, u32=Uint32, u64=Uint64, select=_select_int32):
    """(m, l) with n // d == (mul_hi(m, n) + n) >> l for all 0 <= n < 2^31, 1 <= d < 2^31: l = ceil(log2 d),
    m = floor(2^32 (2^l - d) / d) + 1 < 2^32 (Granlund and Montgomery 1994, Theorem 4.2; Hacker's Delight
    10-9). A launch's host code runs it on a run-time d; the CPU proof runs it on Python ints (u32 = u64
    = int, select a conditional: tests/test_magic_division.py)."""
    shift = 0
    for k in range(31):
        shift = shift + select(d > (1 << k), 1, 0)
    m = (u64(1 << 32) * ((u64(1) << u64(shift)) - u64(d))) // u64(d) + u64(1)
    return u32(m), shift


def magic_quotient(n: Uint32, m: Uint32, shift: Int32) -> Uint32:
    """n // d for 0 <= n < 2^31, (m, shift) = division_magic(d): 3 instructions where a division by a
    run-time divisor takes about 17 (mul_hi(m, n) <= n, so the sum does not wrap)."""
    return (cute.arch.mul_hi(n, m) + n) >> Uint32(shift)


# ---- bit tricks -------------------------------------------------------------------------------
# (one arith.bitcast each: a register array recast costs ~10 ops of tracing for the same SASS)
def f32_bits(x: Float32) -> Uint32:
    return Float32(x).bitcast(Uint32)


def f32_from_bits(b: Uint32) -> Float32:
    return Uint32(b).bitcast(Float32)


def pow2(e: Int32) -> Float32:
    """2^e for e in [-126, 128] (128 gives +Inf), from the exponent bits."""
    return f32_from_bits(Uint32(e + 127) << Uint32(23))


def scale_multiplier(e: Int32) -> Float32:
    """2^-e with e clamped to [-126, 126]: a normal float32 (differs only for Inf blocks)."""
    return pow2(-cutlass.min(cutlass.max(e, Int32(-126)), Int32(126)))


# ---- stores of converted values ---------------------------------------------------------------
def e4m3_vector(values) -> cute.Tensor:
    """8 float32 -> 8 e4m3 bytes (cvt.rn.satfinite.e4m3x2.f32 on every target)."""
    frag = cute.make_rmem_tensor(VEC, cutlass.Float8E4M3FN)
    frag.store(values.to(cutlass.Float8E4M3FN))
    return frag


def e4m3_round(r: Float32):
    """r -> (its e4m3 byte, that byte's value as float32, the value twice as a float16x2 word):
    cvt.rn.satfinite.e4m3x2.f32 (every target), then back through cvt.rn.f16x2.e4m3x2 (exact: every
    e4m3 value is a float16)."""
    pair, value, halves = cute.arch.inline_ptx(
        "{ .reg .b16 e4pair, e4lo, e4hi; .reg .b32 e4h;\n"
        " cvt.rn.satfinite.e4m3x2.f32 e4pair, {$r0}, {$r0};\n"
        " cvt.rn.f16x2.e4m3x2 e4h, e4pair;\n"
        " mov.b32 {e4lo, e4hi}, e4h;\n"
        " cvt.f32.f16 {$w1}, e4lo;\n"
        " mov.b32 {$w2}, e4h;\n"
        " mov.b16 {$w0}, e4pair; }",
        write_only_types=[cutlass.Uint16, Float32, Uint32],
        read_only_args=[r],
    )
    return Uint32(pair) & Uint32(0xFF), value, halves


def e2m1_positive_zeros(word: Uint32) -> Uint32:
    """Clear the sign of every e2m1 code in `word` whose magnitude is 0 (0x8 -> 0x0): Fp4Zero.POSITIVE."""
    mag = word & Uint32(0x77777777)
    nonzero = (mag | (mag >> Uint32(1)) | (mag >> Uint32(2))) & Uint32(0x11111111)
    return mag | (word & (nonzero << Uint32(3)))


def add_zero(frag: cute.Tensor):
    """frag[i] + 0.0 in place (add.rn.f32, never folded away): -0.0 becomes +0.0, nothing else changes."""
    for i in range(cute.size(frag)):
        frag[i] = cute.arch.inline_ptx(
            "add.rn.f32 {$w0}, {$r0}, 0f00000000;", write_only_types=[Float32], read_only_args=[frag[i]]
        )


def e4m3_times_zero(frag: cute.Tensor):
    """8 e4m3 bytes of x * 2^-126 in a block holding Inf rewritten in place as those of x * 0: Inf and
    NaN (here 0x7E / 0x7F: no finite x * 2^-126 reaches 448) become NaN 0x7F, every other byte +-0 with
    its sign (InfScale.OVERFLOW / WRAPPED)."""
    words = cute.recast_tensor(frag, Uint32)
    for i in range(VEC // 4):
        w = words[i]
        big = ((w & Uint32(0x7F7F7F7F)) + Uint32(0x02020202)) & Uint32(0x80808080)  # low 7 bits >= 0x7E
        words[i] = (big >> Uint32(7)) * Uint32(0x7F) | (w & Uint32(0x80808080) & ~big)


def e4m3_nan_bytes(frag: cute.Tensor, negative):
    """Replace the NaN bytes (0x7F, the only NaN cvt.rn.satfinite.e4m3x2 emits) of 8 e4m3 values in
    place by 0x7E (+448), or 0xFE (-448) where `negative`: E4m3Nan.POS_MAX / NEG_MAX. A byte whose low
    seven bits are all ones carries into its bit 7 when 1 is added to them: no finite e4m3 does."""
    words = cute.recast_tensor(frag, Uint32)
    for i in range(VEC // 4):
        w = words[i]
        hit = ((w & Uint32(0x7F7F7F7F)) + Uint32(0x01010101)) & Uint32(0x80808080)
        words[i] = (w ^ (hit >> Uint32(7))) | cutlass.select_(negative, hit, Uint32(0))


def store_byte(addr: Int64, byte_offset: Int64, value):
    cute.make_tensor(gmem_ptr(addr, byte_offset, Uint8, 1), cute.make_layout(1))[0] = Uint8(value)


def store_u32(addr: Int64, byte_offset: Int64, value: Uint32):
    cute.make_tensor(gmem_ptr(addr, byte_offset, Uint32, 4), cute.make_layout(1))[0] = value


def store_f32(addr: Int64, byte_offset: Int64, value: Float32):
    cute.make_tensor(gmem_ptr(addr, byte_offset, Float32, 4), cute.make_layout(1))[0] = value


# ---- leaner exact quantization arithmetic (LaunchConfig.lean_quant) ------------------------------------
# Each gives the bits of the rule it replaces for every input the formats can produce; the proofs run on
# the CPU (tests/test_lean_quant_cpu.py, exhaustive where the space allows) against the reference.
def mul_rn(a: Float32, b: Float32) -> Float32:
    """a * b rounded once (mul.rn: never contracted into a neighbouring add)."""
    return cute.arch.inline_ptx(
        "mul.rn.f32 {$w0}, {$r0}, {$r1};", write_only_types=[Float32], read_only_args=[a, b]
    )


def fma_rn(a: Float32, b: Float32, c: Float32) -> Float32:
    return cute.arch.inline_ptx(
        "fma.rn.f32 {$w0}, {$r0}, {$r1}, {$r2};", write_only_types=[Float32], read_only_args=[a, b, c]
    )


def reciprocal_of_e4m3(s: Float32) -> Float32:
    """RN(1 / s) for a positive finite e4m3 value s (an NVFP4 group scale): rcp.approx (within 1 ulp,
    PTX ISA) and one Newton step, exact for every such s and every start within 4 ulps."""
    r = cute.arch.inline_ptx("rcp.approx.f32 {$w0}, {$r0};", write_only_types=[Float32], read_only_args=[s])
    return fma_rn(r, fma_rn(-s, r, Float32(1.0)), r)


def quotient_by_reciprocal(x: Float32, s: Float32, r: Float32) -> Float32:
    """RN(x / s) from r = RN(1 / s), for s with at most 4 significant bits (an e4m3 value; 6; 448) and
    finite x with x / s finite: the product's residual is exact in an fma, one correction rounds right
    (residual taken as q*s - x so that x = -0 keeps its sign)."""
    q = mul_rn(x, r)
    return fma_rn(-fma_rn(q, s, -x), r, q)


def quotient_by_constant(amax: Float32, c: float) -> Float32:
    """RN(amax / c) for amax >= 0 (+Inf included) and c in {6, 448}: quotient_by_reciprocal, and +Inf
    for +Inf (the correction of an infinite product is NaN; min.f32 returns its other operand)."""
    q0 = mul_rn(amax, Float32(1.0 / c))
    return fmin(fma_rn(-fma_rn(q0, Float32(c), -amax), Float32(1.0 / c), q0), q0 * Float32(2.0))


def e2m1_pack8_by_magic(y, saturate: bool = True) -> Uint32:
    """8 float32 -> one word of 8 e2m1 codes (element 2j in the low nibble of byte j), the rule of
    numerics.e2m1_codes: round to nearest even, saturate to +-6, the sign of y, NaN -> +6 (0x7).
    c = max(min(y, 6), -6) (NaN -> +6); with 2^k = max(2^floor(log2|c|), 1), |c| + 2^(22+k) rounds |c|
    at the E2M1 spacing 2^(k-1) of its binade by the FPU's own nearest-even, whose low bits count the
    steps: code = steps + 2k. Constants of the 8 codes are summed once (no nibble carries: 0 <= code <= 7).
    saturate=False: y is known to be in [-6, 6] and not NaN (quotients_by_e4m3), so c = y."""
    codes = Uint32(0)
    signs = Uint32(0)
    bias = 0
    for i in range(8):
        c = fmax(fmin(y[i], Float32(6.0)), Float32(-6.0)) if saturate else y[i]
        b = f32_bits(c)
        p = cutlass.max(b & Uint32(0x7F800000), Uint32(0x3F800000))  # bits of 2^k
        s = fma_rn(f32_from_bits(p), Float32(4194304.0), cute.math.absf(c))  # |c| + 2^(22+k), one rounding
        codes = codes + ((f32_bits(s) + (p >> Uint32(22)) - p) << Uint32(4 * i))  # code + 0x0B000000 + 254
        signs = signs | ((b >> Uint32(28 - 4 * i)) & Uint32(8 << (4 * i)))
        bias += (0x0B000000 + 254) << (4 * i)
    return (codes - Uint32(bias % 2**32)) | signs


def amax_quotient(amax: Float32, c: float, lean: bool) -> Float32:
    """RN(amax / c), the scale quotient of the formats that divide: an IEEE division, or with `lean`
    quotient_by_constant (the same bits)."""
    return quotient_by_constant(amax, c) if lean else amax / Float32(c)


def e4m3_reciprocal(s: Float32, lean: bool) -> Float32:
    """RN(1 / s) of a positive e4m3 scale: an IEEE division, or with `lean` reciprocal_of_e4m3."""
    return reciprocal_of_e4m3(s) if lean else Float32(1.0) / s


def quotients_by_e4m3(x, s: Float32) -> list:
    """RN(clamp(x_i, -6s, 6s) / s) for the VEC values of x and a positive e4m3 scale s: the E2M1 codes
    of x / s (a value beyond +-6s codes +-6 either way, NaN +6), each quotient in [-6, 6]."""
    r = reciprocal_of_e4m3(s)
    limit = s * Float32(6.0)  # exact: 6 times an e4m3 value
    return [quotient_by_reciprocal(fmax(fmin(x[i], limit), -limit), s, r) for i in range(VEC)]
