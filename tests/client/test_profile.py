"""Window profiles: the greedy knapsack against exhaustive search, the trace replay, the JSON file."""

import json
import logging

import numpy as np
import pytest

from kvdrive_client.cache_sim import CachePolicy, Trace, stream_hits
from kvdrive_client.profile import (
    FORMAT_VERSION,
    ProfileError,
    WindowProfile,
    capacity_pages,
    choose_shrink,
    profile_from_trace,
    shrunk,
    step_halves,
    solve_windows,
    solve_windows_exact,
    total_at,
    uniform_cost,
    window_misses,
    window_misses_per_step,
)


def convex_case(rng, streams, choices):
    """Every upgrade step costs the same bytes and saves no more than the step before."""
    unit, base = int(rng.integers(1, 5)), int(rng.integers(0, 5))
    costs = np.array([[base + unit * j for j in range(choices)]] * streams)
    savings = -np.sort(-rng.integers(0, 20, (streams, choices - 1)), axis=1)
    misses = rng.integers(60, 100, (streams, 1)) - np.concatenate([np.zeros((streams, 1)), savings.cumsum(axis=1)], 1)
    return misses, costs


def general_case(rng, streams, choices):
    """Any misses (rising with the window too), uneven and zero-byte upgrade steps."""
    costs = rng.integers(0, 10, (streams, choices)).cumsum(axis=1)
    misses = rng.integers(0, 100, (streams, choices)).astype(float)
    return misses, costs


def random_budget(rng, costs):
    floor, ceiling = int(costs[:, 0].sum()), int(costs[:, -1].sum())
    return floor + int(rng.integers(0, ceiling - floor + 2))


def test_greedy_is_exact_on_convex_curves_with_even_steps():
    rng = np.random.default_rng(0)
    for _ in range(300):
        misses, costs = convex_case(rng, int(rng.integers(1, 5)), int(rng.integers(2, 6)))
        budget = random_budget(rng, costs)
        greedy, exact = solve_windows(misses, costs, budget), solve_windows_exact(misses, costs, budget)
        assert total_at(costs, greedy) <= budget
        assert total_at(misses, greedy) == pytest.approx(total_at(misses, exact)), (misses, costs, budget)


@pytest.mark.parametrize("make", [convex_case, general_case])
def test_greedy_fits_the_budget_is_never_worse_than_uniform_and_stays_within_the_bound(make):
    rng = np.random.default_rng(1)
    inexact = 0
    for _ in range(300):
        misses, costs = make(rng, int(rng.integers(1, 5)), int(rng.integers(1, 5)) + (make is convex_case))
        budget = random_budget(rng, costs)
        greedy, exact = solve_windows(misses, costs, budget), solve_windows_exact(misses, costs, budget)
        _, uniform = uniform_cost(misses, costs, budget)
        got, best = total_at(misses, greedy), total_at(misses, exact)
        assert total_at(costs, greedy) <= budget and total_at(costs, exact) <= budget
        assert best <= got <= uniform + 1e-9
        # The documented bound: within the largest saving of one stream of the optimum.
        assert got <= best + (misses[:, 0] - misses.min(axis=1)).max() + 1e-9
        inexact += got > best + 1e-9
    if make is general_case:
        assert inexact > 0  # the greedy is a heuristic there, and the cases show it


def test_an_upgrade_that_does_not_fit_leaves_the_greedy_short_of_the_optimum():
    # A's upgrade has the best ratio, takes 3 of 4 bytes, and B's and C's no longer fit.
    misses = [[3.3, 0.0], [2.0, 0.0], [2.0, 0.0]]
    costs = [[0, 3], [0, 2], [0, 2]]
    assert solve_windows(misses, costs, 4) == [1, 0, 0]
    assert solve_windows_exact(misses, costs, 4) == [0, 1, 1]


def test_the_best_uniform_choice_is_kept_when_the_greedy_misses_more():
    # Greedy alone: A to choice 1, then A to 2, and B's upgrade no longer fits: 1 + 3 = 4 misses.
    misses = [[8.0, 3.0, 1.0], [3.0, 0.0, 8.0]]
    costs = [[0, 5, 8], [0, 5, 9]]
    assert uniform_cost(misses, costs, 11) == (1, 3.0)
    assert solve_windows(misses, costs, 11) == [1, 1]


def test_bytes_are_spent_only_where_they_save_misses():
    misses = [[5.0, 5.0, 5.0], [9.0, 9.0, 2.0], [4.0, 1.0, 1.0]]
    costs = [[10, 20, 30], [10, 20, 30], [10, 10, 40]]
    # Stream 2's first upgrade is free; stream 0 never gains; stream 1 gains only at its top choice.
    assert solve_windows(misses, costs, 1000) == [0, 2, 1]
    assert solve_windows(misses, costs, 30) == [0, 0, 1]


def test_a_budget_below_the_cheapest_choice_everywhere_is_refused():
    misses, costs = [[3.0, 1.0], [3.0, 1.0]], [[10, 20], [10, 20]]
    for solve in (solve_windows, solve_windows_exact, uniform_cost):
        with pytest.raises(ValueError, match="cannot hold even the cheapest choice"):
            solve(misses, costs, 19)
    assert solve_windows(misses, costs, 20) == [0, 0]


@pytest.mark.parametrize("misses, costs, match", [
    ([[1.0, 0.0]], [[1, 2], [1, 2]], "same"),
    ([1.0, 0.0], [1, 2], r"\[streams\]\[choices\]"),
    ([[1.0, 0.0]], [[2, 1]], "decrease"),
    ([[1.0, float("nan")]], [[1, 2]], "finite"),
    ([[1.0, 0.0]], [[-1, 2]], ">= 0"),
])
def test_bad_curves_are_refused(misses, costs, match):
    with pytest.raises(ValueError, match=match):
        solve_windows(misses, costs, 10)


# ---------------------------------------------------------------- the trace replay


def random_trace(seed, streams=6, steps=12, k=3, pool=16):
    rng = np.random.default_rng(seed)
    selected = np.stack([np.stack([rng.choice(pool, k, replace=False) for _ in range(steps)]) for _ in range(streams)])
    scores = rng.standard_normal((streams, steps, pool)).astype(np.float32)
    return Trace(selected, scores)


def test_window_misses_replay_the_trace_at_each_window_without_the_warmup():
    trace = random_trace(0)
    choices = [1.0, 1.5, 2.0, 8.0]
    got = window_misses(trace, choices, warmup_steps=2)
    assert got.shape == (6, 4)
    for n in range(6):
        for j, window in enumerate(choices):
            hits = stream_hits(trace.selected[n], trace.scores[n], capacity_pages(window, 3), CachePolicy.LOOKAHEAD)
            assert got[n, j] == pytest.approx((3 * 10 - sum(hits[2:])) / 10)
    # 8 x 3 pages hold the whole pool of 16: after the warm-up only first uses miss.
    first_uses = [len(set(trace.selected[n].ravel())) - len(set(trace.selected[n, :2].ravel())) for n in range(6)]
    assert got[:, 3] == pytest.approx(np.array(first_uses) / 10)
    with pytest.raises(ValueError, match="warmup_steps"):
        window_misses(trace, choices, warmup_steps=12)


def test_profile_from_trace_chooses_within_the_budget_and_beats_uniform():
    trace = random_trace(1, streams=2 * 3)
    meta = dict(num_layers=2, num_kv_heads=3, page_bytes=1024, sink_pages=1, model="tiny", dtype="float32",
                page_size=16, budget=0.0625, text="random", context=512)
    p = profile_from_trace(trace, **meta)
    assert (p.num_layers, p.num_kv_heads, p.k, p.steps) == (2, 3, 3, 11)
    assert p.cache_bytes == 6 * capacity_pages(4.0, 3, 1) * 1024  # uniform x4 by default
    assert all(w in p.choices for row in p.windows for w in row)
    assert p.used_bytes <= p.cache_bytes
    window, uniform_bytes, uniform_fetched = p.uniform()
    assert window == 4.0 and uniform_bytes == p.cache_bytes
    assert p.fetched_bytes_per_step() <= uniform_fetched
    small = profile_from_trace(trace, cache_bytes=6 * capacity_pages(1.0, 3, 1) * 1024, **meta)
    assert small.windows == [[1.0] * 3] * 2
    with pytest.raises(ValueError, match="cannot hold even"):
        profile_from_trace(trace, cache_bytes=1024, **meta)
    with pytest.raises(ValueError, match="streams"):
        profile_from_trace(trace, **{**meta, "num_layers": 3})


def test_held_out_steps_keep_real_differences_between_heads():
    # Half the streams miss a lot at small windows and nothing at large ones, the other
    # half the reverse shape, on every step: a difference that holds on held-out steps.
    steps = 8
    per_step = np.zeros((6, 3, steps))
    per_step[:3] = np.array([8.0, 2.0, 0.0])[:, None]
    per_step[3:] = np.array([1.0, 1.0, 1.0])[:, None]
    costs = np.array([[1, 2, 4]] * 6)
    check = choose_shrink(step_halves(per_step), costs, budget=15)  # uniform: choice 1 everywhere (12 bytes)
    assert check.shrink > 0
    assert min(check.held_out) < check.uniform
    choice = solve_windows(shrunk(per_step.mean(axis=2), check.shrink), costs, 15)
    assert choice[:3] == [2, 2, 2] and choice[3:] == [0, 0, 0]


def test_noise_between_heads_falls_back_to_one_window_everywhere():
    # Every stream's curve is the same but for noise that flips between the halves:
    # per-head windows fitted on one half lose on the other, so one window is kept.
    steps = 8
    per_step = np.tile(np.array([6.0, 3.0, 1.0])[None, :, None], (6, 1, steps))
    flip = np.where(np.arange(6) % 2 == 0, 1.0, -1.0)
    per_step[:, 1, : steps // 2] += 2.0 * flip[:, None]
    per_step[:, 1, steps // 2 :] -= 2.0 * flip[:, None]
    costs = np.array([[1, 2, 4]] * 6)
    check = choose_shrink(step_halves(per_step), costs, budget=6 * 2)
    assert check.shrink == 0.0 and min(check.held_out) >= check.uniform
    assert step_halves(per_step[:, :, :3]) is None  # too short to split
    with pytest.raises(ValueError, match="at least 2 folds"):
        choose_shrink([per_step.mean(axis=2)], costs, budget=12)


def test_each_calibration_sequence_is_held_out_in_turn(caplog):
    # Two sequences of random selections: the profile's curves are their mean, and the
    # shrink is chosen by fitting on one and scoring on the other.
    one, two = random_trace(5, streams=6), random_trace(6, streams=6)
    meta = dict(num_layers=2, num_kv_heads=3, page_bytes=1024, sink_pages=0, model="tiny", dtype="float32",
                page_size=16, budget=0.0625, text="random", context=512)
    both = Trace(np.concatenate([one.selected, two.selected]), np.concatenate([one.scores, two.scores]))
    with caplog.at_level(logging.INFO, logger="kvdrive_client.profile"):
        p = profile_from_trace(both, cache_bytes=6 * capacity_pages(2.0, 3) * 1024, **meta)
    assert any("2 calibration sequences" in r.message for r in caplog.records)
    mean = (window_misses(one, p.choices) + window_misses(two, p.choices)) / 2
    assert np.allclose(np.asarray(p.misses).reshape(6, -1), mean)
    with pytest.raises(ValueError, match="multiple of that many"):
        profile_from_trace(Trace(both.selected[:7], both.scores[:7]), **meta)


@pytest.mark.parametrize("seed", range(4))
def test_random_selections_get_one_window_everywhere(seed, caplog):
    trace = random_trace(seed, streams=2 * 3)  # no head really differs from another
    meta = dict(num_layers=2, num_kv_heads=3, page_bytes=1024, sink_pages=1, model="tiny", dtype="float32",
                page_size=16, budget=0.0625, text="random", context=512)
    budget = 6 * capacity_pages(2.0, 3, 1) * 1024
    with caplog.at_level(logging.INFO, logger="kvdrive_client.profile"):
        p = profile_from_trace(trace, cache_bytes=budget, **meta)
    assert any("two halves of the calibration steps" in r.message for r in caplog.records)
    per_step = window_misses_per_step(trace, p.choices)
    costs = np.array([[capacity_pages(w, 3, 1) * 1024 for w in p.choices]] * 6)
    check = choose_shrink(step_halves(per_step), costs, budget)
    assert p.shrink == check.shrink == 0.0 and min(check.held_out) >= check.uniform
    assert {w for row in p.windows for w in row} == {2.0}  # the largest window that fits everywhere


# ---------------------------------------------------------------- the file


@pytest.fixture
def profile():
    return WindowProfile(model="SmolLM2-135M-Instruct", dtype="float32", page_size=16, budget=0.0625, k=4,
                         sink_pages=1, page_bytes=8192, cache_bytes=3 * 2 * 17 * 8192, choices=[1.0, 2.0, 4.0],
                         windows=[[4.0, 1.0], [2.0, 2.0], [1.0, 4.0]],
                         misses=[[[3.0, 2.0, 1.0], [1.0, 1.0, 1.0]], [[2.0, 1.0, 1.0], [2.5, 1.0, 0.5]],
                                 [[1.0, 1.0, 1.0], [3.0, 2.0, 0.0]]],
                         text="calibration.txt", context=2048, steps=31, shrink=0.5)


def test_save_and_load_round_trip(tmp_path, profile):
    path = tmp_path / "profile.json"
    profile.save(path)
    loaded = WindowProfile.load(path)
    assert loaded == profile
    assert loaded.windows == [[4.0, 1.0], [2.0, 2.0], [1.0, 4.0]]
    assert (loaded.num_layers, loaded.num_kv_heads, loaded.page_size, loaded.budget) == (3, 2, 16, 0.0625)
    assert loaded.used_bytes == (17 + 5 + 9 + 9 + 5 + 17) * 8192


def rewrite(tmp_path, profile, **changes):
    path = tmp_path / "profile.json"
    profile.save(path)
    doc = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            del doc[key]
        else:
            doc[key] = value
    path.write_text(json.dumps(doc))
    return path


@pytest.mark.parametrize("changes, match", [
    ({"version": FORMAT_VERSION + 1}, f"version {FORMAT_VERSION + 1}; this KVDrive reads version {FORMAT_VERSION}"),
    ({"version": 1}, "profile the model again"),
    ({"format": "something-else"}, "not a window profile"),
    ({"cache_bytes": None}, r"missing fields \['cache_bytes'\]"),
    ({"colour": "blue"}, r"unknown fields \['colour'\]"),
    ({"windows": [[4.0, 1.0], [2.0, 2.0]]}, r"misses must be \[layers\]\[KV heads\]\[choices\] = \[2, 2, 3\], got \[3, 2, 3\]"),
    ({"windows": [[4.0, 1.0], [2.0], [1.0, 4.0]]}, "ragged"),
    ({"windows": [[4.0, 1.0], [2.0, 3.0], [1.0, 4.0]]}, "one of the choices"),
    ({"misses": [[[3.0, 2.0]] * 2] * 3}, r"got \[3, 2, 2\]"),
    ({"page_size": "16"}, "page_size must be a whole number"),
    ({"choices": [2.0, 1.0, 4.0]}, "increasing"),
    ({"model": 7}, "model must be a string"),
    ({"shrink": 1.5}, r"shrink must be a number in \[0, 1\]"),
])
def test_bad_files_are_refused_with_the_reason(tmp_path, profile, changes, match):
    path = rewrite(tmp_path, profile, **changes)
    with pytest.raises(ProfileError, match=match):
        WindowProfile.load(path)


def test_a_file_that_is_not_json_or_not_an_object_is_refused(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text("windows: x4\n")
    with pytest.raises(ProfileError, match="not JSON"):
        WindowProfile.load(path)
    path.write_text("[1, 2]")
    with pytest.raises(ProfileError, match="not a window profile"):
        WindowProfile.load(path)


def test_fill_budget_spends_what_the_solver_left_on_the_smallest_windows():
    from kvdrive_client.profile import fill_budget

    costs = np.array([[1, 2, 4], [1, 2, 4], [1, 2, 4]])
    assert fill_budget([0, 2, 0], costs, 8) == [1, 2, 1]  # 1 + 4 + 1 = 6 spent -> two one-byte steps fit
    assert fill_budget([0, 0, 0], costs, 3) == [0, 0, 0]
    assert fill_budget([2, 2, 2], costs, 100) == [2, 2, 2]
