"""``libra view``: a live web page of a run (its fleet, C-MLFQ's buckets and moves, every
trajectory with its timeline and conversation, training and allocation), fed by the
run's event stream (``libra.events``), or by a finished run folder's events log."""

from libra.view._app import ViewApp
from libra.view._history import History
from libra.view._records import RecordFiles
from libra.view._server import LOOPBACK, serve_view, view_key

__all__ = ["LOOPBACK", "History", "RecordFiles", "ViewApp", "serve_view", "view_key"]
