"""How large a step's plan is on the wire, and how long process 0 takes to send it to the others.

    .venv/bin/python scripts/bench_plan_wire.py --devices 1024 --global-batch 4096 \
        --lengths ../shared/data/wikipedia_lens.txt

With several processes, process 0 plans each step and publishes the plan in the coordinator's
key-value store; every other process reads it (jaxsb/wire.py). This plans one step of the
given setting (the simulator's cost presets and planners), then measures, side by side in one
run, the plan as readable JSON (`wire.plan_to_json`, what version 2 of the plan message sent)
and as the packed message (`wire.encode("plan", ...)`, version 3): bytes, encode and decode
time, and the time to publish it and read it back through a real coordinator (a
one-process `jax.distributed` service on loopback: the store's own cost, without a network's
latency). Times are medians of --repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def plan_one_step(args):
    """(Plan, SolveInfo, solve seconds) of the first full batch of the setting."""
    from jaxsb.planner.simulation import make_batches, make_planners, preset_options, read_lengths, synthetic_lengths
    from jaxsb.simulate import simulator_cost

    n = args.devices
    cost = simulator_cost(args.preset, None, n, preset_options(args.preset, n, args.max_len, []))
    planners, _ = make_planners([args.planner], [], cost, n, args.time_limit, None, None)
    source = read_lengths(args.lengths) if args.lengths else synthetic_lengths(args.dist, 0)
    batches, _, _ = make_batches(source, n, args.global_batch, args.max_len, 1, align=2 * n)
    if not batches:
        raise SystemExit(f"error: not one full batch of {args.global_batch} sequences")
    t = time.perf_counter()
    solution = planners[args.planner].solve(batches[0])
    return solution.plan, solution.info, time.perf_counter() - t


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--devices", type=int, default=1024)
    p.add_argument("--global-batch", type=int, default=4096)
    p.add_argument("--max-len", type=int, default=192000)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--lengths", metavar="PATH", help="one sequence length per line")
    src.add_argument("--dist", default="long-tail", help="a synthetic length mix of the simulator")
    p.add_argument("--preset", default="gpu-h100")
    p.add_argument("--planner", default="jaxsb")
    p.add_argument("--time-limit", type=float, default=None, help="the planner's time limit (s)")
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args(argv)

    import jax
    from jax._src import distributed

    from jaxsb import devices, wire

    plan, info, solve_s = plan_one_step(args)
    print(f"{args.planner} planned {len(plan.lengths)} sequences on {args.devices} devices in {solve_s:.2f} s: "
          f"{len(plan.template.microbatches)} micro-batches, "
          f"{sum(len(mb.groups) for mb in plan.template.microbatches)} groups")

    message = (plan, solve_s, info)
    packed = wire.encode("plan", message)

    rest = {k: v for k, v in json.loads(packed)["body"].items() if k != "plan"}  # solve_s, info: as sent

    def encode_plain() -> bytes:  # version 2: the same message with the plan as plain JSON
        body = {"plan": wire.plan_to_json(plan)} | rest
        return json.dumps({"jaxsb": "plan", "version": 2, "body": body}, separators=(",", ":")).encode()

    plain = encode_plain()
    assert wire.decode("k", "plan", packed)[1][0] == plan  # exact round trip

    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{_free_port()}", num_processes=1, process_id=0)
    client = distributed.global_state.client
    counter = iter(range(10**9))

    def send_and_receive(payload: bytes):
        key = f"bench/plan/{next(counter)}"
        devices._publish(client, key, payload)
        assert devices._fetch(client, key, 60.0) == payload
        client.key_value_delete(key)

    rows = [
        ("plain JSON (plan message v2)", plain, encode_plain, lambda: json.loads(plain)),
        ("packed (plan message v3)", packed, lambda: wire.encode("plan", message),
         lambda: wire.decode("k", "plan", packed)),
    ]
    print(f"\n{'encoding':<30} {'bytes':>9} {'encode ms':>10} {'decode ms':>10} {'send+receive ms':>16}")
    results = []
    for name, payload, enc, dec in rows:
        r = (len(payload), _median_ms(enc, args.repeats), _median_ms(dec, args.repeats),
             _median_ms(lambda: send_and_receive(payload), args.repeats))
        results.append(r)
        print(f"{name:<30} {r[0]:>9,} {r[1]:>10.2f} {r[2]:>10.2f} {r[3]:>16.2f}")
    print(f"\nratio plain/packed: {results[0][0] / results[1][0]:.1f}x the bytes, "
          f"{results[0][3] / results[1][3]:.2f}x the send+receive time "
          "(plain's decode is json.loads alone; packed's rebuilds and validates the Plan)")
    jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
