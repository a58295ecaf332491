"""The fused RoPE kernel (levers/rope.py launches it): imported only where Triton is installed."""

import triton
import triton.language as tl


@triton.jit
def _rnd(x, dt: tl.constexpr):
    """fp32 -> dt (round to nearest even) -> fp32: the rounding of an eager op's result. bf16 by the bits (the
    upper half of the fp32, rounded to nearest even), so it is exact wherever the kernel runs (Triton's CPU
    interpreter casts otherwise)."""
    if dt == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (((bits >> 16) & 1) + 0x7FFF)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(dt).to(tl.float32)


@triton.jit
def rope_kernel(x_ptr, o_ptr, cos_ptr, sin_ptr, S, H, x_sb, x_sh, x_ss, o_sb, o_sh, o_ss, c_sb, c_ss,
                HALF: tl.constexpr, BLOCK_H: tl.constexpr, BACKWARD: tl.constexpr):
    # one token (b, s) per program, all its heads: x [b, h, s, d] (unit stride over d), cos/sin [b, s, d]
    # offsets in int64: at 1M tokens x 32 heads x 128 a tensor holds 2^32 elements, past int32 (s * x_ss overflowed)
    t = tl.program_id(0).to(tl.int64)
    b, s = t // S, t % S
    j = tl.arange(0, HALF)
    h = tl.arange(0, BLOCK_H).to(tl.int64)
    c = cos_ptr + b * c_sb + s * c_ss
    cos1, cos2 = tl.load(c + j).to(tl.float32), tl.load(c + HALF + j).to(tl.float32)
    sn = sin_ptr + b * c_sb + s * c_ss
    sin1, sin2 = tl.load(sn + j).to(tl.float32), tl.load(sn + HALF + j).to(tl.float32)
    mask = (h < H)[:, None]
    xp = x_ptr + b * x_sb + s * x_ss + h[:, None] * x_sh + j[None, :]  # [BLOCK_H, HALF]
    x1 = tl.load(xp, mask=mask, other=0.0)
    x2 = tl.load(xp + HALF, mask=mask, other=0.0)
    dt = x1.dtype
    x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
    # each product rounded (to nearest even) to the dtype, then their sum: where PyTorch's eager ops round
    if BACKWARD:  # d/dx of x * cos + rotate_half(x) * sin: g * cos + rotate_half^T(g * sin)
        y1 = _rnd(x1 * cos1[None, :], dt) + _rnd(x2 * sin2[None, :], dt)
        y2 = _rnd(x2 * cos2[None, :], dt) - _rnd(x1 * sin1[None, :], dt)
    else:
        y1 = _rnd(x1 * cos1[None, :], dt) + _rnd(-x2 * sin1[None, :], dt)
        y2 = _rnd(x2 * cos2[None, :], dt) + _rnd(x1 * sin2[None, :], dt)
    op = o_ptr + b * o_sb + s * o_ss + h[:, None] * o_sh + j[None, :]
    tl.store(op, _rnd(y1, dt).to(dt), mask=mask)  # the sum rounded (then exact in dt)
    tl.store(op + HALF, _rnd(y2, dt).to(dt), mask=mask)
