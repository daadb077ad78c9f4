"""Constants of the on-disk format shared by the daemon and kvstore-inspect."""

# Bumped whenever the data file or the LMDB records change shape; a store written
# with another version is refused at open rather than misread.
# 2: block checksums are CRC-32C (1 used zlib's CRC-32).
# 3: every catalog record carries a CRC-32C, a counts record, sequences keyed by owner
#    (kvstored migrates a format-2 catalog in place).
# 4: engine block records keyed by namespace and first extent id, the engine key in the
#    value (kvstored migrates a format-2 or format-3 catalog in place).
FORMAT_VERSION = 4

# Every extent starts and ends on this boundary so it can be read with O_DIRECT.
ALIGN = 4096

DATA_FILE = "blocks.kvd"
META_DIR = "meta"


def align_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


def align_down(n: int, align: int = ALIGN) -> int:
    return n // align * align
