"""The main job: SmolLM2-135M answering over real text, its KV cache served by an embedded kvstored,
beside plain transformers (dense attention, the whole KV cache in memory) answering the same prompt.

It says what it is doing as it goes (a line at least every few seconds, also during the
one-time model conversion and kernel compile of a machine's first run), streams both
answers token by token, and ends with the two side by side: the answers, where they
first differ, how often KVDrive's token was dense's own choice given the same text
before it, prefill and decode speeds, and the device memory KVDrive reserved.
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TextIO

# A line at least this often (seconds) while a stage runs without saying anything itself.
HEARTBEAT_S = 6.0
# Prefill progress at most this often (seconds): one line per layer on a slow host, fewer on a fast one.
PREFILL_EVERY_S = 3.0


class Reporter:
    """The demo's output: lines as they come, and while a stage runs silent, a heartbeat line."""

    def __init__(self, out: TextIO | None = None) -> None:
        self.out = out if out is not None else sys.stdout
        self._last = time.perf_counter()
        self._stage: str | None = None
        self._stage_start = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="demo-heartbeat", daemon=True)
        self._thread.start()

    def say(self, line: str, end: str = "\n") -> None:
        with self._lock:
            print(line, end=end, file=self.out, flush=True)
            self._last = time.perf_counter()

    def touch(self) -> None:
        """Something was shown (a streamed token): no heartbeat due."""
        self._last = time.perf_counter()

    @contextmanager
    def stage(self, what: str):
        """Heartbeat lines name ``what`` while the block runs; the stage's seconds are yielded in a list."""
        self._stage, self._stage_start = what, time.perf_counter()
        took = [0.0]
        try:
            yield took
        finally:
            took[0] = time.perf_counter() - self._stage_start
            self._stage = None

    def detail(self, what: str) -> None:
        """Rename the running stage (heartbeat lines say it)."""
        self._stage = what

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def _beat(self) -> None:
        while not self._stop.wait(1.0):
            stage = self._stage
            if stage is not None and time.perf_counter() - self._last >= HEARTBEAT_S:
                self.say(f"  ... {stage} ({time.perf_counter() - self._stage_start:.0f} s)")


# What a user should expect from a sparse budget (the README says the same).
EXPECT = """\
What to expect: budget 1 attends every page and answers as dense attention does, token for
token. A sparse budget attends, per step, the first 16 and last 64 tokens and that share of
the pages between them; its logits stay close to dense's and most steps pick dense's own
next token, but greedy decoding carries on from the first step that picks another (usually
where dense's top two were close), so the answers part there and go on in other words.
KVDrive's decode pays for selection and fetching every step: it is for KV caches that do
not fit on the device. Here the whole KV fits in memory, so the speeds say what KVDrive
costs on this host, not what it saves."""


@dataclass
class Answer:
    """One generate() of the demo's prompt: the new tokens, their text and where the time went."""

    tokens: list[int]
    text: str
    prefill_s: float  # the call's start to the first new token
    decode_s: float  # the first new token to the last

    @property
    def tokens_per_s(self) -> float | None:
        return (len(self.tokens) - 1) / self.decode_s if len(self.tokens) > 1 and self.decode_s > 0 else None


@dataclass
class Comparison:
    """KVDrive's answer against dense's."""

    same_prefix: int  # tokens the two answers share from their start
    agreed: int  # KVDrive's tokens that dense ranks first, given KVDrive's text before each
    steps: int  # KVDrive's tokens
    margin: float | None  # at the first difference: dense's logit for its own pick minus for KVDrive's


def compare(kv_tokens: list[int], dense_tokens: list[int], dense_logits) -> Comparison:
    """``dense_logits`` ``[len(kv_tokens), vocab]``: dense's logits before each of KVDrive's tokens,
    over the prompt and KVDrive's tokens before it (teacher-forced)."""
    same = 0
    while same < min(len(kv_tokens), len(dense_tokens)) and kv_tokens[same] == dense_tokens[same]:
        same += 1
    top = dense_logits.argmax(dim=-1).tolist()
    agreed = sum(t == k for t, k in zip(top, kv_tokens))
    margin = None
    if same < len(kv_tokens):
        row = dense_logits[same]
        margin = float(row.max() - row[kv_tokens[same]])
    return Comparison(same, agreed, len(kv_tokens), margin)


def side_by_side(label: str, left: str, right: str, label_width: int = 9, width: int = 36) -> list[str]:
    """``left`` and ``right`` wrapped into two columns after ``label``."""
    lw, rw = textwrap.wrap(left, width) or [""], textwrap.wrap(right, width) or [""]
    rows = []
    for i in range(max(len(lw), len(rw))):
        a = lw[i] if i < len(lw) else ""
        b = rw[i] if i < len(rw) else ""
        rows.append(f"{label if i == 0 else '':<{label_width}} {a:<{width}}  {b}".rstrip())
    return rows


def main(argv: list[str] | None = None, out: TextIO | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvdrive.tools.demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EXPECT)
    p.add_argument("--dram", default="32M", help="DRAM tier of the embedded daemon (small, so some blocks come from SSD)")
    p.add_argument("--budget", type=float, default=0.0625,
                   help="fraction of the selectable pages attended per decode step (attach()'s default)")
    p.add_argument("--document", default=None,
                   help="text the question is asked about (default: /usr/share/common-licenses/GPL-3)")
    p.add_argument("--question", default="Which license is this document, and who published it?")
    p.add_argument("--max-new-tokens", type=int, default=48)
    args = p.parse_args(argv)
    rep = Reporter(out)
    try:
        return _run(args, rep)
    finally:
        rep.close()


def _run(args, rep: Reporter) -> int:
    import logging  # noqa: PLC0415 - heavy imports after argument parsing: --help returns at once

    logging.basicConfig(level=logging.WARNING)
    rep.say("loading SmolLM2-135M-Instruct (offline GGUF) ...")
    with rep.stage("importing torch and transformers") as import_s:
        from kvdrive.kernels import warm_up  # noqa: PLC0415
        from kvdrive_client.architecture import model_shape  # noqa: PLC0415
        from kvdrive_client.config import AttachConfig  # noqa: PLC0415
        from kvdrive_client.lowrank import fitted_layout  # noqa: PLC0415
        from kvdrive_client.models import LICENSE_DIR, load_smollm2  # noqa: PLC0415

    def on_load(line: str) -> None:
        rep.detail(f"loading the model: {line}")
        rep.say(f"  {line}")

    with rep.stage("loading the model") as load_s:
        model, tok = load_smollm2(progress=on_load)
    rep.say(f"  loaded in {load_s[0]:.1f} s ({model.dtype}, {model.config._attn_implementation} attention)")
    document_path = args.document or str(LICENSE_DIR / "GPL-3")
    document = open(document_path, encoding="utf-8", errors="replace").read()
    messages = [{"role": "user", "content": f"{document}\n\n{args.question}"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    prompt_len = ids["input_ids"].shape[1]

    rep.say("preparing KVDrive's CPU kernels (compiled once per machine, then loaded from the cache) ...")
    with rep.stage("kernel warm-up") as warm_s:
        def on_kernel(event):
            if event.seconds is None:
                rep.detail(f"kernel warm-up: {event.kernel} ({event.index}/{event.total})")
            elif event.compiled:
                rep.say(f"  {event}")
        # The kernels attach() prepares: the default index's selection at the model's sketch layout,
        # attention for the model's dtype.
        cfg, head_dim = AttachConfig(), model_shape(model)[0].head_dim
        warmed = warm_up(dtypes=(model.dtype,), indexes=(cfg.index.value,), progress=on_kernel,
                         layouts=(fitted_layout(cfg.lowrank_layout(head_dim), head_dim),))
    rep.say(f"  {warmed.summary}")

    rep.say(f"\nprompt: {prompt_len} tokens ({document_path}) + question: {args.question}")
    kv, stats = _through_kvdrive(args, rep, model, tok, ids)
    dense, dense_logits = _dense(args, rep, model, tok, ids, kv.tokens)
    cmp = compare(kv.tokens, dense.tokens, dense_logits)
    attn = model.config._attn_implementation
    _report(args, rep, tok, kv, dense, cmp, stats, attn, prompt_len)
    rep.say("\nset-up:")
    rep.say(f"  load            {import_s[0] + load_s[0]:7.1f} s  (imports {import_s[0]:.1f} s, model {load_s[0]:.1f} s)")
    rep.say(f"  kernel warm-up  {warm_s[0]:7.1f} s  ({len(warmed.compiled)} compiled, {len(warmed.loaded)} loaded "
            f"from the cache)")
    rep.say(f"\n{EXPECT}")
    return 0


def _through_kvdrive(args, rep: Reporter, model, tok, ids) -> tuple[Answer, dict]:
    import torch  # noqa: PLC0415

    from kvdrive_client import attach, connect  # noqa: PLC0415

    with rep.stage("starting the embedded kvstored"):
        store = connect(None, dram=args.dram)
    try:
        info = store.server_info
        rep.say(f"embedded kvstored pid {info['pid']}: DRAM tier {info['dram_bytes'] >> 20} MiB, "
                f"SSD engine {info['engine']}")
        with rep.stage("attaching KVDrive to the model"):
            handle = attach(model, store, budget=args.budget)
        # A cache of our own, to watch its prefill (generate() makes one per call otherwise).
        cache = handle.new_cache(1)
        cache.session.add_observer(_kvdrive_prefill_progress(rep, handle.shape.num_layers))
        streamer = _streamer(tok, rep, _kv_label(args))
        t = time.perf_counter()
        with rep.stage("prefill through KVDrive"), torch.no_grad():
            out = model.generate(**ids, cache=cache, max_new_tokens=args.max_new_tokens, do_sample=False,
                                 streamer=streamer)
        end = time.perf_counter()
        cache.close()
        stats = handle.stats()
        handle.detach()
    finally:
        with rep.stage("stopping the embedded kvstored"):
            store.close()
    return _answer(tok, out[0, ids["input_ids"].shape[1]:], t, streamer.first_token_at, end), stats


def _dense(args, rep: Reporter, model, tok, ids, kv_tokens: list[int]):
    """Plain transformers' answer, and dense's logits before each of KVDrive's tokens given KVDrive's
    text before it (the prompt's cache cropped back, then KVDrive's tokens in one forward)."""
    import torch  # noqa: PLC0415
    from transformers import DynamicCache  # noqa: PLC0415

    rep.say("the same prompt through plain transformers (dense attention, the whole KV cache in memory) ...")
    cache = DynamicCache(config=model.config)
    streamer = _streamer(tok, rep, "dense: ".ljust(len(_kv_label(args))))
    hooks = _dense_prefill_progress(rep, model, ids["input_ids"].shape[1], streamer)
    t = time.perf_counter()
    try:
        with rep.stage("dense prefill"), torch.no_grad():
            out = model.generate(**ids, cache=cache, max_new_tokens=args.max_new_tokens, do_sample=False,
                                 streamer=streamer, output_logits=True, return_dict_in_generate=True)
    finally:
        for h in hooks:
            h.remove()
    end = time.perf_counter()
    prompt_len = ids["input_ids"].shape[1]
    answer = _answer(tok, out.sequences[0, prompt_len:], t, streamer.first_token_at, end)
    with rep.stage("dense's choices along KVDrive's answer"), torch.no_grad():
        extra = cache.get_seq_length() - prompt_len
        if extra:
            cache.crop(-extra)  # back to the prompt alone
        first = out.logits[0][0]  # before the first new token: the prompt alone, as KVDrive's first step
        rest = torch.tensor([kv_tokens[:-1]], dtype=torch.long)
        mask = torch.ones(1, prompt_len + rest.shape[1], dtype=torch.long)
        logits = model(input_ids=rest, attention_mask=mask, cache=cache).logits[0] if rest.shape[1] else first[:0]
    return answer, torch.cat([first[None], logits.to(first.dtype)])


def _kv_label(args) -> str:
    return f"KVDrive ({args.budget * 100:g}%): "


def _answer(tok, new, start: float, first_token_at: float | None, end: float) -> Answer:
    tokens = new.tolist()
    first = first_token_at or end
    return Answer(tokens, tok.decode(tokens, skip_special_tokens=True).strip(), first - start, end - first)


def _report(args, rep: Reporter, tok, kv: Answer, dense: Answer, cmp: Comparison, stats: dict, attn: str,
            prompt_len: int) -> None:
    rep.say("")
    rep.say(side_by_side("", f"KVDrive, budget {args.budget * 100:g}%", f"dense (plain transformers, {attn})")[0])
    for row in side_by_side("answer", kv.text, dense.text):
        rep.say(row)
    for label, a, b in (("prefill", f"{kv.prefill_s:.1f} s ({prompt_len} tokens)", f"{dense.prefill_s:.1f} s"),
                        ("decode", _speed(kv), _speed(dense))):
        rep.say(side_by_side(label, a, b)[0])
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    busy = ": busy, both speeds count other programs' work" if load > cores else ""
    rep.say(f"          (one after the other; {cores} cores, load average {load:.1f}{busy})")
    if cmp.same_prefix == len(kv.tokens) == len(dense.tokens):
        rep.say(f"\nthe two answers are the same, token for token ({len(kv.tokens)} tokens)")
    else:
        at = cmp.same_prefix
        theirs = repr(tok.decode(dense.tokens[at:at + 1])) if at < len(dense.tokens) else "the end"
        ours = repr(tok.decode(kv.tokens[at:at + 1])) if at < len(kv.tokens) else "the end"
        rep.say(f"\nthe answers are the same for their first {at} tokens; token {at + 1} differs: KVDrive {ours}, "
                f"dense {theirs}")
        if cmp.margin is not None:
            rep.say(f"  (there dense rated KVDrive's token {cmp.margin:.2f} below its own in logit: "
                    f"{'a near tie' if cmp.margin < 1.0 else 'a clear preference'})")
    rep.say(f"given the same text before it, KVDrive's token was dense's first choice at {cmp.agreed} of "
            f"{cmp.steps} steps")
    steps = stats.get("steps", 0)
    rep.say(f"\nKVDrive: attended {stats.get('attended_fraction', 0):.1%} of the context per step; device-cache hit "
            f"rate {stats['hit_rate'] or 0:.1%} ({stats.get('hits', 0)} hits, {stats.get('misses', 0)} misses)")
    rep.say(f"  fetched {stats['bytes_from_dram'] / 2**20:.2f} MiB from DRAM, {stats['bytes_from_ssd'] / 2**20:.2f} MiB "
            f"from SSD; stored at prefill {stats.get('bytes_put', 0) / 2**20:.1f} MiB")
    rep.say(f"  reserved on the device: cache {stats.get('device_cache_bytes', 0) / 2**20:.1f} MiB for "
            f"{stats.get('kv_bytes', 0) / 2**20:.1f} MiB of K and V, index {stats.get('index_bytes', 0) / 2**20:.1f} MiB")
    if steps:
        rep.say("  per step: " + ", ".join(f"{key[:-3]} {stats.get(key, 0) / steps:.1f} ms"
                                           for key in ("select_ms", "fetch_ms", "attention_ms")))


def _speed(a: Answer) -> str:
    rate = a.tokens_per_s
    return f"{rate:.1f} tokens/s ({len(a.tokens)} tokens)" if rate is not None else f"{len(a.tokens)} token(s)"


class LayerProgress:
    """A prefill's progress, a line per layer done (at most every few seconds, and the last)."""

    def __init__(self, rep: Reporter, num_layers: int, what: str) -> None:
        self.rep, self.num_layers, self.what = rep, num_layers, what
        self.start = self.last = None

    def layer_done(self, layer: int, tokens: int) -> None:
        now = time.perf_counter()
        if self.start is None:
            self.start = self.last = now
            self.rep.say(f"{self.what}: {tokens} tokens through {self.num_layers} layers ...")
        if now - self.last >= PREFILL_EVERY_S or layer == self.num_layers - 1:
            self.last = now
            self.rep.say(f"  {self.what}: layer {layer + 1}/{self.num_layers} ({now - self.start:.0f} s)")


def _kvdrive_prefill_progress(rep: Reporter, num_layers: int):
    """KVDrive's prefill progress, from the session's per-layer hook."""
    from kvdrive_client.session import Observer  # noqa: PLC0415

    class PrefillProgress(Observer):
        def __init__(self) -> None:
            self.lines = LayerProgress(rep, num_layers, "KVDrive prefill")

        def on_prefill_layer(self, layer, keys, values, query, mask):
            self.lines.layer_done(layer, keys.shape[2])

    return PrefillProgress()


def _dense_prefill_progress(rep: Reporter, model, tokens: int, streamer) -> list:
    """Plain transformers' prefill progress, from forward hooks on the decoder layers (until the first
    new token); returns the hooks, to remove."""
    layers = model.model.layers
    lines = LayerProgress(rep, len(layers), "dense prefill")

    def hook(layer: int):
        def done(module, args, output) -> None:
            if streamer.first_token_at is None:
                lines.layer_done(layer, tokens)
        return done

    return [m.register_forward_hook(hook(i)) for i, m in enumerate(layers)]


def _streamer(tok, rep: Reporter, label: str):
    """transformers' TextStreamer, printing through the reporter after ``label`` and noting when the
    first token came."""
    from transformers import TextStreamer  # noqa: PLC0415

    class Streamer(TextStreamer):
        first_token_at: float | None = None

        def put(self, value):
            if not self.next_tokens_are_prompt and self.first_token_at is None:
                self.first_token_at = time.perf_counter()
                rep.detail("decoding")
                rep.say(label, end="")
            super().put(value)
            rep.touch()

        def on_finalized_text(self, text: str, stream_end: bool = False):
            rep.say(text, end="\n" if stream_end else "")

    return Streamer(tok, skip_prompt=True, skip_special_tokens=True)


if __name__ == "__main__":
    raise SystemExit(main())
