"""Where the recorder's rows go: a CSV file, and TensorBoard when it is installed."""

from __future__ import annotations

import csv
import os
import warnings

#: The columns of a row, in CSV order (see docs/debugging.md).
COLUMNS = ("step", "layer", "role", "direction", "format", "shape", "calls", "amax", "scale",
           "block_scale_min", "block_scale_max", "saturated", "flushed", "sqnr_db",
           "nonfinite")

#: The columns written to TensorBoard, one scalar each per layer, role and direction.
SCALARS = ("amax", "scale", "saturated", "flushed", "sqnr_db")


def check_path(name: str, value) -> str | None:
    """``value`` as a path string (None stays None); TypeError for anything else."""
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{name}={value!r}: expected a path (str or os.PathLike) or None")
    return os.fspath(value)


class CsvSink:
    """Rows appended to a new CSV file (header first), flushed after each step, so a run
    that stops keeps what it recorded."""

    def __init__(self, path: str) -> None:
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            raise ValueError(f"csv_path={path!r}: the folder {folder!r} does not exist")
        self.path = path
        self._file = open(path, "w", newline="")
        self._writer = csv.DictWriter(self._file, fieldnames=COLUMNS)
        self._writer.writeheader()
        self._file.flush()

    def write(self, rows: list[dict]) -> None:
        self._writer.writerows({k: ("" if v is None else v) for k, v in row.items()}
                               for row in rows)
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class TensorBoardSink:
    """Rows as scalars ``<layer>/<role>/<direction>/<column>`` at the row's step."""

    def __init__(self, writer) -> None:
        self.writer = writer

    def write(self, rows: list[dict]) -> None:
        for row in rows:
            tag = f"{row['layer']}/{row['role']}/{row['direction']}"
            for name in SCALARS:
                if row[name] is not None:
                    self.writer.add_scalar(f"{tag}/{name}", row[name], row["step"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def open_tensorboard(logdir: str) -> TensorBoardSink | None:
    """A sink writing to ``logdir``, or None (with a warning) where TensorBoard is not
    installed: the CSV and ``Recorder.rows`` still get every row."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as err:
        warnings.warn(f"lowprec.debug: tensorboard_dir={logdir!r} given but TensorBoard is not "
                      f"installed ({err}); recording to CSV and Recorder.rows only "
                      f"(pip install tensorboard)", RuntimeWarning, stacklevel=3)
        return None
    return TensorBoardSink(SummaryWriter(log_dir=logdir))
