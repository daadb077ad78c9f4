"""The demo: KVDrive's answer and speeds beside dense attention's, where they differ, and no silent stretch."""

from __future__ import annotations

import re
import threading
import time

import pytest
import torch

from kvdrive.tools import demo


def test_compare_finds_the_first_difference_and_counts_dense_first_choices():
    vocab = 5
    kv, dense = [1, 2, 3, 4], [1, 2, 0, 0]
    logits = torch.zeros(len(kv), vocab)
    for step, top in enumerate([1, 2, 0, 4]):  # dense's pick before each of KVDrive's tokens, given KVDrive's text
        logits[step, top] = 2.0
    logits[2, 3] = 1.5  # KVDrive's third token: dense's second choice, 0.5 below its first
    cmp = demo.compare(kv, dense, logits)
    assert (cmp.same_prefix, cmp.agreed, cmp.steps) == (2, 3, 4)
    assert cmp.margin == pytest.approx(0.5)
    same = demo.compare([1, 2], [1, 2], logits[:2])
    assert (same.same_prefix, same.agreed, same.margin) == (2, 2, None)


def test_side_by_side_wraps_each_answer_into_its_own_column():
    rows = demo.side_by_side("answer", "one two three four five six", "uno", label_width=7, width=10)
    assert rows == ["answer  one two     uno", "        three four", "        five six"]


class TimedOutput:
    """What the demo writes, with when each write came."""

    def __init__(self) -> None:
        self.text, self.times = "", []
        self._lock = threading.Lock()

    def write(self, s: str) -> int:
        with self._lock:
            self.text += s
            self.times.append(time.monotonic())
        return len(s)

    def flush(self) -> None:
        pass


def test_the_demo_shows_both_answers_and_speeds_side_by_side_and_says_something_every_few_seconds(tmp_path):
    # A short document keeps the test short; budget 1 answers as dense does, token for token.
    document = tmp_path / "gpl-start.txt"
    document.write_text(open("/usr/share/common-licenses/GPL-3", encoding="utf-8").read()[:1500])
    out = TimedOutput()
    t0 = time.monotonic()
    assert demo.main(["--document", str(document), "--budget", "1", "--max-new-tokens", "8", "--dram", "16M"],
                     out=out) == 0
    gaps = [b - a for a, b in zip([t0, *out.times], [*out.times, time.monotonic()])]
    assert max(gaps) <= 10.0, f"{max(gaps):.1f} s without output:\n{out.text}"
    text = out.text
    head = re.search(r"^ +KVDrive, budget 100% +dense \(plain transformers, \w+\)$", text, re.M)
    assert head, text
    answer = re.search(r"^answer +(\S.*?)  +(\S.*)$", text, re.M)
    assert answer and answer.group(1).strip() == answer.group(2).strip(), text
    assert re.search(r"^decode +\d+\.\d tokens/s \(8 tokens\) +\d+\.\d tokens/s \(8 tokens\)$", text, re.M), text
    assert "the two answers are the same, token for token (8 tokens)" in text
    assert "KVDrive's token was dense's first choice at 8 of 8 steps" in text
    reserved = re.search(r"reserved on the device: cache ([\d.]+) MiB for ([\d.]+) MiB of K and V", text)
    assert reserved and 0 < float(reserved.group(1)) <= float(reserved.group(2)), text
    assert demo.EXPECT in text
