"""Texts whose continuation copies spans from far back, generated offline from a seed.

A selector's misses cost most where the model copies: the next token is a random code or
a name the model can only read from one earlier token, so the page holding it has to be
chosen. Dense attention copies these well (its loss on the repeated part is low), so
every nat a sparse run loses there is a page it did not choose. Three kinds:

- ``table``: a table of random records (ids, names, cities, codes, amounts, dates), then
  the same table again, row for row;
- ``shuffled``: the same records again in another order (each record's id is not
  predictable; the rest of the record is, once the id has been read);
- ``quote``: a report of templated sentences full of random names and figures, then the
  minutes of another meeting, then the first report quoted in full.

:func:`build` sizes a text for a context: the source takes about
:data:`SOURCE_SHARE` of the context's tokens, so the decode, which starts where the
context ends, copies from about that many tokens back. The same kind, seed, tokenizer and
context give the same text on any machine.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

SOURCE_SHARE = 0.7  # the source's share of the context: the copy distance at the decode
GAP_SHARE = 0.15  # quote: the other minutes' share of the context, between the report and its quote
KINDS = ("table", "shuffled", "quote")

_FIRST = ("Mina", "Tomas", "Aiko", "Farid", "Lena", "Oskar", "Priya", "Jonah", "Ines", "Kofi", "Marta", "Yusuf",
          "Elif", "Dmitri", "Sade", "Bruno", "Hana", "Lucas", "Noor", "Pavel", "Rosa", "Tariq", "Vera", "Wen")
_LAST = ("Ortega", "Lindqvist", "Okafor", "Tanaka", "Haddad", "Novak", "Ferreira", "Kowalski", "Mbeki", "Sato",
         "Brennan", "Castillo", "Dubois", "Eriksen", "Gallo", "Horvath", "Ivanova", "Jensen", "Kaur", "Moreau")
_CITIES = ("Lisbon", "Tampere", "Osaka", "Valparaiso", "Graz", "Accra", "Quebec", "Tbilisi", "Cork", "Medellin",
           "Bergen", "Izmir", "Leipzig", "Hobart", "Kraków", "Mombasa", "Porto", "Recife", "Turku", "Zadar")
_ITEMS = ("pump housings", "cable drums", "filter cartridges", "valve seats", "gear blanks", "sensor boards",
          "bearing shells", "hose clamps", "relay modules", "drill bits", "paint drums", "fuse boxes")
_CODE = "ABCDEFGHJKLMNPQRSTUVWXYZ23456789"


def _code(rng: random.Random, n: int = 4) -> str:
    return "".join(rng.choice(_CODE) for _ in range(n))


def _name(rng: random.Random) -> str:
    return f"{rng.choice(_LAST)}, {rng.choice(_FIRST)}"


def _record(rng: random.Random, i: int) -> str:
    return (f"R{rng.randrange(10000):04d}-{i} | {_name(rng)} | {rng.choice(_CITIES)} | {_code(rng)}-{_code(rng)} | "
            f"{rng.randrange(100, 99999)}.{rng.randrange(100):02d} | 20{rng.randrange(10, 27)}-{rng.randrange(1, 13):02d}-"
            f"{rng.randrange(1, 29):02d}")


def _sentence(rng: random.Random) -> str:
    who, city, item = f"{rng.choice(_FIRST)} {rng.choice(_LAST)}", rng.choice(_CITIES), rng.choice(_ITEMS)
    forms = (
        f"On 20{rng.randrange(10, 27)}-{rng.randrange(1, 13):02d}-{rng.randrange(1, 29):02d} {who} of the {city} office "
        f"approved order {_code(rng)}-{_code(rng)} for {rng.randrange(2, 900)} {item} at {rng.randrange(3, 500)}.{rng.randrange(100):02d} each.",
        f"{who} reported that lot {_code(rng)} of {item} from {city} failed inspection {rng.randrange(2, 40)} times "
        f"out of {rng.randrange(41, 400)}.",
        f"The {city} depot holds {rng.randrange(10, 9000)} {item} under reference {_code(rng, 6)}, counted by {who}.",
        f"Shipment {_code(rng)}/{rng.randrange(100, 999)} left {city} with {rng.randrange(2, 80)} pallets of {item}; "
        f"{who} signed for it.",
    )
    return rng.choice(forms)


def _sentences(rng: random.Random) -> Iterator[str]:
    while True:
        yield _sentence(rng)


def _prose(sentences: list[str]) -> str:
    """Sentences in paragraphs of four."""
    return "\n\n".join(" ".join(sentences[i : i + 4]) for i in range(0, len(sentences), 4))


def _records(rng: random.Random) -> Iterator[str]:
    i = 0
    while True:
        i += 1
        yield _record(rng, i)


@dataclass(frozen=True)
class CopyText:
    """A generated text: its tokens, and where its copied part starts."""

    kind: str
    seed: int
    text: str
    ids: list[int]
    copy_start: int  # the first token of the copied part
    source_tokens: int  # the copied part's source, in tokens (the copy distance of a verbatim copy)

    def copied(self, first: int, last: int) -> bool:
        """Whether tokens ``[first, last)`` all lie in the copied part."""
        return self.copy_start <= first and last <= len(self.ids)


def _take(units, count: Callable[[str], int], tokens: int, sep: str) -> list[str]:
    """Units from ``units`` until they hold ``tokens`` tokens (each unit counted with its separator)."""
    out, n = [], 0
    while n < tokens:
        u = next(units)
        out.append(u)
        n += count(u + sep)
    return out


def build(kind: str, seed: int, context: int, decode: int, tokenize: Callable[[str], Sequence[int]]) -> CopyText:
    """A ``kind`` text (one of :data:`KINDS`) for a ``context``-token prompt then ``decode`` tokens
    (and the one after them, a target), all of them in the copied part, as are the
    context's last ``decode`` tokens.

    ``tokenize``: text -> token ids. ValueError when ``decode`` does not fit in the copied
    part (more than about a seventh of the context).
    """
    if kind not in KINDS:
        raise ValueError(f"copy text kind {kind!r}: choose one of {', '.join(KINDS)}")
    rng = random.Random(f"{kind}:{seed}")
    count = lambda s: len(tokenize(s))  # noqa: E731
    source_tokens = int(SOURCE_SHARE * context)
    if kind == "quote":
        title = f"Report {_code(rng, 6)}\n\n"
        body = _take(_sentences(rng), count, source_tokens, " ")
        gap = _take(_sentences(random.Random(f"{kind}:{seed}:gap")), count, int(GAP_SHARE * context), " ")
        source = title + _prose(body)
        head = (source + "\n\nMinutes of another meeting\n\n" + _prose(gap)
                + "\n\nThe first report, quoted in full:\n\n")
        copy = source
    else:
        header = "id | name | city | code | amount | date\n"
        rows = _take(_records(rng), count, source_tokens, "\n")
        source = header + "\n".join(rows)
        if kind == "shuffled":
            rows = rows[:]
            random.Random(f"{kind}:{seed}:order").shuffle(rows)
            bridge = "\n\nThe same records, in another order:\n\n"
        else:
            bridge = "\n\nThe same table, repeated:\n\n"
        head = source + bridge
        copy = header + "\n".join(rows)
    text = head + copy
    ids = list(tokenize(text))
    start = len(tokenize(head))
    out = CopyText(kind, seed, text, ids, start, count(source))
    # The context's last ``decode`` tokens copy already (the model has found its place), and so do the decoded ones.
    if not out.copied(context - decode, context + decode + 1):
        raise ValueError(f"a {kind} text for a {context}-token context copies {len(ids) - start} tokens from token "
                         f"{start}: {decode} decode tokens do not fit after the context in its copied part")
    return out
