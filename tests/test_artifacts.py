"""The cache entries pagedserve writes (`artifacts.write_cache_entry`): whole or not at all."""

import logging

from pagedserve import artifacts


def _fill(text):
    def fill(folder):
        (folder / "value").write_text(text)
    return fill


def test_an_entry_is_written_whole_and_a_second_writer_keeps_the_first(tmp_path, caplog):
    entry = tmp_path / "kind" / "key"
    artifacts.write_cache_entry(entry, _fill("first"))
    with caplog.at_level(logging.DEBUG, logger="pagedserve.artifacts"):
        artifacts.write_cache_entry(entry, _fill("second"))  # as a process that lost the race
    assert (entry / "value").read_text() == "first"
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert sorted(p.name for p in entry.parent.iterdir()) == ["key"]  # no temporary left


def test_an_entry_that_cannot_be_written_is_a_warning_not_an_error(tmp_path, caplog):
    blocker = tmp_path / "kind"
    blocker.write_text("a file where the folder should be")
    with caplog.at_level(logging.WARNING, logger="pagedserve.artifacts"):
        artifacts.write_cache_entry(blocker / "key", _fill("x"))
    assert any("could not write the cache entry" in r.message for r in caplog.records)
