"""KVDrive's decode path, one stage per module.

- :mod:`.state`: the shapes and records the stages pass: the model's shape, one layer's
  state, the per-step plan (built once per decode step, read by every layer) and the
  micro-batch record that carries a slice of the batch through the stages.
- :mod:`.prefill`: after a layer's dense prefill: page importance, the index, the
  puts to the store, the seeded device cache.
- :mod:`.select`: which pages each (row, KV head) attends, and where they sit in
  the device cache (hits, misses, evictions).
- :mod:`.fetch`: the store side: sequences, staging buffers, sparse gets of the misses,
  puts of the pages completed while decoding.
- :mod:`.attention`: exact attention over sink + selected pages + local window.
- :mod:`.pipeline`: the stages over micro-batches, one after another or overlapped.
- :mod:`.tuning`: warm-up calibration of the micro-batch size and the cache multiplier.

:class:`kvdrive_client.session.Session` only orchestrates them.
"""
