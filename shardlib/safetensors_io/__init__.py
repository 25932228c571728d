"""Reading and writing safetensors files without mapping them: strict header parsing, slice reads with ``preadv``
straight into destination tensors, and streamed checksummed writes (used by :mod:`shardlib.checkpoint`).

Reading never maps a file: :class:`SafetensorsFile` parses the safetensors header itself (strictly: every error
names the file and the tensor) and reads exactly the bytes of the requested rows straight into the destination
tensor, so a rank's resident memory is its local shards and never the file's pages. Nothing is ever unpickled.
Writing streams: a file's header first, then each tensor's bytes in bounded blocks, written by background threads
while the caller hashes (xxh3-128) and reads the next block; byte ranges of another file are copied inside the
kernel (``copy_file_range``) while the caller reads them once to hash them; files are fsynced when finished.

Modules: :mod:`.base` (limits, errors, dtypes, checksums), :mod:`.reader`, :mod:`.writer`, :mod:`.stream`
(tensor copies from any readable source into written files).
"""

from .base import (
    CHECKSUM, DTYPES, CheckpointError, checksum_of, dtype_name, file_checksum, inside, safetensors_order, sha256_of,
    strict_json,
)
from .reader import ReaderPool, SafetensorsFile, SafetensorsFiles
from .stream import copy_rows, copy_split
from .writer import OutFile, Writer

__all__ = [
    "CHECKSUM", "DTYPES", "CheckpointError", "checksum_of", "dtype_name", "file_checksum", "inside",
    "safetensors_order", "sha256_of", "strict_json", "ReaderPool", "SafetensorsFile", "SafetensorsFiles", "copy_rows",
    "copy_split", "OutFile", "Writer",
]
