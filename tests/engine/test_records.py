"""An episode's pieces joined into one record."""

from __future__ import annotations

import msgspec
import pytest

from libra.engine import join_pieces
from libra.engine._records import TrajectoryRecord, WeightSpan
from tests._helpers import scripted_record as record


def test_pieces_are_laid_end_to_end_with_where_each_starts() -> None:
    first = record("a", None, [0, 1, 1], ids=[5, 6, 7], version=2, group="first")
    first.tokens, first.stop_reason = "exact", "history_edited"
    second = record("a", 1.0, [0, 0, 1, 1], ids=[5, 8, 9, 10], version=3)
    third = record("a", 1.0, [0, 1], ids=[5, 11], version=3)
    episode = join_pieces([first, second, third])
    assert episode.token_ids == [5, 6, 7, 5, 8, 9, 10, 5, 11]
    assert episode.loss_mask == [0, 1, 1, 0, 0, 1, 1, 0, 1]
    assert episode.piece_starts == [3, 7]
    spans = [WeightSpan(1, 3, 2), WeightSpan(5, 7, 3), WeightSpan(8, 9, 3)]
    assert episode.weight_versions == spans
    assert episode.turns == 3 and episode.tokens == "exact"
    # Its ending and reward are the last piece's; its task and first weights the first's.
    assert (episode.reward, episode.stop_reason, episode.weight_version) == (1.0, "model_stop", 2)
    assert episode.task_id == "first" and episode.id == "a"
    # A joined episode joins again as its pieces did.
    again = join_pieces([join_pieces([first, second]), third])
    assert msgspec.to_builtins(again) == msgspec.to_builtins(episode)


def test_an_episode_with_a_piece_that_is_not_exact_is_not() -> None:
    pieces = [record("a", None, [0, 1]), record("a", 1.0, [0, 1], tokens="drift")]
    assert join_pieces(pieces).tokens == "drift"


def test_one_piece_is_its_own_episode_and_none_is_an_error() -> None:
    only = record("a", 1.0, [0, 1])
    assert join_pieces([only]) is only
    assert only.piece_starts == []
    with pytest.raises(ValueError, match="no pieces"):
        join_pieces([])


def test_a_record_written_before_pieces_reads_as_one_piece() -> None:
    written = msgspec.json.encode(record("a", 1.0, [0, 1]))
    assert b"piece_starts" in written
    old = msgspec.json.decode(written.replace(b',"piece_starts":[]', b""))
    assert msgspec.convert(old, TrajectoryRecord).piece_starts == []
