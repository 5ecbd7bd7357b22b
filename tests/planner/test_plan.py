"""The Plan type: building, validation errors, template hashing, and the host layout (every
real token lands exactly once, in its sequence's order, with its own position and id)."""

import dataclasses

import numpy as np
import pytest

from jaxsb.plan.layout import SeqData, layout_microbatch
from jaxsb.training.planning import ProgramBudget, widen
from jaxsb.plan import (BUFFER_BUCKETS, SHARDED, GroupSpec, Placement, PlanError, bucket, build_plan,
                                executable_problem, validate)


def _seqs(lengths, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        t = rng.integers(1, 1000, n + 1).astype(np.int32)
        out.append(SeqData(t[:-1], t[1:], np.ones(n, np.float32), np.arange(n, dtype=np.int32)))
    return out


def test_buckets_grow_by_at_most_half():
    assert BUFFER_BUCKETS[:8] == (128, 256, 384, 512, 768, 1024, 1536, 2048)
    assert bucket(0) == 0 and bucket(1) == 128 and bucket(129) == 256 and bucket(1025) == 1536
    with pytest.raises(PlanError, match="exceed the largest buffer bucket"):
        bucket(BUFFER_BUCKETS[-1] + 1)


def test_build_plan_places_groups_and_pads_devices():
    plan = build_plan(8, [[GroupSpec(4, "ring", (0,)), GroupSpec(2, "ring", (1, 2))]], [1000, 300, 200])
    groups = plan.template.microbatches[0].groups
    assert [(g.start, g.degree, g.scheme) for g in groups] == [(0, 4, "ring"), (4, 2, "ring"),
                                                                (6, 1, "local"), (7, 1, "local")]
    assert plan.summary() == "4,2,1,1"
    assert plan.template.microbatches[0].shard_len == 256  # ring: 2*ceil(1000/8)=250 -> 256; 500/2 -> 256
    assert hash(plan.template) == hash(dataclasses.replace(plan.template))


def test_skrull_mix_uses_the_local_region():
    plan = build_plan(8, [[GroupSpec(8, "ulysses", (0,), ((1,), (), (2, 3)))]], [2000, 300, 100, 100])
    mb = plan.template.microbatches[0]
    assert (mb.shard_len, mb.local_len) == (256, 384)
    assert plan.placements[2] == Placement(0, 0, 2) and plan.placements[0].rank == SHARDED
    assert plan.sequences_of(0, 0) == ([0], {0: [1], 2: [2, 3]})


@pytest.mark.parametrize("build, message", [
    (lambda: build_plan(8, [[GroupSpec(8, "ring", (0, 0))]], [10]), "placed twice"),
    (lambda: build_plan(8, [[GroupSpec(8, "ring", (0,))]], [10, 20]), r"sequences \[1\] \(lengths \[20\]\) are placed nowhere"),
    (lambda: build_plan(8, [[GroupSpec(8, "ring", (0,)), GroupSpec(2, "ring", (1,))]], [10, 20]),
     "groups use 10 devices, only 8 exist"),
    (lambda: build_plan(8, [[GroupSpec(8, "ring", (5,))]], [10]), "sequence id 5 out of range"),
    (lambda: build_plan(8, [[GroupSpec(8, "magic", (0,))]], [10]), "scheme 'magic'"),
])
def test_build_errors_name_the_problem(build, message):
    with pytest.raises(PlanError, match=message):
        build()


def test_validate_catches_buffer_overflow_and_bad_ranks():
    plan = build_plan(8, [[GroupSpec(8, "ring", (0,), ((1,),))]], [1000, 50])
    small = dataclasses.replace(plan.template.microbatches[0], shard_len=64)
    with pytest.raises(PlanError, match="need 126 tokens per device in the shard region, buffer holds 64"):
        validate(dataclasses.replace(plan, template=dataclasses.replace(plan.template, microbatches=(small,))))
    no_local = dataclasses.replace(plan.template.microbatches[0], local_len=0)
    with pytest.raises(PlanError, match="local sequences \\[1\\] need 50 tokens"):
        validate(dataclasses.replace(plan, template=dataclasses.replace(plan.template, microbatches=(no_local,))))
    bad_rank = dataclasses.replace(plan, placements=(plan.placements[0], Placement(0, 0, 9)))
    with pytest.raises(PlanError, match="placed on rank 9, group degree 8"):
        validate(bad_rank)
    with pytest.raises(PlanError, match="has length 0"):
        validate(dataclasses.replace(plan, lengths=(1000, 0)))


def test_executable_problem_names_what_the_executor_cannot_run():
    mixed = build_plan(8, [[GroupSpec(4, "ulysses", (0,)), GroupSpec(2, "ulysses", (1,))]], [10, 10])
    assert "ulysses needs groups of one degree" in executable_problem(mixed.template)
    two = build_plan(8, [[GroupSpec(4, "ulysses", (0,)), GroupSpec(4, "ring", (1,))]], [10, 10])
    assert "mixes schemes" in executable_problem(two.template)
    ok = build_plan(8, [[GroupSpec(4, "ring", (0,)), GroupSpec(2, "ring", (1,))], [GroupSpec(4, "ulysses", (2,)),
                                                                                  GroupSpec(4, "ulysses", (3,))]],
                    [10, 10, 10, 10])
    assert executable_problem(ok.template) is None


def _tokens_of(buffers, seg_id):
    """The (position, token) pairs of one sequence found anywhere in the buffers, sorted."""
    where = buffers["segment_ids"] == seg_id
    pairs = sorted(zip(buffers["positions"][where].tolist(), buffers["tokens"][where].tolist()))
    return pairs


@pytest.mark.parametrize("specs", [
    [[GroupSpec(8, "ring", (0, 1, 2, 3, 4, 5))]],
    [[GroupSpec(8, "ulysses", (0, 1, 2, 3, 4, 5))]],
    [[GroupSpec(4, "ring", (0, 1)), GroupSpec(2, "ring", (2, 3)), GroupSpec(1, "local", (4,)),
      GroupSpec(1, "local", (5,))]],
    [[GroupSpec(4, "ring", (0,), ((1,), (), (2, 3))), GroupSpec(4, "ring", (4,), ((), (5,)))]],
], ids=["ring8", "ulysses8", "ring4211", "skrull"])
@pytest.mark.parametrize("align", [1, 16])
def test_layout_holds_every_token_once(specs, align):
    lengths = [300, 37, 1, 64, 120, 9]
    seqs = _seqs(lengths)
    plan = build_plan(8, specs, lengths, budgets=[3, 1, 2, 5, 4, 6], align=align)
    buf = layout_microbatch(plan, 0, seqs, align)
    assert buf["tokens"].shape == (8, plan.template.microbatches[0].tokens_per_device)
    for i, s in enumerate(seqs):
        assert _tokens_of(buf, i + 1) == list(zip(range(len(s)), s.tokens.tolist()))
        assert set(buf["budgets"][buf["segment_ids"] == i + 1].tolist()) == {plan.budgets[i]}
    pad = buf["segment_ids"] == 0
    assert buf["loss_mask"][pad].sum() == 0 and buf["loss_mask"].sum() == sum(lengths)
    if align > 1:  # every sequence starts on a block boundary of its device's buffer
        dev, col = np.nonzero((buf["positions"] == 0) & (buf["segment_ids"] > 0))
        assert len(dev) == len(lengths) and np.all(col % align == 0)


def test_ring_layout_is_zigzag():
    lengths = [64]
    plan = build_plan(4, [[GroupSpec(4, "ring", (0,))]], lengths, buckets=(16,))
    buf = layout_microbatch(plan, 0, _seqs(lengths))
    # 64 tokens, 8 chunks of 8: rank r holds chunks r and 7 - r
    assert buf["positions"][0].tolist() == list(range(0, 8)) + list(range(56, 64))
    assert buf["positions"][3].tolist() == list(range(24, 32)) + list(range(32, 40))


def test_planned_pieces_are_the_sequences_the_rows_hold():
    """A planned step's sequences (the data iterator's pieces, never packed) carry exactly the
    tokens, targets, mask and positions the rows path packs for the same pieces."""
    from jaxsb.data import Piece, pack_rows
    from jaxsb.data.batching import build_batch
    from jaxsb.training.planning import sequence_of_piece

    rng = np.random.default_rng(0)
    pieces = [Piece(rng.integers(1, 50, n).astype(np.int32), rng.random(n) < 0.8, (0, i, 0), f"doc{i}")
              for i, n in enumerate([5, 3, 7, 2, 9])]
    batch = build_batch(pieces, pack_rows([len(p) for p in pieces], 2, (16,)), 2, pad_id=0)
    k = 0
    for r in range(2):  # the rows' documents, in packing order: contiguous runs of one segment id
        for seg in range(1, int(batch.segment_ids[r].max()) + 1):
            idx = np.flatnonzero(batch.segment_ids[r] == seg)
            want = pieces[batch.doc_refs[k][1]]
            got = sequence_of_piece(want)
            assert got.tokens.tolist() == batch.tokens[r, idx].tolist()
            assert got.positions.tolist() == batch.positions[r, idx].tolist()
            assert got.loss_mask.tolist() == batch.loss_mask[r, idx].tolist()
            trained = got.loss_mask > 0
            assert got.targets[trained].tolist() == batch.targets[r, idx][trained].tolist()
            k += 1
    assert k == len(pieces)


def test_program_budget_widens_then_falls_back():
    budget = ProgramBudget(3)

    def fallback(plan):
        return build_plan(8, [[GroupSpec(8, "ring", tuple(range(len(plan.lengths))))]], plan.lengths,
                          planner="fallback")

    big = build_plan(8, [[GroupSpec(8, "ring", (0,))]], [4000])
    small = build_plan(8, [[GroupSpec(8, "ring", (0,))]], [100])
    other = build_plan(8, [[GroupSpec(4, "ring", (0,)), GroupSpec(4, "ring", (1,))]], [100, 100])
    third = build_plan(8, [[GroupSpec(2, "ring", (0,)), GroupSpec(2, "ring", (1,))]], [100, 100])
    assert budget.admit(big, fallback).how == "new"
    assert budget.admit(other, fallback).how == "new"
    adm = budget.admit(small, fallback)  # no room: widened into the big program
    assert adm.how == "widened" and adm.plan.template == big.template
    adm = budget.admit(third, fallback)  # nothing to widen into: the fallback, widened too
    assert adm.how == "fallback" and adm.plan.template == big.template and adm.plan.planner == "fallback"
    assert len(budget.templates) == 2
    assert widen(third, budget.templates) is None


def test_program_budget_reuses_a_slightly_larger_program_before_compiling():
    budget = ProgramBudget(8)

    def fallback(plan):
        raise AssertionError("there is room: no fallback")

    big = build_plan(8, [[GroupSpec(8, "ring", (0,))]], [4000])
    near = build_plan(8, [[GroupSpec(8, "ring", (0,))]], [3000])  # 376 of big's 500 tokens per device
    far = build_plan(8, [[GroupSpec(8, "ring", (0,))]], [1000])
    assert budget.admit(big, fallback).how == "new"
    adm = budget.admit(near, fallback)
    assert adm.how == "widened" and adm.plan.template == big.template
    assert budget.admit(far, fallback).how == "new"  # big is 4x its buffers: compiled on its own
    assert len(budget.templates) == 2
