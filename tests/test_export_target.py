"""The export directory rule against forged markers and interrupted re-exports (issue 29).

These call :func:`write_export` with a fill function writing small files: no model is needed to
exercise which folders an export may delete and what its marker says after a crash."""

import json
import os

import pytest

from comlrl import ConfigError
from comlrl.checkpoint.export import MARKER, export_record, write_export


def _fill(tag, folders=("agent_0", "agent_1")):
    def fill(tmp):
        for name in folders:
            (tmp / name).mkdir()
            (tmp / name / "model.safetensors").write_text(tag)
    return fill


def _forge(target, folders, files):
    record = json.loads((target / MARKER).read_text())
    record.update(folders=folders, files=files)
    (target / MARKER).write_text(json.dumps(record))


@pytest.mark.parametrize("how", ["relative", "absolute", "nested"])
def test_a_forged_marker_never_deletes_outside_the_export(tmp_path, how):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "thesis.tex").write_text("years of work")
    target = tmp_path / "final"
    write_export(target, _fill("one"), origin="a")
    name = {"relative": "../victim", "absolute": str(victim), "nested": "agent_0/../../victim"}[how]
    _forge(target, ["agent_0", "agent_1", name], ["agent_0/model.safetensors", "agent_1/model.safetensors"])
    assert export_record(target) is None  # a record naming a path is no record of ours
    with pytest.raises(ConfigError, match="export did not write"):
        write_export(target, _fill("two", ("agent_0",)), origin="b")
    assert (victim / "thesis.tex").read_text() == "years of work"
    assert (target / "agent_1" / "model.safetensors").read_text() == "one"


def test_a_forged_file_entry_outside_the_folders_is_no_record(tmp_path):
    target = tmp_path / "final"
    write_export(target, _fill("one"), origin="a")
    _forge(target, ["agent_0", "agent_1"], ["agent_0/model.safetensors", "../elsewhere/x"])
    assert export_record(target) is None


def test_fill_writing_a_dotted_folder_is_refused(tmp_path):
    def fill(tmp):
        (tmp / ".hidden").mkdir()
    with pytest.raises(ConfigError, match="plain top-level folders"):
        write_export(tmp_path / "final", fill, origin="a")
    assert not (tmp_path / "final").exists()


def test_a_crash_mid_reexport_leaves_the_export_marked_incomplete(tmp_path, monkeypatch):
    target = tmp_path / "final"
    write_export(target, _fill("one"), origin="checkpoint-1")
    real_rename = os.rename

    def dying_rename(src, dst):  # the process dies as the second agent's new folder moves in
        if ".tmp-export-" in str(src) and os.path.basename(str(dst)) == "agent_1" and "replaced" not in str(dst):
            raise KeyboardInterrupt("killed")
        return real_rename(src, dst)
    monkeypatch.setattr(os, "rename", dying_rename)
    with pytest.raises(KeyboardInterrupt):
        write_export(target, _fill("two"), origin="checkpoint-2")
    monkeypatch.setattr(os, "rename", real_rename)
    assert (target / "agent_0" / "model.safetensors").read_text() == "two"  # two checkpoints' agents ...
    marker = json.loads((target / MARKER).read_text())
    assert marker["complete"] is False and marker["source"] == "checkpoint-2"  # ... under a marker that says so
    assert marker["replacing"] == "checkpoint-1"
    assert export_record(target)["complete"] is False
    # the next export takes it over whole and leaves nothing behind
    assert write_export(target, _fill("three"), origin="checkpoint-3") == ["agent_0", "agent_1"]
    assert sorted(p.name for p in target.iterdir()) == [MARKER, "agent_0", "agent_1"]
    assert export_record(target)["complete"] is True
    assert {(target / a / "model.safetensors").read_text() for a in ("agent_0", "agent_1")} == {"three"}


def test_a_reexport_drops_stale_folders_and_leaves_no_old_copies(tmp_path):
    target = tmp_path / "final"
    write_export(target, _fill("one", ("agent_0", "agent_1", "critic")), origin="a")
    assert write_export(target, _fill("two", ("agent_0",)), origin="b") == ["agent_0"]
    assert sorted(p.name for p in target.iterdir()) == [MARKER, "agent_0"]
    assert export_record(target)["files"] == ["agent_0/model.safetensors"]


def test_a_killed_exports_scratch_beside_a_new_target_is_removed_by_the_next(tmp_path):
    target = tmp_path / "final"
    dead = tmp_path / f".tmp-export-final-{2**22 + 12345}-deadbeef"  # a pid above Linux's limit: not running
    (dead / "agent_0").mkdir(parents=True)
    (dead / "agent_0" / "model.safetensors").write_text("partial")
    live = tmp_path / f".tmp-export-final-{os.getpid()}-cafe0000"  # a running export's: left alone
    live.mkdir()
    other = tmp_path / ".tmp-export-elsewhere-1-0"  # another target's
    other.mkdir()
    write_export(target, _fill("one"), origin="a")
    assert not dead.exists() and live.is_dir() and other.is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, other.name, "final"])


def test_a_full_disk_is_a_clear_error_and_leaves_the_earlier_export(tmp_path, monkeypatch):
    from comlrl.exceptions import CheckpointError

    target = tmp_path / "final"
    write_export(target, _fill("one"), origin="a")

    def full(tmp):
        raise OSError(28, "No space left on device", str(tmp / "agent_0" / "model.safetensors"))
    with pytest.raises(CheckpointError, match="No space left on device.*holds the earlier export"):
        write_export(target, full, origin="b")
    assert export_record(target)["complete"] and (target / "agent_0" / "model.safetensors").read_text() == "one"
    assert sorted(p.name for p in target.iterdir()) == [MARKER, "agent_0", "agent_1"]
    with pytest.raises(CheckpointError, match="nothing was written"):
        write_export(tmp_path / "new", full, origin="b")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]


def test_a_large_foreign_folder_is_refused_without_walking_it(tmp_path, monkeypatch):
    from pathlib import Path

    target = tmp_path / "data"
    for i in range(3):
        (target / f"shard{i}").mkdir(parents=True)
        (target / f"shard{i}" / "part.bin").write_text("x")
    walked = []
    real_rglob = Path.rglob
    monkeypatch.setattr(Path, "rglob", lambda self, pattern: walked.append(self) or real_rglob(self, pattern))
    with pytest.raises(ConfigError, match="already holds files export did not write \\(shard0, shard1, shard2\\)"):
        write_export(target, _fill("one"), origin="a")
    assert walked == []
