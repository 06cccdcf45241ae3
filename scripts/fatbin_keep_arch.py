"""Zero every GPU code image in a shared library's CUDA fat binaries except the SASS for one
architecture (e.g. 90), so that a multi-architecture wheel compresses to what a 64 MiB carry allows.

Headers stay as they are (the CUDA driver still reads a valid fat binary and picks the exact-match
SASS); only the payloads of the other images become zeros. For scripts/gpu_check_prepare_faiss.sh.
Prints one JSON line: images kept and zeroed, bytes zeroed."""

import argparse
import json
import mmap
import struct

MAGIC = struct.pack("<I", 0xBA55ED50)
KIND = {1: "ptx", 2: "sass"}


def keep_arch(path: str, arch: int) -> dict:
    kept = zeroed = zero_bytes = 0
    with open(path, "r+b") as fh, mmap.mmap(fh.fileno(), 0) as m:
        pos = 0
        while (i := m.find(MAGIC, pos)) >= 0:
            _version, header_size, fat_size = struct.unpack_from("<HHQ", m, i + 4)
            j, end = i + header_size, i + header_size + fat_size
            while j + 32 <= end:
                kind, _, entry_header, size = struct.unpack_from("<HHIQ", m, j)
                entry_arch = struct.unpack_from("<I", m, j + 28)[0]
                if entry_header == 0 or j + entry_header + size > end:
                    break
                if KIND.get(kind) == "sass" and entry_arch == arch:
                    kept += 1
                else:
                    a = j + entry_header
                    m[a : a + size] = bytes(size)
                    zeroed += 1
                    zero_bytes += size
                j += entry_header + size
            pos = end if end > i else i + 4
        m.flush()
    if not kept:
        raise SystemExit(f"{path}: no sass image for sm_{arch}: nothing would run there")
    return {"path": path, "arch": arch, "images_kept": kept, "images_zeroed": zeroed, "bytes_zeroed": zero_bytes}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("library")
    ap.add_argument("--arch", type=int, default=90)
    a = ap.parse_args()
    print(json.dumps(keep_arch(a.library, a.arch)))
