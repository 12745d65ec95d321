import json

from benchmark.core.store import host_name, quarantine, quarantined
from benchmark.core.store.claims import HOST_ENV


def test_quarantine_moves_the_file_and_records_why(tmp_path, monkeypatch):
    monkeypatch.setenv(HOST_ENV, "node-17")
    zoo = tmp_path / "zoo"
    zoo.mkdir()
    (zoo / "seed_000007.safetensors").write_bytes(b"first")
    dest = quarantine(zoo / "seed_000007.safetensors", "checksum mismatch")
    assert dest == zoo / "quarantine" / "seed_000007.safetensors" and dest.read_bytes() == b"first"
    assert not (zoo / "seed_000007.safetensors").exists()
    record = json.loads((zoo / "quarantine" / "seed_000007.json").read_text())
    assert record["reason"] == "checksum mismatch" and record["host"] == "node-17" == host_name()
    assert record["file"] == "seed_000007.safetensors" and record["time"].endswith("Z")
    (zoo / "seed_000007.safetensors").write_bytes(b"second")
    again = quarantine(zoo / "seed_000007.safetensors", "truncated")
    assert again.name == "seed_000007-2.safetensors" and again.read_bytes() == b"second"
    listed = quarantined(zoo)
    assert [q.path.name for q in listed] == ["seed_000007-2.safetensors", "seed_000007.safetensors"]
    assert [q.reason for q in listed] == ["truncated", "checksum mismatch"]


def test_json_files_get_a_separate_record(tmp_path):
    (tmp_path / "seed_000001.json").write_text("{bad")
    dest = quarantine(tmp_path / "seed_000001.json", "damaged failure record")
    assert dest.read_text() == "{bad"
    assert json.loads((tmp_path / "quarantine" / "seed_000001.json.reason.json").read_text())["reason"] == \
        "damaged failure record"
    assert [q.path.name for q in quarantined(tmp_path, suffix=".json")] == ["seed_000001.json"]


def test_two_quarantines_of_one_name_keep_both_pieces_of_evidence(tmp_path, monkeypatch):
    """Another process quarantines a file of the same name between this one's choice of a free
    name and its move: neither the evidence nor the record of the other may be overwritten."""
    import importlib
    import os

    module = importlib.import_module("benchmark.core.store.quarantine")

    (tmp_path / "seed_000003.safetensors").write_bytes(b"mine")
    qdir = tmp_path / "quarantine"
    for name in ("rename", "link"):
        real = getattr(os, name)

        def move(src, dst, *args, _real=real, **kwargs):
            if str(dst).startswith(str(qdir)) and not (qdir / "seed_000003.safetensors").exists():
                (qdir / "seed_000003.safetensors").write_bytes(b"theirs")  # the other process, in the gap
            return _real(src, dst, *args, **kwargs)

        monkeypatch.setattr(module.os, name, move)
    dest = module.quarantine(tmp_path / "seed_000003.safetensors", "bit flip")
    assert (qdir / "seed_000003.safetensors").read_bytes() == b"theirs"
    assert dest != qdir / "seed_000003.safetensors" and dest.read_bytes() == b"mine"
    assert json.loads(module._record_path(dest).read_text())["reason"] == "bit flip"
