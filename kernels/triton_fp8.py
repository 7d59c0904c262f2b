"""float8 e4m3fn encode / decode for Triton kernels, in integer bit operations on the raw bytes.

Triton's own fp8e4nv type converts only on SM89+ GPUs (Ampere has no such instruction) and its
interpreter rounds some values wrongly (0.4946 became 0.25 here), so the fp8 KV cache
(``kv_quant``) reaches the Triton kernels as ``uint8`` and these helpers convert, equal to
``torch``'s conversion on every finite input (round to nearest even, saturated at ±448 by the
caller's clamp; the NaN bytes are never written).

e4m3fn: sign bit, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is subnormal
(``m * 2**-9``); the largest finite value is 448 (``0x7E``).
"""

from __future__ import annotations

from fuseserve.kernels.triton_runtime import tl, triton


@triton.jit
def fp8_decode(b):
    """``uint8`` e4m3fn bytes → float32 values."""
    x = b.to(tl.int32)
    sign = (x & 0x80) << 24
    e = (x >> 3) & 0xF
    m = x & 7
    normal = (sign | ((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    sub = m.to(tl.float32) * 0.001953125  # m * 2**-9
    sub = tl.where(sign != 0, -sub, sub)
    return tl.where(e == 0, sub, normal)


@triton.jit
def fp8_encode(x):
    """float32 values in ``[-448, 448]`` → ``uint8`` e4m3fn bytes, rounded to nearest even."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = tl.abs(x)
    abits = a.to(tl.int32, bitcast=True)
    # normal: round the 23-bit mantissa to 3 bits (nearest even), a carry moves the exponent up
    r = abits + 0x7FFFF + ((abits >> 20) & 1)
    normal = (((r >> 23) - 120) << 3) | ((r >> 20) & 7)
    # subnormal (|x| < 2**-6): the count of 2**-9 steps, rounded to nearest even by the float adder
    # (8 steps is the smallest normal, byte 0x08, so the carry needs no special case)
    steps = (a * 512.0 + 8388608.0) - 8388608.0
    sub = steps.to(tl.int32)
    byte = tl.where(a < 0.015625, sub, normal)
    return (byte | sign).to(tl.uint8)
