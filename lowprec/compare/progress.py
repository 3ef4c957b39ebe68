"""A small progress bar on stderr (no dependency): redrawn in place on a terminal,
a line every tenth of the run otherwise (logs, CI)."""

from __future__ import annotations

import math
import sys
import time


class Progress:
    def __init__(self, label: str, total: int, stream=None, width: int = 24,
                 interactive: bool | None = None) -> None:
        self.label, self.total, self.width = label, max(total, 1), width
        self.stream = stream if stream is not None else sys.stderr
        self.interactive = (self.stream.isatty() if interactive is None and
                            hasattr(self.stream, "isatty") else bool(interactive))
        self.start = time.perf_counter()
        self._last_draw = 0.0
        self._last_decile = -1
        self._line = ""

    def _render(self, step: int, loss: float, ms: float, note: str = "") -> str:
        frac = min(step / self.total, 1.0)
        filled = int(round(frac * self.width))
        bar = "#" * filled + "-" * (self.width - filled)
        elapsed = time.perf_counter() - self.start
        eta = elapsed / step * (self.total - step) if step else float("nan")
        loss_s = f"{loss:.3f}" if math.isfinite(loss) else str(loss)
        eta_s = f"eta {eta:4.0f}s" if math.isfinite(eta) else "eta   ?s"
        text = (f"{self.label:<20} [{bar}] {step:>5}/{self.total:<5} loss {loss_s:>7} "
                f"{ms:7.1f} ms/step {eta_s}")
        return text + (f"  {note}" if note else "")

    def update(self, step: int, loss: float, ms: float, note: str = "") -> None:
        line = self._render(step, loss, ms, note)
        self._line = line
        if self.interactive:
            now = time.perf_counter()
            if note or step >= self.total or now - self._last_draw > 0.1:
                self.stream.write("\r" + line + "\x1b[K")
                self.stream.flush()
                self._last_draw = now
        else:
            decile = int(10 * step / self.total)
            if note or decile != self._last_decile:
                self.stream.write(line + "\n")
                self.stream.flush()
                self._last_decile = decile

    def close(self, result=None) -> None:
        elapsed = time.perf_counter() - self.start
        tail = ""
        if result is not None:
            if result.status == "ok" and result.val_loss is not None:
                tail = f"done in {elapsed:.1f}s, held-out loss {result.val_loss:.4f}"
            else:
                tail = f"{result.status.upper()}: {result.status_detail}"
        if self.interactive:
            self.stream.write("\r" + self._line + "\x1b[K" + ("\n" if self._line else ""))
        self.stream.write(f"{self.label:<20} {tail}\n")
        self.stream.flush()
