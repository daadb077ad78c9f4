"""kvstored: the KVDrive storage daemon (DRAM + SSD tiers, sparse block reads over ZeroMQ)."""
