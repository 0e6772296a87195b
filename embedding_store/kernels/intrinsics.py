"""LLVM intrinsics the store's numba kernels call: a cache prefetch, a raw address as a
pointer, and float32 to float16 (and back) in one instruction where the CPU has it.

Each is a numba ``@intrinsic``: numba's typed API has no prefetch, pointer or half
type, and LLVM lowers these to the one instruction the kernels need.
"""

from __future__ import annotations

import platform
from typing import Any

import llvmlite.binding as llvm_binding  # type: ignore[import-untyped]
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

# How many ids ahead a kernel prefetches the bucket (or row) it will read: enough
# cache misses in flight to cover memory latency, few enough to stay in L1.
AHEAD = 32


def _prefetch_typer(typingctx: Any, arr: Any, index: Any) -> Any:
    """Hint the CPU to fetch the cache line of ``arr[index]`` (or ``arr[index, 0]``).

    A probe or gather reads lines at random; numpy's gather keeps many misses in
    flight by itself, but a probe loop with a data-dependent branch does not, so
    the kernels ask for line ``i + AHEAD`` while they work on line ``i``.
    """
    sig = types.void(arr, index)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        cg: Any = cgutils  # numba's code generation helpers carry no annotations
        aryty, idxty = signature.args
        ary = context.make_array(aryty)(context, builder, args[0])
        idx = context.cast(builder, args[1], idxty, types.intp)
        zero = context.get_constant(types.intp, 0)
        ptr = cg.get_item_pointer2(
            context,
            builder,
            ary.data,
            cg.unpack_tuple(builder, ary.shape),
            cg.unpack_tuple(builder, ary.strides),
            aryty.layout,
            [idx] + [zero] * (aryty.ndim - 1),
            wraparound=False,
        )
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fn = cg.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]), "llvm.prefetch.p0"
        )
        # read, keep in all cache levels, data cache
        builder.call(fn, [builder.bitcast(ptr, i8p), i32(0), i32(3), i32(1)])
        return context.get_dummy_value()

    return sig, codegen


prefetch: Any = intrinsic(_prefetch_typer)


def _address_typer(typingctx: Any, address: Any) -> Any:
    """The memory at ``address`` (an int64 from an array's ``ctypes.data``) as a pointer,
    for ``numba.carray``."""
    sig = types.voidptr(address)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.inttoptr(args[0], ir.IntType(8).as_pointer())

    return sig, codegen


address: Any = intrinsic(_address_typer)


def _f16_fptrunc_typer(typingctx: Any, x: Any) -> Any:
    """Float32 to float16 bits with LLVM's ``fptrunc`` (one F16C instruction on x86).

    Rounds to nearest even, as numpy does; one instruction instead of ``f16_bits``'s
    integer arithmetic, so a float16 lookup keeps up with a float32 one
    (``benchmarks/store.py``: its rows are float16).
    """
    sig = types.uint16(types.float32)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return sig, codegen


f16_fptrunc: Any = intrinsic(_f16_fptrunc_typer)


def _f16_round_trip_typer(typingctx: Any, x: Any) -> Any:
    """Float32 rounded to float16 and widened back with LLVM's ``fptrunc`` and ``fpext``
    (two F16C instructions on x86, vectorised over a row)."""
    sig = types.float32(types.float32)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.fpext(builder.fptrunc(args[0], ir.HalfType()), ir.FloatType())

    return sig, codegen


f16_round_trip: Any = intrinsic(_f16_round_trip_typer)


def native_f16() -> bool:
    """Whether LLVM turns ``fptrunc`` to half into an instruction on this CPU.

    An x86 CPU without F16C (before 2012) would need a runtime library call that
    numba's JIT may not resolve; other architectures (aarch64) have the instruction.
    """
    if platform.machine().lower() not in {"x86_64", "amd64", "i386", "i686"}:
        return platform.machine().lower() in {"aarch64", "arm64"}
    return "+f16c" in llvm_binding.get_host_cpu_features().flatten().split(",")
