"""The parts of the FAISS GPU carry that can be checked without a GPU (docs/operating.md#gpu-check):
the fat-binary pruning keeps exactly one architecture's SASS, and the cuBLAS-12 shim forwards calls,
arguments on the stack included, to a libcublas.so.13 (here a stand-in built from C)."""

import importlib.util
import shutil
import struct
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _fatbin(entries: list[tuple[int, int, bytes]]) -> bytes:
    body = b""
    for kind, arch, payload in entries:
        head = struct.pack("<HHIQ", kind, 0x0101, 64, len(payload)) + bytes(12) + struct.pack("<I", arch)
        body += head + bytes(64 - len(head)) + payload
    return struct.pack("<IHHQ", 0xBA55ED50, 1, 16, len(body)) + body


def test_fatbin_keep_arch_zeroes_every_image_but_the_kept_sass(tmp_path):
    spec = importlib.util.spec_from_file_location("fatbin_keep_arch", ROOT / "scripts" / "fatbin_keep_arch.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    lib = tmp_path / "lib.so"
    images = [(2, 80, b"\x11" * 100), (2, 90, b"\x22" * 100), (1, 90, b"\x33" * 50)]
    blob = b"ELF-ish prefix" + _fatbin(images) + b"between" + _fatbin(images[:2]) + b"tail"
    lib.write_bytes(blob)
    out = mod.keep_arch(str(lib), 90)
    got = lib.read_bytes()
    assert len(got) == len(blob) and out["images_kept"] == 2 and out["images_zeroed"] == 3
    assert got.count(b"\x22" * 100) == 2  # sm_90 SASS kept in both fat binaries
    assert b"\x11" * 10 not in got and b"\x33" * 10 not in got  # sm_80 SASS and the PTX zeroed
    assert got.startswith(b"ELF-ish prefix") and got.endswith(b"tail") and b"between" in got
    with pytest.raises(SystemExit, match="no sass image for sm_75"):
        mod.keep_arch(str(lib), 75)


@pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc not installed: the shim is built with it")
def test_cublas12_shim_forwards_to_cublas13(tmp_path):
    out = tmp_path / "shim"
    subprocess.run(["bash", str(ROOT / "scripts" / "cublas12_shim" / "make.sh"), str(out)], check=True)
    fake = tmp_path / "fake13"
    fake.mkdir()
    (fake / "f.c").write_text(
        "int cublasCreate_v2(void **h){ *h=(void*)0x1234; return 0; }\n"
        "int cublasDestroy_v2(void *h){ return h==(void*)0x1234 ? 0 : 7; }\n"
        "int cublasGemmEx(void*h,int ta,int tb,int m,int n,int k,const void*al,const void*A,int At,int lda,"
        "const void*B,int Bt,int ldb,const void*be,void*C,int Ct,int ldc,int ct,int algo){\n"
        "  return (m==1&&n==2&&k==3&&lda==10&&ldb==13&&Ct==15&&ldc==16&&ct==68&&algo==-1) ? 0 : 99; }\n"
        + "".join(f"int {s}(void){{ return 0; }}\n" for s in (
            "cublasGemmStridedBatchedEx", "cublasGetMathMode", "cublasSetMathMode", "cublasSetStream_v2", "cublasSgemmEx")))
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(fake / "libcublas.so.13"), "-Wl,-soname,libcublas.so.13",
                    str(fake / "f.c")], check=True)
    (fake / "t.c").write_text(
        "#include <stdio.h>\nint cublasCreate_v2(void **h); int cublasDestroy_v2(void *h);\n"
        "int cublasGemmEx(void*h,int ta,int tb,int m,int n,int k,const void*al,const void*A,int At,int lda,"
        "const void*B,int Bt,int ldb,const void*be,void*C,int Ct,int ldc,int ct,int algo);\n"
        "int main(void){ void*h; int a=cublasCreate_v2(&h); int b=cublasGemmEx(h,0,0,1,2,3,0,0,0,10,0,0,13,0,0,15,16,68,-1);"
        " int c=cublasDestroy_v2(h); printf(\"%d %d %d\\n\",a,b,c); return a||b||c; }\n")
    subprocess.run(["gcc", "-o", str(fake / "t"), str(fake / "t.c"), f"-L{out}", "-l:libcublas.so.12"], check=True)
    ok = subprocess.run([str(fake / "t")], env={"LD_LIBRARY_PATH": f"{out}:{fake}"}, capture_output=True, text=True)
    assert ok.returncode == 0 and ok.stdout.split() == ["0", "0", "0"], ok.stderr
    syms = subprocess.run(["nm", "-D", str(out / "libcublas.so.12")], capture_output=True, text=True).stdout
    assert "cublasGemmEx@@libcublas.so.12" in syms  # the versioned name faiss-gpu's libfaiss asks for
    missing = subprocess.run([str(fake / "t")], env={"LD_LIBRARY_PATH": str(out)}, capture_output=True, text=True)
    assert missing.returncode != 0 and "cannot load libcublas.so.13" in missing.stderr  # says why, never jumps to 0
