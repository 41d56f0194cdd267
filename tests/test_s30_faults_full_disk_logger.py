"""A logger destination that fails because of the machine (W&B copying a heatmap PNG into its run
folder on a full disk: `OSError: [Errno 28] No space left on device`) is one warning line, while
training goes on. Before, the warning carried the error's traceback: 45 lines of W&B's and
shutil's frames per kind (images, then table) in the middle of a healthy run's log, read as a
crash (seen with W&B offline on a 600 kB tmpfs). A logger's own bug keeps its traceback."""

from __future__ import annotations

import errno
import logging

import pytest
from composer.loggers import LoggerDestination

from foundry_fp8.composer.destinations import deliver


class _Failing(LoggerDestination):
    def __init__(self, error: Exception):
        self.error = error

    def log_images(self, *args, **kwargs) -> None:
        raise self.error


@pytest.mark.parametrize("error, traceback", [
    (OSError(errno.ENOSPC, "No space left on device"), False),
    (ConnectionError("connection refused"), False),  # an OSError too: the network
    (TypeError("unexpected keyword argument"), True)])
def test_a_machine_failure_is_one_line_a_logger_bug_keeps_its_traceback(caplog, error,
                                                                         traceback):
    with caplog.at_level(logging.WARNING, logger="foundry_fp8.composer.destinations"):
        deliver([_Failing(error)], "images", lambda d: d.log_images(), "fp8_stats")
    [record] = caplog.records
    assert f"_Failing failed to log images ({type(error).__name__}: {error})" in record.message
    assert (record.exc_info is not None) is traceback
    assert ("Traceback" in caplog.text) is traceback


def test_the_machine_failures_traceback_is_kept_for_debug_logging(caplog):
    """The one line is the warning; with debug logging the traceback is there to read."""
    error = OSError(errno.ENOSPC, "No space left on device")
    with caplog.at_level(logging.DEBUG, logger="foundry_fp8.composer.destinations"):
        deliver([_Failing(error)], "images", lambda d: d.log_images(), "fp8_stats")
    [warning, debug] = caplog.records
    assert (warning.levelno, warning.exc_info) == (logging.WARNING, None)
    assert debug.levelno == logging.DEBUG and debug.exc_info[1] is error
