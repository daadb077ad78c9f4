"""kvstored as the KV tier of serving engines.

- :mod:`kvdrive_client.integrations.vllm` — a secondary tier of vLLM's offloading
  connector (``TieringOffloadingSpec``'s ``secondary_tiers``).
- :mod:`kvdrive_client.integrations.sglang` — a HiCache storage backend of SGLang
  (``--hicache-storage-backend dynamic``).

Both stand on :class:`~kvdrive_client.integrations.blocks.BlockStore`: the engine's
blocks, opaque byte strings of one size named by the engine's prefix hash, kept in
kvstored one sequence per key in a namespace per engine, model and tenant. Every module
here imports without the engine installed; the adapter classes exist where it is.
How to run each engine with kvstored is in docs/engines.md.
"""
