"""The main job: SmolLM2-135M answering over real text, its KV cache served by an embedded kvstored.

It says what it is doing as it goes (a line at least every few seconds, also during the
one-time model conversion and kernel compile of a machine's first run), streams the
answer token by token, and ends with where the time went, beside plain transformers'
prefill of the same prompt.
"""

from __future__ import annotations

import argparse
import threading
import time
from contextlib import contextmanager

# A line at least this often (seconds) while a stage runs without saying anything itself.
HEARTBEAT_S = 6.0
# Prefill progress at most this often (seconds): one line per layer on a slow host, fewer on a fast one.
PREFILL_EVERY_S = 3.0


class Reporter:
    """The demo's output: lines as they come, and while a stage runs silent, a heartbeat line."""

    def __init__(self) -> None:
        self._last = time.perf_counter()
        self._stage: str | None = None
        self._stage_start = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="demo-heartbeat", daemon=True)
        self._thread.start()

    def say(self, line: str, end: str = "\n") -> None:
        with self._lock:
            print(line, end=end, flush=True)
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvdrive.tools.demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dram", default="32M", help="DRAM tier of the embedded daemon (small, so some blocks come from SSD)")
    p.add_argument("--budget", type=float, default=0.0625, help="fraction of the context attended per decode step")
    p.add_argument("--document", default=None,
                   help="text the question is asked about (default: /usr/share/common-licenses/GPL-3)")
    p.add_argument("--question", default="Which license is this document, and who published it?")
    p.add_argument("--max-new-tokens", type=int, default=48)
    args = p.parse_args(argv)
    rep = Reporter()
    try:
        return _run(args, rep)
    finally:
        rep.close()


def _run(args, rep: Reporter) -> int:
    import logging  # noqa: PLC0415 - heavy imports after argument parsing: --help returns at once

    logging.basicConfig(level=logging.WARNING)
    rep.say("loading SmolLM2-135M-Instruct (offline GGUF) ...")
    with rep.stage("importing torch and transformers") as import_s:
        import torch  # noqa: PLC0415

        from kvdrive.kernels import warm_up  # noqa: PLC0415
        from kvdrive_client import attach, connect  # noqa: PLC0415
        from kvdrive_client.config import AttachConfig  # noqa: PLC0415
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
        # The kernels attach() prepares: the default index's selection, attention for the model's dtype.
        warmed = warm_up(dtypes=(model.dtype,), indexes=(AttachConfig().index.value,), progress=on_kernel)
    rep.say(f"  {warmed.summary}")

    rep.say(f"\nprompt: {prompt_len} tokens ({document_path}) + question: {args.question}")
    with connect(None, dram=args.dram) as store:
        info = store.server_info
        rep.say(f"embedded kvstored pid {info['pid']}: DRAM tier {info['dram_bytes'] >> 20} MiB, SSD engine {info['engine']}")
        handle = attach(model, store, budget=args.budget)
        # A cache of our own, to watch its prefill (generate() makes one per call otherwise).
        cache = handle.new_cache(1)
        cache.session.add_observer(_prefill_progress(rep, handle.shape.num_layers))
        streamer = _streamer(tok, rep)
        t = time.perf_counter()
        with rep.stage("prefill through KVDrive"), torch.no_grad():
            out = model.generate(**ids, cache=cache, max_new_tokens=args.max_new_tokens, do_sample=False,
                                 streamer=streamer)
        elapsed = time.perf_counter() - t
        cache.close()
        stats = handle.stats()
        handle.detach()
    generated = out.shape[1] - prompt_len
    prefill_s = (streamer.first_token_at or time.perf_counter()) - t
    decode_s = elapsed - prefill_s

    rep.say("plain transformers' prefill of the same prompt, for comparison (no KVDrive) ...")
    with rep.stage("plain transformers prefill") as plain_s, torch.no_grad():
        model(**ids, use_cache=True, logits_to_keep=1)
    rep.say(f"  {plain_s[0]:.1f} s")

    steps = stats.get("steps", 0)
    rep.say(f"\ngenerated {generated} tokens in {elapsed:.1f} s through KVDrive (budget {args.budget:.2%})")
    rep.say(f"  attended per step: {stats.get('attended_fraction', 0):.1%} of the context")
    rep.say(f"  device-cache hit rate: {stats['hit_rate']:.1%} ({stats.get('hits', 0)} hits, {stats.get('misses', 0)} misses)")
    rep.say(f"  fetched: {stats['bytes_from_dram'] / 2**20:.2f} MiB from DRAM, {stats['bytes_from_ssd'] / 2**20:.2f} MiB from SSD")
    rep.say(f"  stored at prefill: {stats.get('bytes_put', 0) / 2**20:.1f} MiB; index {stats.get('index_bytes', 0) / 2**10:.0f} KiB")
    if steps:
        for key in ("select_ms", "fetch_ms", "attention_ms"):
            rep.say(f"  {key[:-3]} per step: {stats.get(key, 0) / steps:.1f} ms")
    rep.say("\ntime split:")
    rep.say(f"  load            {import_s[0] + load_s[0]:7.1f} s  (imports {import_s[0]:.1f} s, model {load_s[0]:.1f} s)")
    rep.say(f"  kernel warm-up  {warm_s[0]:7.1f} s  ({len(warmed.compiled)} compiled, {len(warmed.loaded)} loaded "
            f"from the cache)")
    rep.say(f"  prefill         {prefill_s:7.1f} s  ({prompt_len} tokens; plain transformers, "
            f"{model.config._attn_implementation}: {plain_s[0]:.1f} s, KVDrive {prefill_s / plain_s[0]:.1f}x that)")
    per_step = f", selection {stats.get('select_ms', 0) / steps:.1f} ms/step" if steps else ""
    rate = f"{(generated - 1) / decode_s:.1f} tokens/s" if generated > 1 and decode_s > 0 else "one token"
    rep.say(f"  decode          {decode_s:7.1f} s  ({generated} tokens, {rate}{per_step})")
    return 0


def _prefill_progress(rep: Reporter, num_layers: int):
    """An observer printing the prefill's progress, a layer at a time (at most every few seconds)."""
    from kvdrive_client.session import Observer  # noqa: PLC0415

    class PrefillProgress(Observer):
        def __init__(self) -> None:
            self.start = self.last = None

        def on_prefill_layer(self, layer, keys, values, query, mask):
            now = time.perf_counter()
            if self.start is None:
                self.start = self.last = now
                rep.say(f"prefill: {keys.shape[2]} tokens through {num_layers} layers ...")
            if now - self.last >= PREFILL_EVERY_S or layer == num_layers - 1:
                self.last = now
                rep.say(f"  prefill: layer {layer + 1}/{num_layers} ({now - self.start:.0f} s)")

    return PrefillProgress()


def _streamer(tok, rep: Reporter):
    """transformers' TextStreamer, printing through the reporter and noting when the first token came."""
    from transformers import TextStreamer  # noqa: PLC0415

    class Streamer(TextStreamer):
        first_token_at: float | None = None

        def put(self, value):
            if not self.next_tokens_are_prompt and self.first_token_at is None:
                self.first_token_at = time.perf_counter()
                rep.detail("decoding")
                rep.say("answer: ", end="")
            super().put(value)
            rep.touch()

        def on_finalized_text(self, text: str, stream_end: bool = False):
            rep.say(text, end="\n" if stream_end else "")

    return Streamer(tok, skip_prompt=True, skip_special_tokens=True)


if __name__ == "__main__":
    raise SystemExit(main())
