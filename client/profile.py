"""Per-(layer, KV head) device-cache windows for a total byte budget, from a selection trace.

Each (layer, KV head) keeps a device cache of ``window x k`` pages (k: pages a step
selects). A bigger window misses less (fewer pages fetched from the store per step)
but holds more bytes, and heads differ in how much a bigger window helps. Given a
total device-cache budget in bytes, picking one window per stream so that the pages
fetched per step are fewest is a multiple-choice knapsack:

- :func:`solve_windows` solves it greedily, by saving per extra cache byte;
  :func:`solve_windows_exact` by exhaustive search (small cases, for tests);
  :func:`uniform_cost` gives the best single window for every stream, the baseline.
- :func:`window_misses` measures the curves: it replays a selection trace
  (:mod:`kvdrive_client.cache_sim`, ``LOOKAHEAD`` eviction as the device cache does)
  at every window choice.
- :func:`profile_from_trace` does both and returns a :class:`WindowProfile`, which
  :meth:`~WindowProfile.save` / :meth:`~WindowProfile.load` keep as versioned JSON.

Pure bookkeeping: numpy in, lists out; no tensors, no device.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np

from kvdrive_client.cache_sim import CachePolicy, Trace, stream_hits
from kvdrive_client.errors import KVDriveError

log = logging.getLogger(__name__)

DEFAULT_CHOICES = (1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0)
UNIFORM_WINDOW = 4.0  # AttachConfig's default window: the budget a profile is compared at by default
FORMAT_NAME = "kvdrive-window-profile"
FORMAT_VERSION = 2
EXACT_MAX_COMBINATIONS = 1_000_000


class ProfileError(KVDriveError, ValueError):
    """A window profile file that cannot be used; the message says what is wrong with it."""


# ---------------------------------------------------------------- the knapsack


def _curves(misses, costs) -> tuple[np.ndarray, np.ndarray]:
    m = np.asarray(misses, dtype=np.float64)
    c = np.asarray(costs)
    if m.ndim != 2 or m.shape[0] < 1 or m.shape[1] < 1:
        raise ValueError(f"misses must be [streams][choices] with at least one of each, got shape {m.shape}")
    if c.shape != m.shape:
        raise ValueError(f"costs {c.shape} and misses {m.shape} must have the same [streams][choices] shape")
    if not np.issubdtype(c.dtype, np.integer):
        c = c.astype(np.float64)
    if not (np.isfinite(m).all() and np.isfinite(c).all()):
        raise ValueError("misses and costs must be finite numbers")
    if (c < 0).any():
        raise ValueError("costs must be >= 0")
    if (np.diff(c, axis=1) < 0).any():
        s = int(np.flatnonzero((np.diff(c, axis=1) < 0).any(axis=1))[0])
        raise ValueError(f"costs of stream {s} decrease from one choice to the next; order choices cheapest first")
    return m, c


def _check_floor(c: np.ndarray, budget: float) -> None:
    floor = c[:, 0].sum()
    if floor > budget:
        raise ValueError(f"a budget of {budget} cannot hold even the cheapest choice of every stream ({floor}); "
                         "raise the budget or add a cheaper choice")


def solve_windows(misses, costs, budget: float) -> list[int]:
    """One choice per stream, total cost <= ``budget``, few total misses (greedy).

    ``misses[s][j]``: fetched bytes (or pages) per step of stream ``s`` at choice ``j``;
    ``costs[s][j]``: its cache bytes, non-decreasing in ``j`` (choice 0 the cheapest).
    Every stream starts at choice 0; then, while one fits the budget left, the
    upgrade of one stream from its current choice to any higher one with the largest
    saving per extra byte is taken (ties: the cheaper step). From a stream's current
    choice the best such ratio leads along the lower convex hull of its curve, so
    until an upgrade first fails to fit, this is the classic greedy of the LP
    relaxation. Finally, the best uniform choice (:func:`uniform_cost`) is returned
    instead if it misses less.

    What that guarantees:

    - exact when every upgrade step of every stream costs the same bytes and each
      stream's savings per step never grow (convex curves): then the greedy takes
      the largest single-step savings, in order, as many as fit;
    - otherwise not always optimal (0/1 knapsack effects: a good upgrade that does
      not fit leaves budget unused), but at most the largest saving of one stream,
      ``max_s (misses[s][0] - min_j misses[s][j])``, above the optimum: the LP
      optimum lies within one hull segment of where the greedy first stalls;
    - never worse than the best uniform choice that fits.

    Raises ``ValueError`` when even choice 0 of every stream exceeds ``budget``.
    """
    m, c = _curves(misses, costs)
    _check_floor(c, budget)
    n, num_choices = m.shape
    rows = np.arange(n)
    later = np.arange(num_choices)[None, :]
    choice = np.zeros(n, dtype=np.int64)
    while True:
        left = budget - c[rows, choice].sum()  # re-summed: no drift from float costs
        gain = m[rows, choice][:, None] - m
        extra = c - c[rows, choice][:, None]
        ok = (later > choice[:, None]) & (gain > 0) & (extra <= left)
        if not ok.any():
            break
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where(extra > 0, gain / extra, np.inf)
        ratio = np.where(ok, ratio, -np.inf)
        tied = np.flatnonzero(ratio.ravel() == ratio.max())
        s, j = divmod(int(tied[np.argmin(extra.ravel()[tied])]), num_choices)
        choice[s] = j
    uniform = _best_uniform(m, c, budget)
    if uniform is not None and uniform[1] < m[rows, choice].sum():
        return [uniform[0]] * n
    return choice.tolist()


def fill_budget(choice: list[int], costs, budget: float) -> list[int]:
    """Spend what the solver left of ``budget``: raise the smallest windows one step at a time.

    The solver stops where the calibration trace shows no more saving, which on a
    short trace is often only because the trace is short; cache bytes left unused
    there would help on other text. Streams at the lowest choice go first (ties: the
    lowest stream), while a step fits.
    """
    c = np.asarray(costs)
    at = np.array(choice, dtype=np.int64)
    rows = np.arange(len(at))
    while True:
        left = budget - c[rows, at].sum()
        can = at < c.shape[1] - 1
        step = np.where(can, c[rows, np.minimum(at + 1, c.shape[1] - 1)] - c[rows, at], np.inf)
        ok = can & (step <= left)
        if not ok.any():
            return at.tolist()
        s = int(np.flatnonzero(ok)[np.argmin(at[ok])])
        at[s] += 1


def solve_windows_exact(misses, costs, budget: float) -> list[int]:
    """The optimum by trying every combination (fewest misses; ties: cheapest). Small cases only."""
    m, c = _curves(misses, costs)
    _check_floor(c, budget)
    n, num_choices = m.shape
    if num_choices**n > EXACT_MAX_COMBINATIONS:
        raise ValueError(f"{num_choices}^{n} combinations is too many to try; use solve_windows")
    rows = np.arange(n)
    best, best_key = None, None
    for combo in itertools.product(range(num_choices), repeat=n):
        at = np.array(combo)
        cost = c[rows, at].sum()
        if cost > budget:
            continue
        key = (m[rows, at].sum(), cost)
        if best_key is None or key < best_key:
            best, best_key = list(combo), key
    assert best is not None, "choice 0 everywhere fits, so some combination does"
    return best


def _best_uniform(m: np.ndarray, c: np.ndarray, budget: float) -> tuple[int, float] | None:
    fits = [j for j in range(m.shape[1]) if c[:, j].sum() <= budget]
    if not fits:
        return None
    j = min(fits, key=lambda j: (m[:, j].sum(), c[:, j].sum()))
    return j, float(m[:, j].sum())


def uniform_cost(misses, costs, budget: float) -> tuple[int, float]:
    """``(choice, total misses)`` of the best choice that every stream can take together within ``budget``.

    With misses that do not grow with the window that is the largest such window:
    what one window for all (layer, KV head) gives at the same cache bytes.
    """
    m, c = _curves(misses, costs)
    _check_floor(c, budget)
    best = _best_uniform(m, c, budget)
    assert best is not None, "choice 0 everywhere fits"
    return best


def total_at(values, choice: list[int]) -> float:
    """Sum over streams of ``values[s][choice[s]]``: the total misses (or costs) of a solution."""
    a = np.asarray(values)
    return float(a[np.arange(len(choice)), choice].sum())


# ---------------------------------------------------------------- measuring the curves


def capacity_pages(window: float, k: int, sink_pages: int = 0) -> int:
    """Device-cache slots per (layer, KV head) at ``window``, as the decode session sizes them."""
    return max(1, math.ceil(window * k) + sink_pages)


def window_misses_per_step(trace: Trace, choices, warmup_steps: int = 1) -> np.ndarray:
    """Misses ``[streams, choices, counted steps]``: the trace replayed at ``ceil(window x k)`` pages per stream.

    A trace that records the prefill's seeding starts each replayed cache as the
    session does (its most important pages, as many as the window holds). Without
    it the replayed caches start empty and the first steps miss every selected page
    at any window; ``warmup_steps`` steps are replayed but not counted.
    """
    if trace.scores is None:
        raise ValueError("the trace needs the selector's scores (LOOKAHEAD eviction ranks cached pages by them)")
    if not 0 <= warmup_steps < trace.num_steps:
        raise ValueError(f"warmup_steps must be in 0..{trace.num_steps - 1} for a {trace.num_steps}-step trace, "
                         f"got {warmup_steps}")
    k = trace.max_selected
    if k < 1:
        raise ValueError("the trace selects no pages")
    counted = (trace.selected[:, warmup_steps:] >= 0).sum(axis=2)
    out = np.zeros((trace.num_streams, len(choices), trace.num_steps - warmup_steps))
    for j, window in enumerate(choices):
        capacity = capacity_pages(window, k)
        for n in range(trace.num_streams):
            seeded = None if trace.seeded is None else trace.seeded[n]
            hits = stream_hits(trace.selected[n], trace.scores[n], capacity, CachePolicy.LOOKAHEAD, seeded)
            out[n, j] = counted[n] - np.asarray(hits[warmup_steps:])
    return out


def window_misses(trace: Trace, choices, warmup_steps: int = 1) -> np.ndarray:
    """Misses per step ``[streams, choices]``, averaged over the counted steps (see :func:`window_misses_per_step`)."""
    return window_misses_per_step(trace, choices, warmup_steps).mean(axis=2)


# ---------------------------------------------------------------- guarding against over-fitting

SHRINK_LEVELS = (0.25, 0.5, 0.75, 1.0)  # 0 (below) stands for one window everywhere
MIN_STEPS_TO_VALIDATE = 4


def shrunk(misses: np.ndarray, weight: float) -> np.ndarray:
    """Each stream's curve pulled toward the mean curve: ``weight`` 1 keeps it, smaller trusts it less."""
    return weight * misses + (1.0 - weight) * misses.mean(axis=0, keepdims=True)


def _solve(misses: np.ndarray, costs: np.ndarray, budget: float) -> list[int]:
    return fill_budget(solve_windows(misses, costs, budget), costs, budget)


@dataclass(frozen=True)
class Validation:
    """How much per-stream curves are trusted, chosen on held-out calibration data.

    The data comes in folds: one per calibration sequence, or (one sequence) the two
    halves of its steps. Windows solved on all folds but one are scored on that one,
    for every fold, at each shrink level and for the best uniform window.
    ``held_out[i]``: pages missed per step, summed over the held-out folds, at
    ``SHRINK_LEVELS[i]``; ``uniform``: the same for one window everywhere.
    """

    shrink: float
    held_out: tuple[float, ...]
    uniform: float
    folds: str


def step_halves(per_step: np.ndarray) -> list[np.ndarray] | None:
    """Two folds from one sequence's ``[streams, choices, steps]``: the first and second half of the steps."""
    steps = per_step.shape[2]
    if steps < MIN_STEPS_TO_VALIDATE:
        return None
    return [per_step[:, :, : steps // 2].mean(axis=2), per_step[:, :, steps // 2 :].mean(axis=2)]


def choose_shrink(folds: list[np.ndarray], costs, budget: float, what: str = "folds") -> Validation:
    """The shrink level that missed least on held-out folds, or 0 (one window everywhere) where none beat that.

    ``folds``: two or more ``[streams, choices]`` miss curves measured on different data.
    """
    if len(folds) < 2:
        raise ValueError(f"held-out validation needs at least 2 folds, got {len(folds)}")
    c = np.asarray(costs)
    j, _ = uniform_cost(np.mean(folds, axis=0), c, budget)  # as profile_from_trace picks it: on all the data
    uniform = sum(total_at(f, [j] * len(c)) for f in folds)
    scores = []
    for weight in SHRINK_LEVELS:
        score = 0.0
        for i, held in enumerate(folds):
            train = np.mean([f for n, f in enumerate(folds) if n != i], axis=0)
            score += total_at(held, _solve(shrunk(train, weight), c, budget))
        scores.append(score)
    best = int(np.argmin(scores))
    weight = SHRINK_LEVELS[best] if scores[best] < uniform else 0.0
    return Validation(shrink=weight, held_out=tuple(float(x) for x in scores), uniform=float(uniform), folds=what)


# ---------------------------------------------------------------- the profile


@dataclass(frozen=True)
class WindowProfile:
    """Chosen device-cache windows per (layer, KV head), and what they were chosen from.

    ``windows[layer][head]``: the chosen window, one of ``choices``. ``misses[layer][head][j]``:
    pages fetched per decode step at window ``choices[j]``, measured on ``text``
    (``context`` tokens, then ``steps`` counted decode steps) with ``k`` pages selected
    per step at ``budget`` and ``page_size``. ``page_bytes``: one page of K and V of one
    KV head in ``dtype``. ``cache_bytes``: the total device-cache budget solved for, all
    layers and heads, ``sink_pages`` per stream included.
    """

    model: str
    dtype: str
    page_size: int
    budget: float
    k: int
    sink_pages: int
    page_bytes: int
    cache_bytes: int
    choices: list[float]
    windows: list[list[float]]
    misses: list[list[list[float]]]
    text: str
    context: int
    steps: int
    shrink: float

    def __post_init__(self) -> None:
        for name in ("page_size", "k", "sink_pages", "page_bytes", "cache_bytes", "context", "steps"):
            value, least = getattr(self, name), 0 if name == "sink_pages" else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ProfileError(f"{name} must be a whole number >= {least}, got {value!r}")
        if not isinstance(self.budget, (int, float)) or not self.budget > 0:
            raise ProfileError(f"budget must be a number > 0, got {self.budget!r}")
        if not isinstance(self.shrink, (int, float)) or isinstance(self.shrink, bool) or not 0 <= self.shrink <= 1:
            raise ProfileError(f"shrink must be a number in [0, 1], got {self.shrink!r}")
        choices = _floats(self.choices, "choices")
        if not choices or choices != sorted(set(choices)) or choices[0] < 1:
            raise ProfileError(f"choices must be distinct increasing windows >= 1, got {self.choices}")
        windows = np.asarray(self.windows, dtype=object)
        if windows.ndim != 2 or windows.size == 0:
            raise ProfileError(f"windows must be [layers][KV heads], got {_shape(self.windows)}")
        chosen = _floats(windows.ravel().tolist(), "windows")
        if any(w not in choices for w in chosen):
            raise ProfileError(f"every window must be one of the choices {choices}")
        want = [*windows.shape, len(choices)]
        if _shape(self.misses) != want:
            raise ProfileError(f"misses must be [layers][KV heads][choices] = {list(want)}, got {_shape(self.misses)}")
        if not all(math.isfinite(x) and x >= 0 for x in _floats(np.ravel(np.asarray(self.misses, dtype=object)), "misses")):
            raise ProfileError("misses must be finite numbers >= 0")

    @property
    def num_layers(self) -> int:
        return len(self.windows)

    @property
    def num_kv_heads(self) -> int:
        return len(self.windows[0])

    def choice_bytes(self, window: float) -> int:
        """Cache bytes of one (layer, KV head) at ``window``."""
        return capacity_pages(window, self.k, self.sink_pages) * self.page_bytes

    def curves(self) -> tuple[np.ndarray, np.ndarray]:
        """``(misses, costs)`` ``[streams, choices]``, streams in (layer, head) order: the knapsack solved."""
        m = np.asarray(self.misses, dtype=np.float64).reshape(-1, len(self.choices))
        c = np.array([[self.choice_bytes(w) for w in self.choices]] * len(m), dtype=np.int64)
        return m, c

    @property
    def used_bytes(self) -> int:
        """Device-cache bytes of the chosen windows."""
        return sum(self.choice_bytes(w) for row in self.windows for w in row)

    def fetched_bytes_per_step(self) -> float:
        """Predicted bytes fetched from the store per decode step at the chosen windows."""
        at = [self.choices.index(w) for row in self.windows for w in row]
        return total_at(self.curves()[0], at) * self.page_bytes

    def uniform(self) -> tuple[float, int, float]:
        """``(window, cache bytes, fetched bytes per step)`` of the best single window within ``cache_bytes``."""
        m, c = self.curves()
        j, misses = uniform_cost(m, c, self.cache_bytes)
        return self.choices[j], int(c[:, j].sum()), misses * self.page_bytes

    def save(self, path: str | Path) -> None:
        doc = {"format": FORMAT_NAME, "version": FORMAT_VERSION, **asdict(self)}
        Path(path).write_text(_dumps(doc), encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> "WindowProfile":
        """Read a profile written by :meth:`save`; :class:`ProfileError` says what is wrong with a bad one."""
        raw = Path(path).read_text(encoding="utf-8")
        try:
            doc = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ProfileError(f"{path} is not a window profile: not JSON ({exc})") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
            raise ProfileError(f"{path} is not a window profile (no \"format\": \"{FORMAT_NAME}\")")
        if doc.get("version") != FORMAT_VERSION:
            raise ProfileError(f"{path} is window profile version {doc.get('version')!r}; this KVDrive reads version "
                               f"{FORMAT_VERSION}: profile the model again with kvdrive-profile")
        names = {f.name for f in fields(cls)}
        body = {key: value for key, value in doc.items() if key not in ("format", "version")}
        missing, unknown = sorted(names - body.keys()), sorted(body.keys() - names)
        if missing or unknown:
            raise ProfileError(f"{path}: missing fields {missing}, unknown fields {unknown}")
        for name in ("model", "dtype", "text"):
            if not isinstance(body[name], str):
                raise ProfileError(f"{path}: {name} must be a string, got {body[name]!r}")
        try:
            return cls(**body)
        except ProfileError as exc:
            raise ProfileError(f"{path}: {exc}") from None


def _dumps(doc: dict) -> str:
    """JSON with one line per field, and per layer for the ``[layer][...]`` tables."""
    lines = []
    for key, value in doc.items():
        if isinstance(value, list) and value and isinstance(value[0], list):
            rows = ",\n".join(f"  {json.dumps(row)}" for row in value)
            lines.append(f" {json.dumps(key)}: [\n{rows}\n ]")
        else:
            lines.append(f" {json.dumps(key)}: {json.dumps(value)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


def _floats(values, name: str) -> list[float]:
    if not isinstance(values, (list, tuple, np.ndarray)):
        raise ProfileError(f"{name} must be a list of numbers, got {values!r}")
    out = []
    for v in values:
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            raise ProfileError(f"{name} must hold numbers, got {v!r}")
        out.append(float(v))
    return out


def _shape(nested) -> list[int] | str:
    """The shape of a regular nested list, or ``"ragged"``."""
    try:
        a = np.asarray(nested, dtype=object)
    except ValueError:
        return "ragged"
    if any(isinstance(x, list) for x in a.ravel()):
        return "ragged"
    return list(a.shape)


def profile_from_trace(trace: Trace, *, num_layers: int, num_kv_heads: int, page_bytes: int,
                       cache_bytes: int | None = None, choices=DEFAULT_CHOICES, sink_pages: int = 0,
                       warmup_steps: int | None = None, model: str, dtype: str, page_size: int, budget: float, text: str,
                       context: int) -> WindowProfile:
    """Measure every window choice on ``trace`` and solve.

    Streams are in (sequence, layer, KV head) order: one or more calibration
    sequences, whose curves are averaged; with two or more, each sequence is held
    out in turn to decide how far per-head curves are trusted (:func:`choose_shrink`).

    ``cache_bytes``: the total device-cache budget; by default what a uniform window
    of :data:`UNIFORM_WINDOW` takes. ``warmup_steps``: steps replayed but not
    counted; by default none when the trace records the prefill's seeding (the
    replay then starts as the session does) and one when it does not. The other
    keywords describe the run for the profile's record.
    """
    if warmup_steps is None:
        warmup_steps = 0 if trace.seeded is not None else 1
    streams = num_layers * num_kv_heads
    if trace.num_streams % streams:
        raise ValueError(f"the trace has {trace.num_streams} streams; {num_layers} layers x {num_kv_heads} KV heads "
                         "per sequence needs a multiple of that many")
    sequences = trace.num_streams // streams
    choices = sorted({float(w) for w in choices})
    if choices[0] < 1:
        raise ValueError(f"windows must be >= 1 (the cache holds at least one step's selection), got {choices}")
    # [sequences, streams, choices, steps] -> per-sequence curves; the profile's curves are their mean.
    per_step = window_misses_per_step(trace, choices, warmup_steps)
    per_seq = per_step.reshape(sequences, streams, len(choices), -1)
    misses = per_seq.mean(axis=(0, 3))
    k = trace.max_selected
    costs = np.array([[capacity_pages(w, k, sink_pages) * page_bytes for w in choices]] * streams, dtype=np.int64)
    if cache_bytes is None:
        cache_bytes = capacity_pages(UNIFORM_WINDOW, k, sink_pages) * page_bytes * streams
    if sequences >= 2:
        folds, what = list(per_seq.mean(axis=3)), f"{sequences} calibration sequences"
    else:
        folds, what = step_halves(per_seq[0]), "the two halves of the calibration steps"
    if folds is None:
        log.warning("a %d-step trace of one sequence is too short to check the windows on held-out data; per-head "
                    "curves used as measured", per_step.shape[2])
        weight = 1.0
    else:
        check = choose_shrink(folds, costs, cache_bytes, what)
        weight = check.shrink
        log.info("held out in turn among %s: per-head windows at shrink %s missed %s pages/step, one window %.1f: "
                 "shrink %.2f kept", what, list(SHRINK_LEVELS), [round(x, 1) for x in check.held_out], check.uniform,
                 weight)
    if weight == 0:
        picked = [uniform_cost(misses, costs, cache_bytes)[0]] * len(misses)
    else:
        picked = _solve(shrunk(misses, weight), costs, cache_bytes)
    windows = [[choices[picked[layer * num_kv_heads + head]] for head in range(num_kv_heads)]
               for layer in range(num_layers)]
    return WindowProfile(
        model=model, dtype=dtype, page_size=page_size, budget=float(budget), k=k, sink_pages=sink_pages,
        page_bytes=page_bytes, cache_bytes=int(cache_bytes), choices=choices, windows=windows,
        misses=misses.reshape(num_layers, num_kv_heads, len(choices)).tolist(), text=text, context=context,
        steps=trace.num_steps - warmup_steps, shrink=float(weight),
    )
