"""Plan data types, the 1F1B schedule builder and the analytic cost model (no torch)."""

import dataclasses
import subprocess
import sys

import pytest

from concertina_hf.planning import (
    Action, ActionKind, Chunk, ChunkKind, CostModel, Plan, PlanError, ProfileSample, Slice, StageLayout,
    backward_order, build_schedule,
)

TINY = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
            vocab_size=512, num_hidden_layers=4)


def _plan(num_stages=3):
    chunks = (
        Chunk(0, ChunkKind.SPLIT, (Slice(0, 0, 10),)),
        Chunk(1, ChunkKind.SPLIT, (Slice(0, 10, 6),)),
        Chunk(2, ChunkKind.HYBRID, (Slice(0, 16, 4), Slice(1, 0, 3))),
        Chunk(3, ChunkKind.PACKED, (Slice(2, 0, 4), Slice(3, 0, 5))),
    )
    groups = ((0, 1, 2, 3),)
    return Plan(
        strategy="test", seq_lens=(20, 3, 4, 5), layout=StageLayout.even(6, num_stages), chunks=chunks,
        groups=groups, schedule=build_schedule(chunks, groups, num_stages),
        recompute=tuple((0, 1, 2, 0)[: len(chunks)] for _ in range(num_stages)),
    )


def test_plan_validates_roundtrips_and_hashes():
    plan = _plan().validate()
    again = Plan.from_json(plan.to_json())
    assert again == plan and hash(again) == hash(plan)
    assert again.fingerprint() == plan.fingerprint()
    assert plan.chunk_counts() == {"packed": 1, "split": 2, "hybrid": 1}
    grid = plan.grid(mark=Action(1, ActionKind.BACKWARD, 2))
    assert ">1B2<" in grid and "0[16:20] 1[0:3]" in grid


def test_backward_order_reverses_split_chains():
    plan = _plan()
    assert backward_order(plan.chunks, plan.groups[0]) == [2, 1, 0, 3]
    # the last stage runs each backward right after the forward it needs
    assert [str(a) for a in plan.schedule[-1]] == ["2F0", "2F1", "2F2", "2B2", "2B1", "2B0", "2F3", "2B3"]


def test_uniform_chunks_give_textbook_1f1b():
    p, m = 4, 6
    chunks = tuple(Chunk(i, ChunkKind.PACKED, (Slice(i, 0, 8),)) for i in range(m))
    sched = build_schedule(chunks, [tuple(range(m))], p)
    for s, acts in enumerate(sched):
        warmup = [a for a in acts[: p - s]]
        assert all(a.kind is ActionKind.FORWARD for a in warmup)
        assert acts[p - s].kind is ActionKind.BACKWARD
        steady = acts[p - s: p - s + 2 * (m - (p - s))]
        assert [a.kind for a in steady] == [ActionKind.BACKWARD, ActionKind.FORWARD] * (m - (p - s))


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d["chunks"][3]["slices"].pop(), "covers"),
    (lambda d: d["schedule"][0].reverse(), "before its forward"),
    (lambda d: d["recompute"][0].__setitem__(0, 9), "outside"),
    (lambda d: d["chunks"][2]["slices"].reverse(), "tail slice first"),
])
def test_validate_names_the_broken_invariant(mutate, message):
    d = _plan().to_dict()
    mutate(d)
    with pytest.raises(PlanError, match=message):
        Plan.from_dict(d).validate()


def test_backward_of_slices_must_run_in_reverse_order():
    plan = _plan()
    bad = list(plan.schedule[2])
    i, j = bad.index(Action(2, ActionKind.BACKWARD, 2)), bad.index(Action(2, ActionKind.BACKWARD, 0))
    bad[i], bad[j] = bad[j], bad[i]
    d = plan.to_dict()
    d["schedule"][2] = [str(a) for a in bad]
    with pytest.raises(PlanError, match="later slice"):
        Plan.from_dict(d).validate()


def test_neighbouring_stages_must_order_chunks_the_same_way():
    """Messages between two ranks match in issue order: stage 1 may not backward the chunks in
    another order than stage 0 (each stage's list alone is fine)."""
    chunks = tuple(Chunk(i, ChunkKind.PACKED, (Slice(i, 0, 8),)) for i in range(3))
    groups = ((0, 1, 2),)
    plan = Plan("test", (8, 8, 8), StageLayout.even(4, 2), chunks, groups, build_schedule(chunks, groups, 2),
                ((0, 0, 0), (0, 0, 0))).validate()
    F, B = ActionKind.FORWARD, ActionKind.BACKWARD
    swapped = (plan.schedule[0], tuple(Action(1, k, c) for k, c in [(F, 0), (F, 1), (B, 1), (B, 0), (F, 2), (B, 2)]))
    with pytest.raises(PlanError) as e:
        dataclasses.replace(plan, schedule=swapped).validate()
    assert str(e.value).startswith(
        "stages 0 and 1 run the backward passes of the chunks in different orders: at position 0 chunk 0 on "
        "stage 0 but chunk 1 on stage 1 ([0, 1, 2] vs [1, 0, 2])")
    # a plan lists compute actions only: messages are the lowering's business
    sends = (plan.schedule[0] + (Action(0, ActionKind.SEND_F, 0),), plan.schedule[1])
    with pytest.raises(PlanError, match="0SEND_F0 in the schedule: a plan lists forwards and backwards only"):
        dataclasses.replace(plan, schedule=sends).validate()


def test_actions_print_and_parse_like_torch_pipelining():
    for text in ("1F3", "0B12", "1SEND_F3", "2RECV_F3", "2SEND_B3", "1RECV_B3"):
        assert str(Action.parse(text)) == text
    a = Action.parse("1SEND_F3")
    assert a.kind is ActionKind.SEND_F and a.peer == 2 and str(a.partner) == "2RECV_F3"
    assert str(Action.parse("2SEND_B3").partner) == "1RECV_B3" and Action.parse("1RECV_B3").peer == 2
    assert [k.is_compute for k in ActionKind] == [True, True, False, False, False, False]
    for bad in ("F3", "1X3", "1SEND3", "1F"):
        with pytest.raises(PlanError, match="not an action"):
            Action.parse(bad)


def test_stage_layout_even_and_errors():
    assert StageLayout.even(10, 4).layer_ranges == ((0, 3), (3, 6), (6, 8), (8, 10))
    with pytest.raises(PlanError, match="pipeline size"):
        StageLayout.even(2, 4)


def test_analytic_cost_model_terms():
    cost = CostModel.from_hf_config(TINY)
    lay = StageLayout.even(4, 2)
    short = Chunk(0, ChunkKind.PACKED, (Slice(0, 0, 100),))
    late = Chunk(1, ChunkKind.HYBRID, (Slice(1, 900, 100),))
    # same tokens, more context: more attention time; backward about twice forward
    assert cost.fwd_time(lay, 0, late) > cost.fwd_time(lay, 0, short)
    assert cost.bwd_time(lay, 0, short) == pytest.approx(2 * cost.fwd_time(lay, 0, short))
    assert cost.bwd_time(lay, 0, short, 2) > cost.bwd_time(lay, 0, short, 0)
    # recompute trades activation bytes for time; the head stage keeps logits
    assert cost.act_memory(lay, 0, short, 2) < cost.act_memory(lay, 0, short, 0)
    assert cost.act_memory(lay, 1, short) > cost.act_memory(lay, 0, short)
    # a recomputed non-final slice (split chunk) still keeps its K/V; a final one (hybrid) does not
    early = Chunk(2, ChunkKind.SPLIT, (Slice(1, 800, 100),))
    assert cost.act_memory(lay, 0, early, 2) == pytest.approx(
        cost.act_memory(lay, 0, late, 2) + 2 * cost.kv_bytes_per_token * 100)
    # every layer of stage 0 (2 of 4) recomputed: the hybrid tail keeps only the layers' inputs
    # and the stage's output, no K/V of its own; the rotary tables its layers share, once
    assert cost.act_memory(lay, 0, late, 2) == pytest.approx(
        (2 * cost.ckpt_bytes_per_token + cost.output_bytes_per_token + cost.stage_bytes_per_token
         + cost.ids_bytes_per_token) * 100)
    # (a saved layer also keeps the 900 earlier keys the varlen kernel concatenates)
    assert cost.act_memory(lay, 0, late) - cost.act_memory(lay, 0, late, 1) == pytest.approx(
        (cost.act_bytes_per_token - cost.ckpt_bytes_per_token) * 100 + cost.context_bytes_per_token * 900)
    # a slice after 900 tokens of context: its backward holds the gradients of its 1000 keys
    # and values (more than the 100 tokens' own), at the query heads' width and summed
    assert cost.bwd_context_bytes_per_token == 2 * 2 * (64 + 32)  # bf16: q (4 heads of 16), k/v (2)
    # cos and sin (float32 in some models whatever the dtype), and a bf16 stage's input, which the
    # first norm copies to float32 rather than saving it
    assert cost.stage_bytes_per_token == 2 * 4 * 16 + 2 * 64
    assert cost.ids_bytes_per_token == 8 and cost.with_parallel(sp=4).ids_bytes_per_token == 8
    assert cost.transient_memory(lay, 0, late) == pytest.approx(cost.bwd_context_bytes_per_token * 1000)
    # recomputing all of a stage's layers re-materializes one in backward; fewer do not raise it
    assert cost.transient_memory(lay, 0, short, 1) == cost.transient_memory(lay, 0, short, 0)
    assert cost.transient_memory(lay, 0, short, 2) == pytest.approx(
        cost.transient_memory(lay, 0, short, 0) + cost.act_bytes_per_token * 100)
    assert cost.static_memory(lay, 0) > 0 and CostModel.from_dict(cost.to_dict()) == cost


def test_fit_recovers_coefficients():
    true = CostModel(num_layers=2, alpha_attn=3e-9, alpha_tok=2e-6, beta=1e-4, bwd_factor=2.5)
    shapes = [((0, 128),), ((0, 512),), ((256, 256),), ((0, 64), (0, 64)), ((1024, 128),), ((0, 2048),)]
    samples = []
    for sh in shapes:
        f = true.layer_fwd_time([Slice(0, c, s) for c, s in sh])
        samples.append(ProfileSample(sh, f, 2.5 * f, act_bytes=100.0 * sum(s for _, s in sh)))
    from concertina_hf.planning.fit import fit_profile

    fitted = fit_profile(CostModel.from_hf_config(TINY), samples)
    assert fitted.alpha_attn == pytest.approx(3e-9, rel=1e-6)
    assert fitted.alpha_tok == pytest.approx(2e-6, rel=1e-6)
    assert fitted.beta == pytest.approx(1e-4, rel=1e-6)
    assert fitted.bwd_factor == pytest.approx(2.5) and fitted.act_bytes_per_token == pytest.approx(100.0)
    assert fitted.source == "fitted"


def test_planning_does_not_import_torch():
    code = "import sys, concertina_hf.planning; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
