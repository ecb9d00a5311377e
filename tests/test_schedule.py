"""The load-aware scheduler (dspark_jax.schedule) against plain-loop references, its direction, the
early stop's losslessness, and the engine's policies."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import recorded_compiles
from dspark_jax import schedule as sched


def loop_prefix_schedule(conf: np.ndarray, table: np.ndarray, live=None) -> np.ndarray:
    """Algorithm 1 as the paper writes it: one admission at a time, float32 like the jnp code
    (free slots, live False, cost a token of B but commit nothing)."""
    rows, block = conf.shape
    surv = np.cumprod(np.clip(conf.astype(np.float32), 0, 1), axis=1, dtype=np.float32)
    entries = sorted(((-surv[r, j], r, j) for r in range(rows) for j in range(block) if surv[r, j] > 0))
    sps = lambda b: np.float32(table[b]) if b < len(table) else np.float32(0)  # noqa: E731
    lengths = np.zeros(rows, np.int32)
    tau, tokens = np.float32(rows if live is None else np.sum(live)), rows
    best = tau * sps(tokens)
    for neg, r, j in entries:
        new_tau = np.float32(tau + np.float32(-neg))
        new = np.float32(new_tau * sps(tokens + 1))
        if new <= best:
            break
        assert lengths[r] == j  # survival is non-increasing along a row: prefixes only
        lengths[r], tau, tokens, best = j + 1, new_tau, tokens + 1, new
    return lengths


def random_case(rng, rows, block, kind):
    conf = rng.uniform(0.0, 1.0, (rows, block)).astype(np.float32)
    if kind == "ties":  # few distinct values: equal survivals across rows and along a row
        conf = rng.choice(np.asarray([0.0, 0.5, 1.0], np.float32), (rows, block))
    free = rng.uniform(size=rows) < 0.3
    conf[free] = 0.0  # free slots
    n = rows * (block + 1) + 1
    if kind == "flat":
        table = np.full(n, 10.0, np.float32)
    elif kind == "steep":
        table = (100.0 / (1.0 + 0.5 * np.arange(n))).astype(np.float32)
    elif kind == "short":
        # ends inside the admission path (three lengths per shape, so few compiles)
        table = rng.uniform(5, 10, rows + [1, 3, max(1, rows * block // 2)][rng.integers(3)]).astype(np.float32)
    else:  # a jagged staircase, decreasing on average
        table = np.sort(rng.uniform(1, 20, n)).astype(np.float32)[::-1] * rng.uniform(0.9, 1.1, n).astype(np.float32)
    return conf, table, ~free


SHAPES = [(1, 7), (3, 4), (8, 7), (5, 1)]  # (rows, block): few shapes, few compiles
KINDS = ["random", "ties", "flat", "steep", "short"]


@pytest.mark.parametrize("kind", KINDS)
def test_prefix_schedule_equals_plain_loop(kind):
    rng = np.random.default_rng(KINDS.index(kind))
    fn = jax.jit(sched.prefix_schedule)
    for _ in range(60):
        rows, block = SHAPES[int(rng.integers(len(SHAPES)))]
        conf, table, live = random_case(rng, rows, block, kind)
        got = np.asarray(fn(jnp.asarray(conf), jnp.asarray(table)))
        np.testing.assert_array_equal(got, loop_prefix_schedule(conf, table), err_msg=f"{conf}\n{table}")
        got = np.asarray(fn(jnp.asarray(conf), jnp.asarray(table), jnp.asarray(live)))
        np.testing.assert_array_equal(got, loop_prefix_schedule(conf, table, live), err_msg=f"{conf}\n{table}")


def test_prefix_schedule_edges():
    conf = np.asarray([[0.9, 0.8, 0.5], [0.0, 0.0, 0.0]], np.float32)
    flat = np.full(9, 5.0, np.float32)
    assert np.asarray(sched.prefix_schedule(conf, flat)).tolist() == [3, 0]  # whole block, free row nothing
    steep = np.asarray([5.0, 5.0, 5.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0], np.float32)
    assert np.asarray(sched.prefix_schedule(conf, steep)).tolist() == [0, 0]  # any extra token costs too much
    short = np.full(4, 5.0, np.float32)  # the table ends at B = 3: one admission at most
    assert np.asarray(sched.prefix_schedule(conf, short)).tolist() == [1, 0]


@pytest.mark.parametrize("policy", ["prefix_schedule", "level_schedule"])
def test_steeper_table_never_verifies_more(policy):
    rng = np.random.default_rng(3)
    fn = jax.jit(getattr(sched, policy))
    for _ in range(60):
        rows, block = SHAPES[int(rng.integers(len(SHAPES)))]
        conf, _, _ = random_case(rng, rows, block, "random")
        n = rows * (block + 1) + 1
        rate = rng.uniform(0.0, 0.3)
        mild = (1.0 / (1.0 + rate * np.arange(n))).astype(np.float32)
        steep = (mild * (1.0 / (1.0 + rng.uniform(0.0, 0.5) * np.arange(n)))).astype(np.float32)  # falls faster
        assert fn(conf, steep).sum() <= fn(conf, mild).sum()


def loop_lagged(conf, lagged, table):
    rows, block = conf.shape
    cum = lambda c: np.cumprod(np.clip(c, 0, 1), axis=1, dtype=np.float32)  # noqa: E731
    sps = lambda b: np.float32(table[b]) if b < len(table) else np.float32(0)  # noqa: E731
    old = sorted((x for x in cum(lagged).ravel() if x > 0), reverse=True)
    tau, best, budget = np.float32(rows), np.float32(rows) * sps(rows), 0
    for k, x in enumerate(old, start=1):
        tau = np.float32(tau + x)
        if tau * sps(rows + k) > best:
            best, budget = tau * sps(rows + k), k
    surv = cum(conf)
    entries = sorted((-surv[r, j], r, j) for r in range(rows) for j in range(block) if surv[r, j] > 0)[:budget]
    lengths = np.zeros(rows, np.int32)
    for _, r, _ in entries:
        lengths[r] += 1
    return lengths


def test_lagged_schedule_equals_plain_loop():
    rng = np.random.default_rng(5)
    fn = jax.jit(sched.lagged_schedule)
    for kind in ["random", "ties", "steep", "short"]:
        for _ in range(30):
            rows, block = SHAPES[int(rng.integers(len(SHAPES)))]
            conf, table, _ = random_case(rng, rows, block, kind)
            lagged, _, _ = random_case(rng, rows, block, kind)
            np.testing.assert_array_equal(np.asarray(fn(conf, lagged, table)), loop_lagged(conf, lagged, table))


def loop_level_schedule(conf: np.ndarray, table: np.ndarray, live=None, lagged=False) -> np.ndarray:
    """Algorithm 1 over whole levels, as a loop: level j costs the dense forward's step from
    R * j to R * (j + 1) tokens and gains the column sum of survivals; admit while Theta rises
    (lagged: the first best level over all of them)."""
    rows, block = conf.shape
    surv = np.cumprod(np.clip(conf.astype(np.float32), 0, 1), axis=1, dtype=np.float32)
    sps = lambda b: np.float32(table[b]) if b < len(table) else np.float32(0)  # noqa: E731
    tau = np.float32(rows if live is None else np.sum(live))
    best, level = tau * sps(rows), 0
    for j in range(block):
        gain = np.float32(0)
        for r in range(rows):
            gain = np.float32(gain + surv[r, j])
        tau = np.float32(tau + gain)
        theta = np.float32(tau * sps(rows * (j + 2)))
        if gain <= 0 or (theta <= best and not lagged):
            break
        if theta > best:
            best, level = theta, j + 1
    return np.minimum(level, (surv > 0).sum(axis=1)).astype(np.int32)


@pytest.mark.parametrize("kind", KINDS)
def test_level_schedule_equals_plain_loop(kind):
    rng = np.random.default_rng(10 + KINDS.index(kind))
    fn, lagged = jax.jit(sched.level_schedule), jax.jit(sched.lagged_level_schedule)
    for _ in range(40):
        rows, block = SHAPES[int(rng.integers(len(SHAPES)))]
        conf, table, live = random_case(rng, rows, block, kind)
        np.testing.assert_array_equal(np.asarray(fn(conf, table)), loop_level_schedule(conf, table))
        np.testing.assert_array_equal(np.asarray(fn(conf, table, live)), loop_level_schedule(conf, table, live))
        old, _, _ = random_case(rng, rows, block, kind)
        expect = np.minimum(loop_level_schedule(old, table, lagged=True).max(initial=0),
                            (np.cumprod(conf, axis=1) > 0).sum(axis=1))
        np.testing.assert_array_equal(np.asarray(lagged(conf, old, table)), expect)


def test_level_schedule_is_prefix_schedule_for_one_row_and_dense_for_many():
    rng = np.random.default_rng(4)
    for _ in range(30):
        conf, table, _ = random_case(rng, 1, 7, "random")
        np.testing.assert_array_equal(np.asarray(sched.level_schedule(conf, table)),
                                      np.asarray(sched.prefix_schedule(conf, table)))
    # Two rows, widths 1 / 2 / 3 cost 10 / 9 / 5 steps per second. Row 0 is confident, row 1 not:
    # priced by B, row 0's second token looks cheap (B = 4 still runs at 9), so prefix_schedule
    # verifies [2, 0] at width 3; the dense forward prices that at 5, and the level schedule
    # stops at width 2, verifying one token of each row.
    conf = np.asarray([[0.95, 0.95], [0.3, 0.3]], np.float32)
    table = np.asarray([10, 10, 10, 9, 9, 5, 5], np.float32)
    assert np.asarray(sched.prefix_schedule(conf, table)).tolist() == [2, 0]
    assert np.asarray(sched.level_schedule(conf, table)).tolist() == [1, 1]
    params = sched.ScheduleParams(jnp.asarray(table), jnp.float32(0.5), jnp.int32(2), jnp.float32(10))
    out = sched.schedule("dspark", conf, conf, jnp.asarray([2, 2]), params)
    np.testing.assert_allclose(float(out.predicted_throughput), (2 + 0.95 + 0.3) * 9, rtol=1e-6)


def test_drafting_pays_weighs_the_drafter_cost():
    # Two rows, confidences 0.5: with the drafter, widths 1 / 2 / 3 run 9 / 8 / 7 rounds/s, so the
    # best level (2) gives Theta = (2 + 1 + 0.5) * 7 = 24.5; a plain round gives 2 * plain_sps, and
    # drafting must beat it by GATE_MARGIN.
    conf = jnp.full((2, 2), 0.5, jnp.float32)
    table = jnp.asarray([9, 9, 9, 8, 8, 7, 7], jnp.float32)
    caps, live = jnp.asarray([2, 2], jnp.int32), jnp.ones((2,), bool)

    def pays(plain, probe_due=False, max_length=2):
        params = sched.ScheduleParams(table, jnp.float32(0.5), jnp.int32(max_length), jnp.float32(plain))
        return bool(sched.drafting_pays(conf, caps, params, live, jnp.bool_(probe_due)))

    even = 24.5 / (2 * (1 + sched.GATE_MARGIN))  # the plain rate at which drafting just fails to pay
    assert pays(even - 0.25) and not pays(even + 0.25) and not pays(12.0)  # 12.0: a gain inside the margin
    assert pays(12.5, probe_due=True)  # the probe round drafts anyway...
    assert not pays(1.0, max_length=0)  # ...but nothing drafts under a cap of 0
    # Probes: PROBE_EVERY rounds after a round that paid, else twice the last gap, capped.
    gaps = [int(sched.next_probe_gap(jnp.int32(g), jnp.bool_(paid)))
            for g, paid in [(16, True), (64, True), (16, False), (64, False), (sched.MAX_PROBE_EVERY, False)]]
    assert gaps == [sched.PROBE_EVERY, sched.PROBE_EVERY, 32, 128, sched.MAX_PROBE_EVERY]
    # ...never shorter than the load's floor (what keeps the probes' extra cost under PROBE_BUDGET).
    gaps = [int(sched.next_probe_gap(jnp.int32(g), jnp.bool_(paid), jnp.int32(43)))
            for g, paid in [(16, True), (16, False), (32, False), (200, False)]]
    assert gaps == [43, 43, 64, sched.MAX_PROBE_EVERY]
    # After drafting, level 0 is priced with the drafter's cost (9, not plain_sps): level 1 pays.
    assert np.asarray(sched.level_schedule(conf, table)).tolist() == [2, 2]


def test_draft_depth_follows_the_caps_and_the_recent_best_level():
    """The depth a round drafts: never past the live rows' caps or max_length; under the table
    policies at most DEPTH_HEADROOM levels past the one the recent confidences make best, except
    in a depth probe (caps only)."""
    g = 7
    table = jnp.asarray([9, 9, 9, 8, 8] + [2] * 12, jnp.float32)  # two rows: level 1 best, level 2 loses
    live = jnp.ones((2,), bool)
    recent = jnp.full((2, g), 0.5, jnp.float32)

    def depth(policy, caps=(7, 7), max_length=7, conf=recent, rows_live=live, probe=False):
        params = sched.ScheduleParams(table, jnp.float32(0.5), jnp.int32(max_length), jnp.float32(9.0))
        return int(sched.draft_depth(policy, conf, jnp.asarray(caps, jnp.int32), params, rows_live, probe))

    assert int(sched.best_level(recent, table, live)) == 1
    assert depth("dspark") == depth("dspark-lagged") == 1 + sched.DEPTH_HEADROOM
    assert depth("dspark", probe=True) == 7 and depth("dspark", caps=(4, 3), probe=True) == 4
    assert depth("fixed") == depth("threshold") == 7
    assert depth("fixed", caps=(3, 5)) == 5 and depth("fixed", max_length=4) == 4
    assert depth("fixed", caps=(6, 2), rows_live=jnp.asarray([False, True])) == 2  # a done row's cap is 0
    assert depth("dspark", caps=(1, 1)) == 1
    assert depth("dspark", conf=jnp.zeros((2, g), jnp.float32)) == sched.DEPTH_HEADROOM  # level 0 (a gate probe)
    assert depth("dspark", conf=jnp.zeros((2, g), jnp.float32), probe=True) == sched.DEPTH_HEADROOM  # not deeper
    assert depth("fixed", max_length=0) == 1


def test_probe_floor_bounds_what_probes_cost():
    # A drafted round that verifies nothing runs at SPS(R) = table[R]; against the plain rate its
    # extra is plain / SPS(R) - 1 plain rounds, spread over at least extra / PROBE_BUDGET rounds.
    table = jnp.asarray([0, 0, 10.0, 9, 8, 7, 6], jnp.float32)

    def floor(plain, rows=2):
        params = sched.ScheduleParams(table, jnp.float32(0.5), jnp.int32(2), jnp.float32(plain))
        return int(sched.probe_floor(params, rows))

    assert floor(14.25) == int(np.ceil((14.25 / 10.0 - 1.0) / sched.PROBE_BUDGET))  # 42.5 -> 43 at 1 %
    assert floor(10.0) == floor(10.05) == sched.PROBE_EVERY  # a nearly free drafter: the old gap
    assert floor(1000.0) == sched.MAX_PROBE_EVERY
    assert floor(10.0, rows=0) == sched.PROBE_EVERY  # no drafted rate known (0): no floor


def test_gate_average_replaces_its_start_then_decays():
    # A row's drafted rounds with confidence x_1, x_2, ...: the mean of the first ones while that
    # weighs a new round more than 1 - GATE_DECAY, exponential decay after; a row not live keeps its.
    xs = np.asarray([0.2, 0.6, 0.1, 0.9, 0.4, 0.3, 0.8], np.float32)
    avg, rounds, live = jnp.ones((2, 1), jnp.float32), jnp.zeros((2,), jnp.int32), jnp.asarray([True, False])
    expect = None
    for n, x in enumerate(xs):
        avg = sched.gate_average(avg, rounds, jnp.full((2, 1), x), live)
        rounds = rounds + live.astype(jnp.int32)
        w = max(1 / (n + 1), 1 - sched.GATE_DECAY)
        expect = x if expect is None else (1 - w) * expect + w * x
        np.testing.assert_allclose(float(avg[0, 0]), expect, rtol=1e-6)
    mean = xs[:4].mean()  # the first four rounds weigh alike (1/4 = 1 - GATE_DECAY), then decay
    for x in xs[4:]:
        mean = sched.GATE_DECAY * mean + (1 - sched.GATE_DECAY) * x
    np.testing.assert_allclose(float(avg[0, 0]), mean, rtol=1e-6)
    assert float(avg[1, 0]) == 1.0


def test_online_sums_weigh_each_event_by_what_came_after_it():
    """online_update against its closed form: an event of round t weighs ONLINE_DECAY to the power
    of the events after it at its position, a round with none there counting as one; the ratio
    adds ONLINE_PRIOR pseudo-events at 1, so with no news it drifts back to 1."""
    rng = np.random.default_rng(0)
    rows, block, rounds = 3, 4, 40
    conf = rng.uniform(0.2, 1.0, (rounds, rows, block)).astype(np.float32)
    lengths = rng.integers(0, block + 1, (rounds, rows))
    lengths[5:9] = 0  # rounds with no event at any position
    n_acc = rng.integers(0, block + 1, (rounds, rows))
    k = np.arange(block)
    tried = (k < lengths[..., None]) & (k <= n_acc[..., None])  # [rounds, rows, G] like decode_round's
    hit = tried & (k < n_acc[..., None])
    predicted = accepted = jnp.zeros((block,), jnp.float32)
    for t in range(rounds):
        predicted, accepted = sched.online_update(predicted, accepted, jnp.asarray(conf[t]), jnp.asarray(tried[t]),
                                                  jnp.asarray(hit[t]))
    ages = np.maximum(tried.sum(axis=1), 1)  # [rounds, G]
    after = np.cumsum(ages[::-1], axis=0)[::-1] - ages  # the ages of the rounds after each
    weight = sched.ONLINE_DECAY ** after  # [rounds, G]
    expect_pred = (weight * np.where(tried, conf, 0).sum(axis=1)).sum(axis=0)
    expect_acc = (weight * hit.sum(axis=1)).sum(axis=0)
    np.testing.assert_allclose(np.asarray(predicted), expect_pred, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(accepted), expect_acc, rtol=1e-5)
    ratio = np.clip((expect_acc + sched.ONLINE_PRIOR) / (expect_pred + sched.ONLINE_PRIOR), *sched.ONLINE_RATIO_RANGE)
    np.testing.assert_allclose(np.asarray(sched.online_ratio(predicted, accepted)), ratio, rtol=1e-5)
    # Clipped at both ends; and after many rounds without events the correction is gone.
    many = jnp.full((block,), 1e4, jnp.float32)
    np.testing.assert_allclose(np.asarray(sched.online_ratio(many, 0 * many)), sched.ONLINE_RATIO_RANGE[0])
    np.testing.assert_allclose(np.asarray(sched.online_ratio(many, 3 * many)), sched.ONLINE_RATIO_RANGE[1])
    nothing = jnp.zeros((rows, block), bool)
    low = (many, 0 * many)
    for _ in range(1500):
        low = sched.online_update(*low, jnp.ones((rows, block)), nothing, nothing)
    np.testing.assert_allclose(np.asarray(sched.online_ratio(*low)), 1.0, atol=0.01)
    np.testing.assert_allclose(np.asarray(sched.corrected(jnp.asarray([[0.8, 0.6, 0.3, 0.1]]),
                                                          jnp.asarray([2.0, 0.5, 1.0, 0.25]))),
                               [[1.0, 0.3, 0.3, 0.025]], rtol=1e-6)


def test_a_new_request_starts_its_gate_from_the_measured_slots(tiny):
    from dspark_jax import Engine, SamplingParams

    target, drafter, _ = tiny
    engine = Engine(target, drafter, slots=4, max_len=128, policy="dspark", sps_table=np.full(17, 1.0))
    params = SamplingParams(max_new_tokens=40)
    state = engine.insert_many(engine.new_state(), [(i, p, params) for i, p in enumerate(_prompts(2, seed=3))])
    np.testing.assert_array_equal(np.asarray(state.gate_confidences), 1.0)  # nothing measured yet: ones
    state, _ = engine.step(state, rounds=3)  # a flat table: every round drafts and measures
    rounds, average = np.asarray(state.gate_rounds), np.asarray(state.gate_confidences)
    assert rounds.tolist() == [3, 3, 0, 0] and np.all(average[:2] < 1.0)
    state = engine.free(state, 1)  # a freed slot's measurements still count
    state = engine.insert(state, 2, _prompts(1, seed=9)[0], params)
    np.testing.assert_allclose(np.asarray(state.gate_confidences)[2], average[:2].mean(axis=0), rtol=1e-6)
    assert np.asarray(state.gate_rounds).tolist() == [3, 3, 0, 0]  # its first drafted round replaces it


def test_threshold_fixed_none_and_caps():
    conf = jnp.asarray([[0.9, 0.9, 0.5, 0.9], [0.4, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]], jnp.float32)
    params = sched.ScheduleParams(sps_table=jnp.ones((16,), jnp.float32), threshold=jnp.float32(0.6),
                                  max_length=jnp.int32(4), plain_sps=jnp.float32(1))
    caps = jnp.asarray([4, 4, 0], jnp.int32)
    run = lambda policy, c=caps, p=params: np.asarray(sched.schedule(policy, conf, conf, c, p).lengths).tolist()  # noqa: E731
    assert run("threshold") == [2, 0, 0]  # survivals 0.9, 0.81, 0.405: two reach 0.6
    assert run("fixed") == [4, 4, 0]
    assert run("none") == [0, 0, 0]
    assert run("fixed", jnp.asarray([1, 3, 0], jnp.int32)) == [1, 3, 0]
    assert run("fixed", p=sched.ScheduleParams(params.sps_table, params.threshold, jnp.int32(2), params.plain_sps)) == [2, 2, 0]
    out = sched.schedule("fixed", conf, conf, caps, params)
    assert int(out.tokens) == 3 + 8
    np.testing.assert_allclose(float(out.predicted_tau), 3 + (0.9 + 0.81 + 0.405 + 0.3645) + (0.4 * 4), rtol=1e-6)
    with pytest.raises(ValueError, match="policy must be one of"):
        sched.check_policy("greedy")


def test_staircase_table_and_json(tmp_path):
    table = sched.staircase(4, [1, 2, 4, 8], [40.0, 30.0, 20.0, 10.0], sched.table_size(4, 7))
    assert table.shape == (33,)
    assert table[0] == table[4] == 40.0 and table[5] == table[8] == 30.0 and table[9] == 20.0 and table[32] == 10.0
    cost = sched.CostTable(slots=4, block_size=7, widths=[1, 2, 4, 8], steps_per_second=[40.0, 30.0, 20.0, 10.0],
                           table=table.tolist(), model="m",
                           row_buckets=[sched.CostTable(slots=1, block_size=7, widths=[1, 2], steps_per_second=[80.0, 70.0],
                                                        table=[80.0, 80.0, 70.0, 0.0], plain_steps_per_second=90.0)])
    cost.save(str(tmp_path / "sps.json"))
    assert sched.CostTable.load(str(tmp_path / "sps.json")) == cost
    with pytest.raises(FileNotFoundError, match="no cost table"):
        sched.CostTable.load(str(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="missing"):
        sched.CostTable.load(str(tmp_path / "bad.json"))


# ----------------------------------------------------------------------------- losslessness
def _first_token_rule(policy, n=40_000, seed=0):
    """The paper's counterexample, run through the library's verification: target (0.7, 0.3) over
    tokens {A=0, B=1}, draft (0.5, 0.5); c_1 = 0.5, and c_2 = 1 after A, 0 after B (the Markov head
    lets the confidence see the sampled token). With SPS = (1, 0.6, 0.6) at B = 1, 2, 3, verifying
    only x_1 lowers Theta (1 -> 0.9) while verifying x_1 and x_2 after an A raises it (-> 1.2).
    Returns the emitted first tokens [n]."""
    from dspark_jax.verify import verify_block

    key_draft, key_verify = jax.random.split(jax.random.PRNGKey(seed))
    x = jax.random.bernoulli(key_draft, 0.5, (n, 2)).astype(jnp.int32)  # draft tokens, q = (0.5, 0.5)
    conf = jnp.stack([jnp.full((n,), 0.5), jnp.where(x[:, 0] == 0, 1.0, 0.0)], axis=1)[:, None, :]  # [n, R=1, G=2]
    table = jnp.asarray([0.0, 1.0, 0.6, 0.6], jnp.float32)
    if policy == "dspark":
        lengths = jax.vmap(lambda c: sched.prefix_schedule(c, table))(conf)[:, 0]
    else:  # the same path without the early stop: the argmax of Theta over every prefix of it
        def global_search(c):
            _, ranked = sched.candidates(sched.survival(c))
            theta = sched._path(ranked, table, 1)
            return jnp.argmax(jnp.where(jnp.concatenate([jnp.ones(1, bool), ranked > 0]), theta, -1.0))
        lengths = jax.vmap(global_search)(conf)
    q = jnp.full((n, 2, 2), 0.5, jnp.float32)
    p = jnp.broadcast_to(jnp.asarray([0.7, 0.3], jnp.float32), (n, 3, 2))
    uniforms = jax.random.uniform(key_verify, (n, 3))
    n_acc, next_token = verify_block(x, q, p, lengths.astype(jnp.int32), uniforms)
    return np.asarray(jnp.where(n_acc >= 1, x[:, 0], next_token)), np.asarray(lengths)


def test_early_stop_is_lossless_and_a_global_search_is_not():
    from chisquare import chi2

    tokens, lengths = _first_token_rule("dspark")
    assert lengths.max() == 0  # the early stop never verifies x_1 here
    stat, threshold = chi2(tokens, [0.7, 0.3])
    assert stat < threshold, stat
    tokens, lengths = _first_token_rule("global")
    assert set(np.unique(lengths)) == {0, 2}  # the admission of x_1 depends on x_1 itself
    np.testing.assert_allclose(np.bincount(tokens, minlength=2) / tokens.size, [0.85, 0.15], atol=0.01)
    stat, threshold = chi2(tokens, [0.7, 0.3])
    assert stat > 10 * threshold  # the biased search is detected, far past the threshold


# ----------------------------------------------------------------------------- in the engine
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny target and an untrained DSpark drafter whose calibration spreads its confidences
    (temperature 0.3), so the schedulers see rows and positions that differ."""
    import dataclasses

    from conftest import make_tiny_hf_model
    from dspark_jax import init_drafter, load_target

    path = tmp_path_factory.mktemp("tiny_schedule")
    make_tiny_hf_model(str(path), "llama", False, eos_token_id=95)
    target = load_target(str(path))
    drafter = init_drafter(target, "dspark", seed=1, block_size=3)
    return target, dataclasses.replace(drafter, calibration={"temperatures": [0.3, 0.3, 0.3]}), str(path)


def _prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 90, size=int(rng.integers(3, 20))).tolist() for _ in range(n)]


def _table(slots, block, rate):
    """SPS(B) = 1 / (slots + rate * (B - slots)): each token past one per row costs `rate` of a row."""
    b = np.arange(sched.table_size(slots, block))
    return (1.0 / (slots + rate * np.maximum(b - slots, 0))).astype(np.float32)


def _drafted_rounds(engine, state, rounds=64, row=0):
    """Step until `row` finishes: per round of that row, whether the drafter ran. A step whose
    gate is closed at its start ends before the first round that drafts (decode.step's `shut`),
    so steps run fewer rounds than asked; the rounds themselves do not depend on that."""
    drafted = []
    while not bool(np.asarray(state.done)[row]):
        state, out = engine.step(state, rounds=rounds)
        drafted += [bool(np.any(z)) for z in out.round_confidence_logits[row]]
    return state, drafted


def test_every_policy_gives_the_plain_greedy_tokens(tiny):
    from dspark_jax import generate

    target, drafter, _ = tiny
    prompts = _prompts(4)
    plain = generate(target, prompts, max_new_tokens=16)
    verified = {}
    for policy in ("none", "fixed", "dspark", "dspark-lagged"):  # threshold: test_engine_lengths_follow_...
        out = generate(target, prompts, max_new_tokens=16, drafter=drafter, policy=policy,
                       sps_table=_table(4, 3, 0.3))
        assert out.token_ids == plain.token_ids, policy
        verified[policy] = out.stats.get("verified_per_round")
    assert verified["none"] is None  # plain decoding: the drafter never ran
    assert 2.5 < verified["fixed"] <= 3  # the whole block (less where the budget cuts it)
    assert 0 < verified["dspark"] < verified["fixed"] and 0 < verified["dspark-lagged"] < verified["fixed"]


def _engine_rounds(engine, prompts, rounds=3, **step):
    from dspark_jax import SamplingParams

    state = engine.new_state()
    state = engine.insert_many(state, [(i, p, SamplingParams(max_new_tokens=40)) for i, p in enumerate(prompts)])
    state, out = engine.step(state, rounds=rounds, **step)
    return state, out


def test_a_round_drafts_only_as_deep_as_it_may_verify(tiny):
    """Under "fixed" with max_length 1 the engine drafts at depth 1 (depths (1, 3) at G = 3):
    positions 2-3 carry no confidence; with max_length 2 it drafts the whole block."""
    from dspark_jax import Engine
    from dspark_jax.drafters.dflash import NO_CONFIDENCE

    target, drafter, _ = tiny
    engine = Engine(target, drafter, slots=2, max_len=128, policy="fixed")
    for max_length, deep in ((1, False), (2, True)):
        state, out = _engine_rounds(engine, _prompts(2, seed=4), max_length=max_length)
        assert int(state.drafted_rounds) == 3  # the engine's count of drafted rounds (depth probes)
        z = np.concatenate(out.round_confidence_logits[:2])  # [rounds, 3]
        assert len(z) and np.all(z[:, 0] > NO_CONFIDENCE)
        assert np.all(z[:, 1:] > NO_CONFIDENCE) if deep else np.all(z[:, 1:] == NO_CONFIDENCE)
        assert all(max(lengths) <= max_length for lengths in out.round_lengths[:2])


def test_engine_lengths_follow_the_policy_and_table(tiny):
    from dspark_jax import Engine

    target, drafter, _ = tiny
    prompts = _prompts(3, seed=1)  # 3 of 4 slots live
    engine = Engine(target, drafter, slots=4, max_len=128, policy="dspark", sps_table=np.full(17, 1.0))
    _, out = _engine_rounds(engine, prompts)
    flat = out
    assert all(lengths == [3] * 3 for lengths in out.round_lengths[:3])  # a flat table admits whole blocks
    assert out.round_tokens == [4 + 9] * 3  # every slot (the forward is dense) + verified drafts
    engine.sps_table = np.asarray([1.0] * 5 + [0.1] * 12)  # B > 4: any draft token costs far more than it gains
    _, out = _engine_rounds(engine, prompts)
    assert all(lengths == [0] * 3 for lengths in out.round_lengths[:3]) and out.round_tokens == [4] * 3
    np.testing.assert_allclose(out.round_predicted_tau, [3.0] * 3)
    # ...and at such a load the drafter does not even run (its confidence logits stay zero),
    # while under the flat table it drafted every round.
    assert all(not np.any(z) for z in out.round_confidence_logits[:3])
    assert all(np.all(z != 0) for z in flat.round_confidence_logits[:3])
    engine.sps_table = _table(4, 3, 0.3)
    _, out = _engine_rounds(engine, prompts)
    for r in range(3):  # the predicted tau is what the survivals of the verified positions add up to
        expect = sum(1 + out.round_survival[s][r][:out.round_lengths[s][r]].sum() for s in range(3))
        np.testing.assert_allclose(out.round_predicted_tau[r], expect, rtol=1e-5)
        tokens = 4 + sum(out.round_lengths[s][r] for s in range(3))
        assert out.round_tokens[r] == tokens
        dense = 4 * (1 + max(out.round_lengths[s][r] for s in range(3)))  # the forward's real width
        np.testing.assert_allclose(out.round_predicted_throughput[r], expect * _table(4, 3, 0.3)[dense], rtol=1e-5)

    threshold = Engine(target, drafter, slots=4, max_len=128, policy="threshold", threshold=0.4)
    _, out = _engine_rounds(threshold, prompts)
    for s in range(3):
        expect = (np.asarray(out.round_survival[s]) >= 0.4).sum(axis=1)
        assert out.round_lengths[s] == expect.tolist()
    _, out = _engine_rounds(threshold, prompts, policy="fixed", max_length=2)  # per-call policy and cap
    assert all(lengths == [2] * 3 for lengths in out.round_lengths[:3])


@pytest.mark.parametrize("plain", [1.0, 1.5])
def test_closed_gate_runs_plain_rounds_and_probes_ever_more_rarely(tiny, plain):
    """Where drafting does not pay, a dspark round is a plain one (write-first forward, no draft)
    except the probes: PROBE_EVERY rounds into a new engine, then after a gap that doubles with
    each probe that found drafting still does not pay (up to MAX_PROBE_EVERY); where a drafted
    round costs more than a plain one (plain rate 1.5 against SPS(R) = 1), no gap is shorter than
    probe_floor's (50 rounds)."""
    from dspark_jax import Engine, SamplingParams

    target, drafter, _ = tiny
    prompts = _prompts(3, seed=4)
    steep = [1.0] * 5 + [0.01] * 12  # any draft token costs far more than it gains
    table = sched.CostTable(slots=4, block_size=3, widths=[], steps_per_second=[], table=steep,
                            plain_steps_per_second=plain)
    engine = Engine(target, drafter, slots=4, max_len=256, policy="dspark", sps_table=table,
                    row_buckets=[4])
    state = engine.insert_many(engine.new_state(), [(i, p, SamplingParams(max_new_tokens=230, ignore_eos=True))
                                                    for i, p in enumerate(prompts)])
    first = int(state.forwards)  # the forward count of the first round
    again = engine.insert_many(engine.new_state(), [(i, p, SamplingParams(max_new_tokens=230, ignore_eos=True))
                                                    for i, p in enumerate(prompts)])
    state, drafted = _drafted_rounds(engine, state)
    # Steps of 5 rounds start with the gate closed far more often (the plain-only program) and
    # run the same rounds.
    again, drafted_by_5 = _drafted_rounds(engine, again, rounds=5)
    assert drafted_by_5 == drafted
    assert any(key[-1] is True for key in engine._steps if key[0] != "gate")  # the plain-only program ran
    floor = max(sched.PROBE_EVERY, int(np.ceil((plain - 1.0) / sched.PROBE_BUDGET - 1e-6)))
    expected, r, gap = [], max(sched.PROBE_EVERY, floor) - first, sched.PROBE_EVERY
    while r < len(drafted):
        expected.append(r)
        gap = min(max(2 * gap, floor), sched.MAX_PROBE_EVERY)
        r += 1 + gap
    assert len(drafted) > 200 and len(expected) >= 3
    assert [r for r, d in enumerate(drafted) if d] == expected  # even confidences of one do not pay


def test_a_step_returns_the_next_steps_gate_answer_and_host_view(tiny):
    """Engine.step copies back, with its tokens, what the next step's shape and gate read
    (HostView): the fields equal the device's, and its gate answer equals the gate program's on
    the new state, through steps where the gate is open (probes) and shut, rows finishing, and an
    insert (a new state, read afresh)."""
    import dataclasses

    from dspark_jax import Engine, SamplingParams

    target, drafter, _ = tiny
    steep = sched.CostTable(slots=4, block_size=3, widths=[], steps_per_second=[], table=[1.0] * 5 + [0.01] * 12,
                            plain_steps_per_second=1.5)
    engine = Engine(target, drafter, slots=4, max_len=256, policy="dspark", sps_table=steep)
    prompts = _prompts(4, seed=9)
    state = engine.insert_many(engine.new_state(), [(i, p, SamplingParams(max_new_tokens=40 + 50 * i, ignore_eos=True))
                                                    for i, p in enumerate(prompts[:3])])
    answers, inserted = [], False
    while not bool(np.all(np.asarray(state.done))):
        state, _ = engine.step(state, rounds=4)
        view = engine.host_view(state)
        for field, device in (("done", state.done), ("unreported", state.unreported), ("occupied", state.occupied),
                              ("lengths", state.cache.lengths), ("budget", state.budget), ("emitted", state.emitted)):
            np.testing.assert_array_equal(getattr(view, field), np.asarray(device), err_msg=field)
        (program_rounds, rounds, span, policy, rows, cap), drafts = view.gate
        sp = dataclasses.replace(engine._schedule_for(rows), round_limit=jnp.int32(rounds))
        asked = engine._gate_program(program_rounds, span, policy, rows)(*engine.weights, state, sp)
        assert drafts == bool(asked) and cap == 3 and program_rounds == rounds == 4
        answers.append(drafts)
        if not inserted and bool(np.asarray(state.done)[0]):
            state = engine.free(state, 0)
            state = engine.insert(state, 0, prompts[3], SamplingParams(max_new_tokens=30, ignore_eos=True))
            assert engine.host_view(state).gate is None and bool(engine.host_view(state).unreported[0])
            inserted = True
    assert inserted and True in answers and False in answers


def test_an_over_confident_head_is_corrected_online_and_retried(tiny):
    """A head that says ~1 where the untrained drafter's first token is accepted ~1 time in 6:
    the threshold policy first verifies whole blocks, then the online ratio takes its lengths to
    zero within a few rounds; with no new evidence the ratio drifts back and a later round tries
    drafting again (a correction that stopped drafting for good would learn nothing more)."""
    import dataclasses

    from dspark_jax import Engine, SamplingParams
    from dspark_jax.decode import online_ratio

    target, drafter, _ = tiny
    over = dataclasses.replace(drafter, calibration={"temperatures": [1.0] * 3, "shifts": [8.0] * 3})
    engine = Engine(target, over, slots=4, max_len=256, policy="threshold", threshold=0.5, row_buckets=[4])
    state = engine.insert_many(engine.new_state(), [(i, p, SamplingParams(max_new_tokens=220, ignore_eos=True))
                                                    for i, p in enumerate(_prompts(3, seed=4))])
    lengths = []
    while not bool(np.asarray(state.done)[0]):
        state, out = engine.step(state, rounds=32)
        lengths += out.round_lengths[0]
    tried, hits = np.asarray(state.tried)[0], np.asarray(state.accepted_at)[0]
    assert hits / tried < 0.35  # the head's ~1 is far off
    assert lengths[0] == 3 and all(n == 0 for n in lengths[4:30])
    assert 0 < sum(lengths[30:]) <= 0.1 * 3 * len(lengths[30:])  # retried now and then, not every round
    ratio = np.asarray(online_ratio(state))[0]
    assert ratio < 0.6


def test_a_fresh_engine_starts_its_gate_from_the_measured_acceptance(tiny):
    """A drafter whose calibration measured survival rates a_j starts a fresh engine's gate from
    c_j = a_j / a_{j-1} (engine.confidence_prior), not from ones: where those do not pay, its
    first round is plain and the first drafted round is the probe PROBE_EVERY rounds in."""
    import dataclasses

    from dspark_jax import Engine, SamplingParams
    from dspark_jax.engine import confidence_prior

    target, drafter, _ = tiny
    calibrated = dataclasses.replace(drafter, calibration={"temperatures": [1e6] * 3,
                                                           "survival_rates": [0.5, 0.25, 0.125]})
    assert confidence_prior(calibrated, calibrated.config) == (0.5, 0.5, 0.5)
    assert confidence_prior(drafter, drafter.config) is None  # no rates measured: ones, as before
    # 4 slots: a level of confidences one pays (6 tokens at 0.6 > 3 at 1), of 0.5s none does.
    table = np.asarray([1.0] * 5 + [0.6] * 4 + [0.1] * 8, np.float32)
    engine = Engine(target, calibrated, slots=4, max_len=256, policy="dspark", sps_table=table, row_buckets=[4])
    state = engine.new_state()
    np.testing.assert_allclose(np.asarray(state.gate_confidences), 0.5)
    state = engine.insert_many(state, [(i, p, SamplingParams(max_new_tokens=100, ignore_eos=True))
                                       for i, p in enumerate(_prompts(3, seed=4))])
    np.testing.assert_allclose(np.asarray(state.gate_confidences), 0.5)  # nothing measured: the prior
    first = int(state.forwards)
    state, drafted = _drafted_rounds(engine, state)
    assert [r for r, d in enumerate(drafted) if d][0] == sched.PROBE_EVERY - first


def test_a_round_opened_by_start_values_counts_as_a_probe(tiny):
    """A fresh engine's gate starts from ones (a drafter with no measured survival rates), which
    open it; that first round measures the rows
    like a probe, so where their measured confidences do not pay, the probe gap doubles from it
    (rounds 0, 33, 98) instead of restarting at PROBE_EVERY as after a round that paid."""
    import dataclasses

    from dspark_jax import Engine, SamplingParams

    target, drafter, _ = tiny
    flat = dataclasses.replace(drafter, calibration={"temperatures": [1e6] * 3})  # every confidence 0.5
    # 4 slots: a level of confidences one pays (6 tokens at 0.6 > 3 at 1), of 0.5s none does.
    table = np.asarray([1.0] * 5 + [0.6] * 4 + [0.1] * 8, np.float32)
    conf = np.zeros((4, 3), np.float32)
    conf[:3] = 0.5
    live = jnp.asarray([True, True, True, False])
    params = sched.ScheduleParams(jnp.asarray(table), jnp.float32(0.5), jnp.int32(3), jnp.float32(table[4]))
    assert bool(sched.drafting_pays(jnp.ones((4, 3)), jnp.asarray([3, 3, 3, 0]), params, live))
    assert not bool(sched.drafting_pays(jnp.asarray(conf), jnp.asarray([3, 3, 3, 0]), params, live))

    engine = Engine(target, flat, slots=4, max_len=256, policy="dspark", sps_table=table)
    state = engine.insert_many(engine.new_state(), [(i, p, SamplingParams(max_new_tokens=200, ignore_eos=True))
                                                    for i, p in enumerate(_prompts(3, seed=4))])
    state, drafted = _drafted_rounds(engine, state)
    assert [r for r, d in enumerate(drafted) if d][:3] == [0, 1 + 2 * sched.PROBE_EVERY,
                                                       2 + 2 * sched.PROBE_EVERY + 4 * sched.PROBE_EVERY]


def _context_rows(state, kind, row, length):
    """The drafter context a row's committed `length` positions wrote: DFlash K/V slots
    [0, length); EAGLE-3's entries [0, length - 1) (entry p waits for the token at p + 1) and
    its pending feature; the n-gram drafter's token history."""
    d = state.drafter
    if kind == "dspark":
        return [d.k[:, row, :, :length], d.v[:, row, :, :length]]
    if kind == "eagle3":
        return [d.k[row, :length - 1], d.v[row, :length - 1], d.pending[row]]
    return [d.history[row, :length]]


@pytest.mark.parametrize("kind", ["dspark", "eagle3", "ngram"])
def test_plain_rounds_keep_the_drafter_context(tiny, kind):
    """A drafter engine's plain rounds (policy "none" per call) and a closed dspark gate's (the
    plain-only `shut` program), which both extend the drafter's context once per step over all
    their rounds, emit the plain greedy tokens and give the drafter the same context as rounds
    that verify whole blocks, so the gate's next probe drafts from it."""
    from dspark_jax import Engine, SamplingParams, generate, init_drafter

    target, drafter, _ = tiny
    if kind != "dspark":
        drafter = init_drafter(target, kind, seed=2, block_size=3)
    prompts = _prompts(3, seed=4)
    closed = np.asarray([1.0] * 5 + [0.1] * 12)  # B > 4: any draft token costs far more than it gains

    def run(policy, rounds=2):
        eng = Engine(target, drafter, slots=4, max_len=128, policy="fixed", sps_table=closed)
        st = eng.insert_many(eng.new_state(), [(i, p, SamplingParams(max_new_tokens=24)) for i, p in enumerate(prompts)])
        tokens = [[] for _ in prompts]
        drafted = []
        while not all(bool(d) for d in np.asarray(st.done)[:3]):
            st, out = eng.step(st, rounds=rounds, policy=policy)
            drafted += [bool(np.any(z)) for z in out.round_confidence_logits[0]]
            for i in range(3):
                tokens[i] += out.tokens[i]
        return st, tokens, drafted

    plain_state, plain_tokens, _ = run("none", rounds=5)  # 5: the last step's rounds run past the end
    fixed_state, fixed_tokens, _ = run("fixed")
    assert plain_tokens == fixed_tokens == generate(target, prompts, max_new_tokens=24).token_ids
    lengths = np.asarray(plain_state.cache.lengths)
    others = [fixed_state]
    if kind == "dspark":  # the gate reads a confidence head
        shut_state, shut_tokens, shut_drafted = run("dspark", rounds=8)
        assert shut_drafted.count(False) >= 16  # the gate's first probe is 16 rounds in: those ran shut
        assert shut_tokens == plain_tokens
        others.append(shut_state)
    for other in others:
        assert lengths[:3].tolist() == np.asarray(other.cache.lengths)[:3].tolist()
        for row in range(3):  # every committed position's context, however it was committed
            for a, b in zip(_context_rows(plain_state, kind, row, lengths[row]),
                            _context_rows(other, kind, row, lengths[row])):
                np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=0.02, atol=0.02)
    if kind == "dspark":
        for row in range(3):  # the same projections of the same features: equal up to float rounding
            for a, b in zip(_context_rows(plain_state, kind, row, lengths[row]),
                            _context_rows(shut_state, kind, row, lengths[row])):
                np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-4, atol=1e-5)


def test_dspark_span_plans_for_plain_rounds_and_drafts_are_cut_to_it(tiny, tmp_path_factory):
    """The dspark policies' step attends over a span that plans for plain rounds plus one block
    (Engine.span_for); a round's drafts are cut on the device so every verified position stays
    inside it (decode.round_caps), and the output is still exactly the plain greedy one."""
    import dataclasses

    from conftest import make_tiny_hf_model
    from dspark_jax import Engine, SamplingParams, generate, init_drafter, load_target

    path = tmp_path_factory.mktemp("tiny_long")  # room for spans of 256 and 512 positions
    make_tiny_hf_model(str(path), "llama", False, eos_token_id=95, max_position_embeddings=512)
    target = load_target(str(path))
    drafter = dataclasses.replace(init_drafter(target, "dspark", seed=1, block_size=3),
                                  calibration=tiny[1].calibration)
    engine = Engine(target, drafter, slots=2, max_len=512, policy="dspark", sps_table=np.full(9, 1.0))
    prompt = (_prompts(1, seed=5)[0] * 40)[:230]
    state = engine.insert_many(engine.new_state(), [(0, prompt, SamplingParams(max_new_tokens=60))])
    assert engine.span_for(state, 8, "dspark") == 256  # 230 + 8 plain rounds + one block of 3
    assert engine.span_for(state, 8, "fixed") == 512  # 230 + 8 rounds of 4 positions
    # 247 + 8 tokens fit a span of 256: a row that may run all 8 rounds of a step keeps one slot
    # per later round, which leaves it one draft token (decode.round_caps); a row whose whole
    # budget fits the span needs no room for rounds it cannot run and is not cut.
    from dspark_jax import decode

    prompt = (_prompts(1, seed=5)[0] * 40)[:247]
    at_256 = dataclasses.replace(engine.settings, kv_len=256)
    for budget, want in ((60, 1), (9, 3)):
        state = engine.insert_many(engine.new_state(), [(0, prompt, SamplingParams(max_new_tokens=budget))])
        assert int(decode.round_caps(state, at_256, np.int32(8))[0]) == want
    # The 9-token request then runs in that span, every round verifying what its budget allows.
    tokens = []
    while not bool(np.asarray(state.done)[0]):
        span, position, emitted = engine.span_for(state, 8), int(state.cache.lengths[0]), int(state.emitted[0])
        assert span == 256
        state, out = engine.step(state, rounds=8)
        tokens += out.tokens[0]
        for length, accepted in zip(out.round_lengths[0], out.round_accepted[0]):
            assert length == min(3, budget - emitted - 1) and position + length < span
            position, emitted = position + accepted + 1, emitted + accepted + 1
    assert tokens == generate(target, [prompt], max_new_tokens=budget).token_ids[0]
    # After a step that verified no draft (a steep table closes the gate), the plan is plain
    # rounds only: 248 + 8 fits 256, where another block of 3 would not. An array prices every
    # row bucket and one live request runs at bucket 1 (plain rate SPS(1)), so it is steep past B = 1.
    engine.sps_table = np.asarray([1.0] * 2 + [0.01] * 7, np.float32)
    state = engine.insert_many(engine.new_state(), [(0, prompt[:240], SamplingParams(max_new_tokens=60))])
    assert engine.span_for(state, 8, "dspark") == 256  # 240 + 8 + 3 after the drafting steps above
    state, out = engine.step(state, rounds=8)
    assert out.round_lengths[0] == [0] * 8 and int(state.cache.lengths[0]) == 248
    assert engine.span_for(state, 8, "dspark") == 256 and engine.span_for(state, 8, "fixed") == 512


def test_no_recompile_when_load_table_or_threshold_change(tiny):
    from dspark_jax import Engine, SamplingParams

    target, drafter, _ = tiny
    engine = Engine(target, drafter, slots=4, max_len=128, policy="dspark", sps_table=_table(4, 3, 0.3))
    engine.warmup(rounds=(2,))
    lagged = Engine(target, drafter, slots=4, max_len=128, policy="dspark-lagged", sps_table=_table(4, 3, 0.3))
    lagged.warmup(rounds=(2,))
    with recorded_compiles() as compiles:
        for eng in (engine, lagged):
            state = eng.insert(eng.new_state(), 0, _prompts(1)[0], SamplingParams(max_new_tokens=30))
            state, _ = eng.step(state, rounds=2)
            state = eng.insert(state, 2, _prompts(2)[1],
                               SamplingParams(max_new_tokens=30, temperature=0.8, seed=3))
            state, _ = eng.step(state, rounds=2)  # more load
            eng.sps_table = _table(4, 3, 0.05)
            state, _ = eng.step(state, rounds=2)  # another table
            eng.threshold = 0.9
            state, _ = eng.step(state, rounds=2, max_length=1)  # another cap
            state, out = eng.step(state, rounds=1)  # fewer rounds: the 2-round program, limited
            assert out.rounds == 1
    assert not compiles, compiles


def test_fewer_rounds_on_a_larger_program_run_exactly_those_rounds(tiny):
    """A step of r rounds runs on the smallest warmed-up program of at least r rounds, limited
    to r as data (decode.round_limit): its tokens, rounds and drafts are those of an engine with
    r-round programs, step for step, under the dspark gate and a fixed length."""
    from dspark_jax import Engine, SamplingParams

    target, drafter, _ = tiny
    for policy in ("dspark", "fixed"):
        runs = []
        for warm in ((1, 3), (4,)):
            engine = Engine(target, drafter, slots=4, max_len=128, policy=policy,
                            sps_table=np.ones(sched.table_size(4, 3), np.float32))  # drafting costs nothing
            engine._warm_rounds.update(warm)  # what warmup(rounds=warm) records, without compiling it all
            state = engine.insert_many(engine.new_state(), [
                (i, p, SamplingParams(max_new_tokens=25 + 9 * i, temperature=0.8 * (i % 2), seed=i))
                for i, p in enumerate(_prompts(3, seed=2))])
            trail = []
            for rounds in (1, 3, 1, 1, 3, 3, 3, 3, 3, 3):
                state, out = engine.step(state, rounds=rounds)
                trail.append((out.tokens, out.rounds, out.round_lengths))
            runs.append(trail)
            assert {key[0] for key in engine._steps if key[0] != "gate"} == set(warm)
        assert runs[0] == runs[1], policy
        assert any(n for _, _, lengths in runs[0] for row in lengths for n in row), policy  # drafts were verified


def test_profile_sps_cli_and_json_round_trip(tiny, tmp_path):
    from dspark_jax import Engine
    from dspark_jax.drafters import save_drafter

    target, drafter, path = tiny
    engine = Engine(target, drafter, slots=2, max_len=128, policy="dspark")
    engine.warmup(rounds=(1,))  # no table given: warmup profiles one
    table = engine.cost_table
    assert table.widths == [1, 2, 4] and len(table.table) == 2 * 4 + 1
    assert all(s > 0 for s in table.steps_per_second) and table.plain_steps_per_second > 0
    assert table.table[0] == table.table[2] == table.steps_per_second[0] and table.table[8] == table.steps_per_second[2]
    one = table.row_buckets[0]  # the engine's other row bucket: one slot live, its own forward
    assert [t.slots for t in table.row_buckets] == [1] and one.widths == [1, 2, 4] and len(one.table) == 1 * 4 + 1
    assert all(s > 0 for s in one.steps_per_second) and one.plain_steps_per_second > 0
    save_drafter(drafter, str(tmp_path / "drafter"))
    out = tmp_path / "sps.json"
    assert sched.main(["--model", path, "--drafter", str(tmp_path / "drafter"), "--slots", "2", "--max-len", "128",
                       "--out", str(out)]) == 0
    assert (tmp_path / "sps.png").stat().st_size > 0
    loaded = Engine(target, drafter, slots=2, max_len=128, policy="dspark", sps_table=str(out))
    assert loaded.cost_table.widths == [1, 2, 4] and loaded.sps_table.shape == (9,)
    assert [t.slots for t in loaded.cost_table.row_buckets] == [1]


def test_a_profiled_table_is_cached_and_read_back_by_the_same_engine_only(tiny, tmp_path, monkeypatch):
    from dspark_jax import Engine, table_cache

    target, drafter, _ = tiny
    calls = []
    real = sched.profile_sps
    monkeypatch.setattr(sched, "profile_sps", lambda *a, **k: calls.append(k.get("rows")) or real(*a, **k))
    cache = str(tmp_path / "sps")
    first = Engine(target, drafter, slots=2, max_len=128, policy="dspark", sps_cache=cache)
    first.warmup(rounds=(1,), execute=False)
    assert sorted(calls) == [1, 2] and first.cost_table_source == "profiled"
    # Profiling ran "fixed" and "none" steps; their programs are dropped (memory maps on XLA:CPU).
    assert {key[3] if key[0] == "gate" else key[2] for key in first._steps} == {"dspark"}
    files = os.listdir(cache)
    assert files == [os.path.basename(table_cache.path_for(first, cache))]

    again = Engine(target, drafter, slots=2, max_len=128, policy="dspark", sps_cache=cache)
    again.warmup(rounds=(1,), execute=False)
    assert sorted(calls) == [1, 2], "a matching cached table must not be profiled again"
    assert again.cost_table_source == f"cache {os.path.join(cache, files[0])}"
    np.testing.assert_array_equal(again.sps_table, first.sps_table)
    assert [t.table for t in again.cost_table.row_buckets] == [t.table for t in first.cost_table.row_buckets]

    # Another engine shape, or another drafter shape, is another key: profiled, kept beside.
    other = Engine(target, drafter, slots=2, max_len=128, block_size=2, policy="dspark", sps_cache=cache)
    assert table_cache.fingerprint(other) != table_cache.fingerprint(first)
    other.warmup(rounds=(1,), execute=False)
    assert len(calls) == 4 and other.cost_table_source == "profiled" and len(os.listdir(cache)) == 2

    # A file that is not a table for this engine is reported, ignored and overwritten.
    with open(os.path.join(cache, files[0]), "w") as f:
        f.write("{not json")
    broken = Engine(target, drafter, slots=2, max_len=128, policy="dspark", sps_cache=cache)
    broken.warmup(rounds=(1,), execute=False)
    assert len(calls) == 6 and broken.cost_table_source == "profiled"
    assert table_cache.load(broken, cache)[0].table == broken.cost_table.table

    # A table given by the caller wins over the cache; DSPARK_SPS_CACHE=0 gives the server no directory.
    given = Engine(target, drafter, slots=2, max_len=128, policy="dspark", sps_table=first.cost_table,
                   sps_cache=cache)
    given.warmup(rounds=(1,), execute=False)
    assert len(calls) == 6 and given.cost_table_source == "given"
    monkeypatch.setenv("DSPARK_SPS_CACHE", "0")
    assert table_cache.default_dir() is None


def test_user_errors_name_the_problem(tiny):
    from dspark_jax import Engine

    target, drafter, _ = tiny
    with pytest.raises(ValueError, match="policy must be one of"):
        Engine(target, drafter, slots=2, max_len=128, policy="eager")
    with pytest.raises(ValueError, match="threshold must be"):
        Engine(target, drafter, slots=2, max_len=128, policy="threshold", threshold=1.5)
    with pytest.raises(ValueError, match="sps_table must be"):
        Engine(target, drafter, slots=2, max_len=128, policy="dspark", sps_table=[[1.0]])
    engine = Engine(target, drafter, slots=2, max_len=128)
    with pytest.raises(ValueError, match="max_length must be"):
        engine.step(engine.new_state(), max_length=4)


def test_a_cap_of_zero_steps_plain_rounds_to_the_end(tiny):
    """step(..., max_length=0) under dspark never drafts, probes included, and every step runs
    rounds until the requests finish (a due probe it may not run must not stall the step): the
    tokens are plain greedy decoding's."""
    from dspark_jax import Engine, SamplingParams, generate

    target, drafter, _ = tiny
    prompts = _prompts(2, seed=5)
    engine = Engine(target, drafter, slots=2, max_len=256, policy="dspark", sps_table=_table(2, 3, 0.3))
    state = engine.insert_many(engine.new_state(), [(i, p, SamplingParams(max_new_tokens=60, ignore_eos=True))
                                                    for i, p in enumerate(prompts)])
    tokens = [[], []]
    for _ in range(15):  # 59 rounds are needed: whole steps of 4 (a stalled step ran none)
        state, out = engine.step(state, rounds=4, max_length=0)
        assert out.rounds == 4 or all(out.finished)
        assert not any(np.any(z) for z in out.round_confidence_logits)  # nothing drafted
        for i in range(2):
            tokens[i] += out.tokens[i]
        if all(out.finished):
            break
    assert tokens == generate(target, prompts, max_new_tokens=60, ignore_eos=True).token_ids


def test_a_request_that_fits_its_span_drafts_to_its_last_round(tiny):
    """round_caps keeps room in the step's span for the step's later rounds only where the row
    could run them: a request whose whole budget fits the span verifies every round as much as
    its budget allows, even with 32 rounds a step and the cache filled to the last slot."""
    from dspark_jax import Engine, SamplingParams

    target, drafter, _ = tiny
    prompt, g, max_len = _prompts(1, seed=2)[0][:10], 3, 128
    budget = max_len - len(prompt) - (g + 1)  # the largest the engine accepts
    engine = Engine(target, drafter, slots=1, max_len=max_len, policy="fixed", row_buckets=[1])
    state = engine.insert(engine.new_state(), 0, prompt, SamplingParams(max_new_tokens=budget, ignore_eos=True))
    short, emitted = [], 1
    while True:
        state, out = engine.step(state, rounds=32)
        for length, accepted in zip(out.round_lengths[0], out.round_accepted[0]):
            if length < min(g, budget - emitted - 1):
                short.append((emitted, length))
            emitted += accepted + 1
        if out.finished[0]:
            break
    assert emitted == budget and not short  # was: the last 6 rounds verified nothing


def test_a_reused_slot_starts_the_lagged_history_from_the_prior(tiny):
    """dspark-lagged sizes its budget from confidences two rounds old: a request inserted into a
    slot whose last request finished long ago starts from the same prior as in a fresh engine
    (it held zeros, and the new request's first two rounds verified nothing)."""
    from dspark_jax import Engine, SamplingParams

    target, drafter, _ = tiny
    flat = np.full(9, 1.0, np.float32)  # 2 slots, G = 3: every level pays
    a, other, b = _prompts(3, seed=7)

    def first_lengths(engine, state):
        state = engine.insert(state, 0, b, SamplingParams(max_new_tokens=30, ignore_eos=True))
        lengths = []
        for _ in range(4):
            state, out = engine.step(state, rounds=1)
            lengths += out.round_lengths[0]
        return lengths

    fresh = Engine(target, drafter, slots=2, max_len=128, policy="dspark-lagged", sps_table=flat, row_buckets=[2])
    want = first_lengths(fresh, fresh.new_state())
    assert want == [3, 3, 3, 3]
    used = Engine(target, drafter, slots=2, max_len=128, policy="dspark-lagged", sps_table=flat, row_buckets=[2])
    state = used.insert_many(used.new_state(), [(0, a, SamplingParams(max_new_tokens=3, ignore_eos=True)),
                                                (1, other, SamplingParams(max_new_tokens=60, ignore_eos=True))])
    while not bool(np.asarray(state.done)[0]):
        state, _ = used.step(state, rounds=1)
    for _ in range(3):  # slot 1 drafts on while slot 0 sits done
        state, _ = used.step(state, rounds=1)
    state = used.free(used.free(state, 0), 1)
    assert first_lengths(used, state) == want


def test_calibration_collects_only_rounds_that_verified_the_whole_block(tiny):
    """train.calibrate fits survival labels on rounds that tested all G positions: a request's
    last rounds, cut by its budget, tested nothing past their length and are left out."""
    from dspark_jax import Engine, SamplingParams
    from dspark_jax.batch import run_requests
    from train.calibrate import collect

    target, drafter, _ = tiny
    engine = Engine(target, drafter, slots=2, max_len=128, policy="fixed")
    prompts = _prompts(3, seed=3)
    z, accepted, request = collect(engine, prompts, 0.0, 12, 0)
    results = run_requests(engine, prompts, [SamplingParams(seed=i, max_new_tokens=12) for i in range(3)])
    lengths = np.concatenate([r.round_lengths for r in results])
    assert (lengths < 3).any() and (lengths == 3).any()  # budget-cut rounds exist
    whole = lengths == 3
    assert len(z) == whole.sum()
    np.testing.assert_array_equal(accepted, np.concatenate([r.round_accepted for r in results])[whole])
    np.testing.assert_array_equal(z, np.concatenate([r.round_confidence_logits for r in results])[whole])


def test_evaluation_tau_counts_whole_blocks_and_tested_positions(tiny):
    """train.evaluate's tau is over rounds that verified all G drafts and its acceptance per
    position over positions verification tested: a budget-cut round (fewer drafts verified)
    neither lowers tau nor counts untested positions as rejected. Checked against plain loops."""
    import types

    from dspark_jax import Engine, SamplingParams
    from dspark_jax.batch import run_requests
    from train.evaluate import acceptance

    target, drafter, _ = tiny
    engine = Engine(target, drafter, slots=2, max_len=128, policy="fixed")
    prompts = _prompts(3, seed=8)
    got = acceptance(engine, prompts, 0.0, types.SimpleNamespace(seed=0, max_new_tokens=10))
    results = run_requests(engine, prompts, [SamplingParams(seed=i, max_new_tokens=10) for i in range(3)])
    rounds = [(l, a) for r in results for l, a in zip(r.round_lengths, r.round_accepted)]
    assert any(l < 3 for l, _ in rounds)
    whole = [a + 1 for l, a in rounds if l == 3]
    assert got["rounds"] == len(whole) and got["tau"] == pytest.approx(sum(whole) / len(whole))
    for k in range(3):  # position k + 1: tested when k drafts were accepted and the length exceeds k
        tested = [a for l, a in rounds if a >= k and l > k]
        want = sum(a > k for a in tested) / max(len(tested), 1)
        assert got["acceptance_per_position"][k] == pytest.approx(want)
