"""Compile every jaxsb kernel for TPU and GPU targets with the real compilers, next to JAX's own
attention kernels at the same shape, and print the compile times side by side.

    .venv-targets/bin/python scripts/compile_kernels.py \
        --targets tpu-v5p:2x2x2,tpu-v5e:2x2,tpu-v6e:2x2,gpu-h100:8,gpu-a100:8 \
        --lengths 1024,4096 --head-dims 64,128 --dtypes bfloat16,float32 --repeats 3

For each target and shape case it compiles flash, block-sparse and the ring's chunk op, forward
and forward + backward (kernels_pallas/aot.py), with 8 query heads over 2 kv heads (GQA). The
reference is JAX's own kernel for the target: splash attention on TPU (the same GQA shape) and
`pallas.ops.gpu.attention.mha` on GPU (8 kv heads: it has no GQA), causal with segment ids. Where
mha's default 128 x 128 forward tile does not fit the GPU's shared memory (float32 at D = 128),
it is compiled at the largest smaller square tile that fits, and the cell says which.
Times are wall seconds of lowering + compiling on this host, the median of --repeats compiles
(each of a new function: jit caches on the function), after one warm-up compile per target (the
compiler's own set-up), with Python's garbage collector off while timing (kernels_pallas/aot.py);
a single compile varies by 15-30% on a shared host. Per shape case the compiles go in rounds,
each compiling the references and every jaxsb program once in turn, so a program and its
reference are compiled seconds apart and the host's speed drifting reaches both. The ratio
column is jaxsb / reference from the same rounds. q, k, v and the output enter and leave each
program as a layer holds them (--entry model, the default; --entry bthd: as [B, T, N, D] parameters; see
kernels_pallas/aot.py), for JAX's kernels too. A program the compiler refuses is printed as FAILED
with the compiler's message and makes the exit status 1. Needs .venv-targets
(`bash scripts/setup.sh --targets`).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")


GPU_REFERENCE_TILES = (128, 64, 32)  # mha's default forward tile first, then smaller ones


def _reference(platform: str, case, device, direction: str, tile: int = GPU_REFERENCE_TILES[0],
               entry: str = "model"):
    """(fn, args, free layouts) of JAX's own attention kernel at `case` for `platform` (on GPU,
    mha with a `tile` x `tile` forward tile and its default backward tiles), its q, k, v and
    output as `entry` says for jaxsb's (kernels_pallas/aot.py; splash on TPU takes its own
    [B, N, T, D] either way)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    from kernels_pallas.aot import ENTRY_FREE_LAYOUTS, _with_vjp, at_entry, entry_heads

    free_layouts = ENTRY_FREE_LAYOUTS[entry]
    sh = SingleDeviceSharding(device)
    dt = jnp.dtype(case.dtype)
    seg = jax.ShapeDtypeStruct((case.B, case.T), jnp.int32, sharding=sh)
    if platform == "gpu":
        from jax.experimental.pallas.ops.gpu import attention as gpu_attention

        q = entry_heads(case, case.H, dt, sh, entry)  # mha has no GQA: the case has K = H
        sizes = dataclasses.replace(gpu_attention.BlockSizes.get_default(), block_q=tile, block_k=tile)
        fn = at_entry(lambda q, k, v, s: gpu_attention.mha(q, k, v, s, sm_scale=case.D ** -0.5, causal=True,
                                                           block_sizes=sizes), case, entry)
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
    return (fn if direction == "fwd" else _with_vjp(fn, 3)), args, free_layouts


def _timed(fn, args, platform: str, free_layouts=()) -> tuple[float | None, str | None]:
    from kernels_pallas.aot import compile_program

    try:
        return compile_program(fn, args, platform, free_layouts).compile_s, None
    except Exception as e:  # reported, the sweep goes on
        lines = [ln for ln in str(e).splitlines() if ln.strip()]
        return None, f"{type(e).__name__}: {lines[0][:200] if lines else ''}"


def _rounds(makers: dict, platform: str, repeats: int) -> dict:
    """{key: (median seconds, None) or (None, error)} of the programs `makers` ({key: make() ->
    (fn, args, free layouts)}) over `repeats` rounds, each compiling every program once, in
    turn, as a new function: a program and its reference are compiled seconds apart in every
    round, so the host's speed drifting reaches both. A refused program is not compiled again."""
    times, errors = {key: [] for key in makers}, {}
    for _ in range(repeats):
        for key, make in makers.items():
            if key in errors:
                continue
            fn, fn_args, free = make()
            seconds, error = _timed(fn, fn_args, platform, free)
            if error is not None:
                errors[key] = error
            else:
                times[key].append(seconds)
    return {key: (None, errors[key]) if key in errors else (statistics.median(times[key]), None)
            for key in makers}


def _reference_maker(platform: str, case, device, direction: str, entry: str = "model"):
    """(make, error, note) of JAX's own kernel; on GPU at the largest forward tile of
    GPU_REFERENCE_TILES whose kernel fits the shared memory, found by compiling each once (note:
    the tile, when not mha's default)."""
    tiles = GPU_REFERENCE_TILES if platform == "gpu" else (None,)
    for tile in tiles:
        kw = {"entry": entry} if tile is None else {"tile": tile, "entry": entry}  # splash has no tile

        def make(kw=kw):
            return _reference(platform, case, device, direction, **kw)

        fn, fn_args, free = make()
        _, error = _timed(fn, fn_args, platform, free)
        if error is None or "Shared memory size limit exceeded" not in error:
            break
    note = f" ({tile}x{tile})" if tile not in (None, GPU_REFERENCE_TILES[0]) and error is None else ""
    return (make if error is None else None), error, note


def _warm_up(platform: str, device) -> None:
    """The first compile of a process pays the compiler's set-up (~1 s); not any kernel's."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    from kernels_pallas.aot import compile_program

    x = jax.ShapeDtypeStruct((128, 128), jnp.float32, sharding=SingleDeviceSharding(device))
    compile_program(lambda a: a @ a, (x,), platform)


def main(argv: list[str] | None = None) -> int:
    from kernels_pallas.aot import ENTRIES, Case, kernel_programs

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--targets", default="tpu-v5p:2x2x2,gpu-h100:8")
    p.add_argument("--lengths", default="1024,4096")
    p.add_argument("--head-dims", default="64,128")
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--kernels", default="flash,block_sparse,ring_chunk")
    p.add_argument("--directions", default="fwd,fwd+bwd")
    p.add_argument("--no-reference", action="store_true", help="skip JAX's own kernels")
    p.add_argument("--repeats", type=int, default=3, help="compiles per program; the median is shown")
    p.add_argument("--entry", default=ENTRIES[0], choices=ENTRIES,
                   help="q, k, v and the output as a layer holds them, [B, T, N * D] (model), or as "
                        "the kernels' API takes them, [B, T, N, D] (bthd): kernels_pallas/aot.py")
    p.add_argument("--json", default=None, metavar="FILE", help="write every row as JSON")
    args = p.parse_args(argv)

    from jaxsb.targets import parse_target, target_devices

    kernels, directions = tuple(args.kernels.split(",")), tuple(args.directions.split(","))
    rows, failed = [], 0
    for name in args.targets.split(","):
        target = parse_target(name)
        device = target_devices(target)[0]
        _warm_up(target.platform, device)
        print(f"\n## {target.name} ({device.device_kind}), entry layout {args.entry}\n")
        print("| kernel | direction | shape | jaxsb s | reference s | ratio |")
        print("|---|---|---|---|---|---|")
        for T in map(int, args.lengths.split(",")):
            for D in map(int, args.head_dims.split(",")):
                for dtype in args.dtypes.split(","):
                    case = Case(T=T, D=D, H=8, K=2, dtype=dtype)
                    makers, refs = {}, {}
                    if not args.no_reference:
                        ref_case = case if target.platform == "tpu" else Case(T=T, D=D, H=8, K=8, dtype=dtype)
                        for direction in directions:
                            make, error, note = _reference_maker(target.platform, ref_case, device, direction,
                                                                 args.entry)
                            refs[direction] = (error, note)
                            if make is not None:
                                makers["reference", direction] = make
                    programs = functools.partial(kernel_programs, case, device, kernels=kernels,
                                                 directions=directions, entry=args.entry)
                    listed = programs()
                    for n, prog in enumerate(listed):
                        def make(n=n):  # the same program, as a new function
                            fresh = programs()[n]
                            return fresh.fn, fresh.args, fresh.free_layouts

                        makers[n] = make
                    timed = _rounds(makers, target.platform, args.repeats)
                    for n, prog in enumerate(listed):
                        seconds, error = timed[n]
                        ref_error, note = refs.get(prog.direction, (None, ""))
                        ref_s, ref_run_error = timed.get(("reference", prog.direction), (None, None))
                        ref_error = ref_error or ref_run_error
                        failed += error is not None
                        ratio = f"{seconds / ref_s:.2f}" if seconds and ref_s else "-"
                        shown = f"{seconds:.2f}" if seconds is not None else f"FAILED {error}"
                        ref_shown = "-" if ref_s is None and ref_error is None else (
                            f"{ref_s:.2f}{note}" if ref_s is not None else f"FAILED {ref_error}")
                        print(f"| {prog.kernel} | {prog.direction} | {case.label} | {shown} | {ref_shown} | {ratio} |",
                              flush=True)
                        rows.append({"target": target.name, "kernel": prog.kernel, "direction": prog.direction,
                                     "case": case.label, "seconds": seconds, "error": error,
                                     "reference_seconds": ref_s, "reference_error": ref_error,
                                     "reference_note": note.strip(" ()"), "repeats": args.repeats,
                                     "entry": args.entry})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    print_summary(rows)
    print(f"\n{len(rows)} programs (entry layout {args.entry}), {failed} failed")
    return 1 if failed else 0


def _ratio(row) -> float | None:
    return row["seconds"] / row["reference_seconds"] if row["seconds"] and row["reference_seconds"] else None


def print_summary(rows) -> None:
    """Per target, kernel and direction: median jaxsb seconds, median and worst ratio, how many
    within 2x, how many refused; then the totals (the table in the kernel READMEs)."""
    ratios = [x for x in map(_ratio, rows) if x is not None]
    if not ratios:
        return
    print("\n| target | kernel | direction | jaxsb s (median) | ratio median | ratio worst | within 2x | refused |")
    print("|---|---|---|---|---|---|---|---|")
    for key in sorted({(r["target"], r["kernel"], r["direction"]) for r in rows}):
        group = [r for r in rows if (r["target"], r["kernel"], r["direction"]) == key]
        seconds = [r["seconds"] for r in group if r["seconds"] is not None]
        rs = [x for x in map(_ratio, group) if x is not None]
        cells = [f"{statistics.median(seconds):.2f}" if seconds else "-",
                 f"{statistics.median(rs):.2f}" if rs else "-", f"{max(rs):.2f}" if rs else "-",
                 f"{sum(x <= 2 for x in rs)} of {len(rs)}", str(len(group) - len(seconds))]
        print(f"| {' | '.join(key)} | {' | '.join(cells)} |")
    for name, keep in (("TPU", "tpu"), ("GPU", "gpu")):
        part = [x for r in rows if r["target"].startswith(keep) and (x := _ratio(r)) is not None]
        if part:
            print(f"\n{name}: within 2x {sum(x <= 2 for x in part)} of {len(part)}, median {statistics.median(part):.2f}, "
                  f"worst {max(part):.2f}")
    print(f"\njaxsb / reference compile time: median {statistics.median(ratios):.2f}, worst "
          f"{max(ratios):.2f}; within 2x: {sum(x <= 2 for x in ratios)} of {len(ratios)}")


if __name__ == "__main__":
    sys.exit(main())
