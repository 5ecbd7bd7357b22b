"""Compile every jaxsb kernel for TPU and GPU targets with the real compilers, next to JAX's own
attention kernels at the same shape, and print the compile times side by side.

    .venv-targets/bin/python scripts/compile_kernels.py \
        --targets tpu-v5p:2x2x2,tpu-v5e:2x2,tpu-v6e:2x2,gpu-h100:8,gpu-a100:8 \
        --lengths 1024,4096 --head-dims 64,128 --dtypes bfloat16,float32

For each target and shape case it compiles flash, block-sparse and the ring's chunk op, forward
and forward + backward (kernels_pallas/aot.py), with 8 query heads over 2 kv heads (GQA). The
reference is JAX's own kernel for the target: splash attention on TPU (the same GQA shape) and
`pallas.ops.gpu.attention.mha` on GPU (8 kv heads: it has no GQA), causal with segment ids.
Times are wall seconds of lowering + compiling on this host, one compile each, after one warm-up
compile per target (the compiler's own set-up); the ratio column is jaxsb / reference from the
same run. A program the compiler refuses is printed as FAILED
with the compiler's message and makes the exit status 1. Needs .venv-targets
(`bash scripts/setup.sh --targets`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _reference(platform: str, case, device, direction: str):
    """(fn, args) of JAX's own attention kernel at `case` for `platform`."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    from kernels_pallas.aot import _with_vjp

    sh = SingleDeviceSharding(device)
    dt = jnp.dtype(case.dtype)
    seg = jax.ShapeDtypeStruct((case.B, case.T), jnp.int32, sharding=sh)
    if platform == "gpu":
        from jax.experimental.pallas.ops.gpu import attention as gpu_attention

        q = jax.ShapeDtypeStruct((case.B, case.T, case.H, case.D), dt, sharding=sh)
        fn = lambda q, k, v, s: gpu_attention.mha(q, k, v, s, sm_scale=case.D ** -0.5, causal=True)  # noqa: E731
        args = (q, q, q, seg)
    else:
        from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
        from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

        b = min(512, case.T)
        sizes = splash.BlockSizes(block_q=b, block_kv=b, block_kv_compute=b, block_q_dkv=b, block_kv_dkv=b,
                                  block_kv_dkv_compute=b, block_q_dq=b, block_kv_dq=b)
        mask = masks.MultiHeadMask([masks.CausalMask((case.T, case.T))] * case.H)
        kernel = splash.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1)  # on the host

        def fn(q, k, v, s):
            one = lambda q, k, v, s: kernel(q, k, v, segment_ids=splash.SegmentIds(q=s, kv=s))  # noqa: E731
            return jax.vmap(one)(q, k, v, s)

        q = jax.ShapeDtypeStruct((case.B, case.H, case.T, case.D), dt, sharding=sh)
        kv = jax.ShapeDtypeStruct((case.B, case.K, case.T, case.D), dt, sharding=sh)
        args = (q, kv, kv, seg)
    return (fn if direction == "fwd" else _with_vjp(fn, 3)), args


def _timed(fn, args, platform: str) -> tuple[float | None, str | None]:
    from kernels_pallas.aot import compile_program

    try:
        return compile_program(fn, args, platform).compile_s, None
    except Exception as e:  # reported, the sweep goes on
        lines = [ln for ln in str(e).splitlines() if ln.strip()]
        return None, f"{type(e).__name__}: {lines[0][:200] if lines else ''}"


def _warm_up(platform: str, device) -> None:
    """The first compile of a process pays the compiler's set-up (~1 s); not any kernel's."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    from kernels_pallas.aot import compile_program

    x = jax.ShapeDtypeStruct((128, 128), jnp.float32, sharding=SingleDeviceSharding(device))
    compile_program(lambda a: a @ a, (x,), platform)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--targets", default="tpu-v5p:2x2x2,gpu-h100:8")
    p.add_argument("--lengths", default="1024,4096")
    p.add_argument("--head-dims", default="64,128")
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--kernels", default="flash,block_sparse,ring_chunk")
    p.add_argument("--directions", default="fwd,fwd+bwd")
    p.add_argument("--no-reference", action="store_true", help="skip JAX's own kernels")
    p.add_argument("--json", default=None, metavar="FILE", help="write every row as JSON")
    args = p.parse_args(argv)

    from jaxsb.targets import parse_target, target_devices
    from kernels_pallas.aot import Case, kernel_programs

    rows, failed = [], 0
    for name in args.targets.split(","):
        target = parse_target(name)
        device = target_devices(target)[0]
        _warm_up(target.platform, device)
        print(f"\n## {target.name} ({device.device_kind})\n")
        print("| kernel | direction | shape | jaxsb s | reference s | ratio |")
        print("|---|---|---|---|---|---|")
        for T in map(int, args.lengths.split(",")):
            for D in map(int, args.head_dims.split(",")):
                for dtype in args.dtypes.split(","):
                    case = Case(T=T, D=D, H=8, K=2, dtype=dtype)
                    refs = {}
                    for direction in args.directions.split(","):
                        if not args.no_reference:
                            ref_case = case if target.platform == "tpu" else Case(T=T, D=D, H=8, K=8, dtype=dtype)
                            refs[direction] = _timed(*_reference(target.platform, ref_case, device, direction),
                                                     target.platform)
                    for prog in kernel_programs(case, device, kernels=tuple(args.kernels.split(",")),
                                                directions=tuple(args.directions.split(","))):
                        seconds, error = _timed(prog.fn, prog.args, target.platform)
                        ref_s, ref_error = refs.get(prog.direction, (None, None))
                        failed += error is not None
                        ratio = f"{seconds / ref_s:.2f}" if seconds and ref_s else "-"
                        shown = f"{seconds:.1f}" if seconds is not None else f"FAILED {error}"
                        ref_shown = "-" if ref_s is None and ref_error is None else (
                            f"{ref_s:.1f}" if ref_s is not None else f"FAILED {ref_error}")
                        print(f"| {prog.kernel} | {prog.direction} | {case.label} | {shown} | {ref_shown} | {ratio} |",
                              flush=True)
                        rows.append({"target": target.name, "kernel": prog.kernel, "direction": prog.direction,
                                     "case": case.label, "seconds": seconds, "error": error,
                                     "reference_seconds": ref_s, "reference_error": ref_error})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    ratios = [r["seconds"] / r["reference_seconds"] for r in rows if r["seconds"] and r["reference_seconds"]]
    if ratios:
        print(f"\njaxsb / reference compile time: median {sorted(ratios)[len(ratios) // 2]:.2f}, worst "
              f"{max(ratios):.2f}; within 2x: {sum(x <= 2 for x in ratios)} of {len(ratios)}")
    print(f"\n{len(rows)} programs, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
