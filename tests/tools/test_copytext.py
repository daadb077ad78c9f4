"""The copy texts of ``kvdrive-bench fidelity --copy``, and its report on them, without a model."""

import re

import pytest

from kvdrive.tools import copytext
from kvdrive.tools.bench_common import InputError
from kvdrive.tools.bench_fidelity import (FidelityConfig, FidelityRow, copy_lines, copy_plan, copy_target_lines,
                                           worst_window_lines)
from kvdrive_client.selectors import IndexKind


def words(text: str) -> list[str]:
    """A stand-in tokenizer: words, runs of punctuation and line breaks, one token each."""
    return re.findall(r"\w+|[^\w\s]+|\n", text)


@pytest.mark.parametrize("kind", copytext.KINDS)
def test_a_copy_text_repeats_its_source_far_back_and_the_decode_lies_in_the_copy(kind):
    c = copytext.build(kind, 3, 2048, 64, words)
    assert c == copytext.build(kind, 3, 2048, 64, words)  # the same on every call
    assert c.text != copytext.build(kind, 4, 2048, 64, words).text
    assert c.ids == words(c.text) and c.copied(2048 - 64, 2048 + 65)
    # The source takes about 70% of the context, so the decode copies from that far back.
    assert 0.7 * 2048 <= c.source_tokens <= 0.75 * 2048
    lines = c.text.splitlines()
    if kind == "quote":
        report = c.text.split("\n\nMinutes of another meeting\n\n")[0]
        assert c.text.endswith(report) and c.text.count(report) == 2
        assert len(words(report)) == pytest.approx(c.source_tokens, abs=5)
    else:
        records = [x for x in lines if x.startswith("R")]
        half = len(records) // 2
        assert len(records) == 2 * half and records[:half] != [] and sorted(records[:half]) == sorted(records[half:])
        assert (records[:half] == records[half:]) == (kind == "table")
        assert len(set(records[:half])) == half  # every record once: each copy has one source
    # The copied part starts after the source (and, for a quote, the other minutes); a table and a
    # quote copy their source token for token from the text's first token.
    assert c.copy_start >= c.source_tokens
    if kind != "shuffled":
        assert c.ids[c.copy_start :] == c.ids[: len(c.ids) - c.copy_start]


def test_a_decode_longer_than_the_copy_is_refused_and_kinds_are_checked():
    with pytest.raises(ValueError, match="do not fit"):
        copytext.build("table", 0, 1024, 600, words)
    with pytest.raises(ValueError, match="choose one of table, shuffled, quote"):
        copytext.build("poem", 0, 1024, 16, words)


def copy_row(selector, window, budget, dloss, top1, kind="table"):
    return FidelityRow(selector, budget, 7168, window, kind, 0, 0.9, dloss, 0.01, top1, 0.95, 0.97, 1, 10, 1.0, 1)


def test_the_copy_report_judges_the_greedy_match_on_every_window_per_budget():
    rows = [copy_row("oracle", 0, 0.0625, 0.0, 1.0), copy_row("lowrank", 0, 0.0625, 0.02, 0.97),
            copy_row("oracle", 1, 0.0625, 0.0, 1.0, "quote"), copy_row("lowrank", 1, 0.0625, 0.09, 0.94, "quote"),
            copy_row("oracle", 0, 0.03125, 0.01, 1.0), copy_row("lowrank", 0, 0.03125, 0.05, 0.92),
            copy_row("oracle", 1, 0.03125, 0.01, 0.98, "quote"), copy_row("lowrank", 1, 0.03125, 0.12, 0.91, "quote")]
    lines = copy_target_lines(rows)
    assert len(lines) == 2
    assert ">= 0.9 of the copied tokens" in lines[0] and "lowest 0.910 at window 1 (quote), mean 0.915: PASS" in lines[0]
    assert ">= 0.95 of the copied tokens" in lines[1] and "lowest 0.940 at window 1 (quote), mean 0.955: MISS" in lines[1]
    table = "\n".join(worst_window_lines(rows))
    assert re.search(r"lowrank\s+6\.250%\s+7168\s+2\s+\+0\.0550\s+\+0\.0900\s+1 quote.*0\.940$", table, re.M)
    c = copytext.build("quote", 1, 1024, 16, words)
    (line,) = copy_lines(rows, {(1, 7168): c})
    assert f"window 1 quote seed 1, context 7168: {len(c.ids)} tokens" in line and "on 0.970 of the decoded" in line


def test_a_copy_run_plans_its_windows_per_kind_and_seed_and_refuses_bad_options():
    cfg = FidelityConfig(contexts=(512, 1024), tokens=8, budgets=(0.0625,), selectors=(IndexKind.LOWRANK,), text=None,
                         copy=("table", "quote"), windows=2)
    plan, info = copy_plan(cfg, words)
    assert plan == [("table", 0), ("table", 0), ("quote", 0), ("quote", 0)] and not cfg.tuned
    copies = info["copies"]
    assert [(copies[(w, 512)].kind, copies[(w, 512)].seed) for w in range(4)] == [
        ("table", 0), ("table", 1), ("quote", 0), ("quote", 1)]
    assert copies[(0, 1024)].copy_start > copies[(0, 512)].copy_start  # each context has its own text
    with pytest.raises(InputError, match="do not fit"):
        copy_plan(FidelityConfig(contexts=(512,), tokens=200, budgets=(0.0625,), selectors=(IndexKind.LOWRANK,),
                                 text=None, copy=("table",)), words)
    with pytest.raises(ValueError, match="--copy takes text kinds among table, shuffled, quote"):
        FidelityConfig(contexts=(512,), tokens=8, budgets=(0.0625,), selectors=(), text=None, copy=("poem",))
    with pytest.raises(ValueError, match="--copy with --text or --corpus"):
        FidelityConfig(contexts=(512,), tokens=8, budgets=(0.0625,), selectors=(), text=None, copy=("table",), corpus="")
